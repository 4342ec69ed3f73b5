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


def positive(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value
