"""Torch mode: the log's slab allocations made for real through PyTorch's CUDA caching allocator.

Every admission becomes `torch.empty(nbytes, dtype=torch.uint8, device="cuda")` (one per slab:
a request with n samples has n, listed in the log's `offsets`) and every free drops them, in
log order, with the process capped at exactly `capacity` bytes by
`torch.cuda.set_per_process_memory_fraction` (a deterministic cap: a segment that would take
reserved memory past it fails without asking CUDA). After every operation
`torch.cuda.memory_stats()` is read (less the stats before the replay), and the same operation
is made on the `torch-caching` model (`raw_malloc` / `raw_free`, the same byte sizes), so the
two can be compared operation by operation: allocated, reserved, inactive-split bytes, segment
count, num_ooms, num_alloc_retries, and which allocations raised OOM.

One pass runs with default settings, another with `expandable_segments:True`; settings and the
memory fraction are restored afterwards, and everything is freed on any error. No managed
memory is used.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pandas as pd
from kvfrag.validate.outcome import Outcome

#: memory_stats() keys compared, by the short name the report uses.
KEYS = {
    "allocated": "allocated_bytes.all.current",
    "reserved": "reserved_bytes.all.current",
    "inactive_split": "inactive_split_bytes.all.current",
    "segments": "segment.all.current",
    "num_ooms": "num_ooms",
    "num_alloc_retries": "num_alloc_retries",
}
#: The model claims to follow torch's rules exactly, so every figure is held to 0.
TOLERANCES = dict.fromkeys([*KEYS, "ooms"], 0)


def cap_fraction(capacity: int, total: int) -> float:
    """The memory fraction whose cap, as torch computes it (size_t(f * total)), is `capacity`."""
    f = capacity / total
    while int(f * total) < capacity:
        f = math.nextafter(f, 1.0)
    while f > 0 and int(f * total) > capacity:
        f = math.nextafter(f, 0.0)
    return f


def _configured_expandable() -> bool:
    """Whether the environment asked for expandable segments (what settings go back to)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def make_model(capacity: int, expandable: bool):
    """The torch-caching model, or None when `sim` does not register it (yet)."""
    from kvfrag.sim.allocators import REGISTRY, make_allocator

    if "torch-caching" not in REGISTRY:
        return None
    return make_allocator(
        "torch-caching",
        capacity=capacity,
        bytes_per_token=1,
        max_model_len=1,
        expandable_segments=expandable,
    )


def replay_torch(
    log: pd.DataFrame,
    outcome: Outcome,
    expandable: bool = False,
    sizes: dict[int, int] | None = None,
) -> Outcome:
    """Replay the log's admits and frees on CUDA; `sizes` overrides bytes per request id."""
    import torch

    oom_error = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    capacity = outcome.capacity
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if torch.cuda.memory_reserved() or torch.cuda.memory_allocated():
        outcome.status = "error"
        outcome.note = (
            f"{torch.cuda.memory_reserved()} B already reserved by this process; torch mode "
            "needs a clean caching allocator"
        )
        return outcome.finish(TOLERANCES)
    settings = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if expandable and settings is None:
        outcome.status = "skip"
        outcome.note = f"torch {torch.__version__} cannot switch expandable_segments at run time"
        return outcome.finish(TOLERANCES)
    _, total = torch.cuda.mem_get_info()
    model = make_model(capacity, expandable)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    old_fraction = getter() if getter is not None else 1.0
    tensors: dict[int, Any] = {}
    try:
        if settings is not None:
            settings(f"expandable_segments:{expandable}")
        torch.cuda.set_per_process_memory_fraction(cap_fraction(capacity, total))
        base = torch.cuda.memory_stats()
        rows = _run(log, outcome, torch, oom_error, tensors, model, base, sizes or {})
    except oom_error as exc:  # outside an allocation (stats, ...): give up cleanly
        outcome.status = "error"
        outcome.note = f"CUDA out of memory: {str(exc).splitlines()[0]}"
        rows = []
    finally:
        tensors.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if settings is not None:
            settings(f"expandable_segments:{_configured_expandable()}")
        torch.cuda.set_per_process_memory_fraction(old_fraction)
    outcome.series = pd.DataFrame(rows)
    outcome.checks = len(rows)
    if model is None and outcome.status != "error":
        outcome.status = "measured"
        outcome.note = "torch-caching model not registered: measured only"
    return outcome.finish(TOLERANCES)


def _run(log, out, torch, oom_error, tensors, model, base, sizes) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    addr: dict[int, list[int]] = {}  # rid -> model block addresses (one per slab)
    ooms = [0, 0]  # (predicted, measured) allocations refused so far
    ops = log[log["op"].isin(("admit", "free"))]
    for row in ops.itertuples(index=False):
        rid, seq = int(row.rid), int(row.seq)
        offsets = getattr(row, "offsets", None)
        copies = len(offsets) if isinstance(offsets, (list, tuple)) and offsets else 1
        one = int(sizes.get(rid, int(row.nbytes) // copies))  # a slab per sequence (n > 1)
        out.ops += 1
        meas_oom = pred_oom = False
        if row.op == "admit":
            try:
                tensors[rid] = [
                    torch.empty(one, dtype=torch.uint8, device="cuda") for _ in range(copies)
                ]
            except oom_error:  # all or none: the slabs taken so far go back
                meas_oom = True
                ooms[1] += 1
            if model is not None:
                ptrs = []
                for _ in range(copies):
                    ptr = model.raw_malloc(one)
                    if ptr is None:
                        pred_oom = True
                        ooms[0] += 1
                        for p in ptrs:
                            model.raw_free(p)
                        break
                    ptrs.append(ptr)
                else:
                    addr[rid] = ptrs
        else:
            tensors.pop(rid, None)
            if model is not None:
                for ptr in addr.pop(rid, ()):
                    model.raw_free(ptr)
        stats = torch.cuda.memory_stats()
        rec: dict[str, Any] = {"seq": seq, "t": float(row.t), "op": row.op, "rid": rid,
                               "nbytes": one * copies, "live": len(tensors)}
        pred = model.stats() if model is not None else {}
        for name, key in KEYS.items():
            rec[f"pred_{name}"] = pred.get(key, math.nan)
            rec[f"meas_{name}"] = stats.get(key, 0) - base.get(key, 0)
        rec["pred_ooms"], rec["meas_ooms"] = (ooms[0] if model is not None else math.nan), ooms[1]
        rec["refused_pred"], rec["refused_meas"] = pred_oom, meas_oom
        if model is not None:
            _compare(out, rec)
        rows.append(rec)
    return rows


def _compare(out: Outcome, rec: dict[str, Any]) -> None:
    """Record the first operation where prediction and measurement part."""
    if rec["refused_pred"] != rec["refused_meas"]:
        what = "raised OOM" if rec["refused_meas"] else "succeeded"
        out.fail(rec["seq"], f"{rec['op']} of {rec['nbytes']:,} B by request {rec['rid']}: "
                             f"torch {what}, the model predicted the opposite")
        return
    for name in KEYS:
        pred, meas = rec[f"pred_{name}"], rec[f"meas_{name}"]
        if pred != meas:
            out.fail(rec["seq"], f"{rec['op']} of {rec['nbytes']:,} B by request {rec['rid']}: "
                                 f"{name} predicted {pred:,}, measured {meas:,}")
            return
