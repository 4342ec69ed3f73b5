"""A scenario's validation: simulate each allocator with its allocation log, replay it, report.

`plan` decides which (allocator, mode) pairs run: arena for contiguous and buddy, paged for
paged, vattention and prefix-caching, torch for contiguous, buddy and torch-caching (CUDA
only). `--mode auto` picks one mode per allocator (torch-caching -> torch); `--mode all` runs
every mode an allocator supports.
`check_device` and `check_cap` refuse, with one line, what cannot or must not run: torch
missing, CUDA absent, or a KV budget (plus the replay's scratch) over the memory cap.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfrag.sim.engine import run as run_engine
from kvfrag.sim.scenario import Scenario, build_allocator
from kvfrag.sim.scenario_parts import AllocatorSpec
from kvfrag.sim.scenario_run import iter_runs
from kvfrag.sim.units import format_size
from kvfrag.validate.outcome import Outcome
from kvfrag.workloads import build_workload

MODES = ("arena", "paged", "torch")
SUPPORTS = {
    "arena": ("contiguous", "buddy"),
    # vAttention pages log and replay as paged blocks; prefix caching's cached blocks too
    "paged": ("paged", "vattention", "prefix-caching"),
    "torch": ("contiguous", "buddy", "torch-caching"),
}
AUTO = {
    "contiguous": "arena",
    "buddy": "arena",
    "paged": "paged",
    "vattention": "paged",
    "prefix-caching": "paged",
    "torch-caching": "torch",
}
CPU_CAP = 2 << 30  # default cap on the host
CAP_FRACTION = 0.5  # default cap on a GPU: this share of its free memory
SEGMENT = 2 << 20  # CUDA segments are rounded up to this


@dataclass
class Job:
    point: int
    sweep: dict[str, Any]
    scenario: Scenario
    spec: AllocatorSpec
    mode: str


def torch_or_error():
    try:
        import torch
    except ImportError:
        raise ValueError(
            "kvfrag validate needs torch: pip install 'kvfrag[validate]' (or a CPU build of torch)"
        ) from None
    return torch


def check_device(device: str) -> None:
    """Raise a one-line ValueError unless `device` can be used here."""
    torch = torch_or_error()
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device cuda: CUDA is not available here (torch {torch.__version__}); "
            "use --device cpu for the arena and paged modes"
        )


def set_threads(device: str, threads: int | None) -> None:
    """Limit torch's CPU thread pool for the replays: one thread on cpu unless asked.

    A replay is a stream of small copies and fills; torch's intra-op pool, sized to every core,
    only adds contention: on a 2-core machine with a load of about 3, `kvfrag validate
    scenarios/validate-tiny.yaml --device cpu` took 143 s (91 s of CPU) with two threads and
    59 s (37 s of CPU) with one.
    On cuda the kernels run on the device and the pool is left as it is unless `--threads`
    is given."""
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be 1 or more, not {threads}")
    if threads is None and device != "cpu":
        return
    torch_or_error().set_num_threads(threads or 1)


def default_cap(device: str) -> int:
    if device == "cuda":
        free, _ = torch_or_error().cuda.mem_get_info()
        return int(CAP_FRACTION * free)
    return CPU_CAP


def plan(scenario: Scenario, mode: str, device: str) -> tuple[list[Job], list[Outcome]]:
    """The replays to run, and the ones that cannot run here (as skipped outcomes)."""
    if mode == "torch" and device != "cuda":
        raise ValueError(
            "--mode torch needs --device cuda: it measures PyTorch's CUDA caching allocator"
        )
    jobs, skipped = [], []
    for i, sweep, point, spec in iter_runs(scenario):
        if mode == "auto":
            modes = [AUTO[spec.kind]] if spec.kind in AUTO else []
        elif mode == "all":
            modes = [m for m in MODES if spec.kind in SUPPORTS[m]]
        else:
            modes = [mode] if spec.kind in SUPPORTS[mode] else []
        for m in modes:
            why = "torch mode needs CUDA" if m == "torch" and device != "cuda" else None
            if m == "paged" and spec.kind == "vattention":
                why = _straddling(point, spec)
            if why:
                skipped.append(
                    Outcome(spec.label, spec.kind, m, device, point.budget_bytes, i, "skip", why)
                )
            else:
                jobs.append(Job(i, sweep, point, spec, m))
    if not jobs and mode not in ("auto", "all"):
        kinds = ", ".join(sorted({s.kind for s in scenario.allocators}))
        raise ValueError(
            f"--mode {mode} replays {', '.join(SUPPORTS[mode])} allocators; this scenario has "
            f"{kinds}"
        )
    return jobs, skipped


def _straddling(point: Scenario, spec: AllocatorSpec) -> str | None:
    """Why vAttention pages cannot replay as token-aligned paged blocks, if they cannot."""
    allocator = build_allocator(point, spec)
    if allocator.pages_per_block == 1:
        return None
    return (
        f"{allocator.geometry.name}'s {allocator.row}-byte token rows straddle "
        f"{format_size(allocator.page_size)} pages: pages are not token-aligned blocks, which "
        "paged mode replays"
    )


def device_bytes(job: Job, device: str) -> int:
    """The most device memory a job's replay takes: its budget plus scratch (torch mode: the
    budget itself, which the memory fraction enforces)."""
    from kvfrag.validate.replay import SCRATCH

    budget = job.scenario.budget_bytes
    if job.mode == "torch":
        return budget
    scratch = 3 * min(SCRATCH, budget)  # a gathered copy, a comparison, index tensors
    if device == "cuda":
        return -(-budget // SEGMENT) * SEGMENT + scratch
    return budget + scratch


def check_cap(jobs: list[Job], device: str, cap: int) -> None:
    for job in jobs:
        need = device_bytes(job, device)
        if need > cap:
            raise ValueError(
                f"{job.spec.label} ({job.mode}): the KV budget of "
                f"{format_size(job.scenario.budget_bytes)} needs {format_size(need)} on "
                f"{device}, over the cap of {format_size(cap)}; shrink it with "
                "--set kv_budget=... or raise --cap"
            )


def replays(jobs: list[Job]) -> int:
    """How many outcomes `run_jobs` gives for `jobs`: torch mode replays twice (without and
    with expandable segments), the others once."""
    return sum(2 if job.mode == "torch" else 1 for job in jobs)


#: `on_step(job, step, done, total)`: `job` is simulating (done of total requests retired)
#: or replaying (done of total log rows replayed); called at the start of each step, then
#: every ~0.2 s or every few log rows, as the step goes (a torch-mode replay: once, total 0).
StepProgress = Callable[[Job, str, int, int], None]


def run_jobs(
    jobs: list[Job],
    base_dir: Path,
    device: str,
    checkpoints: int | None = None,
    on_job: Callable[[Outcome], None] | None = None,
    on_step: StepProgress | None = None,
) -> list[Outcome]:
    """Simulate every allocator once (with its log) and replay it in each planned mode."""
    cache: dict[str, Any] = {}
    sims: dict[tuple[int, str], tuple[Any, Any]] = {}
    outcomes: list[Outcome] = []
    for job in sorted(jobs, key=lambda j: j.mode == "torch"):  # torch last: it sets the cap
        key = (job.point, job.spec.label)
        if key not in sims:
            sims[key] = _simulate(job, base_dir, cache, on_step)
        result, allocator, requested = sims[key]
        replayed = _replay(job, result, allocator, requested, device, checkpoints, on_step)
        for outcome in replayed:
            outcome.max_running = int(result.summary["max_running"])
            outcomes.append(outcome)
            if on_job is not None:
                on_job(outcome)
    return outcomes


def _simulate(
    job: Job, base_dir: Path, cache: dict[str, Any], on_step: StepProgress | None = None
):
    point, spec = job.scenario, job.spec
    key = point.workload.model_dump_json() + f"|{point.max_model_len}"
    if key not in cache:
        cache[key] = build_workload(point.workload, base_dir, None, point.max_model_len)
    allocator = build_allocator(point, spec)
    config = dataclasses.replace(point.engine_config(), log_allocations=True)
    progress = None
    if on_step is not None:
        on_step(job, "simulating", 0, len(cache[key].requests))
        progress = functools.partial(on_step, job, "simulating")
    result = run_engine(cache[key].requests, allocator, config, progress)
    return result, allocator, _requested_sizes(allocator, cache[key].requests)


def _requested_sizes(allocator: Any, requests: Any) -> dict[int, int]:
    """Bytes each request asks its slab allocator for (before any rounding the allocator
    applies): what torch mode passes to torch.empty."""
    from kvfrag.sim.engine_requests import slot_request

    slab = getattr(allocator, "slab_bytes", None)
    if slab is None or "request_id" not in requests:
        return {}
    out = {}
    mml = allocator.max_model_len
    has_max = "max_tokens" in requests
    for row in requests.itertuples(index=False):
        mt = getattr(row, "max_tokens", None) if has_max else None
        mt = None if mt is None or mt != mt else int(mt)
        n = 1
        for col in ("n", "beam_width"):
            k = getattr(row, col, 1)
            n *= 1 if k is None or k != k else int(k)  # (NaN: not set)
        req, _ = slot_request(int(row.request_id), int(row.prompt_tokens),
                              int(row.output_tokens), mt, n, False, (), 0)
        out[req.rid] = int(slab(min(allocator.reservation_tokens(req), mml)))
    return out


def _replay(
    job: Job, result: Any, allocator: Any, requested: dict[int, int], device: str,
    checkpoints: int | None, on_step: StepProgress | None = None,
) -> list[Outcome]:
    from kvfrag.validate.replay import replay_log

    point, spec = job.scenario, job.spec
    torch = torch_or_error()
    oom_error = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

    def outcome(mode: str) -> Outcome:
        return Outcome(spec.label, spec.kind, mode, device, point.budget_bytes, job.point)

    if job.mode == "torch":
        from kvfrag.validate.torch_mode import replay_torch

        if on_step is not None:  # (no progress within: total 0)
            on_step(job, "replaying through torch", 0, 0)
        outs = []
        for expandable in (False, True):
            out = outcome("torch+expandable" if expandable else "torch")
            outs.append(replay_torch(result.log, out, expandable, requested))
        return outs
    out = outcome(job.mode)
    block_size = getattr(allocator, "block_size", None) if job.mode == "paged" else None
    progress = None
    if on_step is not None:
        on_step(job, "replaying", 0, len(result.log))
        progress = functools.partial(on_step, job, "replaying")
    try:
        replay_log(result.log, out, point.geometry.bytes_per_token, device, block_size,
                   checkpoints, progress)
    except oom_error as exc:
        out.status = "error"
        out.note = f"{device} out of memory: {str(exc).splitlines()[0]}"
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
    return [out]
