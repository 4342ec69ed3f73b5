"""Memory snapshots of the caching-allocator model: structure, pickling, agreement with the
trace, readability by torch's own snapshot tools, and replay of a snapshot's trace."""

from __future__ import annotations

import pickle

import pytest
from kvfrag.sim.allocators import Request, TorchCachingAllocator
from kvfrag.sim.snapshot import replay, snapshot, trace_ops

MiB = 1024 * 1024
PLAIN = (dict, list, tuple, str, int, float, bool, type(None))


def scenario(**opts) -> TorchCachingAllocator:
    """A history with splits, merges, a cached segment release, an OOM and live blocks."""
    a = TorchCachingAllocator(120 * MiB, 1, 2**40, reserve="oracle", **opts)
    sizes = [3 * MiB, 700 * 1024, int(13.5 * MiB), 5 * MiB, 1000, 30 * MiB, 2 * MiB]
    for rid, n in enumerate(sizes):
        assert a.admit(Request(rid, 1, n - 1))
    a.free(1)
    a.free(3)
    a.free(5)
    assert not a.admit(Request(50, 1, 200 * MiB))  # OOM (after releasing cached segments)
    assert a.admit(Request(51, 1, 4 * MiB - 1))
    a.free(0)
    return a


CONFIGS = [
    {},
    {"expandable_segments": True},
    {"max_split_size_mb": 24},
    {"roundup_power2_divisions": 4},
]
by_config = pytest.mark.parametrize("opts", CONFIGS, ids=["default", "expandable", "msplit", "p2"])


def walk(obj) -> None:
    assert isinstance(obj, PLAIN), type(obj)
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert isinstance(k, str)
            walk(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            walk(v)


@by_config
def test_structure(opts):
    a = scenario(**opts)
    snap = snapshot(a)
    assert set(snap) == {"segments", "device_traces", "allocator_settings"}
    walk(snap)
    segs = snap["segments"]
    assert [s["address"] for s in segs] == sorted(s["address"] for s in segs)
    for s in segs:
        assert {
            "device",
            "address",
            "total_size",
            "allocated_size",
            "active_size",
            "requested_size",
            "stream",
            "segment_type",
            "segment_pool_id",
            "is_expandable",
            "frames",
            "blocks",
        } <= set(s)
        addr = s["address"]
        for b in s["blocks"]:
            assert b["address"] == addr and b["state"] in ("active_allocated", "inactive")
            assert set(b) == {"address", "size", "requested_size", "state", "frames"}
            addr += b["size"]
        assert addr - s["address"] == s["total_size"]
        active = [b for b in s["blocks"] if b["state"] == "active_allocated"]
        assert s["allocated_size"] == s["active_size"] == sum(b["size"] for b in active)
        assert s["requested_size"] == sum(b["requested_size"] for b in active)
        assert s["is_expandable"] == bool(opts.get("expandable_segments"))
    st = a.stats()
    assert sum(s["total_size"] for s in segs) == st["reserved_bytes.all.current"]
    assert sum(s["allocated_size"] for s in segs) == st["allocated_bytes.all.current"]
    trace = snap["device_traces"][0]
    for i, e in enumerate(trace):
        assert {"action", "size", "stream", "time_us", "frames"} <= set(e)
        if e["action"] == "free_requested":
            nxt = trace[i + 1]
            assert nxt["action"] == "free_completed" and nxt["addr"] == e["addr"]
        if e["action"] == "oom":
            assert "device_free" in e and "addr" not in e
    assert any(e["action"] == "oom" for e in trace)
    assert trace[-1]["action"] == "snapshot"
    settings = snap["allocator_settings"]
    assert settings["expandable_segments"] == bool(opts.get("expandable_segments"))
    assert settings["max_split_size"] == (
        -1 if "max_split_size_mb" not in opts else opts["max_split_size_mb"] * MiB
    )
    assert set(settings["roundup_power2_divisions"]) == {str(1 << i) for i in range(16)}


@by_config
def test_pickle_round_trip(opts):
    snap = snapshot(scenario(**opts))
    data = pickle.dumps(snap, protocol=4)
    assert data[:2] == b"\x80\x04"
    assert pickle.loads(data) == snap


@by_config
def test_segments_agree_with_trace(opts):
    """Replaying the trace's segment and alloc/free events from nothing gives the final state."""
    snap = snapshot(scenario(**opts))
    segments: dict[int, int] = {}
    mapped = 0
    active: dict[int, int] = {}
    for e in snap["device_traces"][0]:
        act = e["action"]
        if act == "segment_alloc":
            segments[e["addr"]] = e["size"]
        elif act == "segment_free":
            assert segments.pop(e["addr"]) == e["size"]
        elif act == "segment_map":
            mapped += e["size"]
        elif act == "segment_unmap":
            mapped -= e["size"]
        elif act == "alloc":
            assert e["addr"] not in active
            active[e["addr"]] = e["size"]
        elif act == "free_completed":
            assert active.pop(e["addr"]) == e["size"]
    final_active = {
        b["address"]: b["requested_size"]
        for s in snap["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    }
    assert final_active == active
    if opts.get("expandable_segments"):
        assert mapped == sum(s["total_size"] for s in snap["segments"])
    else:
        assert segments == {s["address"]: s["total_size"] for s in snap["segments"]}


@by_config
def test_trace_ops_replay_reproduces_events(opts):
    a = scenario(**opts)
    snap = snapshot(a)
    ops = trace_ops(snap)
    assert [op for op, _, _ in ops].count("oom") == 1
    assert sum(op == "alloc" for op, _, _ in ops) == sum(act == "alloc" for act, _, _ in a.events)
    b = TorchCachingAllocator(a.capacity, 1, 2**40, **opts)
    events = replay(ops, b)
    assert events == a.events  # same settings, same calls: the same decisions and addresses
    assert b.stats()["num_ooms"] == 1
    # a bigger cap predicts no OOM for the same calls
    c = TorchCachingAllocator(10 * a.capacity, 1, 2**40, **opts)
    assert not [e for e in replay(ops, c) if e[0] == "oom"]


def test_trace_ops_skips_frees_from_before_recording():
    snap = {
        "device_traces": [
            [
                {"action": "free_requested", "addr": 5, "size": 10},
                {"action": "free_completed", "addr": 5, "size": 10},
                {"action": "alloc", "addr": 7, "size": 100},
                {"action": "segment_alloc", "addr": 7, "size": 2 * MiB},
                {"action": "free_requested", "addr": 7, "size": 100},
                {"action": "oom", "device_free": 0, "size": 512},
            ]
        ]
    }
    assert trace_ops(snap) == [("alloc", 100, 7), ("free", 100, 7), ("oom", 512, None)]


def test_device_index():
    snap = snapshot(scenario(), device=1)
    assert len(snap["device_traces"]) == 2 and snap["device_traces"][0] == []
    assert all(s["device"] == 1 for s in snap["segments"])
    with pytest.raises(ValueError):
        snapshot(scenario(), device=-1)


@by_config
def test_torch_memory_viz_reads_it(opts, tmp_path):
    torch_viz = pytest.importorskip("torch.cuda._memory_viz")
    snap = snapshot(scenario(**opts))
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=4))
    loaded = pickle.loads(path.read_bytes())
    summary = torch_viz.segsum(loaded)  # checks each segment's sizes add up
    assert "total_reserved" in summary
    assert "raise OutOfMemoryError" in torch_viz.trace(loaded)
    lines = torch_viz.segments(loaded, format_flamegraph=lambda text: text)  # no download
    assert "active_allocated" in lines and "inactive" in lines
    html = torch_viz.trace_plot(loaded)
    assert "MemoryViz.js" in html
