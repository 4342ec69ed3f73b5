"""Capacity: how many requests an allocator holds at once when the queue never empties.

What a serving engineer means by "how many requests fit" is the batch the server carries at
full load: the number of requests running in the *saturated steady state*, where a request
waits at every moment, so every byte a departure frees is taken again at once. The count at
the first refusal is not it: at t = 0 every request holds only its prompt, and the memory
then fits more requests than it does once they have grown while decoding (or, for paged
blocks under pressure, preempt each other); nor is a run's own `mean_running`, which follows
the arrival rate whenever the server keeps up.

`saturate` measures it with a *saturating replay*: the same requests (lengths, samples,
prefixes), all queued at t = 0, on a fresh allocator with the engine's limits as the scenario
sets them. `capacity_requests` is the time-averaged number of running requests over the
replay's steady window:

- it opens once as many requests have finished as the most that ever ran at once (one
  turnover of the batch: by then the requests admitted into the empty memory of t = 0 have
  mostly left, and the start-up transient with them);
- it closes when the queue first empties (from then on nobody waits: the drain at the end).

The replay's requests are the workload's own when it has at most `SAMPLE` of them, else a
seeded draw of `SAMPLE`, so the cost does not grow with the trace. The window must hold at
least `MIN_TURNOVERS` turnovers (completions), else the replay is taken again with twice the
requests or more (the workload repeated, each copy's prefix hashes made its own), up to
`MAX_SAMPLE`. `capacity_throughput_tok_s` is the tokens generated in the window over its
length.

`max_num_seqs` applies (it is the server's own limit); where it held the batch down,
`capacity_memory_requests` is the same replay with max_num_seqs lifted to the token budget
(every decoder takes one token of it: the most an iteration carries), what the memory alone
holds; elsewhere it equals `capacity_requests`. Nothing here is random beyond the seeded
draw: the figures are the same whichever process computes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
from kvfrag.sim.allocators.base import Allocator
from kvfrag.sim.engine import run as run_engine
from kvfrag.sim.engine_config import EngineConfig
from kvfrag.sim.engine_records import TOO_MANY_SEQUENCES, RunResult

#: Requests in the first replay (at most); at most `MAX_SAMPLE` in a larger one.
SAMPLE = 2048
MAX_SAMPLE = 32768
#: Completions the steady window must hold, in turnovers of the batch (its largest count).
MIN_TURNOVERS = 2
#: Seed of the draw of `SAMPLE` requests from a larger workload.
SEED = 0
#: Columns a replay keeps: lengths, samples, beams, prefixes and accepted drafts (arrivals are
#: all 0; a closed loop's users and think times are dropped: everyone is already waiting).
_KEPT = ("prompt_tokens", "output_tokens", "max_tokens", "n", "beam_width", "hash_ids",
         "accepted_drafts")
#: The summary fields `saturate` returns, in order.
FIELDS = ("capacity_requests", "capacity_throughput_tok_s", "capacity_memory_requests",
          "capacity_capped", "capacity_sample_requests")


@dataclass(frozen=True)
class Window:
    """The steady window of one saturating replay."""

    start_s: float
    end_s: float
    running: float  # time-averaged running requests over the window
    tokens_s: float  # tokens generated per second over the window
    completions: int  # requests that finished inside it
    turnover: int  # the most requests that ran at once


def sample(requests: pd.DataFrame, size: int, seed: int = SEED) -> pd.DataFrame:
    """`size` requests of `requests`, all arriving at t = 0, ids 0..size-1: a seeded draw
    (without replacement, in the table's order) when it has more; else the table repeated
    (each copy's prefix hash ids offset past the others', so copies share no prefix the
    original requests do not), cut at `size`."""
    table = requests[[c for c in _KEPT if c in requests.columns]]
    n = len(table)
    if n == 0:
        return _frame(table, 0)
    if n > size:
        keep = np.sort(np.random.default_rng(seed).choice(n, size, replace=False))
        out = table.iloc[keep].reset_index(drop=True)
    else:
        copies = math.ceil(size / n)
        out = pd.concat([table] * copies, ignore_index=True).iloc[:size]
        if "hash_ids" in out and copies > 1:
            stride = 1 + max((max(h) for h in table["hash_ids"] if len(h)), default=0)
            out["hash_ids"] = [
                [x + (i // n) * stride for x in h] for i, h in enumerate(out["hash_ids"])
            ]
    out.attrs = dict(requests.attrs)
    return _frame(out, len(out))


def _frame(table: pd.DataFrame, n: int) -> pd.DataFrame:
    table = table.copy()
    table.insert(0, "arrival_s", np.zeros(n))
    table.insert(0, "request_id", np.arange(n, dtype=np.int64))
    return table


def steady_window(result: RunResult) -> Window | None:
    """The steady window of a saturating replay's result (see the module's docstring), or
    None when it has none (the queue emptied before one turnover finished)."""
    ts, req = result.timeseries, result.requests
    if not len(ts):
        return None
    turnover = int(ts["running"].max())
    done = req[req["status"] == "completed"]
    finished = np.sort(done["finished_s"].to_numpy(dtype=float))
    if turnover < 1 or len(finished) < turnover:
        return None
    start = float(finished[turnover - 1])
    t, dt = ts["t_s"].to_numpy(dtype=float), ts["dt_s"].to_numpy(dtype=float)
    empty = np.flatnonzero(ts["waiting"].to_numpy() == 0)
    end = float(t[empty[0]]) if len(empty) else float(t[-1] + dt[-1])
    inside = (t >= start) & (t < end)
    span = float(dt[inside].sum())
    if span <= 0:
        return None
    counts = ts["running"].to_numpy(dtype=np.int64)[inside]
    # (about a whole count: a constant batch comes out as that count exactly, not 46.00...01)
    base = int(np.median(counts))
    running = base + float(((counts - base) * dt[inside]).sum()) / span
    completions = int(((finished > start) & (finished <= end)).sum())
    tokens = _generated_by(done, end) - _generated_by(done, start)
    return Window(start, end, running, tokens / span, completions, turnover)


def _generated_by(done: pd.DataFrame, t: float) -> float:
    """Tokens the completed requests had generated by time `t` (a token sampled at `t`
    included), each request's spread evenly from its first token to its last."""
    first = done["first_token_s"].to_numpy(dtype=float)
    last = done["finished_s"].to_numpy(dtype=float)
    count = done["generated_tokens"].to_numpy(dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        part = np.where(last > first, (t - first) / (last - first), 1.0)
    part = np.clip(part, 0.0, 1.0)
    # the first token at `first`, the others spread evenly up to `last`
    got = np.where(t >= first, 1.0 + (count - 1.0) * part, 0.0)
    return float(got.sum())


def replay(
    requests: pd.DataFrame,
    allocator: Callable[[], Allocator],
    config: EngineConfig,
) -> tuple[Window | None, RunResult, int]:
    """Saturating replays of `requests`, enlarging the sample until the steady window holds
    `MIN_TURNOVERS` turnovers (or the sample reaches `MAX_SAMPLE`): (window, the last
    replay's result, its requests)."""
    config = replace(config, max_time_s=None, log_allocations=False)
    size = min(len(requests), SAMPLE)
    while True:
        table = sample(requests, size)
        result = run_engine(table, allocator(), config)
        window = steady_window(result)
        enough = window is not None and window.completions >= MIN_TURNOVERS * window.turnover
        most = int(result.timeseries["running"].max()) if len(result.timeseries) else 0
        if enough or len(table) >= MAX_SAMPLE or most == 0:  # (0: none runs, more won't)
            return window, result, len(table)
        # (enough for a turnover to warm up, MIN_TURNOVERS in the window and one to drain,
        # at the batch this replay reached; at least twice the requests)
        size = min(max(2 * len(table), (MIN_TURNOVERS + 3) * most), MAX_SAMPLE)


def saturate(
    requests: pd.DataFrame,
    allocator: Callable[[], Allocator],
    config: EngineConfig,
) -> dict[str, float | int]:
    """The capacity fields of one allocator on one workload (`FIELDS`, see the module's
    docstring); `allocator()` makes a fresh allocator for each replay. NaN where the replay
    never saturated (the largest sample fits at once)."""
    window, result, n = replay(requests, allocator, config)
    held = math.nan if window is None else window.running
    tokens = math.nan if window is None else window.tokens_s
    memory = held
    seqs = _sequences(requests)
    rejected = result.requests["reason"].eq(TOO_MANY_SEQUENCES).any()
    most = int(result.timeseries["running"].max()) if len(result.timeseries) else 0
    capped = bool(most * seqs >= config.max_num_seqs or rejected)
    if capped and config.max_num_batched_tokens > config.max_num_seqs:
        lifted = replace(config, max_num_seqs=config.max_num_batched_tokens)
        wide, _, _ = replay(requests, allocator, lifted)
        memory = math.nan if wide is None else wide.running
    return {
        "capacity_requests": held,
        "capacity_throughput_tok_s": tokens,
        "capacity_memory_requests": memory,
        "capacity_capped": int(capped and memory != held),
        "capacity_sample_requests": n,
    }


def _sequences(requests: pd.DataFrame) -> int:
    """The most sequences one request runs (n samples or beams)."""
    most = 1
    for col in ("n", "beam_width"):
        if col in requests and len(requests):
            most = max(most, int(requests[col].fillna(1).max()))
    return most
