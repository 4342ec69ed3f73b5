"""Scenario files: every shipped one validates; bad input gives one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfrag.config import ScenarioError, load_scenario
from sim.scenario import Scenario, set_path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "scenarios").glob("*.yaml"))

GOOD = """\
name: t
model: opt-13b
kv_budget: 12GiB
max_model_len: 2048
workload:
  synthetic:
    count: 20
    prompt: {kind: uniform, low: 10, high: 200}
    output: {kind: uniform, low: 10, high: 200}
allocators:
  - {label: orca-max, kind: buddy, reserve: max_model_len}
  - {label: paged-16, kind: paged, block_size: 16}
"""


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_scenario_validates(path):
    loaded = load_scenario(path)
    scenario = loaded.scenario
    assert scenario.name == path.stem
    assert scenario.budget_bytes > 0
    assert scenario.points()


def test_required_scenarios_are_shipped():
    names = {p.stem for p in SHIPPED}
    assert {
        "quickstart",
        "seed-slab-vs-paged",
        "seed-chat-reservation",
        "seed-external-fragmentation",
        "paper-opt13b-sharegpt",
        "azure-conv-llama3-8b",
        "block-size-sweep",
    } <= names


def test_budget_units_and_gpu_budget(tmp_path):
    s = load_scenario(write(tmp_path, GOOD)).scenario
    assert s.budget_bytes == 12 * 2**30
    gpu = GOOD.replace("kv_budget: 12GiB", "kv_budget: {gpu_memory: 80GB, weights: 16GB}")
    s = load_scenario(write(tmp_path, gpu)).scenario
    assert s.budget_bytes == int(80e9 * 0.9) - 16 * 10**9


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GOOD.replace("model: opt-13b", "model: opt13b"),
         r"s.yaml:2: model: .*did you mean 'opt-13b'"),
        (GOOD.replace("max_model_len: 2048", "max_model_len: 2048\nkv_budjet: 1GB"),
         r"s.yaml:5: kv_budjet: unknown key 'kv_budjet'; did you mean 'kv_budget'"),
        (GOOD.replace("kind: paged, block_size", "kind: paged, blok_size"),
         r"s.yaml:12: allocators\[1\]: .*no option 'blok_size'; did you mean 'block_size'"),
        (GOOD.replace("kind: paged,", "kind: pagd,"),
         r"allocators\[1\]: unknown allocator kind 'pagd' \(valid: buddy, contiguous, paged"),
        (GOOD.replace("reserve: max_model_len", "reserve: max"),
         r"allocators: allocator 'orca-max': unknown reservation policy 'max'"),
        (GOOD.replace("kv_budget: 12GiB", "kv_budget: 12 GiBs"), r"kv_budget: .*unknown unit"),
        (GOOD.replace("low: 10, high: 200}", "low: 10, hihg: 200}", 1),
         r"workload.synthetic.prompt.hihg: unknown key 'hihg'; did you mean 'high'"),
        (GOOD.replace("max_model_len: 2048", ""), r"max_model_len: required field is missing"),
        (GOOD + "  - {label: paged-16, kind: paged}\n",
         r"labels must be unique; repeated: paged-16"),
        ("model: [unclosed\n", r"s.yaml:2: malformed YAML"),
        ("- just\n- a list\n", r"a scenario is a YAML mapping"),
    ],
)
def test_bad_scenarios_name_file_line_and_field(tmp_path, text, expected):
    with pytest.raises(ScenarioError, match=expected) as info:
        load_scenario(write(tmp_path, text))
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ScenarioError, match="no such scenario file"):
        load_scenario(tmp_path / "nope.yaml")


def test_set_overrides(tmp_path):
    path = write(tmp_path, GOOD)
    s = load_scenario(
        path,
        ["kv_budget=20GB", "allocators.paged-16.block_size=32", "engine.chunked_prefill=true"],
    ).scenario
    assert s.budget_bytes == 20 * 10**9
    assert s.allocators[1].options == {"block_size": 32}
    assert s.engine.chunked_prefill is True


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("kv_budget", r"--set 'kv_budget': write key=value"),
        ("allocators.paged-32.block_size=8", r"no allocator labelled 'paged-32'; did you mean"),
        ("allocators.paged-16.block_size=0", r"allocator 'paged-16': block_size must be"),
        ("engine.max_num_seqs=-1", r"engine.max_num_seqs: Input should be greater than 0"),
    ],
)
def test_bad_set(tmp_path, item, expected):
    with pytest.raises(ScenarioError, match=expected):
        load_scenario(write(tmp_path, GOOD), [item])


def test_sweep_points_are_the_cartesian_product(tmp_path):
    text = GOOD + (
        "sweep:\n  allocators.paged-16.block_size: [8, 16, 32]\n  kv_budget: [20GB, 40GB]\n"
    )
    s = load_scenario(write(tmp_path, text)).scenario
    points = s.points()
    assert len(points) == 6
    combos = {(v["allocators.paged-16.block_size"], p.budget_bytes) for v, p in points}
    assert combos == {(b, kv) for b in (8, 16, 32) for kv in (20 * 10**9, 40 * 10**9)}


def test_resolved_copy_reloads_to_the_same_scenario(tmp_path):
    import yaml

    loaded = load_scenario(write(tmp_path, GOOD))
    resolved = loaded.resolved()
    assert resolved["kvfrag_version"]
    again = load_scenario(write(tmp_path, yaml.safe_dump(resolved), "r.yaml")).scenario
    assert again == loaded.scenario


def test_relative_trace_paths_resolve_from_the_scenario_folder(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "t.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.0,100,20\n2023-11-16 18:15:47.0,50,10\n"
    )
    text = GOOD.replace(
        """  synthetic:
    count: 20
    prompt: {kind: uniform, low: 10, high: 200}
    output: {kind: uniform, low: 10, high: 200}
""",
        "  trace: {path: data/t.csv}\n",
    )
    loaded = load_scenario(write(tmp_path, text))
    assert loaded.resolved()["workload"]["trace"]["path"] == str(tmp_path / "data" / "t.csv")
    from sim.scenario import run

    result = run(loaded.scenario, loaded.base_dir)
    assert set(result.summary()["completed"]) == {2}


def test_set_path_walks_labels():
    data = {"allocators": [{"label": "a", "kind": "paged"}], "engine": None}
    set_path(data, "allocators.a.block_size", 8)
    set_path(data, "engine.max_num_seqs", 4)
    assert data == {
        "allocators": [{"label": "a", "kind": "paged", "block_size": 8}],
        "engine": {"max_num_seqs": 4},
    }
    with pytest.raises(ValueError, match="whole list element"):
        set_path(data, "allocators.a", 1)
    assert isinstance(Scenario.model_fields, dict)
