"""The request table: the one thing `workloads` hands to the simulator.

Every reader, synthetic generator and transform produces a `Workload` whose `requests` is a
pandas DataFrame with these columns, in this order:

- `request_id` int64: 0..n-1 in arrival order.
- `arrival_s` float64: seconds from the first request (0.0 for the first request of a trace),
  non-decreasing.
- `prompt_tokens` int64 >= 1.
- `output_tokens` int64 >= 1.
- optional `max_tokens` int64 >= `output_tokens`: the declared output limit, where the source or
  the synthetic spec has one.
- optional `n` int64 >= 1: samples per prompt (parallel sampling).
- optional `beam_width` int64 >= 1: beams per prompt (beam search); a request has at most one
  of `n` > 1 and `beam_width` > 1.
- optional `hash_ids` (object): one Python `list[int]` of prefix block hashes per request; the
  block size in tokens is `requests.attrs["hash_block_tokens"]` (512 for Mooncake), so a request
  has at most ceil(prompt_tokens / hash_block_tokens) ids. Equal ids at the same leading
  positions mean a reusable prefix.
- optional `priority` int64, any sign (0 where absent): vLLM's request priority, read by
  `engine.policy: priority` (a lower value is served first).
- optional `accepted_drafts` (object): one non-empty Python `list[int]` per request, each >= 0:
  the drafts its verifying steps accept, in order (read again from the start when they run
  out), for `engine.speculative.acceptance: column`; a count above the scenario's
  `num_tokens` is clipped to it by the engine.
- closed loop only: `user_id` int64 and `think_s` float64. Request i belongs to user
  `user_id[i]`; a user's requests are issued in `request_id` order. `arrival_s` holds the
  arrival of each user's FIRST request (staggered, or 0) and is NaN for the user's later
  requests: the engine releases a user's next request `think_s` seconds after the previous one
  completes (a user's first request has `think_s` 0). NaN arrivals are valid only in this case;
  the finite arrivals are non-decreasing.

Columns other than these are not allowed, so the simulator can trust the table as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

REQUIRED = ("request_id", "arrival_s", "prompt_tokens", "output_tokens")
OPTIONAL = ("max_tokens", "n", "beam_width", "hash_ids", "priority", "accepted_drafts")
CLOSED_LOOP = ("user_id", "think_s")
#: The full column order; a table holds a subsequence of it.
COLUMN_ORDER = REQUIRED + OPTIONAL + CLOSED_LOOP
_INT_COLUMNS = (
    "request_id", "prompt_tokens", "output_tokens", "max_tokens", "n", "beam_width", "user_id",
    "priority",
)
_FLOAT_COLUMNS = ("arrival_s", "think_s")


class WorkloadError(ValueError):
    """Bad workload input; the message names the file, the 1-based row or line and the column."""


#: The most characters of a bad value a message quotes: a 50 MB cell is not echoed whole.
SHOWN_CHARS = 60


def show(value: object, limit: int = SHOWN_CHARS) -> str:
    """`value` as an error message quotes it: numpy scalars as plain Python (`100`, not
    `np.int64(100)`), arrays as lists, and at most `limit` characters of it, then "...".

    Only a bounded head of a long string or sequence is formatted, so quoting a huge cell
    costs no more than quoting a short one.
    """
    if isinstance(value, np.generic):
        value = value.item()
    whole = True
    if isinstance(value, (str, bytes)) and len(value) > limit:
        value, whole = value[:limit], False
    elif isinstance(value, (list, tuple, np.ndarray)):
        if len(value) > limit:
            value, whole = value[:limit], False
        value = value.tolist() if isinstance(value, np.ndarray) else [
            v.item() if isinstance(v, np.generic) else v for v in value
        ]
    text = repr(value)
    if len(text) > limit:
        return text[:limit] + "..."
    return text if whole else text + "..."


@dataclass(frozen=True, eq=False)
class Workload:
    """A validated request table plus what was done to get it (nothing is dropped silently).

    `dropped_rows` counts bad input rows skipped because the scenario asked for it,
    `clipped` / `rejected_long` count requests clipped or removed for exceeding max_model_len,
    `has_arrivals` is False for a length-only table whose `arrival_s` is a placeholder 0.0.
    """

    requests: pd.DataFrame
    source: str
    dropped_rows: int = 0
    clipped: int = 0
    rejected_long: int = 0
    notes: tuple[str, ...] = ()
    has_arrivals: bool = True

    @property
    def closed_loop(self) -> bool:
        return "user_id" in self.requests.columns

    def with_requests(
        self, requests: pd.DataFrame, note: str | None = None, **counts: int
    ) -> Workload:
        """A copy with a new table, `counts` added to the existing counters and `note` appended."""
        changes: dict[str, object] = {"requests": requests}
        for name, extra in counts.items():
            changes[name] = getattr(self, name) + extra
        if note:
            changes["notes"] = (*self.notes, note)
        return replace(self, **changes)


def finish_table(df: pd.DataFrame, rebase: bool = True) -> pd.DataFrame:
    """Renumber `request_id` 0..n-1, order the columns, and (optionally) shift arrivals to 0.

    Used after every operation that removes or reorders rows so that the contract holds.
    """
    out = df.reset_index(drop=True)
    out["request_id"] = np.arange(len(out), dtype=np.int64)
    if rebase and len(out):
        arrivals = out["arrival_s"].to_numpy(dtype=np.float64)
        finite = arrivals[~np.isnan(arrivals)]
        if len(finite):
            out["arrival_s"] = arrivals - finite.min()
    ordered = out[[c for c in COLUMN_ORDER if c in out.columns]]
    ordered.attrs = dict(df.attrs)
    return ordered


@dataclass
class _Check:
    source: str
    df: pd.DataFrame
    problems: list[str] = field(default_factory=list)

    def fail(self, column: str, mask: np.ndarray, what: str) -> None:
        bad = np.flatnonzero(mask)
        if len(bad):
            row = int(bad[0])
            value = self.df[column].iloc[row]
            raise WorkloadError(
                f"{self.source}: row {row + 1}, column {column}: {show(value)} {what}"
                f" ({len(bad)} row(s) affected)"
            )


def validate_requests(df: pd.DataFrame, source: str) -> pd.DataFrame:
    """Check `df` against the request-table contract (module docstring); return it unchanged.

    Raises `WorkloadError` naming `source`, the first bad row (1-based) and column.
    """
    check = _Check(source, df)
    columns = list(df.columns)
    for name in REQUIRED:
        if name not in columns:
            raise WorkloadError(f"{source}: column {name} missing from the request table")
    unknown = [c for c in columns if c not in COLUMN_ORDER]
    if unknown:
        raise WorkloadError(f"{source}: unknown request-table column(s) {unknown}")
    expected = [c for c in COLUMN_ORDER if c in columns]
    if columns != expected:
        raise WorkloadError(f"{source}: columns {columns} are not in the order {expected}")
    if len(df) == 0:
        raise WorkloadError(f"{source}: empty trace (no requests)")
    closed = [c for c in CLOSED_LOOP if c in columns]
    if closed and len(closed) != len(CLOSED_LOOP):
        raise WorkloadError(f"{source}: closed-loop tables need both user_id and think_s")
    for name in _INT_COLUMNS:
        if name in columns and df[name].dtype != np.int64:
            raise WorkloadError(f"{source}: column {name} has dtype {df[name].dtype}, not int64")
    for name in _FLOAT_COLUMNS:
        if name in columns and df[name].dtype != np.float64:
            raise WorkloadError(f"{source}: column {name} has dtype {df[name].dtype}, not float64")

    ids = df["request_id"].to_numpy()
    check.fail("request_id", ids != np.arange(len(df)), "is out of sequence (expected 0..n-1)")
    for name in ("prompt_tokens", "output_tokens", "n", "beam_width"):
        if name in columns:
            check.fail(name, df[name].to_numpy() < 1, "is below 1")
    if "n" in columns and "beam_width" in columns:
        both = (df["n"].to_numpy() > 1) & (df["beam_width"].to_numpy() > 1)
        check.fail("beam_width", both, "is above 1 with n above 1 (sampling or beams, not both)")
    if "max_tokens" in columns:
        limit = df["max_tokens"].to_numpy()
        check.fail("max_tokens", limit < 1, "is below 1")
        check.fail("max_tokens", limit < df["output_tokens"].to_numpy(), "is below output_tokens")

    arrivals = df["arrival_s"].to_numpy()
    missing = np.isnan(arrivals)
    check.fail("arrival_s", np.isinf(arrivals), "is not finite")
    check.fail("arrival_s", arrivals < 0, "is negative")
    if closed:
        users = df["user_id"].to_numpy()
        first_of_user = ~pd.Series(users).duplicated().to_numpy()
        check.fail("arrival_s", missing & first_of_user, "is NaN for a user's first request")
        check.fail("arrival_s", ~missing & ~first_of_user, "is set for a user's later request")
        think = df["think_s"].to_numpy()
        check.fail("think_s", ~np.isfinite(think) | (think < 0), "is not a finite time >= 0")
        check.fail("user_id", users < 0, "is negative")
    else:
        check.fail("arrival_s", missing, "is NaN (allowed only for closed-loop tables)")
    finite = arrivals[~missing]
    if len(finite) > 1:
        backwards = np.zeros(len(df), dtype=bool)
        backwards[np.flatnonzero(~missing)[1:]] = np.diff(finite) < 0
        check.fail("arrival_s", backwards, "is earlier than the previous arrival")

    if "hash_ids" in columns:
        block = df.attrs.get("hash_block_tokens")
        if not isinstance(block, int) or block < 1:
            raise WorkloadError(
                f"{source}: hash_ids present but attrs['hash_block_tokens'] is {show(block)}"
            )
        bad_hash = np.array(
            [not (isinstance(h, list) and all(type(x) is int for x in h)) for h in df["hash_ids"]]
        )
        check.fail("hash_ids", bad_hash, "is not a list of integers")
        counts = np.array([len(h) for h in df["hash_ids"]], dtype=np.int64)
        blocks = -(-df["prompt_tokens"].to_numpy() // block)
        check.fail("hash_ids", counts > blocks,
                   f"has more ids than the prompt has blocks of {block} tokens")
    if "accepted_drafts" in columns:
        problems = [accepted_problem(v) for v in df["accepted_drafts"]]
        first = next((p for p in problems if p is not None), "")
        check.fail("accepted_drafts", np.array([p is not None for p in problems], dtype=bool),
                   first)
    return df


def accepted_problem(value: object) -> str | None:
    """Why `value` is not a request's accepted-draft counts (a non-empty list of ints >= 0),
    or None if it is one."""
    if not isinstance(value, list):
        return "is not a list of accepted-draft counts"
    if not value:
        return "is an empty list (a request needs at least one accepted-draft count)"
    if not all(type(x) is int and x >= 0 for x in value):
        return "holds a count that is not a whole number >= 0"
    return None

