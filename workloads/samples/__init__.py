"""Small trace samples shipped with kvfrag (first N rows of published traces, unmodified).

Origin, license and attribution of each file are in `SOURCE.md` next to this module. A scenario
or the command line refers to a sample as `sample:NAME`.
"""

from __future__ import annotations

from pathlib import Path

_DIR = Path(__file__).resolve().parent

#: sample name -> file name in this directory
FILES: dict[str, str] = {
    "azure-conv": "azure-conv.csv",
    "azure-code": "azure-code.csv",
    "mooncake-conv": "mooncake-conv.jsonl",
    "sharegpt-8k": "sharegpt-8k.csv",
}


def names() -> list[str]:
    """The names accepted by `path` (and as `sample:NAME`)."""
    return sorted(FILES)


def path(name: str) -> Path:
    """Path of the shipped sample `name`, e.g. `path("azure-conv")`."""
    try:
        return _DIR / FILES[name]
    except KeyError:
        raise ValueError(
            f"unknown sample {name!r}; shipped samples: {', '.join(names())}"
        ) from None
