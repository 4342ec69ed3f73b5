"""Reading a Hugging Face config.json as typed layers (`sim.hf_config`): each model family's
way of saying which layers are which, and one plain message for what cannot be read."""

from __future__ import annotations

import pytest
from kvfrag.sim import hf_config
from kvfrag.sim.hf_config import HfConfigError, parse
from kvfrag.sim.layers import MLA, FullAttention, SlidingWindow

LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 32,
         "num_key_value_heads": 8, "hidden_size": 4096, "intermediate_size": 14336,
         "vocab_size": 128256, "torch_dtype": "bfloat16"}


def test_a_dense_model_is_full_attention_with_its_matrices():
    s = parse(LLAMA, "l")
    assert s.layers == (FullAttention(8, 128),) * 4 and not s.hybrid
    arch = hf_config.architecture(LLAMA, "l")
    assert arch is not None and (arch.hidden, arch.heads, arch.head_dim) == (4096, 32, 128)
    assert hf_config.architecture(LLAMA | {"num_local_experts": 8}, "l") is None
    assert hf_config.architecture(LLAMA | {"sliding_window": 16}, "l") is None


@pytest.mark.parametrize(("extra", "kinds"), [
    ({"sliding_window": 64}, ["sliding_window"] * 4),  # Mistral 7B v0.1: every layer
    ({"sliding_window": 64, "use_sliding_window": False}, ["full"] * 4),  # Qwen 2
    ({"sliding_window": 64, "sliding_window_pattern": 2}, ["sliding_window", "full"] * 2),
    ({"sliding_window": 64, "model_type": "gemma2"}, ["sliding_window", "full"] * 2),
    ({"attention_chunk_size": 32}, ["chunked_local"] * 3 + ["full"]),  # Llama 4 default
    ({"attention_chunk_size": 32, "no_rope_layers": [1, 0, 1, 0]},
     ["chunked_local", "full"] * 2),
    ({"no_rope_layers": [1, 0, 1, 0]}, ["full"] * 4),  # no chunk size: nothing chunked
    ({"layer_types": ["full_attention", "sliding_attention", "chunked_attention",
                      "full_attention"], "sliding_window": 8, "attention_chunk_size": 16},
     ["full", "sliding_window", "chunked_local", "full"]),
])
def test_which_layers_are_which(extra, kinds):
    assert [a.kind for a in parse(LLAMA | extra).layers] == kinds


def test_mla_text_config_dtype_and_head_dim():
    ds = parse({"num_hidden_layers": 3, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                "dtype": "float32"})
    assert ds.layers == (MLA(512, 64, 4),) * 3
    nested = {"torch_dtype": "float16", "text_config": {
        "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}}
    assert parse(nested, "n").layers == (FullAttention(4, 64, 2),) * 2
    assert parse(LLAMA | {"torch_dtype": None}).layers[0].dtype_bytes == 2


QWEN_NEXT = {"num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 16,
             "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
             "linear_num_value_heads": 32, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def test_gated_delta_net_and_mamba_layers():
    s = parse(QWEN_NEXT | {"mamba_ssm_dtype": "float32"})
    assert [a.kind for a in s.layers] == ["mamba", "full"] * 2
    assert s.state_bytes_per_request == 2 * (2 * 3 * 8192 + 4 * 32 * 128 * 128)
    jamba = {"model_type": "jamba", "num_hidden_layers": 8, "num_attention_heads": 32,
             "num_key_value_heads": 8, "hidden_size": 4096}
    assert [a.kind for a in parse(jamba).layers].index("full") == 4


@pytest.mark.parametrize(("config", "field", "problem"), [
    ([1, 2], "", "a config.json is a JSON object"),
    ({"model_type": "llama"}, "num_hidden_layers", "missing"),
    (LLAMA | {"num_hidden_layers": 0}, "num_hidden_layers", "from 1 to 1,024, not 0"),
    (LLAMA | {"num_hidden_layers": True}, "num_hidden_layers", "not the boolean true"),
    (LLAMA | {"num_hidden_layers": 1e30}, "num_hidden_layers", "from 1 to 1,024"),
    (LLAMA | {"layer_types": ["full_attention"] * 3}, "layer_types",
     "names 3 layers but num_hidden_layers is 4"),
    (LLAMA | {"layer_types": ["full_attention"] * 3 + ["mystery"]}, "layer_types[3]",
     "unknown layer type 'mystery'"),
    (LLAMA | {"layer_types": "full"}, "layer_types", "must be a list"),
    (LLAMA | {"sliding_window": 0}, "sliding_window", "from 1 to"),
    (LLAMA | {"sliding_window": -5, "sliding_window_pattern": 2}, "sliding_window", "not -5"),
    (LLAMA | {"attention_chunk_size": 0}, "attention_chunk_size", "from 1 to"),
    (LLAMA | {"no_rope_layers": [1, 1]}, "no_rope_layers", "one 0 or 1 per layer (4)"),
    (LLAMA | {"torch_dtype": "int3"}, "torch_dtype", "unknown dtype 'int3'"),
    (LLAMA | {"num_attention_heads": 30}, "head_dim", "not a multiple"),
    (LLAMA | {"text_config": 5}, "text_config", "must be an object"),
    ({"text_config": {"num_hidden_layers": 2}}, "text_config.num_attention_heads", "missing"),
    (LLAMA | {"attn_layer_period": 4, "attn_layer_offset": 4}, "attn_layer_offset",
     "must be below attn_layer_period (4)"),
    (LLAMA | {"attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 0},
     "mamba_d_state", "from 1 to"),
    (LLAMA | {"full_attention_interval": 2}, "linear_num_key_heads", "missing"),
    (QWEN_NEXT | {"linear_num_value_heads": 0}, "linear_num_value_heads", "from 1 to"),
    (QWEN_NEXT | {"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim", "from 2 to"),
    (LLAMA | {"attn_layer_period": 2, "attn_layer_offset": 1, "mamba_expand": 0},
     "mamba_expand", "from 1 to"),
    (LLAMA | {"attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_conv": 1},
     "mamba_d_conv", "from 2 to"),
])
def test_what_cannot_be_read_is_one_line_naming_the_field(config, field, problem):
    with pytest.raises(HfConfigError) as info:
        parse(config)
    assert info.value.field == field
    assert problem in str(info.value)
    assert "\n" not in str(info.value)


def test_relevant_keeps_only_what_is_read():
    config = LLAMA | {"rope_scaling": {"factor": 8.0}, "id2label": {"0": "a"},
                      "text_config": {"num_hidden_layers": 2, "vision": 1}}
    kept = hf_config.relevant(config)
    assert kept["rope_scaling"] == {"factor": 8.0} and "id2label" not in kept
    assert kept["text_config"] == {"num_hidden_layers": 2}
    assert hf_config.relevant([1]) == [1]
    assert parse(LLAMA | {"sliding_window": 16}).layers[0] == SlidingWindow(8, 128, window=16)


GOOD = """\
name: t
model: {hf_config: config.json}
kv_budget: 4GiB
max_model_len: 4096
workload:
  synthetic:
    count: 4
    prompt: {kind: uniform, low: 100, high: 1000}
    output: {kind: fixed, value: 10}
engine:
  step_time: {base_s: 0.02}
allocators:
  - {label: hybrid, kind: hybrid}
"""


@pytest.mark.parametrize(("fields", "expected"), [
    ({"linear_num_value_heads": 0}, "linear_num_value_heads: must be a whole number from 1"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim: must be a whole number from 2"),
    ({"linear_key_head_dim": -128}, "linear_key_head_dim: must be a whole number from 1"),
])
def test_a_mamba_config_json_that_cannot_be_read_is_one_line_exit_2(capsys, tmp_path, fields,
                                                                     expected):
    """A Mamba state that would be 0 bytes (or is not a number) in a config.json: one line
    naming the scenario, the file and the field; exit 2; nothing written."""
    import json

    from kvfrag.cli import main

    (tmp_path / "config.json").write_text(json.dumps(QWEN_NEXT | fields))
    (tmp_path / "s.yaml").write_text(GOOD)
    out = tmp_path / "out"
    code = main(["run", str(tmp_path / "s.yaml"), "-o", str(out), "-q", "--no-plots"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "s.yaml:2: model.hf_config: " in lines[0] and "config.json: " in lines[0], lines[0]
    assert expected in lines[0], lines[0]
    assert not out.exists()


def test_a_mamba_config_json_runs_with_the_hybrid_allocator(tmp_path):
    """Qwen3-Next's config.json: its gated delta nets' state in the hybrid allocator, one
    state block per request per Mamba group."""
    from pathlib import Path

    from kvfrag.sim.hybrid_presets import STACKS
    from kvfrag.sim.scenario import build_allocator

    from kvfrag.config import load_scenario

    copy = Path(__file__).parent / "hf_configs" / "qwen3-next-80b-a3b.json"
    (tmp_path / "config.json").write_text(copy.read_text())
    (tmp_path / "s.yaml").write_text(GOOD)
    s = load_scenario(tmp_path / "s.yaml").scenario
    a = build_allocator(s, s.allocators[0])
    assert a.stack.layers == STACKS["qwen3-next-80b-a3b"].layers
    assert a.plan.block_size == 544 and a.plan.mamba_cache_mode == "none"
    assert sorted(m.kind for m in a.managers) == ["full", "mamba"]


@pytest.mark.parametrize(("fields", "length"), [
    ({"max_position_embeddings": 32768}, 32768),
    # the smallest length key wins; model_max_length over the others (Command-R)
    ({"max_position_embeddings": 32768, "seq_length": 8192}, 8192),
    ({"max_position_embeddings": 8192, "model_max_length": 131072}, 131072),
    # a RoPE factor scales the length, unless its type already did (YaRN, llama3, ...)
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}},
     16384),
    ({"max_position_embeddings": 131072,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072),
    ({"max_position_embeddings": 32768, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     32768),
    # per layer type (nested rope_parameters): the factor applies alike
    ({"max_position_embeddings": 4096, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0},
        "sliding_attention": {"rope_type": "default"}}}, 8192),
    ({}, None),
])
def test_context_length_as_vllm_derives_it(fields, length):
    assert hf_config.context_length(LLAMA | fields) == length


def test_gemma3_length_is_already_scaled():
    config = {"model_type": "gemma3", "rope_scaling": {"rope_type": "linear", "factor": 8.0},
              "text_config": {"max_position_embeddings": 131072}}
    assert hf_config.context_length(config) == 131072


def _scenario(tmp_path, config: dict, model_len: str = "") -> object:
    import json

    from kvfrag.config import load_scenario

    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "s.yaml").write_text(GOOD.replace("max_model_len: 4096\n", model_len))
    return load_scenario(tmp_path / "s.yaml")


def test_a_config_json_gives_max_model_len_when_the_scenario_leaves_it_out(tmp_path):
    loaded = _scenario(tmp_path, LLAMA | {"max_position_embeddings": 8192})
    assert loaded.scenario.max_model_len == 8192
    assert loaded.resolved()["max_model_len"] == 8192
    given = _scenario(tmp_path, LLAMA | {"max_position_embeddings": 8192}, "max_model_len: 2048\n")
    assert given.scenario.max_model_len == 2048


def test_a_config_json_without_a_length_needs_max_model_len(capsys, tmp_path):
    import json

    from kvfrag.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    (tmp_path / "s.yaml").write_text(GOOD.replace("max_model_len: 4096\n", ""))
    out = tmp_path / "out"
    code = main(["run", str(tmp_path / "s.yaml"), "-o", str(out), "-q", "--no-plots"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "max_model_len: required: the model's config.json names no context length" in lines[0]
    assert not out.exists()
    (tmp_path / "config.json").write_text(json.dumps(LLAMA | {"max_position_embeddings": 0}))
    code = main(["run", str(tmp_path / "s.yaml"), "-o", str(out), "-q", "--no-plots"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "model.hf_config: " in lines[0] and "max_position_embeddings" in lines[0], lines[0]
