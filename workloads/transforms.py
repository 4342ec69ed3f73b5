"""Transforms on a `Workload`: each returns a new one and records what it changed.

Row-removing transforms renumber `request_id` and shift arrivals so the first is 0 again.
Lengths over max_model_len are clipped or rejected and counted in `Workload.clipped` /
`Workload.rejected_long`, never silently. Transforms that move or remove arrivals refuse
closed-loop tables (apply the closed loop after them, as `build_workload` does).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pandas as pd
from kvfrag.workloads.spec import MAX_REQUESTS
from kvfrag.workloads.table import Workload, WorkloadError, finish_table


def _open_loop(workload: Workload, what: str) -> None:
    if workload.closed_loop:
        raise WorkloadError(f"{workload.source}: {what} does not apply to closed-loop arrivals")


def _with_arrivals(workload: Workload, what: str) -> None:
    _open_loop(workload, what)
    if not workload.has_arrivals:
        raise WorkloadError(f"{workload.source}: {what} needs arrival times and this "
                            "workload has none; give it an arrival process first")


def first_n(workload: Workload, n: int) -> Workload:
    """The first `n` requests (all of them, with a note, if there are fewer)."""
    df = workload.requests
    note = f"first {n} requests" if n < len(df) else \
        f"first_n {n}: the workload has only {len(df)} requests, all kept"
    return workload.with_requests(finish_table(df.iloc[:n]), note=note)


def sample_n(workload: Workload, n: int, rng: np.random.Generator) -> Workload:
    """`n` requests drawn without replacement, kept in arrival order (thins the rate)."""
    _open_loop(workload, "sample_n")
    df = workload.requests
    if n > len(df):
        raise WorkloadError(f"{workload.source}: cannot sample {n} of {len(df)} requests")
    rows = np.sort(rng.choice(len(df), size=n, replace=False))
    return workload.with_requests(finish_table(df.iloc[rows]), note=f"sampled {n} requests")


def time_window(workload: Workload, start_s: float, end_s: float | None = None) -> Workload:
    """Requests arriving in [start_s, end_s), shifted so the first arrives at 0."""
    _with_arrivals(workload, "a time window")
    df = workload.requests
    arrivals = df["arrival_s"].to_numpy()
    keep = arrivals >= start_s
    if end_s is not None:
        keep &= arrivals < end_s
    if not keep.any():
        raise WorkloadError(f"{workload.source}: no requests arrive in the window "
                            f"[{start_s}, {end_s}) s")
    note = f"window [{start_s}, {'end' if end_s is None else end_s}) s: {int(keep.sum())} requests"
    return workload.with_requests(finish_table(df[keep]), note=note)


def scale_rate(workload: Workload, factor: float) -> Workload:
    """Multiply the arrival rate by `factor` (inter-arrival times divided by it)."""
    _with_arrivals(workload, "rate scaling")
    if not factor > 0:
        raise WorkloadError(f"{workload.source}: rate scale {factor} must be positive")
    df = workload.requests.copy()
    df["arrival_s"] = df["arrival_s"] / factor
    return workload.with_requests(df, note=f"arrival rate x{factor}")


def tile(
    workload: Workload,
    k: int,
    mode: Literal["sequential", "overlay"] = "sequential",
    distinct_prefixes: bool = True,
) -> Workload:
    """`k` copies of the workload: back to back in time, or overlaid (k x the rate).

    Sequential copies start one mean inter-arrival gap after the previous copy's last arrival.
    With `distinct_prefixes` each copy's hash_ids are offset so copies share no prefix blocks
    (a copy stands for other users, not the same prompts again).
    """
    _open_loop(workload, "tiling")
    if k == 1:
        return workload
    df = workload.requests
    if len(df) * k > MAX_REQUESTS:  # (checked before any copy is made)
        raise WorkloadError(
            f"{workload.source}: {len(df):,} requests tiled {k:,} times are {len(df) * k:,}; "
            f"a workload has at most {MAX_REQUESTS:,}"
        )
    arrivals = df["arrival_s"].to_numpy()
    span = float(arrivals[-1] - arrivals[0])
    period = span + (span / (len(df) - 1) if len(df) > 1 else 0.0)
    hash_offset = 0
    if "hash_ids" in df.columns and distinct_prefixes:
        hash_offset = 1 + max((max(h) for h in df["hash_ids"] if h), default=-1)
    copies = []
    for c in range(k):
        copy = df.copy()
        if mode == "sequential":
            copy["arrival_s"] = arrivals + c * period
        if hash_offset and c:
            copy["hash_ids"] = [[x + c * hash_offset for x in h] for h in df["hash_ids"]]
        copies.append(copy)
    tiled = pd.concat(copies, ignore_index=True)
    if mode == "overlay":
        tiled = tiled.sort_values("arrival_s", kind="stable")
    tiled.attrs = dict(df.attrs)
    return workload.with_requests(finish_table(tiled), note=f"tiled x{k} ({mode})")


def limit_parts(
    workload: Workload,
    max_prompt: int | None,
    max_output: int | None,
    mode: Literal["clip", "reject"] = "reject",
) -> Workload:
    """Bound the prompt and the output separately, clipping or rejecting; both are counted
    with the requests `limit_length` clips or rejects.

    Clipping a prompt also shortens its hash_ids to the blocks it still covers.
    """
    df = workload.requests
    prompt = df["prompt_tokens"].to_numpy()
    output = df["output_tokens"].to_numpy()
    long = np.zeros(len(df), dtype=bool)
    if max_prompt is not None:
        long |= prompt > max_prompt
    if max_output is not None:
        long |= output > max_output
    bounds = ", ".join(
        f"{name} <= {value}"
        for name, value in (("prompt", max_prompt), ("output", max_output))
        if value is not None
    )
    return _limit(
        workload, long, mode,
        rejected=f"beyond {bounds}",
        everyone=f"no request has {bounds}",
        clipped=bounds,
        prompt=prompt if max_prompt is None else np.minimum(prompt, max_prompt),
        output=output if max_output is None else np.minimum(output, max_output),
        max_tokens=max_output,
    )


def limit_length(
    workload: Workload, max_model_len: int, mode: Literal["clip", "reject"] = "reject"
) -> Workload:
    """Enforce prompt + output <= max_model_len by clipping or rejecting; both are counted.

    Clipping keeps at most max_model_len - 1 prompt tokens, then shortens the output (and
    max_tokens, and hash_ids to the blocks the clipped prompt still covers).
    """
    if max_model_len < 2:
        raise WorkloadError(f"max_model_len {max_model_len} leaves no room for a prompt and "
                            "an output token")
    df = workload.requests
    prompt = df["prompt_tokens"].to_numpy()
    output = df["output_tokens"].to_numpy()
    new_prompt = np.minimum(prompt, max_model_len - 1)
    return _limit(
        workload, prompt + output > max_model_len, mode,
        rejected=f"longer than max_model_len {max_model_len}",
        everyone=f"every request is longer than max_model_len {max_model_len}",
        clipped=f"max_model_len {max_model_len}",
        prompt=new_prompt,
        output=np.minimum(output, max_model_len - new_prompt),
        max_tokens=max_model_len - new_prompt,
    )


def _limit(
    workload: Workload,
    long: np.ndarray,
    mode: Literal["clip", "reject"],
    *,
    rejected: str,
    everyone: str,
    clipped: str,
    prompt: np.ndarray,
    output: np.ndarray,
    max_tokens: np.ndarray | int | None,
) -> Workload:
    """Reject the requests flagged `long`, or clip every request to `prompt` / `output`
    tokens (a declared max_tokens to `max_tokens`, hash_ids to the blocks the prompt still
    covers); counted, with a note (`rejected` and `clipped` name the bound)."""
    count = int(long.sum())
    if not count:
        return workload
    df = workload.requests
    if mode == "reject":
        _open_loop(workload, "rejecting requests")
        if count == len(df):
            raise WorkloadError(f"{workload.source}: {everyone}")
        note = f"rejected {count} request(s) {rejected}"
        return workload.with_requests(finish_table(df[~long]), note=note, rejected_long=count)
    out = df.copy()
    out["prompt_tokens"] = prompt
    out["output_tokens"] = output
    if "max_tokens" in out.columns and max_tokens is not None:
        out["max_tokens"] = np.minimum(out["max_tokens"], max_tokens)
    if "hash_ids" in out.columns:
        block = df.attrs["hash_block_tokens"]
        keep_blocks = -(-prompt // block)
        out["hash_ids"] = [h[:b] for h, b in zip(df["hash_ids"], keep_blocks, strict=True)]
    return workload.with_requests(out, note=f"clipped {count} request(s) to {clipped}",
                                  clipped=count)


def with_beam_width(workload: Workload, width: int) -> Workload:
    """Set `beam_width` (beam search) on every request, replacing any per-request values."""
    if width < 1:
        raise WorkloadError(f"beam_width={width} must be at least 1")
    df = workload.requests.copy()
    df["beam_width"] = np.full(len(df), width, dtype=np.int64)
    note = f"beam_width={width} for every request"
    return workload.with_requests(finish_table(df, rebase=False), note=note)


def with_priorities(
    workload: Workload, weights: list[tuple[int, float]], rng: np.random.Generator
) -> Workload:
    """Draw each request's priority from `weights`, [(value, relative weight), ...]."""
    values = np.array([v for v, _ in weights], dtype=np.int64)
    p = np.array([w for _, w in weights], dtype=np.float64)
    df = workload.requests.copy()
    df["priority"] = values[rng.choice(len(values), size=len(df), p=p / p.sum())]
    shown = ", ".join(f"{v}: {w:g}" for v, w in weights)
    note = f"priorities drawn ({shown})"
    return workload.with_requests(finish_table(df, rebase=False), note=note)


def with_samples_per_prompt(workload: Workload, n: int) -> Workload:
    """Set `n` (samples per prompt) on every request, replacing any per-request values."""
    if n < 1:
        raise WorkloadError(f"samples per prompt n={n} must be at least 1")
    df = workload.requests.copy()
    df["n"] = np.full(len(df), n, dtype=np.int64)
    return workload.with_requests(finish_table(df, rebase=False), note=f"n={n} for every request")
