"""Command-line options several commands share; light, so that `kvfrag --help` stays quick."""

from __future__ import annotations

import argparse
from typing import Any


def add_set_argument(parser: Any, example: str) -> None:
    """The `--set KEY=VALUE` option every scenario command takes."""
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a field, e.g. --set {example} (repeatable)",
    )


#: The largest count an option takes (worker processes, torch's roundup divisions): 2**20;
#: anything larger is a typo, and would only exhaust the machine.
MAX_COUNT = 2**20


def positive(text: str) -> int:
    """argparse type: a whole number from 1 to MAX_COUNT."""
    try:
        value = int(text) if len(text) <= 20 else 0
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_COUNT:
        shown = repr(text) if len(text) <= 80 else repr(text[:76])[:-1] + "...'"
        raise argparse.ArgumentTypeError(
            f"expected a whole number from 1 to {MAX_COUNT:,}, got {shown}"
        )
    return value
