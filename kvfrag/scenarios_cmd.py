"""`kvfrag scenarios`: the scenarios that ship with kvfrag, one line each."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "scenarios",
        help="list the shipped scenarios (run one by name: kvfrag run quickstart)",
        description="The scenarios that ship with kvfrag, with their one-line descriptions. "
        "`kvfrag run NAME` runs one; `--path` prints where its YAML lies, to copy and edit.",
    )
    p.add_argument("--path", action="store_true", help="print each file's path too")
    p.set_defaults(func=cmd_scenarios)


def cmd_scenarios(args: argparse.Namespace) -> int:
    import yaml

    from kvfrag.config import shipped_scenarios

    found = shipped_scenarios()
    width = max((len(name) for name in found), default=0)
    for name, path in found.items():
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError):
            data = {}
        text = str(data.get("description", "")) if isinstance(data, dict) else ""
        print(f"{name:<{width}}  {text}" + (f"\n{'':<{width}}  {path}" if args.path else ""))
    return 0
