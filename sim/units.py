"""Byte sizes as people write them: "50GB" is 50 * 10**9 bytes, "12GiB" is 12 * 2**30.

The distinction matters: 50 GB of KV at 128 KiB per token and 8,192-token slabs is 46 slabs
(50e9 // 2**30), not 50.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
#: Largest size kvfrag models (1 PiB): a larger one is a typo (TB for GB), and pools sized from
#: it would only exhaust the host's memory. (The bounds of a scenario's other numbers are in
#: `workloads.spec`; this one is here, for the allocators read sizes too.)
MAX_SIZE = 2**50
#: Longest excerpt of a bad value an error message quotes, in characters.
EXCERPT_CHARS = 80
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_LONG = EXCERPT_CHARS - 1
_QUOTED_RE = re.compile(rf"'[^'\n]{{{_LONG},}}'|\"[^\"\n]{{{_LONG},}}\"")


def excerpt(value: object) -> str:
    """`repr(value)`, cut to EXCERPT_CHARS with "..." (a 50 MB string is not echoed whole)."""
    if isinstance(value, str):
        text = repr(value[: EXCERPT_CHARS + 1])
        return text if len(value) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "...'"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<a {len(str(value))}-digit number>"
    text = repr(value) if isinstance(value, int | float | bool) or value is None else (
        f"<a {type(value).__name__}>")
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "..."


def clip_quoted(text: str) -> str:
    """`text` with every quoted value longer than EXCERPT_CHARS cut to an excerpt: for
    messages built elsewhere that quote a value whole."""
    return _QUOTED_RE.sub(lambda m: m.group()[: EXCERPT_CHARS - 4] + "..." + m.group()[0], text)


def parse_size(value: int | str) -> int:
    """Parse a byte size ("50GB", "12GiB", "800 KiB", 4096) into a whole number of bytes.
    Booleans are not sizes (YAML's `true` is not 1 byte); a float is one if it is whole."""
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} (a boolean) is not a size")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"size {value} is not a finite number")
        if not value.is_integer():
            raise ValueError(f"{value!r} is not a size (not a whole number of bytes)")
        value = int(value)
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size {excerpt(value)} is negative")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{excerpt(value)} is not a size (write e.g. 50GB or 12GiB)")
    m = _SIZE_RE.match(value) if len(value) <= EXCERPT_CHARS else None
    if not m:
        raise ValueError(f"{excerpt(value)} is not a size (write e.g. 50GB or 12GiB)")
    number, unit = m.group(1).replace("_", "").replace(",", ""), m.group(2).upper()
    if unit not in _UNITS:
        valid = ", ".join(u for u in _UNITS if u)
        raise ValueError(f"{value!r}: unknown unit {m.group(2)!r} (valid: {valid})")
    try:
        exact = Decimal(number) * _UNITS[unit]
    except ArithmeticError:  # an exponent beyond Decimal's
        exact = Decimal("Infinity")
    if exact > 10**30:  # (no int of a million digits is made of "1e999999")
        raise ValueError(
            f"{value!r} is larger than kvfrag models (at most {format_size(MAX_SIZE)})"
        )
    if exact != exact.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(exact)


def check_size(nbytes: int, what: str, limit: int = MAX_SIZE) -> int:
    """`nbytes`, unless it is above `limit`: sizes are checked before anything is built from
    them, so a unit typo is one clear error rather than a MemoryError."""
    if nbytes > limit:
        raise ValueError(
            f"{what} {format_size(nbytes)} is larger than kvfrag models "
            f"(at most {format_size(limit)})"
        )
    return nbytes


def format_size(nbytes: float) -> str:
    """Render bytes for people, in binary units (the way memory is allocated)."""
    if isinstance(nbytes, int) and abs(nbytes) >= 2**1000:  # beyond a float: its magnitude
        return f"{'-' if nbytes < 0 else ''}about 2**{abs(nbytes).bit_length() - 1} B"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} EiB"


_RATE_RE = re.compile(
    r"^\s*([0-9][0-9_,]*(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*(?:/\s*s)?\s*$"
)


def parse_rate(value: float | str) -> float:
    """Parse a bandwidth ("4.8TB/s", "900 GB/s", "1.5TiB/s", 2e12) into bytes per second (> 0)."""
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} (a boolean) is not a rate")
    if isinstance(value, int | float):
        number = float(value) if abs(value) < 1e300 else float("inf")
    elif isinstance(value, str) and len(value) <= EXCERPT_CHARS and (m := _RATE_RE.match(value)):
        unit = m.group(2).upper()
        if unit not in _UNITS:
            valid = ", ".join(f"{u}/s" for u in _UNITS if u)
            raise ValueError(f"{value!r}: unknown unit {m.group(2)!r} (valid: {valid})")
        number = float(Decimal(m.group(1).replace("_", "").replace(",", "")) * _UNITS[unit])
    else:
        raise ValueError(f"{excerpt(value)} is not a rate (write e.g. 4.8TB/s or 900GB/s)")
    if not number > 0 or number == float("inf"):
        raise ValueError(
            f"rate {excerpt(value)} must be a positive, finite number of bytes per second"
        )
    return number
