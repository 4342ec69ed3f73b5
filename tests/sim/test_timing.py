"""The engine's hardware step time (sim/timing.py): roofline tables, measured profiles, and
what the engine makes of them."""

from __future__ import annotations

import os
from itertools import pairwise, product
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kvfrag.sim.allocators import make_allocator
from kvfrag.sim.architecture import architecture
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig
from kvfrag.sim.hardware import gpu
from kvfrag.sim.reference import reference
from kvfrag.sim.steptime import (
    OPERATORS,
    StepModel,
    allreduce_time,
    efficiency_for,
    layer_ops,
    op_time,
    prefill_attention_time,
)
from kvfrag.sim.timing import OVERHEAD_S, TableTime, from_profile, read_profile, roofline

PROFILES = Path(__file__).resolve().parents[2].parent / "shared" / "profiles" / "vidur-compute"
LLAMA3_8B_A100 = PROFILES / "a100" / "meta-llama" / "Meta-Llama-3-8B" / "mlp.csv"
needs_profiles = pytest.mark.skipif(
    not LLAMA3_8B_A100.is_file(),
    reason=f"{PROFILES} is absent (Vidur's kernel times; see SOURCE.md)",
)

#: (model, gpu, tp) points the roofline is compared on: single GPU and tensor parallel, GQA
#: and MHA, fitted GPUs and ones with borrowed or conservative efficiencies.
SETUPS = [
    ("llama-3-8b", "h100-80gb", 1),
    ("llama-3-8b", "a100-80gb", 2),
    ("llama-2-7b", "a100-40gb", 1),
    ("llama-2-70b", "h100-80gb", 4),
    ("llama-3-70b", "h200", 2),
    ("opt-13b", "l40s", 2),
    ("qwen2.5-7b", "mi300x", 1),
]
MAX_TOKENS = 1024


def table(model: str, gpu_name: str, tp: int, max_tokens: int = MAX_TOKENS, **kw) -> TableTime:
    return roofline(architecture(model), gpu(gpu_name), tp, max_tokens, **kw)


# ------------------------------------------------------------------ roofline == StepModel
@pytest.mark.parametrize(("model", "gpu_name", "tp"), SETUPS)
def test_roofline_iteration_equals_the_step_model_plus_overhead(model, gpu_name, tp):
    t = table(model, gpu_name, tp)
    m = StepModel(architecture(model), gpu(gpu_name), tp)
    assert t.overhead_s == OVERHEAD_S
    assert t.source == f"roofline {gpu_name} tp={tp}"
    grid = product(
        [1, 2, 7, 64, 255, 1024],  # num_tokens (up to the table's end)
        [0, 1, 500, 123_456],  # KV tokens read (0: nobody decodes)
        [(), ((5, 0),), ((300, 17), (1, 4000))],  # prefill chunks (new tokens, context)
        [None, 0, 1],  # sampled positions (None: every token)
    )
    for n, kv, prefills, logits in grid:
        got = t.iteration_s(n, kv, prefills, logits)
        want = m.iteration_s(n, kv, prefills, logits) + OVERHEAD_S
        assert got == pytest.approx(want, rel=1e-9), (n, kv, prefills, logits)


@pytest.mark.parametrize(("model", "gpu_name", "tp"), SETUPS[:4])
def test_affine_matches_the_step_model_when_decoding_or_not(model, gpu_name, tp):
    """Like for like: the decode attention's fixed cost is in `base` exactly when decoding."""
    t = table(model, gpu_name, tp)
    m = StepModel(architecture(model), gpu(gpu_name), tp)
    for n, logits, decoding in product([1, 16, 300, 1024], [0, 1, 16], [True, False]):
        logits = min(logits, n)
        base, per_kv = t.affine(n, logits, decoding)
        want_base, want_per_kv = m.affine(n, logits, decoding)
        assert base == pytest.approx(want_base + OVERHEAD_S, rel=1e-9)
        assert per_kv == pytest.approx(want_per_kv, rel=1e-12)
    # decoding costs one attention kernel's fixed overhead per layer, nothing else
    a, eff = architecture(model), efficiency_for(gpu(gpu_name))
    gap = t.affine(64, 8, True)[0] - t.affine(64, 8, False)[0]
    assert gap == pytest.approx(a.layers * eff.attention_overhead_s, rel=1e-9)


def test_roofline_overhead_is_a_constant_shift():
    slow = table("llama-3-8b", "h100-80gb", 1, overhead_s=0.005)
    fast = table("llama-3-8b", "h100-80gb", 1, overhead_s=0.0)
    assert slow.overhead_s == 0.005
    for n in (1, 10, 1000):
        assert slow.iteration_s(n, 100) - fast.iteration_s(n, 100) == pytest.approx(0.005)


# ------------------------------------------------------------------ tables: shape
@pytest.mark.parametrize(("model", "gpu_name", "tp"), SETUPS)
def test_body_and_head_never_decrease(model, gpu_name, tp):
    t = table(model, gpu_name, tp, max_tokens=8192)
    assert len(t.body) == len(t.head) == 8193
    assert t.body[0] == 0.0 and t.head[0] == 0.0
    assert (np.diff(t.body) >= 0).all()
    assert (np.diff(t.head) >= 0).all()
    assert t.body[1] > 0 and t.head[1] > 0


@pytest.mark.parametrize(("model", "gpu_name", "tp"), SETUPS[:4])
def test_affine_past_the_table_extrapolates_linearly(model, gpu_name, tp):
    last = 256
    t = table(model, gpu_name, tp, max_tokens=last)
    body_slope = t.body[last] - t.body[last - 1]
    head_slope = t.head[last] - t.head[last - 1]
    assert body_slope > 0 and head_slope > 0
    for n in (last + 1, last + 2, 2 * last, 10 * last, 100_000):
        base = t.affine(n, 1, False)[0]
        want = t.affine(last, 1, False)[0] + (n - last) * body_slope
        assert base == pytest.approx(want, rel=1e-12)
        base = t.affine(1, n, False)[0]  # the head's table alike (num_logits past its end)
        want = t.affine(1, last, False)[0] + (n - last) * head_slope
        assert base == pytest.approx(want, rel=1e-12)
    # non-decreasing over the table and well past it
    bases = [t.affine(n, min(n, 8), True)[0] for n in range(0, 4 * last)]
    assert all(b <= c for b, c in pairwise(bases))
    bases = [t.affine(n, n, True)[0] for n in range(0, 4 * last)]
    assert all(b <= c for b, c in pairwise(bases))


def test_a_longer_table_agrees_where_both_are_defined():
    short = table("llama-3-8b", "h100-80gb", 2, max_tokens=128)
    long = table("llama-3-8b", "h100-80gb", 2, max_tokens=4096)
    np.testing.assert_allclose(long.body[:129], short.body, rtol=1e-12)
    np.testing.assert_allclose(long.head[:129], short.head, rtol=1e-12)


# ------------------------------------------------------------------ prefill attention
@pytest.mark.parametrize(("model", "gpu_name", "tp"), SETUPS)
def test_prefill_matches_steptime_and_grows_with_context(model, gpu_name, tp):
    a, g = architecture(model), gpu(gpu_name)
    t = table(model, gpu_name, tp)
    eff = efficiency_for(g)
    assert t.prefill_s(0, 0) == 0.0
    assert t.prefill_s(0, 5000) == 0.0
    for new, context in product([1, 7, 512, 8192], [0, 1, 100, 4096, 100_000]):
        want = prefill_attention_time(a, new, context, g, eff, tp)
        assert t.prefill_s(new, context) == pytest.approx(want, rel=1e-9), (new, context)
    for new in (1, 64, 2048):
        times = [t.prefill_s(new, c) for c in (0, 10, 1000, 10_000, 100_000)]
        assert all(x < y for x, y in pairwise(times))
    times = [t.prefill_s(n, 512) for n in (1, 10, 1000, 10_000)]
    assert all(x < y for x, y in pairwise(times))


# ------------------------------------------------------------------ measured profiles
def _comm_and_norm(model: str, gpu_name: str, tp: int, n: np.ndarray) -> np.ndarray:
    """The roofline's part of a profile's body: all-reduces and the final norm."""
    a, g = architecture(model), gpu(gpu_name)
    e = efficiency_for(g)
    comm = (2 * a.layers + 1) * allreduce_time(n * a.hidden * 2, tp, g, e)
    return comm + op_time(layer_ops(a, tp)["input_layernorm"], n, g, e)


@pytest.fixture(scope="module")
def vidur_llama3():
    """Medians of Vidur's llama-3-8b A100 file by (tp, num_tokens), in ms, read here by hand."""
    if not LLAMA3_8B_A100.is_file():
        pytest.skip(f"{LLAMA3_8B_A100} is absent (see SOURCE.md)")
    raw = pd.read_csv(LLAMA3_8B_A100)
    ops = ["emb", *OPERATORS]
    cols = {f"time_stats.{o}.median": o for o in ops}
    df = raw.rename(columns=cols | {"num_tensor_parallel_workers": "tp"})
    return df.groupby(["tp", "num_tokens"], as_index=False)[ops].median()


@needs_profiles
def test_profile_reproduces_the_measured_layers_at_every_knot(vidur_llama3):
    a, layers = architecture("llama-3-8b"), architecture("llama-3-8b").layers
    profile = read_profile(LLAMA3_8B_A100)
    assert sorted(profile.rows) == sorted(vidur_llama3["tp"].unique()) == [1, 2, 4, 8]
    top = int(vidur_llama3["num_tokens"].max())
    for tp, g in vidur_llama3.groupby("tp"):
        t = from_profile(profile, a, gpu("a100-80gb"), int(tp), top)
        assert t.source.startswith("profile ") and t.source.endswith(f"tp={tp}")
        assert "Meta-Llama-3-8B/mlp.csv" in t.source  # Vidur's file, named by its model
        n = np.arange(top + 1, dtype=float)
        measured_part = t.body - _comm_and_norm("llama-3-8b", "a100-80gb", int(tp), n)
        knots = g["num_tokens"].to_numpy(dtype=int)
        want = (g["emb"] + layers * g[list(OPERATORS)].sum(axis=1)).to_numpy() / 1e3
        np.testing.assert_allclose(measured_part[knots], want, rtol=1e-9)
        # between knots: between its neighbours (piecewise linear)
        for (k0, y0), (k1, y1) in pairwise(zip(knots, want, strict=True)):
            if k1 - k0 < 2:
                continue
            mid = measured_part[k0 + 1 : k1]
            lo, hi = min(y0, y1), max(y0, y1)
            assert (mid >= lo * (1 - 1e-12)).all() and (mid <= hi * (1 + 1e-12)).all()
            # (and on the straight line between them)
            x = np.arange(k0 + 1, k1)
            np.testing.assert_allclose(mid, y0 + (y1 - y0) * (x - k0) / (k1 - k0), rtol=1e-9)


@needs_profiles
def test_profile_time_is_close_to_the_fitted_roofline(vidur_llama3):
    """The roofline's efficiencies were fitted to these files: the two bodies agree within
    the fit's error where batches are decode-sized and prefill-sized."""
    a, g = architecture("llama-3-8b"), gpu("a100-80gb")
    measured = from_profile(read_profile(LLAMA3_8B_A100), a, g, 1, 4096)
    model = roofline(a, g, 1, 4096)
    for n in (1, 16, 256, 4096):
        assert measured.body[n] == pytest.approx(model.body[n], rel=0.25), n
    # attention and the LM head are the roofline's in both
    assert measured.head is not None
    np.testing.assert_allclose(measured.head, model.head, rtol=1e-12)
    assert measured.prefill_s(100, 1000) == model.prefill_s(100, 1000)
    assert measured.affine(8, 8, True)[1] == model.affine(8, 8, True)[1]


@needs_profiles
def test_profile_folder_and_file_read_the_same():
    by_file = read_profile(LLAMA3_8B_A100)
    by_folder = read_profile(LLAMA3_8B_A100.parent)
    assert by_folder.path == by_file.path
    for tp in by_file.rows:
        for x, y in zip(by_file.rows[tp], by_folder.rows[tp], strict=True):
            np.testing.assert_array_equal(x, y)


# ---------------------------------------------------------------- tiny profiles on disk
def _profile_frame(tokens=(1, 8, 64), tps=(1,), ms=1.0, **shape) -> pd.DataFrame:
    """A Vidur-layout table: every operator takes `ms` x num_tokens**0.5 (+ shape columns)."""
    rows = []
    for tp, n in product(tps, tokens):
        row = {"num_tokens": n, "num_tensor_parallel_workers": tp}
        for op in ("emb", *OPERATORS):
            row[f"time_stats.{op}.median"] = ms * n**0.5 / tp
            row[f"time_stats.{op}.mean"] = 99.0  # ignored: the median is read
        rows.append(row | shape)
    return pd.DataFrame(rows)


def _write(path: Path, df: pd.DataFrame) -> Path:
    df.to_csv(path, index=False)
    return path


def test_tiny_profile_round_trip(tmp_path):
    path = _write(tmp_path / "p.csv", _profile_frame(tps=(1, 2)))
    p = read_profile(path)
    assert sorted(p.rows) == [1, 2]
    tokens, emb, layer = p.rows[2]
    np.testing.assert_array_equal(tokens, [1, 8, 64])
    np.testing.assert_allclose(emb, np.sqrt([1, 8, 64]) / 2 / 1e3)  # ms -> s
    np.testing.assert_allclose(layer, len(OPERATORS) * np.sqrt([1, 8, 64]) / 2 / 1e3)
    a = architecture("llama-3-8b")
    t = from_profile(p, a, gpu("h100-80gb"), 1, 200, overhead_s=0.0)
    assert t.overhead_s == 0.0
    n = np.arange(201, dtype=float)
    part = t.body - _comm_and_norm("llama-3-8b", "h100-80gb", 1, n)
    per_n = (1 + a.layers * len(OPERATORS)) * np.sqrt([1, 8, 64]) / 1e3
    np.testing.assert_allclose(part[[1, 8, 64]], per_n, rtol=1e-9)
    # past the last knot: the last segment's slope
    slope = (per_n[2] - per_n[1]) / (64 - 8)
    np.testing.assert_allclose(part[64:], per_n[2] + slope * (n[64:] - 64), rtol=1e-9)
    assert t.body[0] == 0.0 and (np.diff(t.body) >= 0).all()


def test_repeated_rows_are_reduced_to_their_median(tmp_path):
    df = _profile_frame(tokens=(1, 8))
    extra = df.iloc[[1, 1]].copy()
    med = "time_stats.mlp_up_proj.median"
    extra[med] = [100.0, 200.0]  # rows for n=8: sqrt(8), 100 and 200 ms -> median 100
    path = _write(tmp_path / "mlp.csv", pd.concat([df, extra], ignore_index=True))
    _, _, layer = read_profile(path).rows[1]
    assert layer[1] == pytest.approx(((len(OPERATORS) - 1) * 8**0.5 + 100.0) / 1e3)


def test_a_folder_holding_mlp_csv_is_read(tmp_path):
    _write(tmp_path / "mlp.csv", _profile_frame())
    p = read_profile(tmp_path)
    assert p.path.name == "mlp.csv" and sorted(p.rows) == [1]


def test_a_missing_profile_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.csv"):
        read_profile(tmp_path / "nope.csv")
    with pytest.raises(FileNotFoundError, match=r"mlp\.csv"):
        read_profile(tmp_path)  # a folder without mlp.csv


def test_a_missing_column_is_named(tmp_path):
    df = _profile_frame().drop(columns=["time_stats.mlp_act.median"])
    path = _write(tmp_path / "p.csv", df)
    with pytest.raises(ValueError, match=r"missing column\(s\) time_stats\.mlp_act\.median"):
        read_profile(path)
    path = _write(tmp_path / "q.csv", _profile_frame().drop(columns=["num_tokens"]))
    with pytest.raises(ValueError, match="num_tokens"):
        read_profile(path)


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("time_stats.add.median", "fast"),
        ("time_stats.emb.median", ""),
        ("time_stats.attn_rope.median", -1.0),
        ("num_tokens", 0),
        ("num_tensor_parallel_workers", "two"),
    ],
)
def test_a_bad_value_names_its_data_row(tmp_path, column, value):
    df = _profile_frame(tokens=(1, 8, 64, 512)).astype({column: object})
    df.loc[2, column] = value
    path = _write(tmp_path / "p.csv", df)
    with pytest.raises(ValueError, match=r"p\.csv: data row 3: "):
        read_profile(path)


def test_a_tp_not_profiled_lists_those_that_are(tmp_path):
    p = read_profile(_write(tmp_path / "p.csv", _profile_frame(tps=(1, 2, 8))))
    a = architecture("llama-3-8b")
    with pytest.raises(ValueError, match=r"no rows for tp=4 \(profiled: 1, 2, 8\)"):
        from_profile(p, a, gpu("h100-80gb"), 4, 64)
    from_profile(p, a, gpu("h100-80gb"), 8, 64)  # profiled: fine


@pytest.mark.parametrize(
    ("column", "value", "attr"),
    [("n_embd", 5120, "hidden"), ("n_expanded_embd", 11008, "intermediate"),
     ("n_head", 40, "heads"), ("n_kv_head", 32, "kv_heads")],
)
def test_a_shape_mismatch_names_the_column(tmp_path, column, value, attr):
    shape = {"n_embd": 4096, "n_expanded_embd": 14336, "n_head": 32, "n_kv_head": 8}
    p = read_profile(_write(tmp_path / "p.csv", _profile_frame(**shape)))
    a = architecture("llama-3-8b")
    from_profile(p, a, gpu("h100-80gb"), 1, 64)  # the stated shape is llama-3-8b's
    bad = read_profile(_write(tmp_path / "bad.csv", _profile_frame(**(shape | {column: value}))))
    with pytest.raises(ValueError, match=rf"{column}={value}.*'llama-3-8b' has {attr}="):
        from_profile(bad, a, gpu("h100-80gb"), 1, 64)



def test_a_noisy_last_knot_does_not_flatten_the_extrapolation(tmp_path):
    """Linear work (1 us per token per operator) measured densely up to 4,096 tokens, the
    last point 1 % low (run-to-run noise): twice the tokens should still cost about twice."""
    df = _profile_frame(tokens=(1, 1024, 2048, 4000, 4032, 4064, 4096))
    for op in ("emb", *OPERATORS):
        col = f"time_stats.{op}.median"
        df[col] = df["num_tokens"] * 1e-3
        df.loc[df["num_tokens"] == 4096, col] = 4096e-3 * 0.99
    p = read_profile(_write(tmp_path / "p.csv", df))
    t = from_profile(p, architecture("llama-3-8b"), gpu("h100-80gb"), 1, 8192)
    n = np.arange(8193, dtype=float)
    part = t.body - _comm_and_norm("llama-3-8b", "h100-80gb", 1, n)
    assert part[8192] == pytest.approx(2 * part[4096], rel=0.2)


@needs_profiles
def test_a_vidur_profile_keeps_growing_past_its_last_knot():
    path = PROFILES / "h100" / "meta-llama" / "Llama-2-7b-hf" / "mlp.csv"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    a, g = architecture("llama-2-7b"), gpu("h100-80gb")
    p = read_profile(path)
    assert max(p.rows[1][0]) == 4096
    t = from_profile(p, a, g, 1, 8192)
    model = roofline(a, g, 1, 8192)
    assert t.body[4096] == pytest.approx(model.body[4096], rel=0.2)  # measured: agrees
    assert t.body[8192] == pytest.approx(model.body[8192], rel=0.2)  # past it: flat (0.49 x)


def test_a_profile_of_several_models_is_refused(tmp_path):
    df = _profile_frame(n_embd=4096)
    df.loc[1, "n_embd"] = 5120
    with pytest.raises(ValueError, match="n_embd takes several values"):
        read_profile(_write(tmp_path / "p.csv", df))


def test_a_changed_file_is_read_again(tmp_path):
    path = _write(tmp_path / "mlp.csv", _profile_frame(ms=1.0))
    first = read_profile(path)
    assert read_profile(path) is first  # unchanged: read once
    size = path.stat().st_size
    _write(path, _profile_frame(ms=2.0))  # same size, different figures
    assert path.stat().st_size == size
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = read_profile(path)
    assert second is not first
    np.testing.assert_allclose(second.rows[1][1], 2 * first.rows[1][1])


# ------------------------------------------------------------------ the engine with a table
def _one_request(prompt: int, output: int) -> pd.DataFrame:
    return pd.DataFrame(
        {"request_id": [0], "arrival_s": [0.0], "prompt_tokens": [prompt],
         "output_tokens": [output]}
    )


def _paged(model: str = "llama-3-8b", tokens: int = 4096):
    geo = architecture(model).kv_geometry()
    return make_allocator("paged", capacity=tokens * geo.bytes_per_token,
                          bytes_per_token=geo.bytes_per_token, max_model_len=2048,
                          block_size=16)


def _config(step: TableTime, **kw) -> EngineConfig:
    return EngineConfig(**({"max_num_seqs": 8, "max_num_batched_tokens": 512,
                            "chunked_prefill": True, "step_time": step} | kw))


@pytest.mark.parametrize(("prompt", "output"), [(10, 5), (10, 1), (100, 40)])
def test_engine_time_of_one_request_is_the_hand_sum(prompt, output):
    """Prefill: the token-wise work of the prompt, one sampled position, its attention. Each
    of the output - 1 decode steps reads the last sampled token into a new slot and attends
    over every slot held: P + 1, ..., P + O - 1 tokens (slot_request's convention)."""
    t = table("llama-3-8b", "h100-80gb", 1)
    res = run(_one_request(prompt, output), _paged(), _config(t))
    prefill = t.affine(prompt, 1, False)[0] + t.prefill_s(prompt, 0)
    base, per_kv = t.affine(1, 1, True)
    decode = sum(base + per_kv * (prompt + k) for k in range(1, output))
    s = res.summary
    assert s["completed"] == 1
    assert s["sim_time_s"] == pytest.approx(prefill + decode, rel=1e-12)
    row = res.requests.iloc[0]
    assert row["ttft_s"] == pytest.approx(prefill, rel=1e-12)
    assert row["finished_s"] == pytest.approx(prefill + decode, rel=1e-12)
    if output > 1:
        assert row["tpot_s"] == pytest.approx(decode / (output - 1), rel=1e-12)


def test_engine_time_of_a_chunked_prompt_is_the_hand_sum():
    """A prompt over the token budget is prefilled in chunks; each chunk's attention reads
    the chunks before it, and only the last chunk samples a token."""
    t = table("llama-3-8b", "a100-80gb", 2)
    budget, prompt, output = 64, 150, 3
    res = run(_one_request(prompt, output), _paged(),
              _config(t, max_num_batched_tokens=budget))
    chunks = [(64, 0), (64, 64), (22, 128)]
    prefill = sum(
        t.affine(c, 1 if ctx + c == prompt else 0, False)[0] + t.prefill_s(c, ctx)
        for c, ctx in chunks
    )
    base, per_kv = t.affine(1, 1, True)
    decode = sum(base + per_kv * (prompt + k) for k in range(1, output))
    assert res.summary["sim_time_s"] == pytest.approx(prefill + decode, rel=1e-12)
    assert res.requests.iloc[0]["ttft_s"] == pytest.approx(prefill, rel=1e-12)


def test_engine_with_a_table_matches_the_reference_stepper():
    rng = np.random.default_rng(3)
    n = 12
    wl = pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.sort(rng.uniform(0, 0.3, n)).round(4),
            "prompt_tokens": rng.integers(5, 300, n),
            "output_tokens": rng.integers(1, 120, n),
        }
    )
    t = table("llama-3-8b", "h100-80gb", 1, max_tokens=256)
    cfg = _config(t, max_num_batched_tokens=256, max_num_seqs=6)
    fast = run(wl, _paged(tokens=1200), cfg)
    slow = reference(wl, _paged(tokens=1200), cfg)
    assert fast.summary["completed"] == n
    assert fast.summary["sim_time_s"] == pytest.approx(slow["time"], rel=1e-9)
    for rid, r in slow["requests"].items():
        got = fast.requests.set_index("request_id").loc[rid]
        assert got["finished_s"] == pytest.approx(r["finished"], rel=1e-9)
        assert got["first_token_s"] == pytest.approx(r["first"], rel=1e-9)
