"""Fitting the engine's step time to measured iterations: recovery, the >= 0 constraint, the
error stats, and one-line errors that name the file, row and column."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kvfrag.sim.calibrate import (
    COLUMNS,
    error_stats,
    fit_step_time,
    nnls_relative,
    read_iterations,
)
from kvfrag.sim.engine_config import StepTime

TRUE = {"base_s": 0.012, "per_batched_token_s": 9.5e-5, "per_kv_token_s": 4.0e-8}


def synthetic(seed: int, n: int, noise: float, coef: dict[str, float] = TRUE) -> pd.DataFrame:
    """Mixed prefill/decode iterations timed by `coef`, times (1 + N(0, noise))."""
    rng = np.random.default_rng(seed)
    batch = rng.integers(1, 128, n)
    prefill = np.where(rng.random(n) < 0.3, rng.integers(16, 4096, n), 0)
    kv = rng.integers(batch * 64, batch * 2048 + 1)
    seconds = (
        coef["base_s"]
        + coef["per_batched_token_s"] * (prefill + batch)
        + coef["per_kv_token_s"] * kv
    ) * (1 + rng.normal(0, noise, n))
    return pd.DataFrame({
        "batch_size": batch, "prefill_tokens": prefill, "decode_tokens": batch,
        "kv_tokens_read": kv, "seconds": seconds,
    })


def design(frame: pd.DataFrame) -> np.ndarray:
    batched = frame["prefill_tokens"] + frame["decode_tokens"]
    return np.column_stack([np.ones(len(frame)), batched, frame["kv_tokens_read"]]).astype(float)


def test_recovers_exact_coefficients() -> None:
    fit = fit_step_time(synthetic(seed=0, n=50, noise=0.0))
    for name, value in TRUE.items():
        assert getattr(fit, name) == pytest.approx(value, rel=1e-8)
    assert fit.error.max < 1e-9 and fit.held_out is not None and fit.held_out.max < 1e-9
    StepTime(**fit.step_time())  # the engine takes it as is


def test_recovers_coefficients_through_noise() -> None:
    frame = synthetic(seed=1, n=600, noise=0.03)
    fit = fit_step_time(frame)
    assert fit.base_s == pytest.approx(TRUE["base_s"], rel=0.05)
    assert fit.per_batched_token_s == pytest.approx(TRUE["per_batched_token_s"], rel=0.03)
    assert fit.per_kv_token_s == pytest.approx(TRUE["per_kv_token_s"], rel=0.05)
    # |N(0, 0.03)| has median 0.0202 and p90 0.0493; held out it is barely worse.
    assert fit.error.median == pytest.approx(0.0202, rel=0.15)
    assert fit.error.p90 == pytest.approx(0.0493, rel=0.15)
    assert fit.held_out is not None
    assert fit.error.median <= fit.held_out.median < 1.1 * fit.error.median
    assert fit.rows == 600 and len(fit.predicted) == 600
    np.testing.assert_allclose(fit.predicted, design(frame) @ list(fit.step_time().values()))


def test_zero_coefficient_stays_zero_where_noise_would_make_it_negative() -> None:
    rng = np.random.default_rng(2)
    n = 60
    batched = rng.integers(1, 2048, n).astype(float)
    kv = rng.integers(1000, 100000, n).astype(float)
    seconds = (0.01 + 1e-4 * batched) * (1 + rng.normal(0, 0.05, n))  # no KV cost at all
    frame = pd.DataFrame({"batch_size": 1, "prefill_tokens": batched - 1, "decode_tokens": 1,
                          "kv_tokens_read": kv, "seconds": seconds})
    x = design(frame)
    unconstrained = np.linalg.lstsq(x / seconds[:, None], np.ones(n), rcond=None)[0]
    assert unconstrained[2] < 0  # the case the constraint is for
    fit = fit_step_time(frame)
    assert fit.per_kv_token_s == 0.0
    assert fit.base_s == pytest.approx(0.01, rel=0.1)
    assert fit.per_batched_token_s == pytest.approx(1e-4, rel=0.05)
    assert_optimal(x, seconds, np.array(list(fit.step_time().values())))


@pytest.mark.parametrize("seed", range(5))
def test_nnls_meets_the_optimality_conditions(seed: int) -> None:
    """KKT: zero gradient on every free coefficient, a non-negative one on every zero one."""
    rng = np.random.default_rng(seed)
    x = np.column_stack([np.ones(40), rng.integers(1, 4000, 40), rng.integers(0, 10**6, 40)])
    seconds = rng.uniform(0.005, 0.5, 40)  # unrelated to x: constraints bind somewhere
    assert_optimal(x, seconds, nnls_relative(x, seconds))


def assert_optimal(x: np.ndarray, seconds: np.ndarray, coef: np.ndarray) -> None:
    a = x / seconds[:, None]
    scale = np.linalg.norm(a, axis=0)
    gradient = (a / scale).T @ (a @ coef - 1)  # per unit-norm column
    assert np.all(coef >= 0)
    assert np.all(np.abs(gradient[coef > 0]) < 1e-8)
    assert np.all(gradient[coef == 0] > -1e-8)


def test_error_stats_by_hand() -> None:
    stats = error_stats(np.array([1.0, 1.01, 0.98, 1.05, 0.9]), np.ones(5))
    # |errors| sorted 0, .01, .02, .05, .1: p90 at position 3.6 = .05 + .6 x .05
    assert (stats.median, stats.p90, stats.max) == pytest.approx((0.02, 0.08, 0.1))


def test_fit_and_stats_by_hand() -> None:
    """Time falls as tokens grow, so only base_s is free: base = sum(1/y) / sum(1/y^2)."""
    frame = pd.DataFrame({"batch_size": [1, 2, 1, 2], "prefill_tokens": 0,
                          "decode_tokens": [1, 2, 1, 2], "kv_tokens_read": [10, 10, 20, 20],
                          "seconds": [4.0, 2.0, 2.0, 1.0]})
    fit = fit_step_time(frame)
    assert fit.step_time() == pytest.approx(
        {"base_s": 2.25 / 1.5625, "per_batched_token_s": 0.0, "per_kv_token_s": 0.0}
    )
    np.testing.assert_allclose(fit.predicted, 1.44)
    # relative errors -.64, -.28, -.28, +.44
    assert (fit.error.median, fit.error.p90, fit.error.max) == pytest.approx((0.36, 0.58, 0.64))
    assert fit.held_out is None  # fewer than 10 rows
    assert fit.batch_size == (1.0, 1.5, 2.0)


def test_three_rows_fit_exactly() -> None:
    frame = pd.DataFrame({"batch_size": [1, 4, 8], "prefill_tokens": [100, 0, 50],
                          "decode_tokens": [0, 4, 8], "kv_tokens_read": [100, 400, 3000],
                          "seconds": [0.02001, 0.01044, 0.0161]})
    fit = fit_step_time(frame)
    assert fit.step_time() == pytest.approx(
        {"base_s": 0.01, "per_batched_token_s": 1e-4, "per_kv_token_s": 1e-7}, rel=1e-9
    )
    np.testing.assert_allclose(fit.predicted, frame["seconds"], rtol=1e-9)
    assert fit.error.max < 1e-9


def test_reads_csv_with_spaces_and_extra_columns(tmp_path: Path) -> None:
    path = tmp_path / "it.csv"
    synthetic(seed=3, n=20, noise=0.0).assign(notes="warm", gpu="H100").to_csv(
        path, index=False
    )
    path.write_text(path.read_text().replace(",", ", "))  # `a, b` as people type it
    fit = fit_step_time(read_iterations(path), path)
    assert fit.per_kv_token_s == pytest.approx(TRUE["per_kv_token_s"], rel=1e-6)


HEADER = ",".join(COLUMNS)
GOOD = ["1,100,0,100,0.0201", "4,0,4,400,0.01004", "8,50,8,3000,0.0108"]


@pytest.mark.parametrize(("lines", "message"), [
    (["batch_size,prefill_tokens,seconds", "1,2,3"],
     "missing column(s) decode_tokens, kv_tokens_read; expected batch_size, prefill_tokens, "
     "decode_tokens, kv_tokens_read, seconds"),
    ([HEADER, GOOD[0], "4,abc,4,400,0.01", GOOD[2]],
     "data row 2, column prefill_tokens: 'abc' is not a finite number"),
    ([HEADER, GOOD[0], GOOD[1], "8,50,8,,0.01"],
     "data row 3, column kv_tokens_read: '' is not a finite number"),
    ([HEADER, GOOD[0], GOOD[1], "8,50,8,3000,inf"],
     "data row 3, column seconds: 'inf' is not a finite number"),
    ([HEADER, "1,100,nan,100,0.02", GOOD[1], GOOD[2]],
     "data row 1, column decode_tokens: 'nan' is not a finite number"),
    ([HEADER, GOOD[0], "4,0,-4,400,0.01", GOOD[2]],
     "data row 2, column decode_tokens: '-4' must be >= 0"),
    ([HEADER, GOOD[0], GOOD[1], "8,50,8,3000,0"], "data row 3, column seconds: '0' must be > 0"),
    ([HEADER, GOOD[0], GOOD[1], "8,50,8,3000,-0.5"],
     "data row 3, column seconds: '-0.5' must be > 0"),
    ([HEADER, "0,100,0,100,0.02", GOOD[1], GOOD[2]],
     "data row 1, column batch_size: '0' must be >= 1"),
    ([HEADER, GOOD[0], GOOD[1]], "2 data row(s); at least 3 are needed to fit 3 coefficients"),
    ([HEADER], "0 data row(s)"),
    ([HEADER, GOOD[0], GOOD[0], GOOD[0], GOOD[0]],
     "degenerate fit: every row has the same batched tokens and kv_tokens_read"),
    ([HEADER, "4,0,4,100,0.01", "4,0,4,900,0.02", "4,0,4,1600,0.03"],
     "base_s and per_batched_token_s cannot be told apart"),
    ([HEADER, "1,0,1,500,0.01", "4,0,4,500,0.02", "8,0,8,500,0.03"],
     "base_s and per_kv_token_s cannot be told apart"),
    ([HEADER, "1,0,1,100,0.01", "4,0,4,400,0.02", "8,0,8,800,0.03"],
     "kv_tokens_read is a fixed linear function of the batched tokens"),
    ([HEADER, "1,0,1,100,0.001", "4,0,4,500,0.005", "2,0,2,900,0.009"],
     "best fit has base_s = per_batched_token_s = 0"),
])
def test_bad_input_is_one_line_naming_the_file(
    tmp_path: Path, lines: list[str], message: str
) -> None:
    path = tmp_path / "iterations.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as info:
        fit_step_time(read_iterations(path), path)
    text = str(info.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text


def test_unreadable_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.csv: empty file; expected columns batch_size"):
        read_iterations(empty)
    with pytest.raises(ValueError, match=r"cannot read as CSV"):
        read_iterations(tmp_path)  # a folder
    for rows in ([GOOD[0] + ",7", GOOD[1]], [GOOD[0], GOOD[1] + ",7"]):  # a field too many
        long = tmp_path / "long.csv"
        long.write_text("\n".join([HEADER, *rows]) + "\n")
        with pytest.raises(ValueError, match=r"long\.csv: cannot read as CSV: \S"):
            read_iterations(long)
    with pytest.raises(FileNotFoundError, match=r"nope\.csv: no such file"):
        read_iterations(tmp_path / "nope.csv")
