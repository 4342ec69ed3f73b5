"""PyTorch memory snapshots of the caching-allocator model, and replay of real ones.

`snapshot(allocator)` builds the dict `torch.cuda.memory._snapshot()` returns (and
`_dump_snapshot` pickles): `segments` (blocks by address), `device_traces` and
`allocator_settings`, holding only dict/list/tuple/str/int/float/bool/None, so pickling it with
protocol 4 gives a file PyTorch's memory viewer (`torch.cuda._memory_viz`, MemoryViz.js) opens.
See ../shared/docs/torch-caching-allocator.md, sections 6-7. Nothing here writes files.

Modelled choices: one stream (0), no stack frames (`frames` is always []), `time_us` is the
event's index in the trace (the model has no clock), and the trace ends with the `snapshot`
entry torch adds when a snapshot is taken (size = active bytes). An `oom` entry carries
`device_free` instead of `addr`, as torch writes it.

`trace_ops(snap)` turns a (real or modelled) snapshot's trace into the allocation calls that
made it, and `replay(ops, allocator)` runs them against a model, so the model's predicted
segment_alloc / segment_free / oom events can be compared with the recorded ones.
"""

from __future__ import annotations

from typing import Any

from sim.allocators.torch_caching import TorchCachingAllocator

#: Size buckets of torch's roundup_power2_divisions setting (keys "1", "2", ... "32768").
_ROUNDUP_BUCKETS = 16


def _block_state(allocated: bool) -> str:
    return "active_allocated" if allocated else "inactive"


def segment_dicts(allocator: TorchCachingAllocator, device: int = 0) -> list[dict[str, Any]]:
    """The snapshot's `segments`: one per segment (per mapped range when expandable)."""
    out = []
    for blocks in allocator.segments():
        head = blocks[0]
        allocated = sum(b.size for b in blocks if b.allocated)
        requested = sum(b.requested for b in blocks if b.allocated)
        out.append(
            {
                "device": device,
                "address": head.ptr,
                "total_size": sum(b.size for b in blocks),
                "allocated_size": allocated,
                "active_size": allocated,
                "requested_size": requested,
                "stream": 0,
                "segment_type": "small" if head.pool.is_small else "large",
                "segment_pool_id": (0, 0),
                "is_expandable": head.seg is not None,
                "frames": [],
                "blocks": [
                    {
                        "address": b.ptr,
                        "size": b.size,
                        "requested_size": b.requested,
                        "state": _block_state(b.allocated),
                        "frames": [],
                    }
                    for b in blocks
                ],
            }
        )
    return out


def trace_dicts(allocator: TorchCachingAllocator) -> list[dict[str, Any]]:
    """The model's event list as torch trace entries (free_requested/free_completed pairs are
    adjacent, since the model has no stream events), ending with a `snapshot` entry."""
    out = []
    for i, (action, addr, size) in enumerate(allocator.events):
        entry: dict[str, Any] = {"action": action}
        entry["device_free" if action == "oom" else "addr"] = addr
        entry.update(size=size, stream=0, time_us=i, frames=[])
        out.append(entry)
    active = allocator.stats()["active_bytes.all.current"]
    out.append(
        {
            "action": "snapshot",
            "addr": 0,
            "size": active,
            "stream": 0,
            "time_us": len(allocator.events),
            "frames": [],
        }
    )
    return out


def allocator_settings(allocator: TorchCachingAllocator) -> dict[str, Any]:
    """The snapshot's `allocator_settings`, as torch reports its CUDAAllocatorConfig."""
    conf = []
    if allocator.expandable_segments:
        conf.append("expandable_segments:True")
    if allocator.max_split_size_mb is not None:
        conf.append(f"max_split_size_mb:{allocator.max_split_size_mb:g}")
    d = allocator.roundup_power2_divisions
    if d > 1:
        conf.append(f"roundup_power2_divisions:{d}")
    return {
        "PYTORCH_CUDA_ALLOC_CONF": ",".join(conf),
        "max_split_size": -1 if allocator.max_split_size is None else allocator.max_split_size,
        "garbage_collection_threshold": 0.0,
        "expandable_segments": allocator.expandable_segments,
        "pinned_num_register_threads": 1,
        "release_lock_on_cudamalloc": False,
        "pinned_use_cuda_host_register": False,
        "roundup_power2_divisions": {
            str(1 << i): (d if d > 1 else 0) for i in range(_ROUNDUP_BUCKETS)
        },
    }


def snapshot(allocator: TorchCachingAllocator, device: int = 0) -> dict[str, Any]:
    """A `torch.cuda.memory._snapshot()`-format dict of the model's state and trace.

    `device_traces` has one list per device up to `device`; only `device`'s is filled.
    """
    if device < 0:
        raise ValueError("device must be >= 0")
    traces: list[list[dict[str, Any]]] = [[] for _ in range(device + 1)]
    traces[device] = trace_dicts(allocator)
    return {
        "segments": segment_dicts(allocator, device),
        "device_traces": traces,
        "allocator_settings": allocator_settings(allocator),
    }


# ------------------------------------------------------------------------------ replay
def trace_ops(snap: dict[str, Any], device: int = 0) -> list[tuple[str, int, int | None]]:
    """The allocation calls behind a snapshot's trace, in order, as (op, size, addr):

    - ("alloc", requested bytes, recorded address) for each `alloc`;
    - ("free", requested bytes, recorded address) for each `free_requested` of an address
      allocated inside the trace (frees of blocks allocated before recording began, or lost
      to the ring buffer, are dropped);
    - ("oom", rounded bytes, None) for each `oom`: an allocation that failed (torch records
      the rounded size, which rounds to itself, so replaying it asks for the same block).

    Segment events, free_completed and snapshot entries are what the allocator did in
    response; they are left out, to be compared with a replay's.
    """
    ops: list[tuple[str, int, int | None]] = []
    live: set[int] = set()
    for entry in snap["device_traces"][device]:
        action = entry["action"]
        if action == "alloc":
            live.add(entry["addr"])
            ops.append(("alloc", entry["size"], entry["addr"]))
        elif action == "free_requested" and entry["addr"] in live:
            live.discard(entry["addr"])
            ops.append(("free", entry["size"], entry["addr"]))
        elif action == "oom":
            ops.append(("oom", entry["size"], None))
    return ops


def replay(
    ops: list[tuple[str, int, int | None]], allocator: TorchCachingAllocator
) -> list[tuple[str, int, int]]:
    """Run `trace_ops` output against a model (through its raw interface, outside request
    bookkeeping) and return the events the model recorded meanwhile.

    A recorded alloc the model refuses leaves its address unmapped (its free is skipped);
    an `oom` op is attempted, and if the model has room the block is freed again at once. The
    returned events are in the model's address space: compare actions and sizes, not
    addresses.
    """
    start = len(allocator.events)
    addr_map: dict[int, int] = {}
    for op, size, addr in ops:
        if op == "alloc":
            got = allocator.raw_malloc(size)
            if got is not None and addr is not None:
                addr_map[addr] = got
        elif op == "free":
            got = addr_map.pop(addr, None) if addr is not None else None
            if got is not None:
                allocator.raw_free(got)
        elif op == "oom":
            got = allocator.raw_malloc(size)
            if got is not None:  # the model had room the device did not: the program never
                allocator.raw_free(got)  # got the block, so hand it back (it stays cached)
        else:
            raise ValueError(f"unknown op {op!r}")
    return allocator.events[start:]
