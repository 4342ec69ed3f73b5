"""Step time from the hardware: architecture presets, the roofline model, its calibration."""

from __future__ import annotations

import dataclasses
from itertools import pairwise
from pathlib import Path

import pytest
from kvfrag.sim.architecture import PRESETS as ARCHITECTURES
from kvfrag.sim.architecture import Architecture, architecture
from kvfrag.sim.geometry import PRESETS as GEOMETRIES
from kvfrag.sim.hardware import GPU, gpu
from kvfrag.sim.steptime import (
    FIT_FIELDS,
    FITTED,
    OPERATORS,
    StepModel,
    TokenwiseModel,
    allreduce_time,
    cross_validate,
    decode_attention_time,
    efficiency_for,
    embedding_op,
    fit,
    kv_bytes_per_token,
    layer_ops,
    layer_shape,
    load_vidur_profiles,
    op_time,
    prefill_attention_time,
)

PROFILES = Path(__file__).resolve().parents[2].parent / "shared" / "profiles" / "vidur-compute"
needs_profiles = pytest.mark.skipif(
    not PROFILES.is_dir(), reason=f"{PROFILES} is absent (Vidur's kernel times; see SOURCE.md)"
)


# ------------------------------------------------------------------ architecture presets
@pytest.mark.parametrize(
    ("name", "published"),
    [
        # Hugging Face hub parameter counts (safetensors) or the model card's figure
        ("llama-2-7b", 6.74e9),
        ("llama-2-13b", 13.02e9),
        ("llama-2-70b", 68.98e9),
        ("llama-3-8b", 8.03e9),
        ("llama-3-70b", 70.55e9),
        ("llama-3.2-1b", 1.24e9),  # model card: 1.24B (1,235,814,400 in safetensors)
        ("mistral-7b", 7.24e9),
        ("opt-13b", 12.85e9),
        ("opt-66b", 66e9),  # the OPT paper's nominal size (65.7e9 counted)
        ("opt-175b", 175e9),  # ditto (174.6e9 counted)
        ("qwen2.5-7b", 7.61e9),  # model card: 7.61B
        ("qwen2.5-72b", 72.7e9),  # model card: 72.7B
        ("codellama-34b", 33.7e9),
        ("qwen-72b", 72e9),  # model card's nominal size (72.3e9 counted)
    ],
)
def test_parameter_count_matches_the_published_one(name, published):
    a = architecture(name)
    assert a.name == name
    assert a.params() == pytest.approx(published, rel=0.01)
    assert a.weight_bytes() == 2 * a.params()
    assert a.weight_bytes(dtype_bytes=1) == a.params()


def test_exact_llama_counts():
    # exact counts of the safetensors shards
    assert architecture("llama-2-7b").params() == 6_738_415_616
    assert architecture("llama-3-8b").params() == 8_030_261_248
    assert architecture("llama-2-70b").params() == 68_976_648_192


def test_every_architecture_preset_is_pinned():
    assert set(ARCHITECTURES) == set(GEOMETRIES) | {"codellama-34b", "qwen-72b"}


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_kv_geometry_matches_the_kv_preset(name):
    derived, kv = architecture(name).kv_geometry(), GEOMETRIES[name]
    assert (derived.layers, derived.kv_heads, derived.head_dim) == (
        kv.layers, kv.kv_heads, kv.head_dim,
    )
    assert derived.bytes_per_token == kv.bytes_per_token


def test_flops_per_token():
    a = architecture("llama-3-8b")
    per_layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    assert a.layer_matmul_params() == per_layer
    assert a.flops_per_token(lm_head=False) == 2 * 32 * per_layer
    assert a.flops_per_token() == 2 * 32 * per_layer + 2 * 128256 * 4096
    # ~2 FLOPs per parameter, less the embedding (a lookup, not a multiply)
    assert a.flops_per_token() == pytest.approx(2 * (a.params() - 128256 * 4096), rel=1e-3)


def test_attention_flops_are_causal():
    a = architecture("llama-2-7b")
    unit = 4 * a.layers * a.heads * a.head_dim
    assert a.attention_flops(1, 99) == unit * 100  # a decode token sees 100 keys
    assert a.attention_flops(4, 0) == unit * (1 + 2 + 3 + 4)
    assert a.attention_flops(4, 10) == unit * (4 * 10 + 10)


def test_architecture_errors():
    with pytest.raises(ValueError, match=r"unknown model architecture 'gpt-5'.*llama-2-7b"):
        architecture("gpt-5")
    with pytest.raises(ValueError, match="kv_heads"):
        Architecture("bad", 4096, 11008, 32, 32, 5, 128, 32000, gated_mlp=True)
    with pytest.raises(ValueError, match="layers must be a positive integer"):
        Architecture("bad", 4096, 11008, 0, 32, 32, 128, 32000, gated_mlp=True)


# ------------------------------------------------------------------ the roofline model
A100, H100 = gpu("a100-80gb"), gpu("h100-80gb")
LLAMA3_8B = architecture("llama-3-8b")


def test_memory_bound_at_one_token():
    # Vidur, A100: Llama-3-8B's mlp_up_proj at 1 token takes 0.142 ms (its 235 MB of weights)
    eff = efficiency_for(A100)
    op = layer_ops(LLAMA3_8B, 1)["mlp_up_proj"]
    t = TokenwiseModel(LLAMA3_8B, A100).layer_times(1)["mlp_up_proj"]
    assert t == pytest.approx(0.142e-3, rel=0.2)
    mem = op.weight_elems * 2 / (A100.hbm_bandwidth_bytes_s * eff.gemm_mem)
    compute = op.flops_per_token / (A100.fp16_dense_flops * eff.gemm_flops)
    assert mem > 100 * compute


def test_compute_bound_at_32768_tokens():
    # Vidur, A100: the same operator at 32,768 tokens takes 33.35 ms (~74 % of the peak)
    eff = efficiency_for(A100)
    op = layer_ops(LLAMA3_8B, 1)["mlp_up_proj"]
    t = TokenwiseModel(LLAMA3_8B, A100).layer_times(32768)["mlp_up_proj"]
    assert t == pytest.approx(33.35e-3, rel=0.1)
    n = 32768
    mem = (op.weight_elems + n * op.act_elems_per_token) * 2 / (
        A100.hbm_bandwidth_bytes_s * eff.gemm_mem
    )
    compute = n * op.flops_per_token / (A100.fp16_dense_flops * eff.gemm_flops)
    assert compute > 10 * mem


TOKENS = [1, 2, 7, 8, 16, 63, 64, 100, 128, 255, 256, 512, 1000, 1024, 4096, 8192, 32768]


@pytest.mark.parametrize("gpu_name", ["a100-80gb", "h100-80gb", "l40s", "mi300x"])
@pytest.mark.parametrize("model", ["llama-3-8b", "llama-2-70b", "opt-13b", "qwen2.5-7b"])
def test_more_tokens_are_never_faster(gpu_name, model):
    m = TokenwiseModel(architecture(model), gpu(gpu_name))
    tps = [tp for tp in (1, 2, 4, 8) if architecture(model).heads % tp == 0]
    for tp in tps:
        times = [m.time(n, tp) for n in TOKENS]
        assert all(b >= a for a, b in pairwise(times)), (tp, times)
        per_op = [m.layer_times(n, tp) for n in TOKENS]
        for name in OPERATORS:
            ts = [p[name] for p in per_op]
            assert all(b >= a for a, b in pairwise(ts)), name


@pytest.mark.parametrize("gpu_name", ["a100-80gb", "h100-80gb", "mi300x", "l40s"])
@pytest.mark.parametrize("model", ["llama-3-8b", "llama-2-70b", "opt-66b"])
def test_more_gpus_never_slow_a_layer_down(gpu_name, model):
    """Per GPU, sharding only shrinks each operator (the replicated norms stay the same)."""
    m = TokenwiseModel(architecture(model), gpu(gpu_name))
    for n in TOKENS:
        layer = [m.layer_time(n, tp) for tp in (1, 2, 4, 8)]
        assert all(b <= a for a, b in pairwise(layer)), (n, layer)


@pytest.mark.parametrize("gpu_name", ["a100-80gb", "h100-80gb", "mi300x"])
@pytest.mark.parametrize("model", ["llama-3-8b", "llama-3-70b", "opt-175b"])
def test_with_nvlink_more_gpus_are_faster_for_large_batches(gpu_name, model):
    # all-reduces included: over NVLink / Infinity Fabric they never eat the gain
    m = TokenwiseModel(architecture(model), gpu(gpu_name))
    for n in (4096, 32768):
        t = [m.time(n, tp) for tp in (1, 2, 4, 8)]
        assert all(b < a for a, b in pairwise(t)), (n, t)


def test_tokenwise_time_parts():
    m = TokenwiseModel(LLAMA3_8B, A100)
    assert m.time(0) == 0.0
    # the LM head runs on sampled positions only: a 4,096-token prefill samples 1
    assert m.time(4096, num_logits=1) < m.time(4096)
    assert m.time(4096) - m.time(4096, num_logits=1) > 1e-3
    with pytest.raises(ValueError, match="num_logits"):
        m.time(8, num_logits=9)
    with pytest.raises(ValueError, match="num_tokens"):
        m.time(-1)
    with pytest.raises(ValueError, match="tp=3 must divide heads"):
        m.time(8, tp=3)
    # the whole step at one token is about the weights read once at the fitted bandwidth
    weights = LLAMA3_8B.weight_bytes() - 128256 * 4096 * 2  # the embedding is a lookup
    floor = weights / (A100.hbm_bandwidth_bytes_s * FITTED["a100-80gb"].gemm_mem)
    assert floor < m.time(1) < 1.2 * floor


def test_allreduce():
    eff = efficiency_for(A100)
    assert allreduce_time(1e9, 1, A100, eff) == 0.0
    two, eight = allreduce_time(1e9, 2, A100, eff), allreduce_time(1e9, 8, A100, eff)
    assert 0 < two < eight  # 2 (tp-1)/tp of the buffer crosses each GPU's link
    one_way = 600e9 / 2 * eff.interconnect
    assert two == pytest.approx(1e9 / one_way + eff.allreduce_latency_s)


# ------------------------------------------------------------------ attention, affine form
def test_kv_bytes_per_token_per_gpu():
    assert kv_bytes_per_token(LLAMA3_8B) == GEOMETRIES["llama-3-8b"].bytes_per_token
    assert kv_bytes_per_token(LLAMA3_8B, 2) == GEOMETRIES["llama-3-8b"].bytes_per_token / 2
    # 8 KV heads over 16 GPUs: replicated, one head each, like tp = 8
    assert kv_bytes_per_token(LLAMA3_8B, 16) == kv_bytes_per_token(LLAMA3_8B, 8)


def test_decode_attention_is_affine_in_kv_bytes():
    eff = efficiency_for(H100)
    t0 = decode_attention_time(0, H100, eff, layers=32)
    t1 = decode_attention_time(1e9, H100, eff, layers=32)
    t2 = decode_attention_time(2e9, H100, eff, layers=32)
    assert t0 == pytest.approx(32 * eff.attention_overhead_s)
    assert t2 - t1 == pytest.approx(t1 - t0)
    assert t1 - t0 == pytest.approx(1e9 / (H100.hbm_bandwidth_bytes_s * eff.attention_mem))


def test_prefill_attention():
    eff = efficiency_for(A100)
    f = lambda c, p: prefill_attention_time(LLAMA3_8B, c, p, A100, eff)  # noqa: E731
    assert f(0, 1000) == 0.0
    assert f(512, 0) < f(1024, 0) < f(1024, 4096)
    # a long chunk is compute-bound: its FLOPs over the assumed efficiency
    flops = LLAMA3_8B.attention_flops(8192, 0)
    assert f(8192, 0) == pytest.approx(
        32 * eff.attention_overhead_s + flops / (A100.fp16_dense_flops * eff.attention_flops)
    )
    assert prefill_attention_time(LLAMA3_8B, 8192, 0, A100, eff, tp=2) < f(8192, 0)


def test_step_model_is_affine_in_kv_tokens_read():
    s = StepModel(architecture("llama-2-70b"), H100, tp=4)
    base, per_kv = s.affine(64)
    assert per_kv == pytest.approx(
        kv_bytes_per_token(s.arch, 4) / (H100.hbm_bandwidth_bytes_s * s.eff.attention_mem)
    )
    for kv in (1, 1000, 123_456):
        assert s.iteration_s(64, kv) == pytest.approx(base + per_kv * kv)
    # a decode-only stretch: 64 sequences, KV read grows by 64 per iteration; closed form
    n, kv0 = 50, 64 * 900
    stepwise = sum(s.iteration_s(64, kv0 + 64 * i) for i in range(n))
    w0, w1 = base + per_kv * kv0, per_kv * 64
    assert stepwise == pytest.approx(n * w0 + w1 * n * (n - 1) / 2)
    # a prefill chunk adds its own attention on top
    mixed = s.iteration_s(64 + 512, 1000, prefills=[(512, 0)], num_logits=65)
    assert mixed == pytest.approx(
        s.affine(576, num_logits=65)[0] + per_kv * 1000 + s.prefill_attention_s(512, 0)
    )


# ------------------------------------------------------------------ efficiencies
def test_every_gpu_preset_has_efficiencies():
    assert efficiency_for(gpu("a100-40gb")) is FITTED["a100-80gb"]
    assert efficiency_for(gpu("h200")) is FITTED["h100-80gb"]
    for name in ("l40s", "mi300x"):
        e = efficiency_for(gpu(name))
        for field in ("gemm_mem", "gemm_flops", "elementwise_mem", "embedding_mem"):
            assert getattr(e, field) == min(getattr(f, field) for f in FITTED.values())
        assert e.gemm_overhead_s == max(f.gemm_overhead_s for f in FITTED.values())
    custom = GPU("mine", 24 * 2**30, 1e12, 100e12, 64e9)
    assert efficiency_for(custom) == efficiency_for(gpu("l40s"))


def test_efficiency_validation():
    ok = FITTED["a100-80gb"]
    with pytest.raises(ValueError, match=r"gemm_mem must be in \(0, 1\]"):
        dataclasses.replace(ok, gemm_mem=1.2)
    with pytest.raises(ValueError, match="gemm_overhead_s must be finite and >= 0"):
        dataclasses.replace(ok, gemm_overhead_s=-1e-6)
    with pytest.raises(ValueError, match="gemm_sharpness must be >= 1"):
        dataclasses.replace(ok, gemm_sharpness=0.5)
    hard = dataclasses.replace(ok, gemm_sharpness=float("inf"))  # a hard max
    op = layer_ops(LLAMA3_8B)["mlp_up_proj"]
    assert op_time(op, 256, A100, hard) < op_time(op, 256, A100, ok)


# ------------------------------------------------------------------ calibration (../shared)
@pytest.fixture(scope="module")
def profiles():
    return load_vidur_profiles(PROFILES)


@pytest.fixture(scope="module")
def validation(profiles):
    return cross_validate(profiles)


@needs_profiles
def test_profiles_load_and_match_the_presets(profiles):
    assert set(profiles.gpu) == {"a100-80gb", "h100-80gb"}
    assert len(profiles.groupby(["gpu", "model"])) == 10
    assert not profiles.duplicated(["gpu", "model", "num_tokens", "tp"]).any()
    row = profiles[
        (profiles.gpu == "a100-80gb") & (profiles.model == "llama-3-8b")
        & (profiles.num_tokens == 1) & (profiles.tp == 1)
    ]
    assert row["mlp_up_proj"].item() == pytest.approx(0.142e-3, rel=0.01)  # seconds


def test_models_with_one_layer_shape_are_held_out_together():
    assert layer_shape(architecture("llama-2-70b")) == layer_shape(architecture("llama-3-70b"))
    assert layer_shape(architecture("llama-2-70b")) != layer_shape(architecture("codellama-34b"))


@needs_profiles
def test_held_out_error_meets_the_targets(validation):
    """Leave-one-model-out: every point predicted by a fit that never saw its layer shape."""
    assert validation["heldout_pred"].notna().all()
    err = validation["heldout_err"]
    assert err.median() <= 0.10
    assert err.quantile(0.9) <= 0.20
    for _, g in validation.groupby(["gpu", "model"]):  # no model is badly off on its own
        assert g["heldout_err"].median() <= 0.10


@needs_profiles
def test_shipped_constants_match_a_fresh_fit(profiles):
    for name, g in profiles.groupby("gpu"):
        fresh = fit(g, gpu(name))
        for fields in FIT_FIELDS.values():
            for field in fields:
                assert getattr(fresh, field) == pytest.approx(
                    getattr(FITTED[name], field), rel=0.01
                ), (name, field)


@needs_profiles
def test_fit_recovers_known_efficiencies(profiles):
    """Fit to times the model itself generated: the fitter finds the generating values."""
    truth = dataclasses.replace(
        FITTED["a100-80gb"], gemm_mem=0.7, gemm_flops=0.6, gemm_overhead_s=8e-6,
        gemm_sharpness=2.0, elementwise_mem=0.4, embedding_mem=0.25,
    )
    sub = profiles[(profiles.gpu == "a100-80gb") & (profiles.model == "llama-2-7b")].copy()
    a = architecture("llama-2-7b")
    for tp, rows in sub.groupby("tp"):
        n = rows["num_tokens"].to_numpy(dtype=float)
        for name, op in {"emb": embedding_op(a, tp), **layer_ops(a, tp)}.items():
            sub.loc[rows.index, name] = op_time(op, n, A100, truth)
    got = fit(sub, A100)
    for fields in FIT_FIELDS.values():
        for field in fields:
            assert getattr(got, field) == pytest.approx(getattr(truth, field), rel=0.03), field
