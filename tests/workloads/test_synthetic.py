"""Synthetic generators: requested means within sampling error, correlation, arrival processes,
and reproducibility (same seed, same table)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from kvfrag.workloads import (
    AtOnceArrivals,
    ClosedLoopArrivals,
    ConstantArrivals,
    EmpiricalLengths,
    ExponentialLengths,
    FixedLengths,
    GammaArrivals,
    LognormalLengths,
    NormalLengths,
    PoissonArrivals,
    ReplayArrivals,
    SyntheticSpec,
    UniformLengths,
    ZipfLengths,
    load_trace,
    sample_arrivals,
    sample_lengths,
    synthesize,
    validate_requests,
)
from pydantic import ValidationError

N = 40_000


def within(values: np.ndarray, mean: float, sd: float, k: float = 5.0) -> bool:
    """The sample mean is within k standard errors of `mean` (sd: the distribution's sd)."""
    return abs(values.mean() - mean) <= k * sd / math.sqrt(len(values)) + 0.5


@pytest.mark.parametrize(("dist", "mean", "sd"), [
    (UniformLengths(low=10, high=1000), 505.0, math.sqrt((991**2 - 1) / 12)),
    (NormalLengths(mean=800, std=100), 800.0, 100.0),
    (LognormalLengths(mean=1000, sigma=1.0), 1000.0, 1000 * math.sqrt(math.e - 1)),
    (ExponentialLengths(mean=300), 300.0, 300.0),
])
def test_length_means(dist: object, mean: float, sd: float) -> None:
    values = sample_lengths(dist, N, np.random.default_rng(1))
    assert values.dtype == np.int64 and values.min() >= 1
    assert within(values, mean, sd)


def test_fixed_and_uniform_bounds() -> None:
    rng = np.random.default_rng(0)
    assert set(sample_lengths(FixedLengths(value=7), 100, rng)) == {7}
    values = sample_lengths(UniformLengths(low=3, high=5), 1000, rng)
    assert set(values) == {3, 4, 5}


def test_truncated_normal_stays_in_bounds() -> None:
    values = sample_lengths(NormalLengths(mean=100, std=80, min=50, max=150), N,
                            np.random.default_rng(2))
    assert values.min() >= 50 and values.max() <= 150


def test_lognormal_fitted_to_mean_and_p99() -> None:
    dist = LognormalLengths(mean=1000, p99=8000)
    mu, sigma = dist.log_params()
    assert math.exp(mu + sigma**2 / 2) == pytest.approx(1000)
    assert math.exp(mu + 2.3263478740408408 * sigma) == pytest.approx(8000)
    values = sample_lengths(dist, 200_000, np.random.default_rng(3))
    sd = 1000 * math.sqrt(math.exp(sigma**2) - 1)
    assert within(values, 1000, sd)
    assert np.percentile(values, 99) == pytest.approx(8000, rel=0.05)


@pytest.mark.parametrize("kwargs", [
    {"mean": 100}, {"mean": 100, "sigma": 1, "p99": 500}, {"mean": 100, "p99": 90},
    {"mean": 100, "p99": 2000},
])
def test_lognormal_spec_rejects(kwargs: dict) -> None:
    with pytest.raises(ValidationError):
        LognormalLengths(**kwargs)


def test_zipf_mean() -> None:
    dist = ZipfLengths(a=1.2, max=4096)
    values = sample_lengths(dist, N, np.random.default_rng(4))
    k = np.arange(1, 4097)
    p = k**-1.2 / (k**-1.2).sum()
    sd = math.sqrt((p * k**2).sum() - dist.mean() ** 2)
    assert values.max() <= 4096
    assert within(values, dist.mean(), sd)


def test_empirical_resamples_a_trace_column() -> None:
    pool = load_trace("sample:sharegpt-8k").requests["output_tokens"].to_numpy()
    dist = EmpiricalLengths(path="sample:sharegpt-8k")
    values = sample_lengths(dist, N, np.random.default_rng(5), role="output_tokens")
    assert set(values) <= set(pool)
    assert within(values, pool.mean(), pool.std())
    prompts = sample_lengths(EmpiricalLengths(path="sample:sharegpt-8k", field="prompt_tokens"),
                             10, np.random.default_rng(5))
    assert set(prompts) <= set(load_trace("sample:sharegpt-8k").requests["prompt_tokens"])


@pytest.mark.parametrize("rho", [-0.6, 0.0, 0.5, 0.9])
def test_correlation_keeps_marginals(rho: float) -> None:
    spec = SyntheticSpec(count=20_000, prompt=LognormalLengths(mean=1000, sigma=1.0),
                         output=ExponentialLengths(mean=200), correlation=rho)
    df = synthesize(spec, np.random.default_rng(6)).requests
    independent = synthesize(spec.model_copy(update={"correlation": 0.0}),
                             np.random.default_rng(6)).requests
    assert sorted(df["prompt_tokens"]) == sorted(independent["prompt_tokens"])
    assert sorted(df["output_tokens"]) == sorted(independent["output_tokens"])
    spearman = df["prompt_tokens"].rank().corr(df["output_tokens"].rank())
    assert spearman == pytest.approx(6 / math.pi * math.asin(rho / 2), abs=0.03)


def test_poisson_and_gamma_arrivals() -> None:
    rng = np.random.default_rng(7)
    poisson = sample_arrivals(PoissonArrivals(rate=5.0), N, rng)
    gaps = np.diff(poisson)
    assert poisson[0] == 0.0 and (gaps >= 0).all()
    assert within(gaps, 0.2, 0.2)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)
    gamma = sample_arrivals(GammaArrivals(rate=2.0, cv=3.0), N, rng)
    gaps = np.diff(gamma)
    assert within(gaps, 0.5, 1.5)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.15)


def test_constant_at_once_and_replay() -> None:
    rng = np.random.default_rng(8)
    assert sample_arrivals(ConstantArrivals(rate=4.0), 5, rng).tolist() == [0, .25, .5, .75, 1]
    assert sample_arrivals(AtOnceArrivals(), 3, rng).tolist() == [0, 0, 0]
    own = load_trace("sample:azure-conv").requests["arrival_s"].to_numpy()
    replay = ReplayArrivals(path="sample:azure-conv")
    assert sample_arrivals(replay, 100, rng).tolist() == own[:100].tolist()
    longer = sample_arrivals(replay, 4500, rng)
    assert np.all(np.diff(longer) >= 0)
    period = own[-1] + own[-1] / (len(own) - 1)
    assert longer[2000] == pytest.approx(period)
    assert longer[4000] == pytest.approx(2 * period)


def test_closed_loop_table() -> None:
    spec = SyntheticSpec(count=10, prompt=FixedLengths(value=10), output=FixedLengths(value=5),
                         arrival=ClosedLoopArrivals(users=4, think_s=2.0, think="fixed",
                                                    stagger_s=1.0))
    df = synthesize(spec, np.random.default_rng(0)).requests
    assert df["user_id"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert df["arrival_s"].iloc[:4].tolist() == [0.0, 0.25, 0.5, 0.75]
    assert df["arrival_s"].iloc[4:].isna().all()
    assert df["think_s"].tolist() == [0.0] * 4 + [2.0] * 6
    validate_requests(df, "closed")


def test_max_tokens_caps_output() -> None:
    spec = SyntheticSpec(count=1000, prompt=FixedLengths(value=10),
                         output=ExponentialLengths(mean=300), max_tokens=256)
    df = synthesize(spec, np.random.default_rng(0)).requests
    assert (df["max_tokens"] == 256).all() and df["output_tokens"].max() == 256


def test_same_seed_same_table() -> None:
    spec = SyntheticSpec(count=500, prompt=LognormalLengths(mean=500, p99=4000),
                         output=EmpiricalLengths(path="sample:azure-conv"), correlation=0.4,
                         arrival=GammaArrivals(rate=3.0, cv=2.0))
    first = synthesize(spec, np.random.default_rng(42)).requests
    again = synthesize(spec, np.random.default_rng(42)).requests
    other = synthesize(spec, np.random.default_rng(43)).requests
    pd.testing.assert_frame_equal(first, again)
    assert not first.equals(other)
    validate_requests(first, "synthetic")


def test_shared_system_prompt_hashes():
    from pathlib import Path

    from kvfrag.workloads import WorkloadSpec, build_workload

    spec = WorkloadSpec.model_validate(
        {
            "synthetic": {
                "count": 200,
                "prompt": {"kind": "uniform", "low": 1, "high": 100},
                "output": {"kind": "fixed", "value": 5},
                "shared_prefix": {"tokens": 40, "groups": 3, "chunk_tokens": 16},
            },
            "seed": 4,
        }
    )
    df = build_workload(spec, Path(".")).requests
    assert df.attrs["hash_block_tokens"] == 16
    assert (df["prompt_tokens"] >= 41).all()
    heads = {tuple(h[:2]) for h in df["hash_ids"]}
    assert heads == {(0, 1), (2, 3), (4, 5)}  # 40 // 16 = 2 whole chunks, 3 system prompts
    pairs = zip(df["hash_ids"], df["prompt_tokens"], strict=True)
    assert all(len(h) == -(-p // 16) for h, p in pairs)
    own = [x for h in df["hash_ids"] for x in h[2:]]
    assert len(own) == len(set(own)) and min(own) >= 6  # every other chunk is unique
