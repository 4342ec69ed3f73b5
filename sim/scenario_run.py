"""Running a scenario: `run(scenario)` builds the workload once per distinct workload spec and
runs every allocator at every sweep point on it (`iter_runs`, `run_point`), returning records
(`ScenarioResult`: a summary row per run, the time series and request tables). Nothing here
reads YAML or writes files."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from kvfrag.sim.engine import run as run_engine
from kvfrag.sim.engine_records import RunResult
from kvfrag.sim.scenario import Scenario, build_allocator
from kvfrag.sim.scenario_parts import AllocatorSpec
from kvfrag.sim.speculative_spec import check_workload
from kvfrag.workloads import Workload, build_workload


@dataclass
class PointRun:
    """One allocator at one sweep point."""

    point: int
    sweep: dict[str, Any]
    label: str
    kind: str
    scenario: Scenario
    result: RunResult


#: What building a workload can leave out (`workloads.Workload` counts), per summary row.
WORKLOAD_COUNTS = ("dropped_rows", "clipped", "rejected_long")


@dataclass
class ScenarioResult:
    scenario: Scenario
    workloads: dict[int, Workload]  # by sweep point
    runs: list[PointRun]

    def summary(self) -> pd.DataFrame:
        """One row per allocator x sweep point, with the sweep values as columns, and what
        building the point's workload dropped, clipped or rejected (kept on record, not only
        printed). Values stay native (a swept mapping or list as itself; `options` a dict of
        the allocator's scenario options): summary.json keeps them so, and
        `kvfrag.results.summary_table` lays them out for summary.csv and the terminal."""
        rows = []
        for r in self.runs:
            s = r.scenario
            workload = self.workloads.get(r.point)
            counts = {
                f"workload_{name}": int(getattr(workload, name, 0) or 0)
                for name in WORKLOAD_COUNTS
            }
            counts["workload_arrival_rate"] = _arrival_rate(workload)
            rows.append(
                {
                    "label": r.label,
                    "kind": r.kind,
                    "point": r.point,
                    **r.sweep,
                    "model": s.geometry.name,
                    "hardware": s.gpu.name if s.gpu is not None else "",
                    "tp": s.tp,
                    "step_time": s.engine_config().step_time.source,
                    "kv_budget_bytes": s.budget_bytes,
                    **r.result.summary,
                    "options": dict(sorted(_allocator(s, r.label).options.items())),
                    **counts,
                }
            )
        return pd.DataFrame(rows)

    def frames(self, which: str) -> pd.DataFrame:
        """`timeseries` or `requests` of every run, with label and point columns."""
        parts = []
        for r in self.runs:
            df = getattr(r.result, which)
            parts.append(df.assign(label=r.label, point=r.point))
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def _arrival_rate(workload: Workload | None) -> float:
    """Requests per second that arrived (open loop: (n - 1) / span; NaN when undefined): the
    rate the run served, after any filter."""
    if workload is None or len(workload.requests) < 2 or "user_id" in workload.requests:
        return float("nan")  # (closed loop: arrivals follow completions)
    arrivals = workload.requests["arrival_s"].dropna().to_numpy()
    span = float(arrivals.max() - arrivals.min()) if len(arrivals) > 1 else 0.0
    return (len(arrivals) - 1) / span if span > 0 else float("nan")


def _allocator(scenario: Scenario, label: str) -> AllocatorSpec:
    return next(a for a in scenario.allocators if a.label == label)


def iter_runs(scenario: Scenario) -> Iterator[tuple[int, dict[str, Any], Scenario, AllocatorSpec]]:
    for i, (values, point) in enumerate(scenario.points()):
        for spec in point.allocators:
            yield i, values, point, spec


def run(
    scenario: Scenario,
    base_dir: Path | None = None,
    on_run: Callable[[str], None] | None = None,
) -> ScenarioResult:
    """Run every allocator at every sweep point; `on_run(label)` is told as each finishes."""
    base_dir = Path(".") if base_dir is None else base_dir
    cache: dict[str, Workload] = {}
    workloads: dict[int, Workload] = {}
    runs = []
    for i, values, point, spec in iter_runs(scenario):
        key = point.workload.model_dump_json() + f"|{point.max_model_len}"
        if key not in cache:
            cache[key] = build_workload(point.workload, base_dir, None, point.max_model_len)
        workloads[i] = cache[key]
        check_workload(point.engine.speculative, workloads[i].requests, workloads[i].source)
        result = run_point(point, spec, workloads[i].requests)
        runs.append(PointRun(i, values, spec.label, spec.kind, point, result))
        if on_run is not None:
            on_run(spec.label)
    return ScenarioResult(scenario, workloads, runs)


def run_point(
    point: Scenario,
    spec: AllocatorSpec,
    requests: pd.DataFrame,
    progress: Callable[[int, int], None] | None = None,
    capacity: bool = True,
) -> RunResult:
    """One allocator at one sweep point, on its workload's request table (the unit of work
    of `run` and of `sim.sweep`'s executors). A torch-caching run carries the allocator's
    PyTorch memory snapshot at its end (`RunResult.snapshot`, see `sim.snapshot`).
    `progress(done, total)`: requests retired so far, as `sim.engine.run` reports them.
    With `capacity`, the summary carries the saturating replay's figures (`sim.capacity`)
    after `max_running`."""
    from kvfrag.sim.capacity import saturate
    from kvfrag.sim.snapshot import TorchCachingAllocator, snapshot

    allocator = build_allocator(point, spec)
    config = point.engine_config()
    result = run_engine(requests, allocator, config, progress)
    if isinstance(allocator, TorchCachingAllocator):
        result.snapshot = snapshot(allocator)
    if capacity:
        fields = saturate(requests, lambda: build_allocator(point, spec), config)
        summary: dict[str, float | int | str] = {}
        for key, value in result.summary.items():
            summary[key] = value
            if key == "max_running":
                summary.update(fields)
        result.summary = summary
    return result


#: Block sizes vLLM 0.33's attention kernels run on NVIDIA GPUs: multiples of 16. A backend
#: takes a block size that is a multiple of one of its kernel block sizes
#: (vllm/v1/attention/backend.py, AttentionBackend.supports_block_size, and "block_size not
#: supported" in validate_configuration), which get_supported_kernel_block_sizes gives as
#: MultipleOf(16) for FlashAttention (v1/attention/backends/flash_attn.py) and Triton
#: (triton_attn.py), [16, 32, 64] for FlashInfer (flashinfer.py); MLA backends ask more
#: (FlashMLA 64, CUTLASS MLA 128: v1/attention/backends/mla/). vLLM's own default is 16
#: (config/cache.py, CacheConfig.DEFAULT_BLOCK_SIZE).
VLLM_BLOCK_MULTIPLE = 16


def block_size_warnings(specs: Iterable[AllocatorSpec]) -> list[str]:
    """One line per allocator label given a `block_size` vLLM 0.33 cannot run (not a multiple
    of `VLLM_BLOCK_MULTIPLE`), every such size of its sweep points named: a warning, not an
    error (kvfrag may model what vLLM does not)."""
    odd: dict[str, set[int]] = {}
    for spec in specs:
        size = spec.options.get("block_size")
        if isinstance(size, int) and size % VLLM_BLOCK_MULTIPLE:
            odd.setdefault(spec.label, set()).add(size)
    return [
        f"allocator {label!r}: block_size {', '.join(map(str, sorted(sizes)))} is not one vLLM "
        f"0.33's attention kernels run (multiples of {VLLM_BLOCK_MULTIPLE}: 16, 32, 64, ...); "
        "modelled all the same"
        for label, sizes in odd.items()
    ]


def count_runs(scenario: Scenario) -> int:
    return len(scenario.points()) * len(scenario.allocators)
