"""What a run produces, as columns: `RunResult`, the time series' columns (`_SERIES`, gathered
row by row by `_Rows` and converted in chunks), the allocation log's (`LOG_COLUMNS`), and the
reasons a request is rejected for. Compiled with the engine (sim/_native.py): `_Rows` takes a
row at every event.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import pandas as pd
from kvfrag.sim.allocators.base import PARTS, Reason

#: Why the engine rejects a request whose n sequences exceed max_num_seqs (it never fits a batch).
TOO_MANY_SEQUENCES = "too_many_sequences"
#: Every reason a request can be rejected for (its `reason` in the request records). The summary
#: counts each as `rejected_<reason>`, always all of them (0 when none), in this order.
REJECT_REASONS = (Reason.PROMPT_TOO_LONG.value, Reason.TOO_LARGE.value, TOO_MANY_SEQUENCES)


@dataclass
class RunResult:
    """What a run produced: a summary, the accounting over time, one row per request."""

    summary: dict[str, float | int | str]
    timeseries: pd.DataFrame
    requests: pd.DataFrame
    log: pd.DataFrame | None = None  # the allocation log, when asked for
    #: A `torch.cuda.memory._snapshot()`-format dict of the allocator at the end of the run
    #: (`sim.snapshot`): filled by `sim.scenario_run.run_point` for torch-caching runs, else None.
    snapshot: dict[str, Any] | None = None


#: Columns of the allocation log. `check` rows carry the model's accounting at that instant:
#: bytes holding tokens, bytes held but unwritten (reserved + internal) and free bytes.
#: `move` rows (compaction) carry a slab's new offset in `offset`, its old one in `from_offset`.
#: Admit rows carry the request's `prompt` length. A `free` row's `tokens` is 0, or (async
#: scheduling, a preempted decoder: `Allocator.free_preempted`) the tokens it had processed,
#: the only ones whose full blocks a prefix cache keeps. A request whose blocks are not simply
#: appended (n > 1 sequences, or prefix caching with a hash chain) has all of its block ids in
#: `tables` on each admit and grow row: one table per sequence (paged; one while its prompt is
#: prefilled), and its full table with its cached blocks first (prefix caching); `blocks` are
#: then only the ids it did not hold before. `copy` rows (paged copy on write) come right before
#: the row that made them: `blocks` = [source block, destination block], whose bytes the
#: destination must receive before the sequences write on. Slab allocators with n > 1 list each
#: sequence's slab in `offsets` (the first is `offset`; `nbytes` covers all of them). Prefix
#: caching: admit rows carry `keys`, one digest per full prompt block the hash chain names
#: (equal digests: equal tokens); `evict` rows list the idle cached blocks whose bytes were
#: dropped (their ids are free again).
LOG_COLUMNS = (
    "seq", "t", "op", "rid", "tokens", "nbytes", "offset", "blocks",
    "token_states", "held_unwritten", "free", "from_offset",
    "prompt", "tables", "offsets", "keys",
)


#: Time-series rows gathered as Python numbers before they become numpy columns (`_Rows`): a
#: chunk's objects, about 1.5 MiB, are still in cache when converted (1,024-row chunks were a
#: little faster still, but their many small arrays cost 17 MiB more at a million requests).
_ROWS_PER_CHUNK: Final = 4096
_SERIES = (
    "t_s",
    "dt_s",
    "iterations",
    "running",
    "waiting",
    *(f"{p}_bytes" for p in PARTS),
    "largest_hole_bytes",
    "frag_blocked",
)


class _Rows:
    """The time series' rows, one list per column (in _SERIES order), put into numpy columns
    every `_ROWS_PER_CHUNK` rows (floats through struct, see `_doubles`). A list append is the
    cheapest store a compiled loop has (a typed array's append parses its argument: more
    instructions per event in all), and a chunk is converted, and its objects freed, while
    they are still in cache: converting a whole run's rows at its end took 28-70 ms of a
    0.2-0.3 s run (bench/naive_peer.py's 1,000-token case, 22,469 rows), in chunks 11 ms. The
    chunks take 8 bytes a value. The parts are float64 in a chunk with a decode stretch's row
    (time averages), int64 in one without (byte counts), float64 once joined with such a
    chunk: exact, as the engine takes no budget over 1 PiB (below 2**53 bytes)."""

    def __init__(self) -> None:
        self.t: list[float] = []
        self.dt: list[float] = []
        self.iterations: list[int] = []
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.p0: list[object] = []  # (parts as they come: ints, or floats in a stretch)
        self.p1: list[object] = []
        self.p2: list[object] = []
        self.p3: list[object] = []
        self.p4: list[object] = []
        self.hole: list[int] = []
        self.blocked: list[bool] = []
        # blocks per KV-cache group (allocators with groups), row after row in one flat list,
        # summed per group kind (`group_of`: each group's kind) a chunk at a time by numpy: a
        # row extends the list by the allocator's tuple, and numpy reads a flat list of ints
        # at a fraction of a list of lists' cost
        self.groups: list[int] = []
        self.group_of: list[int] = []
        self.group_chunks: list[np.ndarray] = []
        self.stretches = False  # a decode stretch's row is in this chunk: its parts are floats
        self.chunks: list[list[np.ndarray]] = [[] for _ in _SERIES]  # by column, converted

    def flush(self) -> None:
        """The rows gathered since the last flush become a chunk of numpy columns."""
        if not self.t:
            return
        parts = (self.p0, self.p1, self.p2, self.p3, self.p4)
        columns = (
            _doubles(self.t),
            _doubles(self.dt),
            np.array(self.iterations, dtype=np.int64),
            np.array(self.running, dtype=np.int64),
            np.array(self.waiting, dtype=np.int64),
            # (a stretch's floats, and ints as doubles: exact below 2**53)
            *(_doubles(v) if self.stretches else np.array(v, dtype=np.int64) for v in parts),
            np.array(self.hole, dtype=np.int64),
            np.array(self.blocked, dtype=np.bool_),
        )
        for chunks, column in zip(self.chunks, columns, strict=True):
            chunks.append(column)
        if self.groups:
            per_group = np.array(self.groups, dtype=np.int64).reshape(len(self.t), -1)
            held = np.zeros((len(self.t), max(self.group_of) + 1), dtype=np.int64)
            for g, kind in enumerate(self.group_of):
                held[:, kind] += per_group[:, g]
            self.group_chunks.append(held)
            self.groups.clear()
        for rows in self.columns():
            rows.clear()
        self.stretches = False

    def columns(self) -> tuple[list, ...]:
        """The lists gathering rows, in _SERIES order."""
        return (self.t, self.dt, self.iterations, self.running, self.waiting, self.p0, self.p1,
                self.p2, self.p3, self.p4, self.hole, self.blocked)

    def frame(self, groups: list[str] | None = None) -> pd.DataFrame:
        """The rows as a frame (taking the chunks: this empties the rows). Each column is
        joined and its chunks dropped in turn, and the frame holds the joined arrays as
        they are (no copy): at its peak, memory holds the series once and one column.
        `groups`: the group kinds whose blocks each row holds (`blocks_<kind>` columns)."""
        self.flush()
        names = [*_SERIES, *(f"blocks_{kind}" for kind in groups or ())]
        if not self.chunks[0]:
            return pd.DataFrame([], columns=names)
        columns: dict[str, np.ndarray] = {}
        for name, chunks in zip(_SERIES, self.chunks, strict=True):
            columns[name] = np.concatenate(chunks)  # (a copy: some chunks are read-only views)
            chunks.clear()
        if groups:
            held = np.concatenate(self.group_chunks)
            self.group_chunks.clear()
            for i, kind in enumerate(groups):
                columns[f"blocks_{kind}"] = np.ascontiguousarray(held[:, i])
        return pd.DataFrame(columns, copy=False)


def _doubles(values: list) -> np.ndarray:
    """Numbers (floats, or ints) as a float64 column, through struct: a C loop that converts
    each as it is, at about half of numpy's cost per value (which first works out each item's
    type: 15-20 ns against 9-10 ns here; for ints numpy is the faster). A read-only view."""
    return np.frombuffer(struct.pack(f"{len(values)}d", *values), dtype=np.float64)
