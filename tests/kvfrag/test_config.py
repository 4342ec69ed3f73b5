"""Scenario files: every shipped one validates; bad input gives one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvfrag.sim.scenario import Scenario, set_path

from kvfrag.config import ScenarioError, load_scenario

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
        "paper-opt13b-sharegpt-like",
        "paper-opt13b-alpaca-like",
        "opt13b-sharegpt-long",
        "azure-conv-llama3-8b",
        "block-size-sweep",
        "your-question",
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
         r"s.yaml:12: allocators\[1\]\.kind: unknown allocator kind 'pagd' \(valid: buddy, "
         r"contiguous, floor, hybrid, paged"),
        (GOOD.replace("reserve: max_model_len", "reserve: max"),
         r"s.yaml:11: allocators\[0\]: allocator 'orca-max': unknown reservation policy 'max'"),
        (GOOD.replace("kv_budget: 12GiB", "kv_budget: 12 GiBs"), r"kv_budget: .*unknown unit"),
        (GOOD.replace("low: 10, high: 200}", "low: 10, hihg: 200}", 1),
         r"workload.synthetic.prompt.hihg: unknown key 'hihg'; did you mean 'high'"),
        (GOOD.replace("max_model_len: 2048", "").replace(
            "model: opt-13b", "model: {layers: 2, kv_heads: 2, head_dim: 64}"),
         r"s.yaml:1: max_model_len: required for a model that is not a preset .*e\.g\. "
         r"max_model_len: 8192"),
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
        ("engine.max_num_seqs=-1",
         r"engine.max_num_seqs: must be a whole number from 1 to 1,048,576, not -1$"),
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



def test_a_sweep_key_given_with_set_keeps_its_dotted_path(tmp_path):
    """`--set sweep.a.b.c=[...]` sweeps "a.b.c", as the same line under `sweep:` would, and a
    bad point is still blamed on the --set item."""
    sets = ["sweep.allocators.paged-16.block_size=[8, 32]", "sweep.engine.max_num_seqs=[4, 8]"]
    s = load_scenario(write(tmp_path, GOOD), sets).scenario
    combos = {(v["allocators.paged-16.block_size"], v["engine.max_num_seqs"])
              for v, _ in s.points()}
    assert combos == {(b, n) for b in (8, 32) for n in (4, 8)}
    item = "sweep.engine.max_num_seqs=[4, -1]"
    with pytest.raises(ScenarioError) as info:
        load_scenario(write(tmp_path, GOOD), [item])
    assert str(info.value).startswith(f"--set {item!r}: sweep.engine.max_num_seqs: point 2 ")

def test_resolved_copy_reloads_to_the_same_scenario(tmp_path):
    import yaml

    loaded = load_scenario(write(tmp_path, GOOD))
    resolved = loaded.resolved()
    assert resolved["kvfrag_version"]
    again = load_scenario(write(tmp_path, yaml.safe_dump(resolved), "r.yaml")).scenario
    # The copy names the batch limits the defaults gave; the rest is the same scenario.
    assert again.engine_config() == loaded.scenario.engine_config()
    assert again.model_copy(update={"engine": loaded.scenario.engine}) == loaded.scenario
    assert resolved["engine"]["chunked_prefill"] is True  # vLLM's defaults, written out
    assert (resolved["engine"]["max_num_seqs"], resolved["engine"]["max_num_batched_tokens"]) \
        == (256, 2048)


def test_hardware_sets_vllms_batch_defaults(tmp_path):
    """vLLM 0.33's server defaults by GPU class (EngineArgs.get_batch_defaults)."""
    cases = {None: (256, 2048), "a100-80gb": (256, 2048), "l40s": (256, 2048),
             "h100-80gb": (1024, 8192), "h200": (1024, 8192), "mi300x": (1024, 16384)}
    for hardware, expected in cases.items():
        sets = [f"hardware={hardware}"] if hardware else []
        cfg = load_scenario(write(tmp_path, GOOD), sets).scenario.engine_config()
        assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == expected, hardware
        assert cfg.chunked_prefill
    whole = load_scenario(write(tmp_path, GOOD), ["engine.chunked_prefill=false"]).scenario
    assert whole.engine_config().max_num_batched_tokens == 2048  # >= max_model_len (2048)
    with pytest.raises(ScenarioError, match="unknown hardware 'h1000'; did you mean 'h100-80gb'"):
        load_scenario(write(tmp_path, GOOD), ["hardware=h1000"])


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
    from kvfrag.sim.scenario_run import run

    result = run(loaded.scenario, loaded.base_dir)
    assert set(result.summary()["completed"]) == {2}


def test_a_trace_path_given_with_set_is_relative_to_the_current_folder(tmp_path, monkeypatch):
    """What a shell user means by `--set workload.trace.path=data/t.csv`; the YAML's own paths
    stay relative to the YAML."""
    here = tmp_path / "here"
    (here / "data").mkdir(parents=True)
    (here / "data" / "t.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.0,100,20\n2023-11-16 18:15:47.0,50,10\n"
    )
    (tmp_path / "scenarios").mkdir()
    text = GOOD.replace("  synthetic:\n    count: 20\n", "  trace: {path: t.csv}\n  x:\n")
    text = text.replace("  x:\n    prompt: {kind: uniform, low: 10, high: 200}\n"
                        "    output: {kind: uniform, low: 10, high: 200}\n", "")
    path = write(tmp_path / "scenarios", text)
    monkeypatch.chdir(here)
    loaded = load_scenario(path, ["workload.trace.path=data/t.csv"])
    assert loaded.resolved()["workload"]["trace"]["path"] == str(here / "data" / "t.csv")
    with pytest.raises(ScenarioError, match="no such file"):
        load_scenario(path, ["workload.trace.path=nope.csv"])


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


# --------------------------------------------------------------- hostile or mistaken input
ENGINE = "engine:\n  max_time_s: 100\n  watermark: 0.01\n  step_time: {base_s: 0.02}\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GOOD + ENGINE.replace("base_s: 0.02", "base_s: .inf"),
         r"^.*s\.yaml:16: engine\.step_time\.base_s: must be a finite number from 0 to 3,600 "
         r"\(seconds\), not inf$"),
        (GOOD + ENGINE.replace("base_s: 0.02", "base_s: .nan"),
         r"s\.yaml:16: engine\.step_time\.base_s: must be a finite number .*, not nan$"),
        (GOOD + ENGINE.replace("max_time_s: 100", "max_time_s: .inf"),
         r"s\.yaml:14: engine\.max_time_s: must be a finite number above 0 and at most "
         r"1,000,000,000 \(seconds\), not inf$"),
        (GOOD + ENGINE.replace("watermark: 0.01", "watermark: .nan"),
         r"s\.yaml:15: engine\.watermark: must be a finite number at least 0 and below 1, "
         r"not nan$"),
        (GOOD.replace("kv_budget: 12GiB", "kv_budget: .inf"),
         r"s\.yaml:3: kv_budget: size inf is not a finite number \(a size is 1 B to 1\.0 PiB, "
         r"e\.g\. 12GiB\)$"),
        (GOOD.replace("kv_budget: 12GiB", "kv_budget: {gpu_memory: 80GB, utilization: .nan}"),
         r"s\.yaml:3: kv_budget\.utilization: must be a finite number above 0 and at most 1, "
         r"not nan$"),
        (GOOD.replace("output: {kind: uniform, low: 10, high: 200}",
                      "output: {kind: normal, mean: 100, std: .inf}"),
         r"s\.yaml:9: workload\.synthetic\.output\.std: .*finite number"),
        (GOOD.replace("kind: buddy, reserve: max_model_len}", "kind: contiguous, bandwidth: .nan}"),
         r"s\.yaml:11: allocators\[0\]: allocator 'orca-max': bandwidth must be a finite number "
         r"from 1,000,000 to 1e\+15 \(bytes per second\), not nan$"),
        (GOOD + "sweep:\n  engine.watermark: [0.1, .nan]\n",
         r"s\.yaml:14: sweep\.engine\.watermark\[1\]: must be a finite number, not nan$"),
    ],
)
def test_non_finite_numbers_are_refused(tmp_path, text, expected):
    with pytest.raises(ScenarioError, match=expected) as info:
        load_scenario(write(tmp_path, text))
    assert "\n" not in str(info.value)


def test_non_finite_floats_are_refused_by_the_model_too():
    """Programmatic use gets the check: any inf or nan in the validated data, by field."""
    import yaml
    from pydantic import ValidationError

    data = yaml.safe_load(GOOD)
    data["workload"]["synthetic"]["output"] = {"kind": "normal", "mean": 100.0, "std": 1.0}
    data["sweep"] = {"workload.synthetic.output.std": [float("inf")]}
    with pytest.raises(ValidationError, match=r"must be a finite number, not inf"):
        Scenario.model_validate(data)


@pytest.mark.parametrize(
    ("sweep", "expected"),
    [
        ("  engine.max_num_seqz: [1, 2]\n",
         r"s\.yaml:14: sweep\.engine\.max_num_seqz: point 1 \(engine\.max_num_seqz=1\): "
         r"unknown key 'max_num_seqz'; did you mean 'max_num_seqs'\?"),
        ("  kv_budget: [20GB]\n  engine.max_num_seqs: [4, -1]\n",
         r"s\.yaml:15: sweep\.engine\.max_num_seqs: point 2 "
         r"\(kv_budget=20GB, engine\.max_num_seqs=-1\): must be a whole number from 1 to "
         r"1,048,576, not -1$"),
        ("  allocators.paged-16.block_size: [16, 0]\n",
         r"s\.yaml:14: sweep\.allocators\.paged-16\.block_size: point 2 .*: allocators\[1\]: "
         r"allocator 'paged-16': block_size must be a whole number from 1 to 4,194,304, not 0$"),
        ("  allocators.paged-61.block_size: [16]\n",
         r"s\.yaml:14: sweep\.allocators\.paged-61\.block_size: point 1 .*: "
         r"no allocator labelled 'paged-61'; did you mean 'paged-16'\?"),
        ("  kv_budjet: [1GB]\n",
         r"s\.yaml:14: sweep\.kv_budjet: point 1 \(kv_budjet=1GB\): unknown key 'kv_budjet'; "
         r"did you mean 'kv_budget'\?"),
    ],
)
def test_bad_sweep_points_are_one_line_at_the_sweep_key(tmp_path, sweep, expected):
    with pytest.raises(ScenarioError, match=expected) as info:
        load_scenario(write(tmp_path, GOOD + "sweep:\n" + sweep))
    assert "\n" not in str(info.value)


def test_bad_sweep_from_set_names_the_set(tmp_path):
    item = "sweep={engine.max_num_seqs: [4, -1]}"
    with pytest.raises(ScenarioError) as info:
        load_scenario(write(tmp_path, GOOD), [item])
    assert str(info.value) == (
        f"--set {item!r}: sweep.engine.max_num_seqs: point 2 (engine.max_num_seqs=-1): "
        "must be a whole number from 1 to 1,048,576, not -1"
    )


NUM_SEQS = "must be a whole number from 1 to 1,048,576, not "


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("engine.max_num_seqs=-3",
         "--set 'engine.max_num_seqs=-3': engine.max_num_seqs: " + NUM_SEQS + "-3"),
        ("engine={max_num_seqs: -3}",
         "--set 'engine={max_num_seqs: -3}': engine.max_num_seqs: " + NUM_SEQS + "-3"),
        ("allocators.paged-16.block_size=0",
         "--set 'allocators.paged-16.block_size=0': allocators[1]: allocator 'paged-16': "
         "block_size must be a whole number from 1 to 4,194,304, not 0"),
    ],
)
def test_bad_set_values_are_blamed_on_the_set_not_a_line(tmp_path, item, expected):
    with pytest.raises(ScenarioError) as info:
        load_scenario(write(tmp_path, GOOD), [item])
    assert str(info.value) == expected


def test_a_file_error_is_still_blamed_on_its_line_when_sets_are_given(tmp_path):
    text = GOOD + "engine: {max_num_seqs: 0}\n"
    with pytest.raises(ScenarioError, match=r"s\.yaml:13: engine\.max_num_seqs: must be a whole"):
        load_scenario(write(tmp_path, text), ["kv_budget=20GB", "engine.watermark=0.1"])
    bad = GOOD.replace("reserve: max_model_len", "reserve: max")
    with pytest.raises(ScenarioError, match=r"^.*s\.yaml:11: allocators\[0\]: allocator 'orca"):
        load_scenario(write(tmp_path, bad), ["allocators.paged-16.block_size=32"])


def test_duplicate_keys_in_a_set_value(tmp_path):
    with pytest.raises(ScenarioError) as info:
        load_scenario(write(tmp_path, GOOD), ["engine={lookahead: 1, lookahead: 2}"])
    assert str(info.value) == (
        "--set 'engine={lookahead: 1, lookahead: 2}': duplicate key 'lookahead' (first at line 1)"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GOOD + "kv_budget: 1GB\n", r"s\.yaml:13: duplicate key 'kv_budget' \(first at line 3\)$"),
        (GOOD.replace("block_size: 16}", "block_size: 16, block_size: 8}"),
         r"s\.yaml:12: duplicate key 'block_size' \(first at line 12\)$"),
        (GOOD + "  - label: paged-8\n    kind: paged\n    block_size: 8\n    kind: buddy\n",
         r"s\.yaml:16: duplicate key 'kind' \(first at line 14\)$"),
        (GOOD.replace("    count: 20\n", "    count: 20\n    count: 30\n"),
         r"s\.yaml:8: duplicate key 'count' \(first at line 7\)$"),
    ],
)
def test_duplicate_keys_are_refused(tmp_path, text, expected):
    with pytest.raises(ScenarioError, match=expected):
        load_scenario(write(tmp_path, text))


def test_merge_keys_may_override_without_being_duplicates(tmp_path):
    text = GOOD.replace(
        "    prompt: {kind: uniform, low: 10, high: 200}\n"
        "    output: {kind: uniform, low: 10, high: 200}\n",
        "    prompt: &len {kind: uniform, low: 10, high: 200}\n"
        "    output:\n      <<: *len\n      high: 100\n",
    )
    s = load_scenario(write(tmp_path, text)).scenario
    assert s.workload.synthetic.output.high == 100


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GOOD.replace("kv_budget: 12GiB", "kv_budget: 100000000000000000000"),
         r"s\.yaml:3: kv_budget: kv_budget 86\.7 EiB is larger than kvfrag models "
         r"\(at most 1\.0 PiB\)$"),
        (GOOD.replace("kv_budget: 12GiB", "kv_budget: 2000TB"),
         r"s\.yaml:3: kv_budget: kv_budget 1\.8 PiB is larger than kvfrag models"),
        (GOOD.replace("kv_budget: 12GiB", "kv_budget: {gpu_memory: 10000TB}"),
         r"s\.yaml:3: kv_budget\.gpu_memory: gpu_memory 8\.9 PiB is larger than kvfrag models"),
        (GOOD.replace("kv_budget: 12GiB", "kv_budget: " + "9" * 5000),
         r"s\.yaml:3: malformed YAML: integer of 5000 digits is too long$"),
        (GOOD.replace("max_model_len: 2048", "max_model_len: 10000000000"),
         r"s\.yaml:4: max_model_len: must be a whole number from 1 to 2,147,483,648, "
         r"not 10000000000$"),
        (GOOD.replace("block_size: 16}", "block_size: 100000000000}"),
         r"s\.yaml:12: allocators\[1\]: allocator 'paged-16': block_size must be a whole number "
         r"from 1 to 4,194,304, not 100000000000$"),
    ],
)
def test_absurd_sizes_are_refused_before_anything_is_built(tmp_path, text, expected):
    with pytest.raises(ScenarioError, match=expected):
        load_scenario(write(tmp_path, text))


def test_a_petabyte_budget_loads(tmp_path):
    s = load_scenario(write(tmp_path, GOOD.replace("kv_budget: 12GiB", "kv_budget: 1000TB")))
    assert s.scenario.budget_bytes == 10**15


def test_huge_scenario_file_is_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    with path.open("wb") as f:  # sparse: 100 MB without writing them
        f.truncate(100 * 10**6)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert str(info.value) == f"{path}: 100.0 MB; a scenario file is at most 1 MB"


def test_what_is_not_a_regular_file_is_refused(tmp_path):
    import os

    (tmp_path / "d.yaml").mkdir()
    os.mkfifo(tmp_path / "f.yaml")  # reading it would block forever
    for path in (tmp_path / "d.yaml", tmp_path / "f.yaml", Path("/dev/zero")):
        with pytest.raises(ScenarioError) as info:
            load_scenario(path)
        assert str(info.value) == f"{path}: not a regular file"
    link = tmp_path / "zero.yaml"
    link.symlink_to("/dev/zero")
    with pytest.raises(ScenarioError, match=r"zero\.yaml: not a regular file$"):
        load_scenario(link)


def test_binary_file_is_one_line(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(ScenarioError, match=r"s\.yaml: not UTF-8 text"):
        load_scenario(path)


def test_huge_set_value_is_refused(tmp_path):
    item = "description=" + "x" * 70_000
    with pytest.raises(ScenarioError, match=r"70012 characters; a --set item is at most 64 KiB"):
        load_scenario(write(tmp_path, GOOD), [item])


@pytest.mark.parametrize(
    "label",
    ["=HYPERLINK(\"http://x\")", "+cmd", "-1+2", "@SUM(A1)", "paged 16", "a/b", "x" * 65, ""],
)
def test_unsafe_labels_are_refused(tmp_path, label):
    text = GOOD.replace("{label: paged-16,", "{label: " + _yaml_str(label) + ",")
    with pytest.raises(ScenarioError, match=r"s\.yaml:12: allocators\[1\]\.label: label .*use "
                       r"letters, digits"):
        load_scenario(write(tmp_path, text))


def _yaml_str(value: str) -> str:
    import json

    return json.dumps(value)  # a JSON string is a YAML string


def test_safe_labels_are_kept(tmp_path):
    text = GOOD.replace("{label: paged-16,", "{label: Paged_16.v2+cow@h100,")
    s = load_scenario(write(tmp_path, text)).scenario
    assert s.allocators[1].label == "Paged_16.v2+cow@h100"


@pytest.mark.parametrize("name", ["", ".", "..", "../src", "a/b", ".hidden", "a b", "x" * 101])
def test_names_that_are_not_one_folder_name_are_refused(tmp_path, name):
    text = GOOD.replace("name: t\n", f"name: {_yaml_str(name)}\n")
    with pytest.raises(ScenarioError, match=r"s\.yaml:1: name: name .* is not a valid scenario"):
        load_scenario(write(tmp_path, text))
    with pytest.raises(ScenarioError, match=r"^--set 'name=.*': name: name .* is not a valid"):
        load_scenario(write(tmp_path, GOOD), [f"name={_yaml_str(name)}"])


def test_good_names_and_the_file_stem_default(tmp_path):
    text = GOOD.replace("name: t\n", "name: run-2.v1_a\n")
    assert load_scenario(write(tmp_path, text)).scenario.name == "run-2.v1_a"
    bare = GOOD.replace("name: t\n", "")
    assert load_scenario(write(tmp_path, bare, "block-size.yaml")).scenario.name == "block-size"
    with pytest.raises(ScenarioError) as info:
        load_scenario(write(tmp_path, bare, "my scenario.yaml"))
    assert "file name 'my scenario' is not a valid scenario name" in str(info.value)
    assert "give the scenario a name: line" in str(info.value)
    named = load_scenario(write(tmp_path, bare, "my scenario.yaml"), ["name=mine"])
    assert named.scenario.name == "mine"


# ----------------------------------------------------------------- models with layer types
HF_CONFIGS = ROOT / "tests" / "sim" / "hf_configs"


def _run(capsys, scenario: Path, sets: list[str], out: Path) -> tuple[int, str]:
    from kvfrag.cli import main

    argv = ["run", str(scenario), "-o", str(out), "-q", "--no-plots", "-j", "1"]
    for item in sets:
        argv += ["--set", item]
    code = main(argv)
    return code, capsys.readouterr().err


def test_layered_presets_lay_out_all_full(tmp_path):
    path = write(tmp_path, GOOD)
    gemma = load_scenario(path, ["model=gemma-3-27b"]).scenario
    assert gemma.geometry.bytes_per_token == 496 * 1024  # every layer keeps every token
    assert load_scenario(path, ["model=gemma-3-27b", "tp=2"]).scenario.geometry.kv_heads == 8
    ds = load_scenario(path, ["model=deepseek-v3", "tp=8"]).scenario
    assert ds.geometry.bytes_per_token == 61 * 576 * 2  # one latent, whole on every GPU
    assert load_scenario(path, ["model=llama-3-8b"]).scenario.stack is None  # unchanged


def test_a_config_json_is_read_relative_to_the_scenario(tmp_path):
    folder = tmp_path / "models" / "scout"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((HF_CONFIGS / "llama-4-scout.json").read_text())
    text = GOOD.replace("model: opt-13b", "model: {hf_config: models/scout/config.json}")
    loaded = load_scenario(write(tmp_path, text))
    s = loaded.scenario
    assert s.geometry.name == "scout" and s.geometry.bytes_per_token == 192 * 1024
    assert s.stack is not None and s.stack.count() == {"chunked_local": 36, "full": 12}
    resolved = loaded.resolved()["model"]["hf_config"]
    assert resolved["path"] == str(folder / "config.json")
    assert "intermediate_size_mlp" not in resolved["config"]["text_config"]  # (not read)
    again = Scenario.model_validate(
        {k: v for k, v in loaded.resolved().items() if k != "kvfrag_version"})
    assert again.geometry == s.geometry


def test_a_layered_model_in_yaml(tmp_path):
    model = ("{name: g, kv_heads: 16, head_dim: 128, layers: [{type: sliding_window, count: 5, "
             "window: 1024}, {type: full}], num_layers: 62}")
    s = load_scenario(write(tmp_path, GOOD), [f"model={model}"]).scenario
    from kvfrag.sim.hybrid_presets import STACKS

    assert s.stack is not None and s.stack.layers == STACKS["gemma-3-27b"].layers
    mla = "{layers: [{type: mla, latent: 512, rope: 64}], repeat: 61}"
    assert load_scenario(write(tmp_path, GOOD), [f"model={mla}"]).scenario.geometry \
        .bytes_per_token == 70272
    old = "{layers: 32, kv_heads: 8, head_dim: 128}"  # the full-attention form, unchanged
    assert load_scenario(write(tmp_path, GOOD), [f"model={old}"]).scenario.geometry \
        .bytes_per_token == 128 * 1024


@pytest.mark.parametrize(("model", "expected"), [
    ("{layers: [{type: windowed, window: 8}], kv_heads: 8, head_dim: 64}",
     r"model\.layers\[0\]\.type: unknown layer type 'windowed' \(valid: full, sliding_window"),
    ("{layers: [{type: sliding_window, window: 0}], kv_heads: 8, head_dim: 64}",
     r"model\.layers\[0\]\.window: must be a whole number from 1 to 2,147,483,648, not 0"),
    ("{layers: [{type: chunked_local, chunk: -4}], kv_heads: 8, head_dim: 64}",
     r"model\.layers\[0\]\.chunk: must be a whole number from 1 to .*, not -4"),
    ("{layers: [{type: sliding_window, window: true}], kv_heads: 8, head_dim: 64}",
     r"window: must be a whole number .*not the boolean true"),
    ("{layers: [{type: sliding_window}], kv_heads: 8, head_dim: 64}",
     r"model\.layers\[0\]: a sliding_window layer needs window"),
    ("{layers: [{type: full, window: 8}], kv_heads: 8, head_dim: 64}",
     r"model\.layers\[0\]: a full layer has no window \(it takes: count, kv_heads, head_dim\)"),
    ("{layers: [{type: full, count: 6}], kv_heads: 8, head_dim: 64, repeat: 10, num_layers: 62}",
     r"model: num_layers \(62\) does not match the pattern: 6 layer\(s\) x repeat 10 = 60"),
    ("{layers: [{type: full}, {type: mamba, state_bytes: 0}], kv_heads: 8, head_dim: 64}",
     r"model\.layers\[1\]\.state_bytes: state_bytes must be a size from 1 B .*not 0"),
])
def test_bad_layered_models_are_one_line_exit_2_nothing_written(capsys, tmp_path, model,
                                                                 expected):
    import re

    out = tmp_path / "out"
    code, err = _run(capsys, write(tmp_path, GOOD), [f"model={model}"], out)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("kvfrag: error: --set 'model="), lines[0]
    assert re.search(expected, lines[0]), lines[0]
    assert not out.exists()


@pytest.mark.parametrize(("content", "expected"), [
    (b'{"num_hidden_layers": 4,', r"config\.json: not JSON \(line 1, column 25: Expecting"),
    (b"", r"config\.json: not JSON \(line 1, column 1"),
    (b'{"num_hidden_layers": NaN}', r"config\.json: not JSON \(NaN is not a JSON number\)"),
    (b"\xff\xfe", r"config\.json: not UTF-8 text"),
    (b"[1, 2]", r"config\.json: a config\.json is a JSON object of fields .*not a list"),
    (b'{"model_type": "llama"}', r"config\.json: num_hidden_layers: missing"),
    (b'{"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 64, '
     b'"layer_types": ["full_attention"]}',
     r"config\.json: layer_types: names 1 layers but num_hidden_layers is 2"),
    (b'{"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 64, '
     b'"layer_types": ["full_attention", "cross_attention"]}',
     r"config\.json: layer_types\[1\]: unknown layer type 'cross_attention'"),
    (b'{"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 64, '
     b'"sliding_window": 0}', r"config\.json: sliding_window: must be a whole number from 1"),
    (b'{"num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": -1}',
     r"config\.json: qk_rope_head_dim: must be a whole number from 0"),
])
def test_a_bad_config_json_is_one_line_naming_file_and_field(capsys, tmp_path, content,
                                                             expected):
    import re

    (tmp_path / "config.json").write_bytes(content)
    text = GOOD.replace("model: opt-13b", "model: {hf_config: config.json}")
    out = tmp_path / "out"
    code, err = _run(capsys, write(tmp_path, text), [], out)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("kvfrag: error: "), lines[0]
    assert "s.yaml:2: model.hf_config: " in lines[0], lines[0]
    assert re.search(expected, lines[0]), lines[0]
    assert not out.exists()


def test_a_config_json_that_is_missing_huge_or_not_a_file(tmp_path):
    text = GOOD.replace("model: opt-13b", "model: {hf_config: nope/config.json}")
    with pytest.raises(ScenarioError, match=r"s\.yaml:2: model\.hf_config: .*nope/config\.json: "
                       r"no such file"):
        load_scenario(write(tmp_path, text))
    (tmp_path / "big.json").write_bytes(b" " * 4_000_001)
    with pytest.raises(ScenarioError, match=r"big\.json: 4\.0 MB; a config\.json is at most 4 MB"):
        load_scenario(write(tmp_path, GOOD), [f"model={{hf_config: {tmp_path}/big.json}}"])
    with pytest.raises(ScenarioError, match=r"model\.hf_config: .*: not a regular file"):
        load_scenario(write(tmp_path, GOOD), [f"model={{hf_config: {tmp_path}}}"])


def test_vattention_is_refused_for_layers_that_are_not_alike(tmp_path):
    text = GOOD.replace("kind: buddy, reserve: max_model_len}", "kind: vattention}")
    with pytest.raises(ScenarioError, match=r"allocators\[0\]: allocator 'orca-max': vattention "
                       r"lays out one K and one V buffer per layer.*deepseek-v3"):
        load_scenario(write(tmp_path, text), ["model=deepseek-v3"])
    assert load_scenario(write(tmp_path, text), ["model=gemma-3-27b"])  # alike: exact


def test_moe_and_sliding_presets_have_no_timing_on_hardware(tmp_path):
    text = GOOD.replace("kv_budget: 12GiB\n", "hardware: h100-80gb\n")
    with pytest.raises(ScenarioError, match=r"model: timing on `hardware` and a derived "
                       r"kv_budget need the model's hidden"):
        load_scenario(write(tmp_path, text), ["model=gpt-oss-20b"])
    assert load_scenario(write(tmp_path, text), ["model=mistral-small-3"]).scenario.architecture
