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

    from kvfrag import (
        calibrate_cmd,
        compare_cmd,
        plan_cmd,
        report_cmd,
        run_cmd,
        scenarios_cmd,
        snapshot_cmd,
        trace_cmd,
        validate_cmd,
    )

    run_cmd.add_parsers(sub)
    compare_cmd.add_parser(sub)
    trace_cmd.add_parser(sub)
    validate_cmd.add_parser(sub)
    calibrate_cmd.add_parser(sub)
    snapshot_cmd.add_parser(sub)
    report_cmd.add_parser(sub)
    scenarios_cmd.add_parser(sub)
    plan_cmd.add_parser(sub)
    return parser


#: Exit statuses (also in the README).
OK, FAILED, BAD_INPUT, CANNOT_WRITE, BUSY = 0, 1, 2, 3, 4


def main(argv: list[str] | None = None) -> int:
    """0 done; 1 some runs or replays failed; 2 bad input (scenario, option, trace, or an
    output path kvfrag will not write to); 3 the output could not be written (read-only,
    disk full, ...); 4 another kvfrag process is writing the same results folder;
    130/143 interrupted by Ctrl-C/SIGTERM."""
    from kvfrag.outdir import Busy, OutputError, interrupt_status, terminate_as_interrupt

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # (from the start: a SIGTERM while a command still reads its inputs is 143 and the
        # one-line "interrupted" too, not a death by signal)
        with terminate_as_interrupt():
            return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvfrag: error: {exc}", file=sys.stderr)
        return BAD_INPUT
    except OutputError as exc:
        print(f"kvfrag: error: {exc}", file=sys.stderr)
        return CANNOT_WRITE
    except Busy as exc:
        print(f"kvfrag: error: {exc}", file=sys.stderr)
        return BUSY
    except KeyboardInterrupt as exc:
        print("\ninterrupted", file=sys.stderr)
        return interrupt_status(exc)
    except BrokenPipeError:  # `kvfrag scenarios | head`: the reader has what it wanted
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK


if __name__ == "__main__":
    sys.exit(main())
