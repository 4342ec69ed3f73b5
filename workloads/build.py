"""`build_workload`: a `WorkloadSpec` from a scenario -> one validated `Workload`.

Order of operations:

1. the source: the trace file, or the synthetic lengths;
2. an open-loop arrival process (the synthetic one, or a trace's override);
3. the transforms, in `TransformSpec` order: window, first_n, sample_n, tile, rate_scale,
   the length bounds (max_model_len, max_prompt_tokens, max_output_tokens) — except that
   with an arrival process of the scenario's own the length bounds come before step 2: the
   arrivals are drawn for the requests that are kept, so "Poisson 2 req/s" serves 2 req/s;
4. a closed-loop arrival process, last, since closed-loop tables cannot be windowed, sampled,
   tiled or rate-scaled;
5. the scenario-wide `n`, then validation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from kvfrag.workloads.readers import load_trace
from kvfrag.workloads.spec import ClosedLoopArrivals, ReplayArrivals, TransformSpec, WorkloadSpec
from kvfrag.workloads.synthetic import apply_arrivals, sample_requests
from kvfrag.workloads.table import Workload, WorkloadError, validate_requests
from kvfrag.workloads.transforms import (
    first_n,
    limit_length,
    limit_parts,
    sample_n,
    scale_rate,
    tile,
    time_window,
    with_beam_width,
    with_priorities,
    with_samples_per_prompt,
)


def build_workload(
    spec: WorkloadSpec,
    base_dir: Path,
    rng: np.random.Generator | None = None,
    max_model_len: int | None = None,
) -> Workload:
    """Build the workload of a scenario; relative paths resolve against `base_dir`.

    `rng` defaults to `numpy.random.default_rng(spec.seed)`. `max_model_len` is the engine's
    limit; the spec's own `transforms.max_model_len` may only lower it.
    """
    rng = np.random.default_rng(spec.seed) if rng is None else rng
    if spec.trace is not None:
        trace = spec.trace
        workload = load_trace(
            trace.path,
            format=trace.format,
            columns=trace.columns.mapping() if trace.columns else None,
            time_unit=trace.time_unit,
            drop_bad_rows=trace.drop_bad_rows,
            hash_block_tokens=trace.hash_block_tokens,
            base_dir=base_dir,
        )
        arrival = trace.arrival
        if arrival is None and not workload.has_arrivals:
            raise WorkloadError(f"{workload.source}: the trace has no arrival times; give it an "
                                "arrival process (trace.arrival, e.g. {kind: poisson, rate: 2})")
    else:
        assert spec.synthetic is not None  # the spec validator guarantees one source
        workload = sample_requests(spec.synthetic, rng, base_dir)
        arrival = spec.synthetic.arrival
    closed = arrival if isinstance(arrival, ClosedLoopArrivals) else None
    drawn = arrival is not None and closed is None and not _replays_own(arrival)
    if drawn:  # filter first, then draw the arrivals of what is kept
        workload = limit_lengths(workload, spec.transforms, max_model_len)
    if arrival is not None and closed is None:
        workload = apply_arrivals(workload, arrival, rng, base_dir)
    if closed is not None and spec.transforms.rate_scale is not None:
        raise WorkloadError("rate_scale does not apply to closed-loop arrivals; change the "
                            "number of users or the think time instead")
    workload = apply_transforms(workload, spec.transforms, rng, max_model_len, lengths=not drawn)
    if closed is not None:
        workload = apply_arrivals(workload, closed, rng, base_dir)
    if spec.n is not None:
        workload = with_samples_per_prompt(workload, spec.n)
    if spec.beam_width is not None:
        workload = with_beam_width(workload, spec.beam_width)
    if spec.synthetic is not None and spec.synthetic.priority:
        workload = with_priorities(workload, spec.synthetic.priority, rng)
    validate_requests(workload.requests, workload.source)
    return workload


def _replays_own(arrival: object) -> bool:
    """A replay of the trace's own timestamps: real arrivals, thinned by any filter."""
    return isinstance(arrival, ReplayArrivals) and arrival.path is None


def limit_lengths(
    workload: Workload, transforms: TransformSpec, max_model_len: int | None = None
) -> Workload:
    """The length bounds: prompt and output apart, then prompt + output."""
    if transforms.max_prompt_tokens is not None or transforms.max_output_tokens is not None:
        workload = limit_parts(workload, transforms.max_prompt_tokens,
                               transforms.max_output_tokens, transforms.long_requests)
    limits = [m for m in (transforms.max_model_len, max_model_len) if m is not None]
    if limits:
        workload = limit_length(workload, min(limits), transforms.long_requests)
    return workload


def apply_transforms(
    workload: Workload,
    transforms: TransformSpec,
    rng: np.random.Generator,
    max_model_len: int | None = None,
    lengths: bool = True,
) -> Workload:
    """Apply `transforms` in their documented order (see `TransformSpec`); `lengths=False`:
    without the length bounds (applied before the arrivals were drawn)."""
    if transforms.window is not None:
        workload = time_window(workload, transforms.window.start_s, transforms.window.end_s)
    if transforms.first_n is not None:
        workload = first_n(workload, transforms.first_n)
    if transforms.sample_n is not None:
        workload = sample_n(workload, transforms.sample_n, rng)
    if transforms.tile > 1:
        workload = tile(workload, transforms.tile, transforms.tile_mode)
    if transforms.rate_scale is not None:
        workload = scale_rate(workload, transforms.rate_scale)
    if lengths:
        workload = limit_lengths(workload, transforms, max_model_len)
    return workload
