"""Fit the engine's linear step time to iteration times measured on a real server.

The engine (`sim.engine_config.StepTime`) prices one iteration as

    seconds = base_s + per_batched_token_s x (prefill + decode tokens)
                     + per_kv_token_s x (KV tokens read)

where "KV tokens read" is every token held by the running sequences once the iteration has
stored its new ones: each sequence's prompt tokens prefilled so far plus its generated tokens
(a request sampling n sequences counts its shared prompt n times). A user who logged one row per
iteration of their server (`batch_size, prefill_tokens, decode_tokens, kv_tokens_read, seconds`)
gets the three coefficients from `fit_step_time`.

Why relative error: iterations span orders of magnitude (a 1-token decode step vs. an 8k-token
prefill), and plain least squares would fit the big prefills and ignore the decode steps that
are most of a run. Rows are weighted by 1/seconds, so a 5 % miss counts the same on either.
The coefficients must be >= 0 (the engine rejects negative ones, and a negative cost per token
is not physical), so this is non-negative least squares; with three unknowns it is solved
exactly by trying the least-squares fit on each of the 7 non-empty sets of free coefficients
and keeping the best one whose coefficients are all >= 0 (the optimum is the unconstrained fit
on its own support). numpy only.

`batch_size` (sequences in the iteration) is read and checked but is not a term of the engine's
form, which counts tokens: it is only reported. Every bad input is a one-line ValueError
naming the file (and the data row and column where there is one).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path

import numpy as np
import pandas as pd

#: The columns a calibration file must have, in the order the docs list them.
COLUMNS = ("batch_size", "prefill_tokens", "decode_tokens", "kv_tokens_read", "seconds")
#: The engine's coefficients, in the order of the design matrix's columns.
COEFFICIENTS = ("base_s", "per_batched_token_s", "per_kv_token_s")
#: Rows are split into this many folds (row index mod FOLDS) for the held-out error...
FOLDS = 5
#: ...when there are at least this many rows.
MIN_ROWS_HELD_OUT = 10


@dataclass(frozen=True)
class ErrorStats:
    """|predicted - measured| / measured over the rows, as fractions (0.05 = 5 %)."""

    median: float
    p90: float
    max: float


@dataclass(frozen=True, eq=False)
class StepTimeFit:
    """The fitted coefficients, what they predict for each row, and how far off that is."""

    base_s: float
    per_batched_token_s: float
    per_kv_token_s: float
    rows: int
    predicted: np.ndarray = field(repr=False)  # seconds, one per row (read-only)
    error: ErrorStats
    held_out: ErrorStats | None  # 5-fold: each row predicted by a fit without it (>= 10 rows)
    batch_size: tuple[float, float, float]  # min, mean, max: reported, not fitted

    def step_time(self) -> dict[str, float]:
        """The `engine.step_time` block of a scenario (`sim.engine_config.StepTime(**this)`)."""
        return {name: getattr(self, name) for name in COEFFICIENTS}


def read_iterations(path: str | Path) -> pd.DataFrame:
    """A calibration CSV as text cells (checked and converted by `fit_step_time`)."""
    try:
        with warnings.catch_warnings():
            # a row longer than the header: an error, not a silent shift or truncation
            warnings.simplefilter("error", pd.errors.ParserWarning)
            return pd.read_csv(
                path, dtype=str, keep_default_na=False, skipinitialspace=True, index_col=False
            )
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except pd.errors.EmptyDataError:
        raise ValueError(f"{path}: empty file; expected columns {', '.join(COLUMNS)}") from None
    except (pd.errors.ParserError, pd.errors.ParserWarning, UnicodeDecodeError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path}: cannot read as CSV: {reason}") from None


def fit_step_time(frame: pd.DataFrame, source: str | Path = "<data>") -> StepTimeFit:
    """Check the rows of `frame` (columns `COLUMNS`, extra ones ignored) and fit them.

    `source` names the file in error messages."""
    columns = _check(frame, source)
    batched = columns["prefill_tokens"] + columns["decode_tokens"]
    x = np.column_stack([np.ones(len(batched)), batched, columns["kv_tokens_read"]])
    seconds = columns["seconds"]
    _check_identifiable(x, source)
    coef = nnls_relative(x, seconds)
    if coef[0] + coef[1] * batched.max() <= 1e-9 * seconds.max():  # 0 up to rounding
        raise ValueError(
            f"{source}: degenerate fit: the best fit has base_s = per_batched_token_s = 0 "
            "(time only from KV reads), which the engine rejects; are the seconds and "
            "kv_tokens_read columns right?"
        )
    predicted = x @ coef
    predicted.setflags(write=False)
    held_out = None
    if len(seconds) >= MIN_ROWS_HELD_OUT:
        fold = np.arange(len(seconds)) % FOLDS
        out_of_fold = np.empty_like(seconds)
        for k in range(FOLDS):
            test = fold == k
            out_of_fold[test] = x[test] @ nnls_relative(x[~test], seconds[~test])
        held_out = error_stats(out_of_fold, seconds)
    sizes = columns["batch_size"]
    return StepTimeFit(
        *(float(c) for c in coef),
        rows=len(seconds),
        predicted=predicted,
        error=error_stats(predicted, seconds),
        held_out=held_out,
        batch_size=(float(sizes.min()), float(sizes.mean()), float(sizes.max())),
    )


def nnls_relative(x: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """argmin over c >= 0 of sum(((x @ c - seconds) / seconds) ** 2), exactly.

    Tries the least-squares fit on every non-empty subset of columns and keeps the best one
    with no negative coefficient (a rank-deficient subset gets numpy's minimum-norm fit)."""
    a = x / seconds[:, None]  # divide each row by its seconds: the target becomes all ones
    ones = np.ones(len(seconds))
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0  # an all-zero column: its coefficient comes out 0
    a = a / scale  # columns of one norm: tokens (~1e5) and the constant (1) alike
    best, best_loss = np.zeros(x.shape[1]), np.inf
    for size in range(1, x.shape[1] + 1):
        for free in combinations(range(x.shape[1]), size):
            sub = np.linalg.lstsq(a[:, free], ones, rcond=None)[0]
            if np.any(sub < 0):
                continue
            loss = float(np.sum((a[:, free] @ sub - ones) ** 2))
            if loss < best_loss:
                best, best_loss = np.zeros(x.shape[1]), loss
                best[list(free)] = sub
    return best / scale


def error_stats(predicted: np.ndarray, seconds: np.ndarray) -> ErrorStats:
    """Median, 90th percentile (linear interpolation) and max of |pred - seconds| / seconds."""
    rel = np.abs(np.asarray(predicted) - seconds) / seconds
    return ErrorStats(
        median=float(np.median(rel)), p90=float(np.percentile(rel, 90)), max=float(rel.max())
    )


def _check(frame: pd.DataFrame, source: str | Path) -> dict[str, np.ndarray]:
    """The five columns as float arrays, or a ValueError naming the first bad cell."""
    frame = frame.rename(columns=lambda c: str(c).strip())
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(
            f"{source}: missing column(s) {', '.join(missing)}; expected {', '.join(COLUMNS)}"
        )
    if len(frame) < len(COEFFICIENTS):
        raise ValueError(
            f"{source}: {len(frame)} data row(s); at least {len(COEFFICIENTS)} are needed to "
            f"fit {len(COEFFICIENTS)} coefficients"
        )
    out = {}
    for name in COLUMNS:
        raw = frame[name]
        text = raw if pd.api.types.is_numeric_dtype(raw) else raw.astype(str).str.strip()
        values = pd.to_numeric(text, errors="coerce").to_numpy(dtype=float)
        finite = np.isfinite(values)
        with np.errstate(invalid="ignore"):
            if name == "seconds":
                low, rule = values <= 0, "must be > 0"
            elif name == "batch_size":
                low, rule = values < 1, "must be >= 1"
            else:
                low, rule = values < 0, "must be >= 0"
        problem = ~finite | low
        if problem.any():
            row = int(np.argmax(problem))
            why = "is not a finite number" if not finite[row] else rule
            raise ValueError(
                f"{source}: data row {row + 1}, column {name}: {str(raw.iloc[row])!r} {why}"
            )
        out[name] = values
    return out


def _check_identifiable(x: np.ndarray, source: str | Path) -> None:
    """A ValueError unless the rows tell the three coefficients apart (rank 3)."""
    norms = np.linalg.norm(x, axis=0)
    scaled = x / np.where(norms == 0, 1.0, norms)
    if np.linalg.matrix_rank(scaled) == x.shape[1]:
        return
    batched, kv = x[:, 1], x[:, 2]
    if np.ptp(batched) == 0 and np.ptp(kv) == 0:
        why = "every row has the same batched tokens and kv_tokens_read"
    elif np.ptp(batched) == 0:
        why = (
            "prefill_tokens + decode_tokens is the same in every row, so base_s and "
            "per_batched_token_s cannot be told apart"
        )
    elif np.ptp(kv) == 0:
        why = (
            "kv_tokens_read is the same in every row, so base_s and per_kv_token_s cannot be "
            "told apart"
        )
    else:
        why = "kv_tokens_read is a fixed linear function of the batched tokens"
    raise ValueError(
        f"{source}: degenerate fit: {why}; measure iterations of varied sizes and contexts"
    )
