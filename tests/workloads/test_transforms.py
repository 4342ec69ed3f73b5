"""Transforms, the request-table validator and `build_workload` from scenario dicts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfrag.workloads import (
    ClosedLoopArrivals,
    FixedLengths,
    SyntheticSpec,
    Workload,
    WorkloadSpec,
    build_workload,
    first_n,
    limit_length,
    limit_parts,
    load_trace,
    sample_n,
    scale_rate,
    synthesize,
    tile,
    time_window,
    validate_requests,
    with_samples_per_prompt,
)
from kvfrag.workloads.table import WorkloadError
from pydantic import ValidationError


@pytest.fixture(scope="module")
def azure() -> Workload:
    return load_trace("sample:azure-conv")


@pytest.fixture(scope="module")
def mooncake() -> Workload:
    return load_trace("sample:mooncake-conv")


def test_first_n(azure: Workload) -> None:
    head = first_n(azure, 10)
    assert len(head.requests) == 10
    pd.testing.assert_frame_equal(head.requests, azure.requests.iloc[:10])
    everything = first_n(azure, 10_000)
    assert len(everything.requests) == 2000 and "only 2000" in everything.notes[-1]


def test_sample_n_keeps_order_and_rebases(azure: Workload) -> None:
    picked = sample_n(azure, 100, np.random.default_rng(0))
    df = picked.requests
    assert len(df) == 100 and df["request_id"].tolist() == list(range(100))
    assert df["arrival_s"].iloc[0] == 0.0 and df["arrival_s"].is_monotonic_increasing
    again = sample_n(azure, 100, np.random.default_rng(0)).requests
    pd.testing.assert_frame_equal(df, again)
    with pytest.raises(WorkloadError, match="cannot sample"):
        sample_n(azure, 5000, np.random.default_rng(0))


def test_time_window(azure: Workload) -> None:
    arrivals = azure.requests["arrival_s"]
    window = time_window(azure, 100.0, 200.0).requests
    inside = arrivals[(arrivals >= 100) & (arrivals < 200)]
    assert len(window) == len(inside)
    assert window["arrival_s"].iloc[0] == 0.0
    assert window["arrival_s"].iloc[-1] == pytest.approx(inside.iloc[-1] - inside.iloc[0])
    with pytest.raises(WorkloadError, match="no requests arrive"):
        time_window(azure, 10_000.0)


def test_scale_rate(azure: Workload) -> None:
    faster = scale_rate(azure, 4.0).requests
    assert faster["arrival_s"].iloc[-1] == pytest.approx(azure.requests["arrival_s"].iloc[-1] / 4)


def test_length_only_needs_arrivals() -> None:
    lengths = load_trace("sample:sharegpt-8k")
    with pytest.raises(WorkloadError, match="needs arrival times"):
        scale_rate(lengths, 2.0)


def test_limit_length_reject_and_clip(mooncake: Workload) -> None:
    total = mooncake.requests["prompt_tokens"] + mooncake.requests["output_tokens"]
    long = int((total > 32_768).sum())
    assert long > 0
    rejected = limit_length(mooncake, 32_768, "reject")
    assert rejected.rejected_long == long and len(rejected.requests) == 1000 - long
    clipped = limit_length(mooncake, 32_768, "clip")
    df = clipped.requests
    assert clipped.clipped == long and len(df) == 1000
    assert (df["prompt_tokens"] + df["output_tokens"] <= 32_768).all()
    assert all(len(h) <= -(-p // 512) for h, p in zip(df["hash_ids"], df["prompt_tokens"],
                                                      strict=True))
    assert limit_length(mooncake, 10**6) is mooncake


def test_tile_sequential_and_overlay(mooncake: Workload) -> None:
    base = mooncake.requests
    seq = tile(mooncake, 3).requests
    assert len(seq) == 3000 and seq["arrival_s"].is_monotonic_increasing
    period = 330.0 + 330.0 / 999
    assert seq["arrival_s"].iloc[1000] == pytest.approx(period)
    offset = 1 + max(max(h) for h in base["hash_ids"])
    assert seq["hash_ids"].iloc[1000] == [x + offset for x in base["hash_ids"].iloc[0]]
    assert seq.attrs["hash_block_tokens"] == 512
    overlay = tile(mooncake, 2, "overlay").requests
    assert len(overlay) == 2000
    assert overlay["arrival_s"].iloc[-1] == base["arrival_s"].iloc[-1]
    validate_requests(overlay, "overlay")


def test_samples_per_prompt(azure: Workload) -> None:
    df = with_samples_per_prompt(azure, 4).requests
    assert (df["n"] == 4).all() and list(df.columns)[-1] == "n"
    validate_requests(df, "n")


def test_closed_loop_refuses_arrival_transforms() -> None:
    spec = SyntheticSpec(count=20, prompt=FixedLengths(value=9), output=FixedLengths(value=9),
                         arrival=ClosedLoopArrivals(users=3, think_s=1.0))
    workload = synthesize(spec, np.random.default_rng(0))
    for transform in (lambda w: scale_rate(w, 2.0), lambda w: tile(w, 2),
                      lambda w: sample_n(w, 5, np.random.default_rng(0))):
        with pytest.raises(WorkloadError, match="closed-loop"):
            transform(workload)


def test_validator_rejects_contract_breaks(azure: Workload) -> None:
    df = azure.requests
    cases = {
        "NaN": df.assign(arrival_s=df["arrival_s"].where(df.index != 5)),
        "earlier than the previous": df.assign(arrival_s=df["arrival_s"][::-1].to_numpy()),
        "below 1": df.assign(output_tokens=0),
        "not in the order": df[["request_id", "prompt_tokens", "arrival_s", "output_tokens"]],
        "dtype": df.assign(prompt_tokens=df["prompt_tokens"].astype(float)),
        "unknown": df.assign(extra=1),
        "out of sequence": df.assign(request_id=df["request_id"] + 1),
        "empty": df.iloc[:0],
    }
    for match, bad in cases.items():
        with pytest.raises(WorkloadError, match=match):
            validate_requests(bad, "t")
    with pytest.raises(WorkloadError, match="t: row 6, column arrival_s"):
        validate_requests(cases["NaN"], "t")


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 5000), st.integers(1, 5000)), min_size=1, max_size=30),
    st.integers(2, 6000),
)
def test_clip_always_fits(lengths: list[tuple[int, int]], max_len: int) -> None:
    df = pd.DataFrame({
        "request_id": np.arange(len(lengths), dtype=np.int64),
        "arrival_s": np.zeros(len(lengths)),
        "prompt_tokens": np.array([p for p, _ in lengths], dtype=np.int64),
        "output_tokens": np.array([o for _, o in lengths], dtype=np.int64),
    })
    clipped = limit_length(Workload(df, "h"), max_len, "clip").requests
    assert (clipped["prompt_tokens"] + clipped["output_tokens"] <= max_len).all()
    validate_requests(clipped, "h")


def spec_of(text: str) -> WorkloadSpec:
    return WorkloadSpec.model_validate(yaml.safe_load(text))


def test_build_trace_with_transforms(tmp_path: Path) -> None:
    (tmp_path / "traces").mkdir()
    source = load_trace("sample:azure-code").requests
    source.to_csv(tmp_path / "traces" / "t.csv", index=False)
    spec = spec_of("""
trace: {path: traces/t.csv}
transforms: {window: {start_s: 100, end_s: 700}, sample_n: 300, rate_scale: 2.0,
             max_model_len: 4096, long_requests: clip}
n: 2
seed: 3
""")
    workload = build_workload(spec, tmp_path)
    df = workload.requests
    assert len(df) == 300 and (df["n"] == 2).all()
    assert (df["prompt_tokens"] + df["output_tokens"] <= 4096).all()
    assert workload.clipped > 0 and df["arrival_s"].iloc[-1] < 300
    pd.testing.assert_frame_equal(df, build_workload(spec, tmp_path).requests)
    smaller = build_workload(spec, tmp_path, max_model_len=2048).requests
    assert (smaller["prompt_tokens"] + smaller["output_tokens"] <= 2048).all()


def test_build_length_only_trace() -> None:
    spec = spec_of("trace: {path: 'sample:sharegpt-8k'}")
    with pytest.raises(WorkloadError, match="no arrival times"):
        build_workload(spec, Path("."))
    spec = spec_of("""
trace:
  path: sample:sharegpt-8k
  arrival: {kind: replay, path: sample:azure-conv}
transforms: {first_n: 500}
""")
    df = build_workload(spec, Path(".")).requests
    azure = load_trace("sample:azure-conv").requests
    assert df["arrival_s"].tolist() == azure["arrival_s"].iloc[:500].tolist()


def test_build_synthetic_closed_loop() -> None:
    spec = spec_of("""
synthetic:
  count: 100
  prompt: {kind: uniform, low: 100, high: 200}
  output: {kind: normal, mean: 50, std: 10}
  arrival: {kind: closed_loop, users: 8, think_s: 1.5, stagger_s: 2}
transforms: {first_n: 40, max_model_len: 230, long_requests: clip}
seed: 11
""")
    workload = build_workload(spec, Path("."))
    df = workload.requests
    assert len(df) == 40 and df["user_id"].nunique() == 8
    assert df["arrival_s"].notna().sum() == 8
    rng_given = build_workload(spec, Path("."), np.random.default_rng(11)).requests
    pd.testing.assert_frame_equal(df, rng_given)
    with pytest.raises(WorkloadError, match="rate_scale"):
        build_workload(spec.model_copy(update={"transforms": spec.transforms.model_copy(
            update={"rate_scale": 2.0})}), Path("."))


def test_build_synthetic_matches_synthesize() -> None:
    spec = spec_of("""
synthetic:
  count: 300
  prompt: {kind: lognormal, mean: 800, p99: 6000}
  output: {kind: zipf, a: 1.1, max: 2000}
  arrival: {kind: poisson, rate: 10}
seed: 5
""")
    built = build_workload(spec, Path(".")).requests
    direct = synthesize(spec.synthetic, np.random.default_rng(5)).requests
    pd.testing.assert_frame_equal(built, direct)


@pytest.mark.parametrize("text", [
    "seed: 1",
    "{trace: {path: a.csv}, synthetic: {count: 1, prompt: {kind: fixed, value: 1},"
    " output: {kind: fixed, value: 1}}}",
    "trace: {path: a.csv, colour: red}",
    "synthetic: {count: 5, prompt: {kind: weibull}, output: {kind: fixed, value: 1}}",
    "trace: {path: a.csv, arrival: {kind: poisson}}",
    "{trace: {path: a.csv}, transforms: {window: {start_s: 5, end_s: 1}}}",
])
def test_spec_rejects(text: str) -> None:
    with pytest.raises(ValidationError):
        spec_of(text)


def test_spec_is_frozen() -> None:
    spec = spec_of("trace: {path: a.csv}")
    with pytest.raises(ValidationError):
        spec.seed = 4  # type: ignore[misc]


def test_spec_docstring_example_builds() -> None:

    from kvfrag import workloads
    doc = workloads.spec.__doc__ or ""
    block = doc[doc.index("    workload:"):doc.index("Relative paths")]
    spec = WorkloadSpec.model_validate(yaml.safe_load(block)["workload"])
    workload = build_workload(spec, Path("."))
    assert len(workload.requests) == 2000
    assert (workload.requests["prompt_tokens"] + workload.requests["output_tokens"]
            <= 8192).all()


def test_limit_parts_rejects_or_clips_each_part(mooncake: Workload) -> None:
    df = mooncake.requests
    kept = limit_parts(mooncake, 4096, 300, "reject")
    over = (df["prompt_tokens"] > 4096) | (df["output_tokens"] > 300)
    assert kept.rejected_long == int(over.sum()) > 0
    assert len(kept.requests) == len(df) - kept.rejected_long
    assert (kept.requests["prompt_tokens"] <= 4096).all()
    assert (kept.requests["output_tokens"] <= 300).all()
    clipped = limit_parts(mooncake, 4096, None, "clip")
    c = clipped.requests
    assert clipped.clipped == int((df["prompt_tokens"] > 4096).sum())
    assert len(c) == len(df) and (c["prompt_tokens"] <= 4096).all()
    assert (c["output_tokens"] == df["output_tokens"]).all()
    block = df.attrs["hash_block_tokens"]
    assert all(len(h) <= -(-p // block) for h, p in zip(c["hash_ids"], c["prompt_tokens"],
                                                         strict=True))
    validate_requests(c, "clipped")
    assert limit_parts(mooncake, None, None) is mooncake


def test_vllm_benchmark_filter_on_sharegpt() -> None:
    """vLLM's benchmark keeps ShareGPT requests with prompt <= 1024 and prompt + output <= 2048."""
    spec = spec_of("""
trace:
  path: sample:sharegpt-8k
  arrival: {kind: poisson, rate: 2}
transforms: {max_prompt_tokens: 1024, max_model_len: 2048}
""")
    workload = build_workload(spec, Path("."))
    df = workload.requests
    assert (df["prompt_tokens"] <= 1024).all()
    assert (df["prompt_tokens"] + df["output_tokens"] <= 2048).all()
    assert workload.rejected_long == 2000 - len(df) > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_poisson_rate_is_the_rate_served(seed: int) -> None:
    """Arrivals are drawn for the requests that pass the length filters, so a filtered
    Poisson workload arrives at the scenario's rate (within sampling error)."""
    spec = spec_of(f"""
trace:
  path: sample:sharegpt-8k
  arrival: {{kind: poisson, rate: 2}}
transforms: {{max_model_len: 2048}}
seed: {seed}
""")
    workload = build_workload(spec, Path("."))
    arrivals = workload.requests["arrival_s"].to_numpy()
    n = len(arrivals)
    assert workload.rejected_long > 500  # about half of these long conversations are cut
    served = (n - 1) / (arrivals[-1] - arrivals[0])
    # n - 1 exponential gaps: the rate estimate's relative sd is about 1 / sqrt(n); 4 sd.
    assert abs(served - 2.0) < 2.0 * 4 / np.sqrt(n - 1)
