"""A preset's own context length as the default max_model_len, and the warning for block
sizes vLLM 0.33's attention kernels do not run."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvfrag.sim.geometry import CONTEXT_LENGTHS
from kvfrag.sim.hybrid_presets import CONTEXT_LENGTHS as HYBRID_CONTEXT_LENGTHS
from kvfrag.sim.scenario_parts import MODEL_PRESETS, AllocatorSpec, context_length
from kvfrag.sim.scenario_run import VLLM_BLOCK_MULTIPLE, block_size_warnings

from kvfrag.cli import main
from kvfrag.config import ScenarioError, load_scenario

SCENARIO = """\
model: MODEL
kv_budget: 1GiB
workload:
  synthetic:
    count: 20
    prompt: {kind: fixed, value: 100}
    output: {kind: fixed, value: 10}
allocators:
  - {label: paged, kind: paged, block_size: 16}
"""


def load(tmp_path: Path, text: str, sets: tuple[str, ...] = ()):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return load_scenario(path, list(sets))


# ------------------------------------------------------------------ max_model_len
def test_every_preset_carries_its_context_length():
    assert set(CONTEXT_LENGTHS) | set(HYBRID_CONTEXT_LENGTHS) == set(MODEL_PRESETS)
    assert not set(CONTEXT_LENGTHS) & set(HYBRID_CONTEXT_LENGTHS)
    # (config.json's max_position_embeddings, as vLLM takes it: a few pinned)
    assert context_length("llama-3-8b") == 8192
    assert context_length("opt-13b") == 2048
    assert context_length("gemma-3-27b") == 131072
    assert context_length("deepseek-v3") == 163840
    assert context_length("not-a-model") is None


@pytest.mark.parametrize("model", ["llama-3-8b", "llama-2-7b", "mistral-small-3", "gpt-oss-20b"])
def test_a_preset_without_max_model_len_takes_its_own(tmp_path, model):
    loaded = load(tmp_path, SCENARIO.replace("MODEL", model))
    assert loaded.scenario.max_model_len == context_length(model)
    assert loaded.scenario.model_len_default
    assert loaded.resolved()["max_model_len"] == context_length(model)  # saved as used


def test_an_explicit_max_model_len_wins(tmp_path):
    text = SCENARIO.replace("MODEL", "llama-3-8b") + "max_model_len: 2048\n"
    loaded = load(tmp_path, text)
    assert loaded.scenario.max_model_len == 2048 and not loaded.scenario.model_len_default
    set_ = load(tmp_path, SCENARIO.replace("MODEL", "llama-3-8b"), ("max_model_len=4096",))
    assert set_.scenario.max_model_len == 4096


def test_a_sweep_over_models_gives_each_point_its_own(tmp_path):
    text = SCENARIO.replace("MODEL", "llama-3-8b") + "sweep:\n  model: [llama-3-8b, opt-13b]\n"
    points = load(tmp_path, text).scenario.points()
    assert [p.max_model_len for _, p in points] == [8192, 2048]
    text += "max_model_len: 1024\n"
    assert [p.max_model_len for _, p in load(tmp_path, text).scenario.points()] == [1024, 1024]


def test_the_resolved_copy_of_a_sweep_over_models_runs_the_same_points(tmp_path):
    """The resolved scenario saved beside the results leaves max_model_len to each point's
    model (null), so running it again gives every point its own length, not the first's."""
    import yaml

    text = SCENARIO.replace("MODEL", "llama-3-8b") + "sweep:\n  model: [llama-3-8b, opt-13b]\n"
    resolved = load(tmp_path, text).resolved()
    assert resolved["max_model_len"] is None
    resolved.pop("kvfrag_version")
    again = load(tmp_path, yaml.safe_dump(resolved)).scenario
    assert [p.max_model_len for _, p in again.points()] == [8192, 2048]
    single = load(tmp_path, SCENARIO.replace("MODEL", "opt-13b")).resolved()
    assert single["max_model_len"] == 2048  # (no sweep over models: the value used)


def test_a_custom_model_still_needs_it(tmp_path):
    custom = "{name: tiny, layers: 2, kv_heads: 2, head_dim: 64}"
    with pytest.raises(ScenarioError, match=r"max_model_len: required for a model that is not "
                       r"a preset") as info:
        load(tmp_path, SCENARIO.replace("MODEL", custom))
    assert "\n" not in str(info.value)
    assert load(tmp_path, SCENARIO.replace("MODEL", custom) + "max_model_len: 512\n")


# ------------------------------------------------------------------ block sizes
def spec(label: str, size: int, kind: str = "paged") -> AllocatorSpec:
    return AllocatorSpec(label=label, kind=kind, block_size=size)


def test_block_sizes_vllm_does_not_run_are_warned_once_per_allocator():
    assert VLLM_BLOCK_MULTIPLE == 16
    specs = [spec("p", 7), spec("p", 8), spec("p", 16), spec("q", 32), spec("q", 64),
             spec("c", 4, "prefix-caching"), spec("p", 7)]
    lines = block_size_warnings(specs)
    assert len(lines) == 2
    assert lines[0].startswith("allocator 'p': block_size 7, 8 is not one vLLM 0.33")
    assert "multiples of 16" in lines[0]
    assert lines[1].startswith("allocator 'c': block_size 4 ")
    assert block_size_warnings([spec("p", 16), spec("p", 256)]) == []
    assert block_size_warnings([AllocatorSpec(label="s", kind="contiguous")]) == []


def test_the_warning_is_one_line_on_stderr_and_the_run_goes_on(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO.replace("MODEL", "llama-3-8b").replace("block_size: 16",
                                                                     "block_size: 7"))
    assert main(["run", str(path), "-o", str(tmp_path / "r"), "--no-plots", "-q"]) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "block_size" in line]
    assert warned == ["kvfrag: warning: allocator 'paged': block_size 7 is not one vLLM 0.33's "
                      "attention kernels run (multiples of 16: 16, 32, 64, ...); modelled all "
                      "the same"]
    assert (tmp_path / "r" / "summary.csv").is_file()
