"""The summary of a run: its one row of figures (the time averages of memory's parts, counts,
rates, latency percentiles), computed once at its end from the engine's integrals and counters
and the request and time-series frames. Not compiled: it runs once a run, mostly in pandas.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from kvfrag.sim.allocators.base import PARTS
from kvfrag.sim.engine_records import REJECT_REASONS

if TYPE_CHECKING:
    from kvfrag.sim.engine import Engine


def _stats(values: pd.Series) -> dict[str, float]:
    """mean, p50, p90 and p99 of the values that are defined (NaN when none is)."""
    v = values.dropna().to_numpy(dtype=float)
    if not len(v):
        return dict.fromkeys(("mean", "p50", "p90", "p99"), math.nan)
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _speculation(engine: Engine) -> dict[str, float | int]:
    """Speculative decoding's figures (none without it, as the prefix-caching figures): the
    decode steps that verified drafts, the drafts they carried, those accepted, and the
    tokens a step gave."""
    if engine.spec is None:
        return {}
    specs = engine.specs
    assert specs is not None
    steps, drafts, accepted = specs.steps, specs.drafts_total, specs.accepted_total
    return {
        "spec_verify_steps": steps,
        "spec_drafts": drafts,
        "spec_drafts_accepted": accepted,
        "spec_acceptance": accepted / drafts if drafts else math.nan,
        "spec_tokens_per_step": (steps + accepted) / steps if steps else math.nan,
    }


def summary(engine: Engine, requests: pd.DataFrame, ts: pd.DataFrame) -> dict:
    """The run's summary row (its keys: docs/data-dictionary.md) from `engine`'s integrals and
    counters, the request table and the time series `ts` it made."""
    cap = engine.alloc.capacity
    areas = (engine.area0, engine.area1, engine.area2, engine.area3, engine.area4)
    integrals = dict(zip(PARTS, areas, strict=True))
    total = float(ts["dt_s"].sum()) if len(ts) else 0.0
    # Figures of a run in which no time passed (every request rejected at its arrival at
    # t = 0, no requests, max_time_s = 0): time averages are 0/0 there, so the parts and
    # mean_running are the state at that instant (the allocator as it stands, empty: its
    # parts still sum to 1). Ratios of something that never happened are NaN (kv_utilization
    # with nothing ever allocated; queueing and latency with nothing completed); counts and
    # rates of what was produced are 0 (throughput, prefix hits, memory saved by sharing).
    if total:
        # (a part that is 0 can come out as -1e-18 after float sums: clamp the round-off)
        frac = {p: max(integrals[p] / (cap * total), 0.0) for p in PARTS}
        over = min(engine.overreserved / (cap * total), frac["internal"])
        padding = engine.padding / (cap * total)
        out = engine.out_of_window / (cap * total)
    else:
        now = engine.alloc.parts(engine._probe())
        frac = {p: v / cap for p, v in zip(PARTS, now, strict=True)}
        over = engine.alloc.overreserved_bytes() / cap
        waste = engine.alloc.waste_parts()
        padding, out = waste[0] / cap, waste[1] / cap
    # (clamped as the parts are: a part that is 0 can come out as -1e-18 after float sums)
    padding = min(max(padding, 0.0), frac["internal"] - over)
    out = min(max(out, 0.0), frac["internal"] - over - padding)
    if not (math.isfinite(total) and all(math.isfinite(v) for v in frac.values())):
        # (simulated times so long that byte-seconds overflow: written, the run would
        # look like a success whose every share is NaN)
        raise ValueError(
            f"the run's time averages are not finite ({total:.3g} s simulated): its step "
            "or arrival times are too large to measure"
        )
    allocated = integrals["token_states"] + integrals["reserved"] + integrals["internal"]
    done = requests[requests["status"] == "completed"]
    rejected = requests[requests["status"] == "rejected"]
    reasons = Counter(engine.out.reasons.values())  # (a rejected request's reason)
    generated = int(done["generated_tokens"].sum())
    start = float(requests["arrival_s"].min()) if len(requests) else 0.0
    span = (float(done["finished_s"].max()) - start) if len(done) else 0.0

    def pct(col: str, q: float) -> float:
        return float(np.percentile(done[col], q)) if len(done) else math.nan

    return {
        "capacity_bytes": cap,
        "bytes_per_token": engine.alloc.bytes_per_token,
        "max_model_len": engine.alloc.max_model_len,
        "sim_time_s": total,
        **{f"{p}_frac": v for p, v in frac.items()},
        # internal = over-reservation (room for tokens never reached) + rounding (the
        # allocation granularity past the reservation): see Allocator.overreserved_bytes.
        # On hybrid models also padding (pages beyond their layers' real slots) and out
        # of window (written tokens no layer reads again): see Allocator.waste_parts.
        "internal_overreservation_frac": over,
        "internal_padding_frac": padding,
        "internal_out_of_window_frac": out,
        "internal_rounding_frac": max(frac["internal"] - over - padding - out, 0.0),
        "kv_utilization": integrals["token_states"] / allocated if allocated else math.nan,
        # Of the memory separate copies would have needed, the share sharing saved.
        "memory_saved_by_sharing_frac": (
            engine.saved / (allocated + engine.saved) if engine.saved else 0.0
        ),
        "prefill_tokens_skipped": engine.prefix_hits,
        # At first admissions only: reuse across requests, bounded by the trace's ideal
        # reuse (`kvfrag trace stats`); the rest is re-admissions finding their own blocks.
        "prefill_tokens_skipped_first": engine.first_hits,
        "prefix_hit_rate_first_tokens": (
            engine.first_hits / engine.first_lookups if engine.first_lookups else 0.0
        ),
        "prefix_hit_rate_tokens": (
            engine.prefix_hits / engine.prompt_lookups if engine.prompt_lookups else 0.0
        ),
        **engine.alloc.summary_stats(),
        **_speculation(engine),
        "mean_running": engine.busy_running / total if total else float(len(engine.running)),
        "max_running": engine.max_running,
        "requests": len(requests),
        "completed": len(done),
        "rejected": len(rejected),
        **{f"rejected_{why}": int(reasons.get(why, 0)) for why in REJECT_REASONS},
        "unfinished": int(len(requests) - len(done) - len(rejected)),
        "preemptions": engine.preemptions,
        "recomputed_tokens": engine.recomputed,
        "frag_refusals": int(requests["frag_refused"].sum()),
        "frag_blocked_s": engine.frag_blocked_s,
        "compactions": engine.alloc.compactions,
        "bytes_moved": engine.alloc.bytes_moved,
        "stall_s": engine.alloc.stall_s,
        "generated_tokens": generated,
        "throughput_tok_s": generated / span if span else 0.0,
        "throughput_req_s": len(done) / span if span else 0.0,
        "mean_queueing_s": float(done["queueing_s"].mean()) if len(done) else math.nan,
        "p50_queueing_s": pct("queueing_s", 50),
        "p99_queueing_s": pct("queueing_s", 99),
        "mean_latency_s": float(done["latency_s"].mean()) if len(done) else math.nan,
        "p50_latency_s": pct("latency_s", 50),
        "p99_latency_s": pct("latency_s", 99),
        **{
            f"{stat}_{col}": value
            for col in ("ttft_s", "tpot_s")
            for stat, value in _stats(done[col]).items()
        },
        "events": len(ts),
    }
