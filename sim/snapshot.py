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
segment_alloc / segment_free / oom events can be compared with the recorded ones. `compare`
does that call by call (`kvfrag snapshot replay`): `recorded_settings` reads the allocator
options a snapshot records, `infer_capacity` the memory cap its trace implies.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvfrag.sim.allocators.torch_blocks import MiB, get_allocation_size, round_size
from kvfrag.sim.allocators.torch_caching import TorchCachingAllocator

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
      to the ring buffer, are dropped); a trace recorded without `free_requested` entries
      (torch's `skip_actions`) frees at the `free_completed` instead;
    - ("oom", rounded bytes, None) for each `oom`: an allocation that failed (torch records
      the rounded size, which rounds to itself, so replaying it asks for the same block).

    Segment events, snapshot entries and the free_completed that follows a free_requested are
    what the allocator did in response; they are left out, to be compared with a replay's.
    """
    return [(op, size, addr) for _, op, size, addr in indexed_ops(snap["device_traces"][device])]


def indexed_ops(trace: list[dict[str, Any]]) -> list[tuple[int, str, int, int | None]]:
    """`trace_ops` of one device's trace, each with the index of its trace entry first."""
    ops: list[tuple[int, str, int, int | None]] = []
    live: set[int] = set()
    for i, entry in enumerate(trace):
        action = entry["action"]
        if action == "alloc":
            live.add(entry["addr"])
            ops.append((i, "alloc", entry["size"], entry["addr"]))
        elif action in ("free_requested", "free_completed") and entry["addr"] in live:
            live.discard(entry["addr"])
            ops.append((i, "free", entry["size"], entry["addr"]))
        elif action == "oom":
            ops.append((i, "oom", entry["size"], None))
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
    for _ in replay_steps(ops, allocator):
        pass
    return allocator.events[start:]


def replay_steps(
    ops: list[tuple[str, int, int | None]], allocator: TorchCachingAllocator
) -> Iterator[list[tuple[str, int, int]]]:
    """`replay`, one op at a time: yields the events each op made the model record."""
    addr_map: dict[int, int] = {}
    for op, size, addr in ops:
        start = len(allocator.events)
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
        yield allocator.events[start:]


# ------------------------------------------------------------------------------ compare
#: Trace actions by which the allocator reserves or returns device memory.
SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")
#: What `compare` holds the model to: segment events and OOMs.
COMPARED = (*SEGMENT_ACTIONS, "oom")
_GROWS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
#: Capacity when a trace bounds it in no way (no segment, no oom): effectively no cap.
UNBOUNDED = 1 << 50


#: What `compare` reads of each kind of trace entry (whole numbers).
_NEEDS = {
    **dict.fromkeys(("alloc", "free_requested", "free_completed", *SEGMENT_ACTIONS),
                    ("addr", "size")),
    "oom": ("size",),
}


def check_snapshot(snap: Any, device: int | None = None) -> int:
    """Raise ValueError (saying what is wrong) unless `snap` is a snapshot dict whose trace
    `compare` can read; returns the device whose trace to use (`device`, else the one with
    the most trace entries)."""
    if not isinstance(snap, dict):
        raise ValueError(f"not a memory snapshot (a pickled {type(snap).__name__}, not a dict)")
    traces = snap.get("device_traces")
    if traces is None:
        found = ", ".join(sorted(map(str, snap))[:6]) or "nothing"
        raise ValueError(
            "not a memory snapshot with a trace: no device_traces (it holds "
            f"{found}); record one with torch.cuda.memory._record_memory_history()"
        )
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise ValueError("not a memory snapshot: device_traces is not a list per device")
    if device is None:
        used = [i for i, t in enumerate(traces) if t]
        device = max(used, key=lambda i: len(traces[i])) if used else 0
    if not 0 <= device < max(len(traces), 1):
        raise ValueError(f"no trace for device {device} (the snapshot has {len(traces)})")
    for i, entry in enumerate(traces[device] if traces else []):
        if not isinstance(entry, dict) or not isinstance(entry.get("action"), str):
            raise ValueError(f"not a memory snapshot: trace entry {i} has no action")
        need = _NEEDS.get(entry["action"], ())
        bad = [k for k in need if not isinstance(entry.get(k), int)]
        if bad:
            raise ValueError(
                f"not a memory snapshot: trace entry {i} ({entry['action']}) has no whole "
                f"number {bad[0]!r}"
            )
    return device


def recorded_settings(snap: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The model's options (expandable_segments, max_split_size_mb, roundup_power2_divisions)
    as the snapshot's `allocator_settings` record them, and notes on what the model cannot
    follow. Missing settings are torch's defaults."""
    settings = snap.get("allocator_settings")
    opts: dict[str, Any] = {
        "expandable_segments": False,
        "max_split_size_mb": None,
        "roundup_power2_divisions": 1,
    }
    notes: list[str] = []
    if not isinstance(settings, dict):
        notes.append("no allocator_settings recorded: torch's defaults assumed")
        return opts, notes
    if "expandable_segments" in settings:
        opts["expandable_segments"] = bool(settings["expandable_segments"])
    m = settings.get("max_split_size")
    if isinstance(m, int) and not isinstance(m, bool) and 0 < m < 2**62:  # unset: -1 or SIZE_MAX
        opts["max_split_size_mb"] = m // MiB if m % MiB == 0 else m / MiB
    divisions = settings.get("roundup_power2_divisions")
    values = (
        list(divisions.values()) if isinstance(divisions, dict)
        else list(divisions) if isinstance(divisions, (list, tuple)) else []
    )
    used = [v for v in values if isinstance(v, int) and v > 1]
    if used:
        common = Counter(used).most_common(1)[0][0]
        opts["roundup_power2_divisions"] = common
        if len(used) < len(values) or len(set(used)) > 1:
            notes.append(
                "roundup_power2_divisions differs by size bucket; the model applies one value "
                f"to every size: {common}"
            )
    gc = settings.get("garbage_collection_threshold")
    if isinstance(gc, (int, float)) and gc > 0:
        notes.append(f"garbage_collection_threshold {gc:g} is not modelled")
    conf = settings.get("PYTORCH_CUDA_ALLOC_CONF")
    if isinstance(conf, str) and "cudaMallocAsync" in conf:
        notes.append("recorded with backend:cudaMallocAsync, not the caching allocator")
    return opts, notes


def _trace_reserved(trace: list[dict[str, Any]]) -> int:
    """Net bytes the trace's segment events reserved."""
    return sum(_GROWS.get(e["action"], 0) * e["size"] for e in trace if e["action"] in _GROWS)


def reserved_before(snap: dict[str, Any], device: int) -> int:
    """Bytes already reserved when the trace begins: the final segments less what the trace
    reserved (0 when the snapshot has no segments; never negative)."""
    segments = snap.get("segments")
    if not isinstance(segments, list):
        return 0
    end = sum(
        s.get("total_size", 0) for s in segments
        if isinstance(s, dict) and s.get("device", device) == device
    )
    return max(0, end - _trace_reserved(snap["device_traces"][device]))


def infer_capacity(
    snap: dict[str, Any], device: int = 0, divisions: int = 1
) -> tuple[int, str]:
    """The memory cap (bytes the allocator may reserve) the trace implies, and how it was
    found. With an `oom`: the device's free bytes it records plus what was reserved then (the
    model writes exactly that). Without: the least cap under which every segment the trace
    reserved fits (its peak reserved, or, for expandable segments, the reserved bytes before
    a mapping plus the segment size torch checks against the cap): a cap that reproduces the
    trace's decisions, since reserving memory never failed."""
    trace = snap["device_traces"][device]
    reserved = reserved_before(snap, device)
    peak = reserved
    need = reserved
    map_start: int | None = None
    for e in trace:
        action = e["action"]
        if action in _GROWS:
            if action == "segment_map" and map_start is None:
                map_start = reserved
            reserved += _GROWS[action] * e["size"]
            peak = max(peak, reserved)
        elif action == "alloc":
            if map_start is not None:
                rounded = round_size(e["size"], divisions)
                need = max(need, map_start + get_allocation_size(rounded))
            map_start = None
        elif action == "oom":
            free = e.get("device_free")
            if isinstance(free, int) and free >= 0:
                return reserved + free, "the first oom's device_free + the bytes reserved then"
            map_start = None
        elif action in ("free_requested", "free_completed"):
            map_start = None
    cap = max(peak, need)
    if cap == 0:
        return UNBOUNDED, "unbounded: the trace reserves nothing and records no oom"
    return cap, "the least that holds every segment the trace reserved (no oom recorded)"


@dataclass
class Difference:
    """One allocation call after which the model's segment events differ from the trace's."""

    index: int | None  # trace index of the call (None: after the last call)
    op: str  # alloc, free, oom, or "end"
    size: int
    addr: int | None
    recorded: list[dict[str, Any]]  # {index, action, size, addr}
    model: list[dict[str, Any]]  # {action, size, addr}

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "op": self.op,
            "size": self.size,
            "addr": self.addr,
            "recorded": self.recorded,
            "model": self.model,
        }


@dataclass
class Comparison:
    """A recorded trace against the model's replay of its allocation calls."""

    device: int
    entries: int  # trace entries
    ops: dict[str, int]  # alloc / free / oom calls replayed
    skipped_frees: int  # frees of blocks allocated before the trace began
    other_streams: int  # entries on a stream other than 0 (the model has one)
    reserved_before: int  # bytes reserved before the trace began (not replayed)
    recorded: dict[str, int]  # COMPARED action -> count
    model: dict[str, int]
    reserved_end: dict[str, int]  # recorded (the final segments) / model
    calls: int  # allocation calls compared
    differing: int  # calls whose events differ
    differences: list[Difference] = field(default_factory=list)  # the first few

    @property
    def identical(self) -> bool:
        return self.differing == 0


def _skipped_frees(trace: list[dict[str, Any]]) -> int:
    """Frees of blocks the trace never saw allocated (allocated before recording began)."""
    live: set[int] = set()
    requested: set[int] = set()  # free_requested, awaiting free_completed
    unknown: set[int] = set()  # the same, of blocks not allocated in the trace
    skipped = 0
    for e in trace:
        action, addr = e["action"], e.get("addr")
        if action == "alloc":
            live.add(addr)
        elif action == "free_requested":
            if addr in live:
                live.discard(addr)
                requested.add(addr)
            else:
                unknown.add(addr)
                skipped += 1
        elif action == "free_completed":
            if addr in requested:
                requested.discard(addr)
            elif addr in unknown:
                unknown.discard(addr)
            elif addr in live:  # no free_requested recorded: this is the free
                live.discard(addr)
            else:
                skipped += 1
    return skipped


def _event(action: str, size: int, addr: int | None, index: int | None = None) -> dict:
    out: dict[str, Any] = {} if index is None else {"index": index}
    out.update(action=action, size=size, addr=addr)
    return out


def compare(
    snap: dict[str, Any], allocator: TorchCachingAllocator, device: int = 0, keep: int = 5
) -> Comparison:
    """Replay the trace's allocation calls (`trace_ops`) through `allocator` (a fresh model)
    and compare, call by call, the segment events and OOMs each made the model record with
    those the trace records before that call (an oom entry counts as its own call's event).
    Sizes and actions are compared, not addresses. `keep`: how many differences to keep."""
    trace = snap["device_traces"][device]
    ops = indexed_ops(trace)
    groups: list[list[dict[str, Any]]] = [[] for _ in range(len(ops) + 1)]
    k = 0
    op_at = {op[0]: n for n, op in enumerate(ops)}
    for i, e in enumerate(trace):
        action = e["action"]
        if action in COMPARED:
            addr = None if action == "oom" else e["addr"]
            groups[k].append(_event(action, e["size"], addr, i))
        if i in op_at:
            k = op_at[i] + 1
    # groups[n]: the events recorded after op n-1's entry, up to op n's (an oom's own entry
    # included); the last group, those after the last op.
    recorded_by_op = groups[:-1]
    trailing = groups[-1]
    counted_ops = Counter(op for _, op, _, _ in ops)
    recorded = Counter(e["action"] for g in groups for e in g)
    model: Counter[str] = Counter()
    differences: list[Difference] = []
    differing = 0
    plain = [(op, size, addr) for _, op, size, addr in ops]
    steps = replay_steps(plain, allocator)
    for (index, op, size, addr), rec, got in zip(ops, recorded_by_op, steps, strict=True):
        events = [_event(a, sz, None if a == "oom" else ad) for a, ad, sz in got
                  if a in COMPARED]
        model.update(e["action"] for e in events)
        if [(e["action"], e["size"]) for e in rec] != [(e["action"], e["size"]) for e in events]:
            differing += 1
            if len(differences) < keep:
                differences.append(Difference(index, op, size, addr, rec, events))
    if trailing:  # segment events after the last call (an empty_cache): the model has none
        differing += 1
        if len(differences) < keep:
            differences.append(Difference(None, "end", 0, None, trailing, []))
    segments = snap.get("segments")
    if isinstance(segments, list):
        end = sum(
            s.get("total_size", 0) for s in segments
            if isinstance(s, dict) and s.get("device", device) == device
        )
    else:
        end = reserved_before(snap, device) + _trace_reserved(trace)
    return Comparison(
        device=device,
        entries=len(trace),
        ops={name: counted_ops.get(name, 0) for name in ("alloc", "free", "oom")},
        skipped_frees=_skipped_frees(trace),
        other_streams=sum(e.get("stream", 0) != 0 for e in trace),
        reserved_before=reserved_before(snap, device),
        recorded={a: recorded.get(a, 0) for a in COMPARED},
        model={a: model.get(a, 0) for a in COMPARED},
        reserved_end={"recorded": end, "model": allocator.reserved_bytes},
        calls=len(ops) + (1 if trailing else 0),
        differing=differing,
        differences=differences,
    )
