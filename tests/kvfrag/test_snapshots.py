"""PyTorch memory snapshots with the results (`snapshots/LABEL[@POINT].pickle`): written for
torch-caching runs only, by every executor and by `--resume` alike, listed in the manifest,
readable by torch's own snapshot tools; and `kvfrag snapshot replay`, on our own snapshots,
perturbed ones, hand-made ones in torch's fuller format, bad files and any real CUDA snapshot
kept in ../shared."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from kvfrag import sim
from kvfrag.cli import main
from kvfrag.outdir import MANIFEST
from kvfrag.results import read_snapshot

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
MiB = 1024 * 1024

# A tiny model (1 KiB per token) in 40 MiB: the torch-caching model caches, releases and runs
# out of memory (trace entries of every kind); paged writes no snapshot.
SCENARIO = """\
name: snap-tiny
model: {name: tiny, layers: 2, kv_heads: 2, head_dim: 64}
kv_budget: 40MiB
max_model_len: 2048
workload:
  synthetic:
    count: 80
    prompt: {kind: uniform, low: 50, high: 1200}
    output: {kind: uniform, low: 20, high: 600}
    arrival: {kind: poisson, rate: 50}
  seed: 3
engine:
  max_num_seqs: 32
  step_time: {base_s: 0.01, per_batched_token_s: 0.0001}
allocators:
  - {label: torch, kind: torch-caching, reserve: oracle}
  - {label: paged, kind: paged, block_size: 16}
"""
SWEEP = SCENARIO.replace("name: snap-tiny", "name: snap-sweep") + (
    "  - {label: torch-max, kind: torch-caching, reserve: max_model_len}\n"
    "sweep:\n  kv_budget: [24MiB, 40MiB, 24MiB]\n"
)


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("scenarios")
    (folder / "snap-tiny.yaml").write_text(SCENARIO)
    (folder / "snap-sweep.yaml").write_text(SWEEP)
    return folder


def _run(scenario: Path, out: Path, *extra: str) -> int:
    return main(["run", str(scenario), "-o", str(out), "-q", "--no-plots", *extra])


@pytest.fixture(scope="module")
def results(scenarios, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "snap-tiny"
    assert _run(scenarios / "snap-tiny.yaml", out, "-j", "1") == 0
    return out


def _replay(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["snapshot", "replay", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _replay_json(capsys, *args: str) -> dict:
    code, out, err = _replay(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def _pickle(path: Path, obj) -> Path:
    path.write_bytes(pickle.dumps(obj, protocol=4))
    return path


# ------------------------------------------------------------------------ with the results
def test_a_torch_caching_run_writes_its_snapshot(results):
    files = sorted(p.name for p in (results / "snapshots").iterdir())
    assert files == ["torch.pickle"]  # paged has none
    data = (results / "snapshots" / "torch.pickle").read_bytes()
    assert data[:2] == b"\x80\x04"  # protocol 4, as torch's _dump_snapshot writes
    snap = pickle.loads(data)
    assert set(snap) == {"segments", "device_traces", "allocator_settings"}
    actions = {e["action"] for e in snap["device_traces"][0]}
    assert {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
            "oom", "snapshot"} <= actions
    manifest = json.loads((results / MANIFEST).read_text())
    assert "snapshots/torch.pickle" in manifest["files"]
    # the end of the run: every request retired, its segments cached
    summary = json.loads((results / "summary.json").read_text())
    torch_row = next(r for r in summary["runs"] if r["label"] == "torch")
    assert sum(s["allocated_size"] for s in snap["segments"]) == 0
    assert torch_row["completed"] + torch_row["rejected"] == 80


def test_torch_reads_the_snapshot(results):
    viz = pytest.importorskip("torch.cuda._memory_viz")
    path = results / "snapshots" / "torch.pickle"
    with path.open("rb") as fh:
        snap = pickle.load(fh)
    stats = viz.segsum(snap)  # `python -m torch.cuda._memory_viz stats`; checks every segment
    assert f"segments: {len(snap['segments'])}\n" in stats
    reserved = sum(s["total_size"] for s in snap["segments"])
    assert f"total_reserved: {reserved / MiB:.1f}MiB" in stats
    assert "raise OutOfMemoryError" in viz.trace(snap)  # the recorded OOMs, as torch reads them
    for html in (viz.trace_plot(snap), viz.segment_plot(snap)):
        assert "MemoryViz.js" in html and "snapshot.pickle" in html


def test_torchs_command_line_reads_the_snapshot(results):
    pytest.importorskip("torch.cuda._memory_viz")
    path = results / "snapshots" / "torch.pickle"
    segments = len(pickle.loads(path.read_bytes())["segments"])
    done = subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(path)],
        capture_output=True, text=True, check=True,
    )
    assert f"segments: {segments}" in done.stdout


def test_a_sweep_names_its_snapshots_by_point_and_workers_write_the_same(scenarios, tmp_path):
    serial, parallel = tmp_path / "serial", tmp_path / "parallel"
    assert _run(scenarios / "snap-sweep.yaml", serial, "-j", "1") == 0
    assert _run(scenarios / "snap-sweep.yaml", parallel, "-j", "2") == 0
    names = sorted(p.name for p in (serial / "snapshots").iterdir())
    assert names == sorted(f"{label}@{point}.pickle" for label in ("torch", "torch-max")
                           for point in (0, 1, 2))
    for name in names:
        assert (parallel / "snapshots" / name).read_bytes() == (
            serial / "snapshots" / name).read_bytes(), name
    # points 0 and 2 are the same point (computed once): the same snapshot
    assert (serial / "snapshots" / "torch@0.pickle").read_bytes() == (
        serial / "snapshots" / "torch@2.pickle").read_bytes()
    assert (serial / "snapshots" / "torch@0.pickle").read_bytes() != (
        serial / "snapshots" / "torch@1.pickle").read_bytes()
    files = json.loads((serial / MANIFEST).read_text())["files"]
    assert sorted(f for f in files if f.startswith("snapshots/")) == [
        f"snapshots/{n}" for n in names]


def test_resume_writes_the_snapshots_of_staged_points(scenarios, tmp_path, monkeypatch, capsys):
    scenario = scenarios / "snap-sweep.yaml"
    reference = tmp_path / "ref"
    assert _run(scenario, reference, "-j", "1") == 0
    real, calls = sim.sweep.run_task, []

    def interrupted(task, requests):
        calls.append(task.key)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(task, requests)

    monkeypatch.setattr(sim.sweep, "run_task", interrupted)
    out = tmp_path / "r"
    assert _run(scenario, out, "-j", "1") == 130
    staged = [p for p in (out.parent / f".{out.name}.points").iterdir()
              if (p / "summary.json").is_file()]
    assert len(staged) == 2  # the points finished before the interrupt, torch-caching's with
    for point in staged:  # its snapshot
        label = json.loads((point / "summary.json").read_text())["label"]
        assert (point / "snapshot.pickle").is_file() == label.startswith("torch"), label
    assert any((p / "snapshot.pickle").is_file() for p in staged)
    monkeypatch.setattr(sim.sweep, "run_task", real)
    assert _run(scenario, out, "-j", "1", "--resume") == 0
    names = sorted(p.name for p in (reference / "snapshots").iterdir())
    assert sorted(p.name for p in (out / "snapshots").iterdir()) == names
    for name in names:
        assert (out / "snapshots" / name).read_bytes() == (
            reference / "snapshots" / name).read_bytes(), name


def test_a_rerun_replaces_snapshots_but_not_a_users_file(scenarios, tmp_path, capsys):
    scenario = scenarios / "snap-tiny.yaml"
    out = tmp_path / "r"
    assert _run(scenario, out, "-j", "1") == 0
    # a later run with another label replaces the folder: the old snapshot goes
    assert _run(scenario, out, "-j", "1", "--set", "allocators.torch.label=torch2") == 0
    assert sorted(p.name for p in (out / "snapshots").iterdir()) == ["torch2.pickle"]
    # a file of the user's in snapshots/ blocks replacement, like any user file
    mine = out / "snapshots" / "mine.pickle"
    mine.write_bytes(b"my own")
    capsys.readouterr()
    assert _run(scenario, out, "-j", "1") == 2
    assert "snapshots/mine.pickle" in capsys.readouterr().err
    assert mine.read_bytes() == b"my own"
    assert (out / "snapshots" / "torch2.pickle").is_file()
    mine.unlink()
    assert _run(scenario, out, "-j", "1") == 0
    assert sorted(p.name for p in (out / "snapshots").iterdir()) == ["torch.pickle"]


def test_no_snapshots_folder_without_torch_caching(scenarios, tmp_path):
    out = tmp_path / "r"
    assert _run(scenarios / "snap-tiny.yaml", out, "-j", "1", "--set",
                "allocators=[{label: paged, kind: paged, block_size: 16}]") == 0
    assert not (out / "snapshots").exists()


# ------------------------------------------------------------------------ replay
def test_replay_of_our_own_snapshot_is_identical(results, capsys):
    path = results / "snapshots" / "torch.pickle"
    code, out, err = _replay(capsys, path)
    assert code == 0 and err == ""
    assert "\nidentical: " in out
    assert "capacity: 40.0 MiB (41,943,040 B)" in out  # the run's budget, from its OOMs
    doc = _replay_json(capsys, path)
    assert doc["identical"] and doc["calls_differing"] == 0 and doc["differences"] == []
    assert doc["capacity_bytes"] == 40 * MiB
    assert doc["settings_source"] == dict.fromkeys(doc["settings"], "recorded")
    snap = pickle.loads(path.read_bytes())
    trace = snap["device_traces"][0]
    for action in ("segment_alloc", "segment_free", "oom"):
        count = sum(e["action"] == action for e in trace)
        assert doc["events"][action] == {"recorded": count, "model": count}
        assert count > 0
    assert doc["calls"]["alloc"] == sum(e["action"] == "alloc" for e in trace)
    reserved = sum(s["total_size"] for s in snap["segments"])
    assert doc["reserved_end_bytes"] == {"recorded": reserved, "model": reserved}
    assert doc["reserved_before_trace_bytes"] == 0 and doc["notes"] == []


@pytest.mark.parametrize(
    "option",
    ["expandable_segments=true", "max_split_size_mb=24", "roundup_power2_divisions=4",
     "reserve=max_model_len"],
)
def test_replay_is_identical_for_every_setting(scenarios, tmp_path, capsys, option):
    out = tmp_path / "r"
    assert _run(scenarios / "snap-tiny.yaml", out, "-j", "1", "--set",
                f"allocators.torch.{option}") == 0
    doc = _replay_json(capsys, out / "snapshots" / "torch.pickle")
    assert doc["identical"], doc["differences"]
    if option.startswith("expandable"):
        assert doc["settings"]["expandable_segments"] is True
        assert doc["events"]["segment_map"]["recorded"] > 0
    if option.startswith("max_split"):
        assert doc["settings"]["max_split_size_mb"] == 24
    if option.startswith("roundup"):
        assert doc["settings"]["roundup_power2_divisions"] == 4


def test_replay_finds_a_dropped_segment_alloc(results, tmp_path, capsys):
    snap = pickle.loads((results / "snapshots" / "torch.pickle").read_bytes())
    trace = snap["device_traces"][0]
    drop = [i for i, e in enumerate(trace) if e["action"] == "segment_alloc"][3]
    dropped = trace.pop(drop)
    call = trace[drop]  # the alloc it preceded now sits at its index
    assert call["action"] == "alloc" and call["addr"] == dropped["addr"]
    path = _pickle(tmp_path / "perturbed.pickle", snap)
    code, out, _ = _replay(capsys, path)
    assert code == 0  # a difference is a finding
    assert "identical" not in out
    assert f"  [{drop}] alloc {call['size']:,} B at {call['addr']:#x}\n" in out
    assert "      recorded: nothing\n" in out
    assert f"      model:    segment_alloc {dropped['size']:,} B at {dropped['addr']:#x}" in out
    doc = _replay_json(capsys, path)
    assert not doc["identical"] and doc["calls_differing"] == 1
    first = doc["differences"][0]
    assert (first["index"], first["op"], first["size"]) == (drop, "alloc", call["size"])
    assert first["recorded"] == []
    assert first["model"] == [{"action": "segment_alloc", "size": dropped["size"],
                               "addr": dropped["addr"]}]
    seg = doc["events"]["segment_alloc"]
    assert seg["model"] == seg["recorded"] + 1


def test_replay_finds_a_missing_oom_and_a_changed_size(results, tmp_path, capsys):
    snap = pickle.loads((results / "snapshots" / "torch.pickle").read_bytes())
    trace = snap["device_traces"][0]
    oom = next(i for i, e in enumerate(trace) if e["action"] == "oom")
    seg = next(i for i, e in enumerate(trace) if e["action"] == "segment_alloc")
    trace[seg] = {**trace[seg], "size": trace[seg]["size"] + 2 * MiB}
    path = _pickle(tmp_path / "changed.pickle", snap)
    doc = _replay_json(capsys, path, "--show", "1")
    assert len(doc["differences"]) == 1 and doc["calls_differing"] >= 1
    assert doc["differences"][0]["recorded"][0]["index"] == seg
    # a larger capacity than the trace's: the model does not run out where torch did
    doc = _replay_json(capsys, results / "snapshots" / "torch.pickle", "--capacity", "1GiB")
    assert doc["capacity_source"] == "given (--capacity)"
    assert doc["events"]["oom"]["model"] == 0 < doc["events"]["oom"]["recorded"]
    assert any(d["index"] == oom for d in doc["differences"])


def test_replay_options_override_the_recorded_settings(results, capsys):
    path = results / "snapshots" / "torch.pickle"
    doc = _replay_json(capsys, path, "--expandable-segments", "--roundup-power2-divisions", "2")
    assert doc["settings"]["expandable_segments"] is True
    assert doc["settings_source"]["expandable_segments"] == "option"
    assert doc["settings_source"]["max_split_size_mb"] == "recorded"
    assert doc["events"]["segment_map"]["model"] > 0 == doc["events"]["segment_map"]["recorded"]
    assert not doc["identical"]
    code, out, _ = _replay(capsys, path, "--max-split-size-mb", "30")
    assert code == 0 and "max_split_size_mb=30 (given)" in out
    code, _, err = _replay(capsys, path, "--max-split-size-mb", "10")  # torch requires > 20
    assert code == 2 and "max_split_size_mb must be > 20" in err
    code, _, err = _replay(capsys, path, "--roundup-power2-divisions", "3")
    assert code == 2 and "power of 2" in err


def _torch_like() -> dict:
    """A snapshot in the fuller shape a CUDA run writes: stack frames, pool ids, extra keys,
    blocks allocated before recording began (and freed during it), settings torch reports
    when none were set (max_split_size SIZE_MAX), per-bucket divisions."""
    frames = [{"filename": "train.py", "line": 12, "name": "forward"}]
    base = 0x7F3A_0000_0000
    old = base  # a segment from before recording: a 3 MiB block in a 20 MiB segment
    new = base + 20 * MiB
    entry = {"stream": 0, "frames": frames, "pool_id": (0, 0)}
    trace = [
        {"action": "alloc", "addr": old + 3 * MiB, "size": 4 * MiB, "time_us": 1, **entry},
        {"action": "free_requested", "addr": old, "size": 3 * MiB, "time_us": 2, **entry},
        {"action": "free_completed", "addr": old, "size": 3 * MiB, "time_us": 3, **entry},
        {"action": "segment_alloc", "addr": new, "size": 20 * MiB, "time_us": 4, **entry},
        {"action": "alloc", "addr": new, "size": 15 * MiB, "time_us": 5, **entry},
        {"action": "free_requested", "addr": new, "size": 15 * MiB, "time_us": 6, **entry},
        {"action": "free_completed", "addr": new, "size": 15 * MiB, "time_us": 7, **entry},
    ]
    blocks = [
        {"address": old, "size": 3 * MiB, "requested_size": 0, "state": "inactive",
         "frames": []},
        {"address": old + 3 * MiB, "size": 4 * MiB, "requested_size": 4 * MiB,
         "state": "active_allocated", "frames": frames},
        {"address": old + 7 * MiB, "size": 13 * MiB, "requested_size": 0, "state": "inactive",
         "frames": []},
    ]
    segment = {"device": 0, "address": old, "total_size": 20 * MiB, "allocated_size": 4 * MiB,
               "active_size": 4 * MiB, "requested_size": 4 * MiB, "stream": 0,
               "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
               "frames": [], "blocks": blocks}
    second = {**segment, "address": new, "allocated_size": 0, "active_size": 0,
              "requested_size": 0,
              "blocks": [{"address": new, "size": 20 * MiB, "requested_size": 0,
                          "state": "inactive", "frames": []}]}
    return {
        "segments": [segment, second],
        "device_traces": [trace],
        "allocator_settings": {
            "PYTORCH_CUDA_ALLOC_CONF": "",
            "max_split_size": 2**64 - 1,
            "garbage_collection_threshold": 0.0,
            "expandable_segments": False,
            "roundup_power2_divisions": {str(1 << i): (4 if i > 10 else 0) for i in range(16)},
        },
        "external_annotations": [],
    }


def test_replay_reads_torchs_fuller_format(tmp_path, capsys):
    path = _pickle(tmp_path / "cuda.pickle", _torch_like())
    doc = _replay_json(capsys, path)
    assert doc["settings"] == {"expandable_segments": False, "max_split_size_mb": None,
                               "roundup_power2_divisions": 4}
    assert any("differs by size bucket" in n for n in doc["notes"])
    assert doc["reserved_before_trace_bytes"] == 20 * MiB
    assert doc["skipped_frees"] == 1
    assert doc["calls"] == {"alloc": 2, "free": 1, "oom": 0}
    # The model starts empty: its 4 MiB alloc opens a segment where the device had one, and
    # its 15 MiB alloc then fits in that segment's rest where the device opened a new one.
    assert doc["events"]["segment_alloc"] == {"recorded": 1, "model": 1}
    assert [d["index"] for d in doc["differences"]] == [0, 4]
    assert doc["differences"][0]["model"][0]["action"] == "segment_alloc"
    assert doc["differences"][1]["recorded"] == [
        {"index": 3, "action": "segment_alloc", "size": 20 * MiB, "addr": 0x7F3A_0140_0000}]
    assert doc["differences"][1]["model"] == []
    code, out, _ = _replay(capsys, path)
    assert code == 0
    assert "note: 20.0 MiB (20,971,520 B) were reserved before the trace began" in out
    assert "note: 1 free(s) of blocks allocated before the trace began were not replayed" in out


def test_replay_of_a_trace_recorded_without_free_requested(results, tmp_path, capsys):
    """torch's skip_actions=["free_requested"]: the free_completed entries free."""
    snap = pickle.loads((results / "snapshots" / "torch.pickle").read_bytes())
    snap["device_traces"][0] = [
        e for e in snap["device_traces"][0] if e["action"] != "free_requested"]
    doc = _replay_json(capsys, _pickle(tmp_path / "skipped.pickle", snap))
    assert doc["identical"] and doc["calls"]["free"] > 0


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"segments,total_size\n1,2\n", "not a pickle file"),
        (b"", "not a pickle file"),
        (pickle.dumps({"device_traces": [[{"action": "alloc"}] * 40]}, protocol=4)[:50],
         "a damaged pickle file (pickle data was truncated)"),
        (pickle.dumps([1, 2, 3]), "not a memory snapshot (a pickled list, not a dict)"),
        (pickle.dumps({"segments": []}), "no device_traces (it holds segments)"),
        (pickle.dumps({"device_traces": {"0": []}}), "device_traces is not a list per device"),
        (pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 1}]]}),
         "trace entry 0 (alloc) has no whole number 'size'"),
        (pickle.dumps(Path("x")), "refers to pathlib"),
    ],
    ids=["text", "empty", "truncated", "list", "no-traces", "traces-dict", "bad-entry",
         "object"],
)
def test_a_bad_file_is_one_line_naming_it(tmp_path, capsys, content, says):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    code, out, err = _replay(capsys, path)
    assert code == 2 and out == ""
    assert err.startswith(f"kvfrag: error: {path}: ") and says in err
    assert err.count("\n") == 1


def test_a_pickle_that_would_run_code_is_not_run(tmp_path, capsys):
    class Boom:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "ran",))

    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [[]], "x": Boom()}))
    code, _, err = _replay(capsys, path)
    assert code == 2 and "plain data only" in err
    assert not (tmp_path / "ran").exists()


def test_a_missing_file_and_a_missing_device(results, tmp_path, capsys):
    code, _, err = _replay(capsys, tmp_path / "nope.pickle")
    assert code == 2 and f"{tmp_path / 'nope.pickle'}: cannot read it" in err
    path = results / "snapshots" / "torch.pickle"
    code, _, err = _replay(capsys, path, "--device", "3")
    assert code == 2 and f"{path}: no trace for device 3" in err


def test_an_empty_trace_runs_and_says_so(tmp_path, capsys):
    path = _pickle(tmp_path / "empty.pickle", {"segments": [], "device_traces": [[]]})
    code, out, _ = _replay(capsys, path)
    assert code == 0 and "identical" in out and "note: the trace is empty" in out
    assert "torch's default" in out  # no allocator_settings recorded


def test_the_device_with_a_trace_is_chosen(results, tmp_path, capsys):
    snap = pickle.loads((results / "snapshots" / "torch.pickle").read_bytes())
    snap = copy.deepcopy(snap)
    snap["device_traces"] = [[], snap["device_traces"][0]]
    for s in snap["segments"]:
        s["device"] = 1
    doc = _replay_json(capsys, _pickle(tmp_path / "dev1.pickle", snap))
    assert doc["device"] == 1 and doc["identical"]


def test_the_staged_snapshot_reader_refuses_objects(tmp_path):
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"a": [1, (2, 3)], "b": None}, protocol=4))
    assert read_snapshot(path) == {"a": [1, (2, 3)], "b": None}
    path.write_bytes(pickle.dumps({"a": Path("x")}))
    with pytest.raises(ValueError, match="plain data only"):
        read_snapshot(path)


REAL = sorted(SHARED.rglob("*.pickle")) if SHARED.is_dir() else []


@pytest.mark.skipif(not REAL, reason="no recorded CUDA snapshot (*.pickle) in ../shared")
@pytest.mark.parametrize("path", REAL, ids=[p.name for p in REAL])
def test_replay_of_a_real_cuda_snapshot(path, capsys):
    doc = _replay_json(capsys, path)
    assert doc["calls"]["alloc"] > 0
    for action, counts in doc["events"].items():
        assert counts["recorded"] >= 0 and counts["model"] >= 0, action
    assert doc["identical"] == (doc["calls_differing"] == 0)


def test_help_loads_neither_torch_nor_the_simulator():
    code = (
        "import sys, kvfrag.cli; kvfrag.cli.build_parser(); "
        "print([m for m in ('torch', 'pandas', 'sim', 'sim.snapshot') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"
