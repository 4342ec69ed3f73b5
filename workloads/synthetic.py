"""Synthetic workloads: length distributions and arrival processes, all from one seeded Generator.

Every draw comes from the `numpy.random.Generator` passed in, in a fixed order (prompt lengths,
output lengths, correlation, arrivals), so the same seed and spec give the same table.
Continuous length draws are rounded to whole tokens, floored at 1 and capped at MAX_TOKENS
(a lognormal's tail can reach past what an int64 holds).

Prompt/output correlation is induced by reordering (Iman-Conover): both length samples are drawn
independently, then paired by the ranks of a bivariate normal with correlation rho. The
marginals are exactly the requested ones; the Spearman rank correlation comes out near
(6/pi) * asin(rho/2).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
from kvfrag.workloads.readers import load_trace
from kvfrag.workloads.spec import (
    MAX_HASH_IDS,
    MAX_TOKENS,
    ArrivalSpec,
    AtOnceArrivals,
    ClosedLoopArrivals,
    ConstantArrivals,
    EmpiricalLengths,
    ExponentialLengths,
    FixedLengths,
    GammaArrivals,
    LengthSpec,
    LognormalLengths,
    NormalLengths,
    PoissonArrivals,
    ReplayArrivals,
    SyntheticSpec,
    UniformLengths,
    ZipfLengths,
)
from kvfrag.workloads.table import Workload, WorkloadError, finish_table

_MAX_REDRAWS = 1000


def _tokens(values: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(values), 1, MAX_TOKENS).astype(np.int64)


def sample_lengths(
    dist: LengthSpec,
    count: int,
    rng: np.random.Generator,
    base_dir: Path | None = None,
    role: str = "prompt_tokens",
) -> np.ndarray:
    """`count` token lengths (int64 >= 1) from `dist`; `role` picks an empirical column."""
    if isinstance(dist, FixedLengths):
        return np.full(count, dist.value, dtype=np.int64)
    if isinstance(dist, UniformLengths):
        return rng.integers(dist.low, dist.high, size=count, endpoint=True, dtype=np.int64)
    if isinstance(dist, NormalLengths):
        return _truncated_normal(dist, count, rng)
    if isinstance(dist, LognormalLengths):
        mu, sigma = dist.log_params()
        return _tokens(rng.lognormal(mu, sigma, size=count))
    if isinstance(dist, ExponentialLengths):
        return _tokens(rng.exponential(dist.mean, size=count))
    if isinstance(dist, ZipfLengths):
        weights = np.arange(1, dist.max + 1, dtype=np.float64) ** -dist.a
        cdf = np.cumsum(weights)
        picks = np.searchsorted(cdf, rng.random(count) * cdf[-1], side="right")
        return np.minimum(picks + 1, dist.max).astype(np.int64)
    if isinstance(dist, EmpiricalLengths):
        trace = load_trace(
            dist.path,
            format=dist.format,
            columns=dist.columns.mapping() if dist.columns else None,
            base_dir=base_dir,
        )
        pool = trace.requests[dist.field or role].to_numpy(dtype=np.int64)
        return rng.choice(pool, size=count, replace=True)
    raise TypeError(f"unknown length distribution {dist!r}")


def _truncated_normal(dist: NormalLengths, count: int, rng: np.random.Generator) -> np.ndarray:
    out = np.empty(count, dtype=np.int64)
    todo = np.arange(count)
    high = np.inf if dist.max is None else dist.max
    for _ in range(_MAX_REDRAWS):
        if not len(todo):
            return out
        draws = np.rint(rng.normal(dist.mean, dist.std, size=len(todo)))
        ok = (draws >= dist.min) & (draws <= high)
        out[todo[ok]] = draws[ok]
        todo = todo[~ok]
    raise WorkloadError(
        f"normal lengths: mean {dist.mean}, std {dist.std} almost never fall in "
        f"[{dist.min}, {dist.max}]; widen the bounds"
    )


def correlate(
    prompt: np.ndarray, output: np.ndarray, rho: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Pair `prompt` and `output` values by the ranks of a normal pair with correlation rho."""
    z = rng.standard_normal((2, len(prompt)))
    partner = rho * z[0] + np.sqrt(1.0 - rho**2) * z[1]
    ranks_p = np.argsort(np.argsort(z[0], kind="stable"), kind="stable")
    ranks_o = np.argsort(np.argsort(partner, kind="stable"), kind="stable")
    return np.sort(prompt)[ranks_p], np.sort(output)[ranks_o]


def sample_arrivals(
    process: ArrivalSpec, count: int, rng: np.random.Generator, base_dir: Path | None = None
) -> np.ndarray:
    """Open-loop arrival times (float64 seconds, first 0.0, non-decreasing)."""
    if isinstance(process, AtOnceArrivals):
        return np.zeros(count)
    if isinstance(process, ConstantArrivals):
        return np.arange(count, dtype=np.float64) / process.rate
    if isinstance(process, PoissonArrivals):
        gaps = rng.exponential(1.0 / process.rate, size=count - 1)
    elif isinstance(process, GammaArrivals):
        shape = 1.0 / process.cv**2
        gaps = rng.gamma(shape, 1.0 / (process.rate * shape), size=count - 1)
    elif isinstance(process, ReplayArrivals):
        return _replayed(process, count, base_dir)
    else:
        raise TypeError(f"{process!r} is not an open-loop arrival process")
    return np.concatenate([[0.0], np.cumsum(gaps)])


def _replayed(process: ReplayArrivals, count: int, base_dir: Path | None) -> np.ndarray:
    if process.path is None:
        raise WorkloadError("replay arrivals need a trace path here (no trace of its own)")
    trace = load_trace(
        process.path,
        format=process.format,
        columns=process.columns.mapping() if process.columns else None,
        time_unit=process.time_unit,
        base_dir=base_dir,
    )
    if not trace.has_arrivals:
        raise WorkloadError(f"{trace.source}: has no arrival times to replay")
    return _repeat_back_to_back(trace.requests["arrival_s"].to_numpy(), count)


def _repeat_back_to_back(times: np.ndarray, count: int) -> np.ndarray:
    """`count` arrivals: `times` repeated, each copy starting one mean gap after the last ends."""
    if count <= len(times):
        return times[:count].copy()
    span = float(times[-1] - times[0])
    period = span + (span / (len(times) - 1) if len(times) > 1 else 0.0)
    copies = -(-count // len(times))
    tiled = np.concatenate([times - times[0] + c * period for c in range(copies)])
    return tiled[:count]


def closed_loop_columns(
    process: ClosedLoopArrivals, count: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """`arrival_s`, `user_id` and `think_s` for a closed loop (see `workloads.table`)."""
    users = np.arange(count, dtype=np.int64) % process.users
    first = np.arange(count) < process.users
    arrival = np.full(count, np.nan)
    arrival[first] = np.arange(int(first.sum())) * (process.stagger_s / process.users)
    later = count - int(first.sum())
    if process.think == "fixed":
        think_later = np.full(later, float(process.think_s))
    else:
        think_later = rng.exponential(process.think_s, size=later)
    think = np.concatenate([np.zeros(count - later), think_later])
    return {"arrival_s": arrival, "user_id": users, "think_s": think}


def _describe(process: ArrivalSpec) -> str:
    fields = process.model_dump(exclude={"kind"}, exclude_none=True)
    detail = ", ".join(f"{k}={v}" for k, v in fields.items())
    return f"arrivals: {process.kind}" + (f" ({detail})" if detail else "")


def apply_arrivals(
    workload: Workload,
    process: ArrivalSpec,
    rng: np.random.Generator,
    base_dir: Path | None = None,
) -> Workload:
    """Give `workload` the arrivals of `process`, in row order (rows are not reordered).

    Replay without a path keeps the workload's own arrivals (an error if it has none).
    """
    df = workload.requests.drop(columns=["user_id", "think_s"], errors="ignore")
    count = len(df)
    if isinstance(process, ReplayArrivals) and process.path is None:
        if not workload.has_arrivals:
            raise WorkloadError(f"{workload.source}: has no arrival times to replay; "
                                "choose an arrival process")
        return workload
    if isinstance(process, ClosedLoopArrivals):
        for name, values in closed_loop_columns(process, count, rng).items():
            df[name] = values
    else:
        df["arrival_s"] = sample_arrivals(process, count, rng, base_dir)
    note = _describe(process)
    return replace(
        workload,
        requests=finish_table(df, rebase=False),
        notes=(*workload.notes, note),
        has_arrivals=True,
    )


def sample_requests(
    spec: SyntheticSpec, rng: np.random.Generator, base_dir: Path | None = None
) -> Workload:
    """The lengths of a synthetic workload, all arriving at 0 (`has_arrivals` False)."""
    prompt = sample_lengths(spec.prompt, spec.count, rng, base_dir, "prompt_tokens")
    output = sample_lengths(spec.output, spec.count, rng, base_dir, "output_tokens")
    if spec.correlation:
        prompt, output = correlate(prompt, output, spec.correlation, rng)
    table = {
        "request_id": np.arange(spec.count, dtype=np.int64),
        "arrival_s": np.zeros(spec.count),
        "prompt_tokens": prompt,
        "output_tokens": output,
    }
    notes = [f"synthetic: prompt {spec.prompt.kind}, output {spec.output.kind}"
             + (f", correlation {spec.correlation}" if spec.correlation else "")]
    if spec.max_tokens is not None:
        table["output_tokens"] = np.minimum(output, spec.max_tokens)
        table["max_tokens"] = np.full(spec.count, spec.max_tokens, dtype=np.int64)
        notes.append(f"output lengths capped at max_tokens {spec.max_tokens}")
    chunk = 0
    if spec.shared_prefix is not None:
        sp, chunk = spec.shared_prefix, spec.shared_prefix.chunk_tokens
        table["prompt_tokens"] = prompt = prompt + sp.tokens
        table["hash_ids"] = shared_prefix_hashes(prompt, sp.tokens, sp.groups, chunk, rng)
        notes.append(f"system prompt of {sp.tokens} tokens, {sp.groups} different one(s)")
    requests = pd.DataFrame(table)
    if chunk:
        requests.attrs["hash_block_tokens"] = chunk
    return Workload(
        requests=requests,
        source="synthetic",
        notes=tuple(notes),
        has_arrivals=False,
    )


def shared_prefix_hashes(
    prompt: np.ndarray, tokens: int, groups: int, chunk: int, rng: np.random.Generator
) -> list[list[int]]:
    """Hash ids per `chunk` prompt tokens: the first tokens // chunk of them name the chunks
    of the request's system prompt (one of `groups`, drawn), the rest are unique."""
    shared = tokens // chunk
    total = int((-(-prompt.astype(np.int64) // chunk)).sum())
    if total > MAX_HASH_IDS:
        raise WorkloadError(
            f"synthetic: prompts in chunks of {chunk} tokens have {total:,} hash ids; at most "
            f"{MAX_HASH_IDS:,} (use larger chunk_tokens or fewer requests)"
        )
    group = rng.integers(0, groups, len(prompt))
    next_id = groups * shared
    hashes = []
    for g, length in zip(group.tolist(), prompt.tolist(), strict=True):
        own = -(-length // chunk) - shared
        hashes.append([g * shared + c for c in range(shared)] + list(range(next_id, next_id + own)))
        next_id += own
    return hashes


def synthesize(
    spec: SyntheticSpec, rng: np.random.Generator, base_dir: Path | None = None
) -> Workload:
    """A synthetic workload with its arrivals; same `rng` state and spec, same table."""
    return apply_arrivals(sample_requests(spec, rng, base_dir), spec.arrival, rng, base_dir)
