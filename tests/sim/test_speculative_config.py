"""`engine.speculative` as a scenario asks for it (sim/speculative_spec.py): the keys reach the
engine's `Speculative`, bad or unmodelled input is one line naming its field, the request
table's `accepted_drafts` column, and the draft's KV layers in the bytes per token (vLLM's
planner: budget // all layers' page bytes, tests/oracle/test_spec_driver.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kvfrag.sim.layers import FullAttention
from kvfrag.sim.scenario import build_allocator
from kvfrag.sim.speculative import Speculative
from kvfrag.sim.speculative_spec import check_workload
from kvfrag.workloads import WorkloadError, load_trace, validate_requests

from kvfrag.config import ScenarioError, load_scenario

SCENARIO = """\
name: t
model: llama-3-8b
kv_budget: 1GiB
max_model_len: 2048
workload:
  seed: 7
  synthetic:
    count: 20
    prompt: {kind: uniform, low: 10, high: 200}
    output: {kind: uniform, low: 10, high: 200}
allocators:
  - {label: paged-16, kind: paged, block_size: 16}
engine:
  step_time: {base_s: 0.02}
  speculative:
    method: eagle
    num_tokens: 3
    acceptance: 0.7
"""
#: One layer of llama-3-8b's KV (8 KV heads of 128, bf16) for one token: K and V.
LAYER_BYTES = 8 * 128 * 2 * 2

#: Acceptance from the request table's column, on a trace (a synthetic workload has none).
COLUMN = ["workload={trace: {path: 'sample:azure-conv'}}", "engine.speculative.acceptance=column"]


def load(tmp_path: Path, sets: list[str] | None = None, text: str = SCENARIO):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return load_scenario(path, sets or []).scenario


def test_keys_reach_the_engine(tmp_path):
    s = load(tmp_path)
    cfg = s.engine_config()
    assert cfg.speculative == Speculative("eagle", 3, rate=0.7, seed=7)  # the workload's seed
    assert cfg.async_scheduling is True  # left out: vLLM's server default
    dist = load(tmp_path, ["engine.speculative.acceptance={distribution: [[0, 0.2], [1, 0.3], "
                           "[3, 0.5]]}", "engine.speculative.seed=3",
                           "engine.speculative.method=ngram"]).engine_config().speculative
    assert dist == Speculative("ngram", 3, distribution=((0, 0.2), (1, 0.3), (3, 0.5)), seed=3)
    column = load(tmp_path, COLUMN).engine_config().speculative
    assert column is not None and column.from_column
    assert load(tmp_path, ["engine.async_scheduling=false"]).engine_config().speculative


def test_a_sweep_of_acceptance_gives_each_point_its_own(tmp_path):
    text = SCENARIO.replace("acceptance: 0.7", "acceptance: {distribution: [[0, 1], [3, 1]]}")
    text += "sweep:\n  engine.speculative.acceptance: [0.2, {distribution: [[1, 1]]}]\n"
    specs = [p.engine_config().speculative for _, p in load(tmp_path, text=text).points()]
    assert specs == [Speculative("eagle", 3, rate=0.2, seed=7),
                     Speculative("eagle", 3, distribution=((1, 1.0),), seed=7)]


def test_without_speculative_nothing_changes(tmp_path):
    s = load(tmp_path, text=SCENARIO.split("  speculative:")[0])
    assert s.engine_config().speculative is None and s.async_scheduling is True
    assert s.draft_layers == 0 and s.geometry.layers == 32


@pytest.mark.parametrize(("sets", "expected"), [
    (["engine.speculative.method=medusa"],
     r"engine\.speculative\.method: 'medusa' is not a method: one of eagle, mtp, draft_model, "
     r"ngram$"),
    (["engine.speculative.num_tokens=0"],
     r"engine\.speculative\.num_tokens: must be a whole number from 1 to"),
    (["engine.speculative.acceptance=1.5"],
     r"engine\.speculative\.acceptance: must be a rate from 0 to 1, .* not 1\.5$"),
    (["engine.speculative.acceptance=-0.1"],
     r"engine\.speculative\.acceptance: must be a rate from 0 to 1"),
    (["engine.speculative.acceptance=true"],
     r"engine\.speculative\.acceptance: .* not the boolean true$"),
    (["engine.speculative.acceptance={distribution: [[0, 0.5], [4, 0.5]]}"],
     r"engine\.speculative\.acceptance\.distribution\[1\]: accepted count 4 is outside 0\.\.3 "
     r"\(num_tokens\)$"),
    (["engine.speculative.acceptance={distribution: [[-1, 0.5]]}"],
     r"engine\.speculative\.acceptance\.distribution\[0\]: accepted count must be a whole "
     r"number from 0"),
    (["engine.speculative.acceptance={distribution: [[0, 0]]}"],
     r"engine\.speculative\.acceptance\.distribution: the weights sum to 0$"),
    (["engine.speculative.acceptance={distribution: []}"],
     r"engine\.speculative\.acceptance\.distribution: must be a non-empty list"),
    (["engine.speculative.acceptance={rate: 0.5}"],
     r"engine\.speculative\.acceptance: a distribution is .*unknown key 'rate'$"),
    (["engine.speculative.draft_layers=-1"],
     r"engine\.speculative\.draft_layers: must be a whole number from 0"),
    (["engine.speculative.method=draft_model"],
     r"engine\.speculative\.draft_layers: required with method draft_model"),
    (["engine.speculative.method=ngram", "engine.speculative.draft_layers=1"],
     r"engine\.speculative\.draft_layers: ngram proposes drafts from the prompt"),
    (["engine.speculative.window=4"], r"engine\.speculative\.window: unknown key 'window'"),
    (["engine.speculative.method=draft_model", "engine.speculative.draft_model=llama-3.2-2b"],
     r"engine\.speculative\.draft_model: 'llama-3\.2-2b' is not a model preset; did you mean "
     r"'llama-3\.2-1b'\?"),
    (["engine.speculative.draft_model=llama-3.2-1b"],
     r"engine\.speculative\.draft_model: method eagle has no draft model"),
    (["engine.speculative.method=draft_model", "engine.speculative.draft_model=llama-3.2-1b",
      "engine.speculative.draft_layers=2"],
     r"engine\.speculative\.draft_layers: draft_model 'llama-3\.2-1b' gives the draft's layers"),
    (["engine.batching=static"], r"engine\.batching: speculative decoding needs continuous"),
    (["allocators.paged-16.kind=prefix-caching"],
     r"allocators\[0\]: allocator 'paged-16': prefix caching with engine\.speculative is not "
     r"modelled yet"),
    (["allocators.paged-16.kind=hybrid"],
     r"allocators\[0\]: allocator 'paged-16': the hybrid allocator with engine\.speculative"),
    (["engine.speculative.acceptance=column"],
     r"engine\.speculative\.acceptance: column reads the request table's accepted_drafts, "
     r"which a synthetic workload has none of"),
    (["workload.n=2"], r"workload\.n: speculative decoding with sample groups or beams"),
    (["workload.beam_width=2"], r"workload\.beam_width: speculative decoding with sample"),
])
def test_bad_or_unmodelled_input_is_one_line_naming_the_field(tmp_path, sets, expected):
    with pytest.raises(ScenarioError, match=expected) as info:
        load(tmp_path, sets)
    assert "\n" not in str(info.value)


def test_a_line_of_the_file_is_named(tmp_path):
    text = SCENARIO.replace("acceptance: 0.7", "acceptance: 2")
    with pytest.raises(ScenarioError, match=r"s\.yaml:18: engine\.speculative\.acceptance: "):
        load(tmp_path, text=text)


@pytest.mark.parametrize(("sets", "layers"), [
    ([], 1),  # EAGLE: one layer
    (["engine.speculative.method=ngram"], 0),
    (["engine.speculative.method=mtp"], 1),  # llama names no MTP layers: vLLM's default 1
    (["engine.speculative.method=draft_model", "engine.speculative.draft_layers=4"], 4),
    (["engine.speculative.draft_layers=0"], 0),
])
def test_draft_layers_defaults(tmp_path, sets, layers):
    s = load(tmp_path, sets)
    assert s.draft_layers == layers
    assert s.geometry.bytes_per_token == (32 + layers) * LAYER_BYTES


@pytest.mark.parametrize(("drafts", "num_blocks"), [(0, 2048), (1, 1820), (2, 1638)])
def test_pool_blocks_are_vllms_with_the_drafts_layers(tmp_path, drafts, num_blocks):
    """vLLM's planner, measured (test_spec_driver.py::test_draft_kv_layers_share_the_targets_
    blocks): 8 layers of 8 KV heads of 128, bf16, blocks of 16, 1 GiB: the draft's layers in
    the target's group, num_blocks = budget // all layers' page bytes."""
    model = "model={layers: 8, kv_heads: 8, head_dim: 128}"
    s = load(tmp_path, [model, "max_model_len=4096", f"engine.speculative.draft_layers={drafts}"])
    paged = build_allocator(s, s.allocators[0])
    assert paged.num_blocks == num_blocks == (1 << 30) // ((8 + drafts) * 16 * LAYER_BYTES)


def test_llama_3_8b_pool_with_an_eagle_layer(tmp_path):
    s = load(tmp_path)
    paged = build_allocator(s, s.allocators[0])
    assert paged.num_blocks == (1 << 30) // ((32 + 1) * 16 * LAYER_BYTES) == 496


def test_mtp_layers_of_deepseek_v3_and_of_a_config_json(tmp_path):
    ds = load(tmp_path, ["model=deepseek-v3", "engine.speculative.method=mtp"])
    latent = (512 + 64) * 2  # one MLA layer's latent per token
    assert ds.draft_layers == 1 and ds.geometry.bytes_per_token == (61 + 1) * latent
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
              "head_dim": 64, "max_position_embeddings": 4096, "num_nextn_predict_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = load(tmp_path, ["model={hf_config: " + str(tmp_path / "config.json") + "}",
                         "engine.speculative.method=mtp"])
    assert hf.draft_layers == 2 and hf.geometry.bytes_per_token == (4 + 2) * 2 * 64 * 2 * 2
    eagle = load(tmp_path, ["model={hf_config: " + str(tmp_path / "config.json") + "}"])
    assert eagle.draft_layers == 1


def test_draft_layers_shard_with_tp_and_copy_a_layered_models_last_layer(tmp_path):
    tp = load(tmp_path, ["model=llama-3-70b", "tp=4", "max_model_len=8192"])
    assert tp.geometry.layers == 81 and tp.geometry.kv_heads == 2
    gemma = load(tmp_path, ["model=gemma-3-27b", "max_model_len=8192"])
    stack = gemma.kv_stack
    assert stack is not None and len(stack.layers) == len(gemma.stack.layers) + 1
    last = gemma.stack.attention_layers[-1]
    assert stack.layers[-1] == FullAttention(last.kv_heads, last.head_dim, last.dtype_bytes)
    paged = build_allocator(gemma, gemma.allocators[0])  # (its model view agrees on the bytes)
    assert paged.bytes_per_token == stack.full_bytes_per_token == gemma.geometry.bytes_per_token


DRAFT = ["engine.speculative.method=draft_model", "engine.speculative.draft_model=llama-3.2-1b"]


def test_a_named_draft_model_keeps_its_own_layers_and_its_weights_leave_the_budget(tmp_path):
    """llama-3.2-1b drafting for llama-3-8b: 16 layers of 8 KV heads of 64 (half the target's
    page a layer) join the bytes per token, as vLLM's planner adds every layer's page bytes;
    with tp 2 its KV heads split too. A budget derived from an H100's memory also leaves out
    the draft's 1.24 B parameters."""
    s = load(tmp_path, DRAFT)
    draft_layer = 2 * 8 * 64 * 2
    assert s.draft_layers == 16
    assert s.geometry.bytes_per_token == 32 * LAYER_BYTES + 16 * draft_layer
    paged = build_allocator(s, s.allocators[0])
    assert paged.num_blocks == (1 << 30) // (16 * (32 * LAYER_BYTES + 16 * draft_layer))
    tp = load(tmp_path, [*DRAFT, "model=llama-3-70b", "tp=2", "max_model_len=8192"])
    assert tp.geometry.bytes_per_token == 80 * 4 * 128 * 2 * 2 + 16 * 2 * 4 * 64 * 2
    gemma = load(tmp_path, [*DRAFT, "model=gemma-3-27b", "max_model_len=8192"])
    assert gemma.kv_stack.layers[-16:] == (FullAttention(8, 64, 2),) * 16
    gpu = ["kv_budget=null", "hardware=h100-80gb"]
    plain = load(tmp_path, gpu).budget_breakdown()
    with_draft = load(tmp_path, [*gpu, *DRAFT]).budget_breakdown()
    assert plain["draft_weights"] == 0
    assert with_draft["draft_weights"] == 2 * 1_235_814_400  # bf16
    assert with_draft["kv_budget"] == plain["kv_budget"] - with_draft["draft_weights"]


def table(**columns) -> pd.DataFrame:
    n = len(next(iter(columns.values())))
    base = {"request_id": np.arange(n), "arrival_s": np.zeros(n),
            "prompt_tokens": np.full(n, 10), "output_tokens": np.full(n, 5)}
    return pd.DataFrame({**base, **columns})


@pytest.mark.parametrize(("counts", "expected"), [
    ([[1, 2], [-1]], r"t\.csv: row 2, column accepted_drafts: \[-1\] holds a count that is not "
     r"a whole number >= 0"),
    ([[1], []], r"row 2, column accepted_drafts: \[\] is an empty list"),
    ([[1], "3"], r"row 2, column accepted_drafts: '3' is not a list"),
    ([[1.5], [1]], r"row 1, column accepted_drafts: \[1\.5\] holds a count"),
])
def test_the_column_is_validated_naming_file_and_row(counts, expected):
    with pytest.raises(WorkloadError, match=expected):
        validate_requests(table(accepted_drafts=pd.Series(counts, dtype=object)), "t.csv")
    good = table(accepted_drafts=pd.Series([[0, 3], [9]], dtype=object))
    assert validate_requests(good, "t.csv") is good  # (above k: the engine clips)


def test_the_column_is_read_from_traces_and_column_maps(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text('arrival_s,prompt_tokens,output_tokens,accepted_drafts\n'
                   '0,10,5,"[1, 2, 3]"\n1,10,5,"[0]"\n')
    assert load_trace(csv).requests["accepted_drafts"].tolist() == [[1, 2, 3], [0]]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"t": 0, "p": 3, "o": 4, "acc": [2, 0]}\n{"t": 1, "p": 3, "o": 4, '
                     '"acc": [1, -2]}\n')
    columns = {"arrival": "t", "prompt_tokens": "p", "output_tokens": "o",
               "accepted_drafts": "acc"}
    with pytest.raises(WorkloadError, match=r"t\.jsonl: line 2, column acc: \[1, -2\] is not a "
                       r"non-empty list of whole numbers >= 0"):
        load_trace(jsonl, "jsonl", columns, "s")
    kept = load_trace(jsonl, "jsonl", columns, "s", drop_bad_rows=True)
    assert kept.requests["accepted_drafts"].tolist() == [[2, 0]] and kept.dropped_rows == 1


def test_check_workload_needs_the_column_and_single_sequences(tmp_path):
    spec = load(tmp_path, COLUMN).engine.speculative
    with pytest.raises(WorkloadError, match=r"^w: engine\.speculative\.acceptance is column, but "
                       r"the request table has no accepted_drafts column"):
        check_workload(spec, table(n=np.ones(2, dtype=np.int64)), "w")
    with pytest.raises(WorkloadError, match=r"^w: row 2, column n: 3: speculative decoding with "
                       r"sample groups or beams"):
        check_workload(spec, table(n=np.array([1, 3]),
                                   accepted_drafts=pd.Series([[1], [1]], dtype=object)), "w")
    check_workload(spec, table(accepted_drafts=pd.Series([[1], [1]], dtype=object)), "w")
    rate = load(tmp_path).engine.speculative
    check_workload(rate, table(n=np.ones(2, dtype=np.int64)), "w")  # (a rate needs no column)


@pytest.mark.parametrize("kind", ["floor", "static-partition"])
def test_the_layouts_by_layer_type_refuse_speculative_decoding(tmp_path, kind):
    with pytest.raises(ScenarioError, match=f"allocator 'a': {kind} with engine.speculative is "
                                            "not modelled yet"):
        load(tmp_path, [f"allocators=[{{label: a, kind: {kind}}}]"])
