"""Looking up a named preset (a model's KV geometry or architecture, a GPU): one error that
lists the valid names and suggests the nearest, whichever registry it is."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import TypeVar

from kvfrag.sim.units import excerpt

T = TypeVar("T")


def nearest(name: str, valid: list[str]) -> str | None:
    """The valid name closest to a misspelt one, if any is close (a name far longer than any
    valid one is close to none, and is not compared)."""
    if len(name) > 3 * max(map(len, valid), default=0):
        return None
    found = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return found[0] if found else None


def lookup(presets: Mapping[str, T], name: str, what: str, custom: str = "") -> T:
    """`presets[name]`; else a ValueError naming the nearest preset, every preset, and (with
    `custom`) the fields of the custom form."""
    try:
        return presets[name]
    except KeyError:
        hint = nearest(name, list(presets))
        raise ValueError(
            f"unknown {what} {excerpt(name)}" + (f"; did you mean {hint!r}?" if hint else "")
            + f" (presets: {', '.join(sorted(presets))}" + (f"; or give {custom}" if custom else "")
            + ")"
        ) from None
