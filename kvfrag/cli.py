"""The `kvfrag` command line: one sub-command per module, errors as one clear line."""

from __future__ import annotations

import argparse
import sys

from kvfrag import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfrag",
        description="Trace-driven KV-cache memory-fragmentation simulator.",
    )
    parser.add_argument("--version", action="version", version=f"kvfrag {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from kvfrag import run_cmd, trace_cmd, validate_cmd

    run_cmd.add_parsers(sub)
    trace_cmd.add_parser(sub)
    validate_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvfrag: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
