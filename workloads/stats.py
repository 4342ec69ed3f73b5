"""Summary statistics of a workload, as plain data (printing and plotting live in the CLI).

Percentiles use numpy's 'linear' interpolation, as the traces' SOURCE.md figures do. The mean
rate is 1 / mean inter-arrival time; the inter-arrival CV is std / mean of the gaps (ddof 0).
Arrival figures are None for tables without arrival times or with closed-loop arrivals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from kvfrag.workloads.table import Workload


@dataclass(frozen=True)
class LengthStats:
    mean: float
    p50: float
    p90: float
    p99: float
    max: int
    min: int

    @classmethod
    def of(cls, values: np.ndarray) -> LengthStats:
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return cls(float(values.mean()), float(p50), float(p90), float(p99),
                   int(values.max()), int(values.min()))


@dataclass(frozen=True)
class TraceStats:
    source: str
    rows: int
    span_s: float | None
    mean_rate: float | None
    interarrival_cv: float | None
    prompt: LengthStats
    output: LengthStats
    prefix_reuse: tuple[float, float] | None = None  # (of blocks, of prompt tokens)


def ideal_prefix_reuse(workload: Workload) -> tuple[float, float] | None:
    """The most a prefix cache could reuse (an unbounded cache, requests in arrival order):
    for each request, the longest leading run of its hash ids seen in earlier requests. Returns
    (share of hashed blocks, share of prompt tokens) — the ceiling for `prefix_hit_rate_*` on
    first admissions; None without hash ids. The same definition as the traces' SOURCE.md."""
    df = workload.requests
    block = int(df.attrs.get("hash_block_tokens", 0) or 0)
    if "hash_ids" not in df.columns or not block:
        return None
    order = np.argsort(df["arrival_s"].to_numpy(), kind="stable")
    hashes = df["hash_ids"].to_numpy()
    prompts = df["prompt_tokens"].to_numpy()
    seen: set[int] = set()
    hit_blocks = total_blocks = hit_tokens = 0
    for i in order:
        ids = hashes[i]
        run = 0
        while run < len(ids) and ids[run] in seen:
            run += 1
        hit_blocks += run
        total_blocks += len(ids)
        hit_tokens += min(run * block, int(prompts[i]))
        seen.update(ids)
    total_tokens = int(prompts.sum())
    if not total_blocks or not total_tokens:
        return None
    return hit_blocks / total_blocks, hit_tokens / total_tokens


def trace_stats(workload: Workload) -> TraceStats:
    df = workload.requests
    span = rate = cv = None
    if workload.has_arrivals and not workload.closed_loop:
        arrivals = df["arrival_s"].to_numpy()
        span = float(arrivals[-1] - arrivals[0])
        gaps = np.diff(arrivals)
        if len(gaps) and gaps.mean() > 0:
            rate = float(1.0 / gaps.mean())
            cv = float(gaps.std() / gaps.mean())
    return TraceStats(
        source=workload.source,
        rows=len(df),
        span_s=span,
        mean_rate=rate,
        interarrival_cv=cv,
        prompt=LengthStats.of(df["prompt_tokens"].to_numpy()),
        output=LengthStats.of(df["output_tokens"].to_numpy()),
        prefix_reuse=ideal_prefix_reuse(workload),
    )


def arrival_rate(workload: Workload, bins: int = 60) -> tuple[np.ndarray, np.ndarray] | None:
    """(bin edges in s, requests per second in each bin), or None without arrivals."""
    if not workload.has_arrivals or workload.closed_loop:
        return None
    arrivals = workload.requests["arrival_s"].to_numpy()
    span = float(arrivals[-1] - arrivals[0])
    if span <= 0:
        return None
    counts, edges = np.histogram(arrivals, bins=bins, range=(arrivals[0], arrivals[-1]))
    return edges, counts / (edges[1] - edges[0])


def length_cdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted lengths, fraction of requests <= each), for plotting a CDF."""
    ordered = np.sort(values)
    return ordered, np.arange(1, len(ordered) + 1) / len(ordered)
