"""The KV budget derived from the hardware (sim/memory.py), vLLM's way."""

from __future__ import annotations

from itertools import pairwise, product

import pytest
from kvfrag.sim.architecture import architecture
from kvfrag.sim.hardware import batch_defaults, gpu
from kvfrag.sim.memory import NON_TORCH_BYTES, activation_peak_bytes, kv_budget

GIB = 2**30

SETUPS = [
    ("llama-3-8b", "h100-80gb", 1),
    ("llama-3-8b", "a100-80gb", 2),
    ("opt-13b", "a100-40gb", 1),
    ("llama-2-70b", "h100-80gb", 4),
    ("llama-3-70b", "h200", 2),
    ("qwen2.5-72b", "mi300x", 1),
]


@pytest.mark.parametrize(("model", "gpu_name", "tp"), SETUPS)
def test_budget_terms_add_up(model, gpu_name, tp):
    g, a = gpu(gpu_name), architecture(model)
    seqs, tokens = batch_defaults(g)
    parts = kv_budget(g, a, tp, 0.9, tokens, seqs)
    assert set(parts) == {"usable", "weights", "draft_weights", "activations", "non_torch",
                          "kv_budget"}
    assert parts["draft_weights"] == 0
    assert all(isinstance(v, int) for v in parts.values())
    assert parts["usable"] == int(g.memory_bytes * 0.9)
    assert parts["non_torch"] == NON_TORCH_BYTES
    assert parts["activations"] == activation_peak_bytes(a, tp, tokens, seqs)
    assert (
        parts["usable"] - parts["weights"] - parts["activations"] - parts["non_torch"]
        == parts["kv_budget"]
    )
    assert 0 < parts["kv_budget"] < parts["usable"]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_weights_split_tp_ways_rounding_up(tp):
    a = architecture("llama-2-70b")
    parts = kv_budget(gpu("mi300x"), a, tp, 0.9, 2048, 256)
    assert parts["weights"] == -(-a.weight_bytes() // tp)
    assert parts["weights"] * tp >= a.weight_bytes() > (parts["weights"] - 1) * tp
    one_byte = kv_budget(gpu("mi300x"), a, tp, 0.9, 2048, 256, dtype_bytes=1)
    assert one_byte["weights"] == -(-a.params() // tp)


def test_weights_round_up_when_tp_does_not_divide_them():
    a = architecture("llama-3-8b")
    assert a.weight_bytes() % 3 == 2  # (8,030,261,248 params x 2 bytes)
    # (heads 32 are not split 3 ways, but memory.kv_budget does not check tp: it only divides)
    assert kv_budget(gpu("h100-80gb"), a, 3, 0.9, 2048, 256)["weights"] == (
        a.weight_bytes() // 3 + 1
    )


@pytest.mark.parametrize("model", ["llama-3-8b", "opt-13b", "llama-2-70b"])
def test_activation_peak_grows_with_tokens_and_sequences(model):
    a = architecture(model)
    by_tokens = [activation_peak_bytes(a, 1, n, 256) for n in (1, 512, 2048, 8192, 16384)]
    assert all(x < y for x, y in pairwise(by_tokens))
    by_seqs = [activation_peak_bytes(a, 1, 2048, s) for s in (1, 64, 256, 1024)]
    assert all(x < y for x, y in pairwise(by_seqs))
    # the sampler's logits and probabilities: fp32, two per sequence over the vocabulary
    step = activation_peak_bytes(a, 1, 2048, 257) - activation_peak_bytes(a, 1, 2048, 256)
    assert step == 2 * a.vocab * 4
    # a larger budget spends more on activations, so leaves less for the KV cache
    g = gpu("h200")
    small = kv_budget(g, a, 8, 0.9, 2048, 256)["kv_budget"]
    large = kv_budget(g, a, 8, 0.9, 16384, 1024)["kv_budget"]
    assert large < small


@pytest.mark.parametrize("model", ["llama-3-8b", "opt-13b", "llama-2-70b"])
def test_tp_shrinks_the_activations(model):
    a = architecture(model)
    peaks = [activation_peak_bytes(a, tp, 8192, 256) for tp in (1, 2, 4, 8)]
    assert all(x > y for x, y in pairwise(peaks))
    # the hidden states and residual stay whole on every GPU: never below them
    hidden = 2 * 8192 * a.hidden * 2
    assert all(p > hidden for p in peaks)


@pytest.mark.parametrize(
    ("tokens", "seqs", "dtype_bytes"), list(product([1, 2048, 8192], [1, 256], [1, 2, 4]))
)
def test_activation_peak_is_linear_in_its_batch(tokens, seqs, dtype_bytes):
    a = architecture("llama-3-8b")
    layer = activation_peak_bytes(a, 2, tokens, seqs, dtype_bytes) - 2 * seqs * a.vocab * 4
    assert layer > 0
    per_token = layer / tokens
    assert per_token == pytest.approx(
        (activation_peak_bytes(a, 2, 2 * tokens, seqs, dtype_bytes) - 2 * seqs * a.vocab * 4)
        / (2 * tokens)
    )


def test_utilization_moves_only_the_usable_part():
    g, a = gpu("a100-80gb"), architecture("llama-3-8b")
    lo, hi = kv_budget(g, a, 1, 0.8, 2048, 256), kv_budget(g, a, 1, 0.95, 2048, 256)
    assert hi["kv_budget"] - lo["kv_budget"] == hi["usable"] - lo["usable"]
    assert hi["weights"] == lo["weights"] and hi["activations"] == lo["activations"]


def test_opt13b_on_a100_40gb_is_near_the_paged_attention_paper():
    """vLLM's batch defaults for a 40 GB card, utilization 0.9: the PagedAttention paper
    reports about 12 GB of KV cache for OPT-13B on one A100-40GB; our estimate (a fixed GiB of
    non-torch memory, the data sheet's capacity) lands a little under it."""
    g, a = gpu("a100-40gb"), architecture("opt-13b")
    seqs, tokens = batch_defaults(g)
    assert (seqs, tokens) == (256, 2048)
    parts = kv_budget(g, a, 1, 0.9, tokens, seqs)
    assert 9 * GIB <= parts["kv_budget"] <= 12 * GIB
    assert parts["weights"] == pytest.approx(2 * 12.85e9, rel=0.01)


def test_a_model_that_does_not_fit_names_model_and_gpu():
    with pytest.raises(ValueError, match=r"llama-2-70b on 1 x l40s leaves .* raise tp"):
        kv_budget(gpu("l40s"), architecture("llama-2-70b"), 1, 0.9, 2048, 256)
    # split 4 ways it fits
    assert kv_budget(gpu("l40s"), architecture("llama-2-70b"), 4, 0.9, 2048, 256)["kv_budget"] > 0


def test_a_budget_exactly_used_up_is_refused():
    g, a = gpu("h100-80gb"), architecture("llama-3-8b")
    parts = kv_budget(g, a, 1, 1.0, 2048, 256)
    # a utilization that leaves nothing (or less) for the KV cache
    util = (parts["weights"] + parts["activations"] + parts["non_torch"]) / g.memory_bytes
    with pytest.raises(ValueError, match="llama-3-8b on 1 x h100-80gb"):
        kv_budget(g, a, 1, util * 0.999, 2048, 256)
