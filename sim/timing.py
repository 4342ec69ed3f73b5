"""Iteration time as the engine consumes it, from the hardware: roofline or measured profile.

The engine (sim/engine.py) asks two things of a step-time model:

- `affine(num_tokens, num_logits, decoding)` -> (base_s, per_kv_token_s): an iteration carrying
  `num_tokens` batched tokens, sampling `num_logits` positions, takes base_s + per_kv_token_s x
  the cached tokens its decoding sequences read;
- `prefill_s(new_tokens, context)`: the attention of one prefill chunk after `context` cached
  tokens (compute-bound; added per chunk).

Inside a decode-only stretch the batch is fixed and the KV read grows by one token per decoding
sequence each iteration, so the stretch still sums in closed form.

`TableTime` answers both from a table over the token count, built once per scenario point:

- `roofline(...)`: every term from sim/steptime.py's model (token-wise layers with fitted
  efficiencies, attention and all-reduce with stated assumptions);
- `from_profile(...)`: the token-wise layers interpolated from a measured per-operator table in
  Vidur's `mlp.csv` layout (../shared/profiles/vidur-compute, or a user's own), the rest (LM head,
  all-reduce, attention: none of them is in such a table) from the roofline.

Both add a fixed per-iteration `overhead_s` for the server's CPU side (scheduling, preparing
inputs, sampling): an ASSUMPTION of 1 ms (vLLM's V1 engine overlaps much of it with the GPU;
Vidur profiles 0.5-3 ms of CPU work per step for its vLLM model). It matters only for small
batches, where an iteration is a few milliseconds.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
from kvfrag.sim.architecture import Architecture
from kvfrag.sim.hardware import GPU
from kvfrag.sim.steptime import (
    OPERATORS,
    Efficiency,
    StepModel,
    allreduce_time,
    efficiency_for,
    embedding_op,
    kv_bytes_per_token,
    layer_ops,
    lm_head_op,
    op_time,
    operator_medians_ms,
)

#: Seconds of CPU work per iteration (see the module docstring). An assumption.
OVERHEAD_S = 1e-3


@dataclass(frozen=True, eq=False)
class TableTime:
    """Iteration time from tables over the batch's token count (see the module docstring).

    body[n]: the token-wise work of n batched tokens without the LM head (embedding, layers,
    all-reduces, final norm); head[k]: the LM head over k sampled positions and its gather.
    Past the tables' end both grow linearly, as their last two entries do.
    """

    #: The KV read the engine passes to `affine`'s per-token term is the decoding sequences'
    #: (prefill chunks pay `prefill_s` instead); the linear StepTime reads every running token.
    decode_kv_only: ClassVar[bool] = True

    source: str  # what the figures come from, for the summary ("roofline h100-80gb tp=1")
    body: np.ndarray = field(repr=False)
    head: np.ndarray = field(repr=False)
    overhead_s: float
    decode_fixed_s: float  # decode attention kernels' fixed cost (one per layer)
    per_kv_token_s: float  # decode attention per cached token read
    prefill_fixed_s: float  # prefill attention kernels' fixed cost (one per layer)
    prefill_pair_s: float  # prefill attention per (query, key) pair
    prefill_token_s: float  # prefill attention per cached token read (its memory side)

    def affine(self, num_tokens: int, num_logits: int, decoding: bool) -> tuple[float, float]:
        base = self.overhead_s + _at(self.body, num_tokens) + _at(self.head, num_logits)
        if decoding:
            base += self.decode_fixed_s
        return base, self.per_kv_token_s

    def prefill_s(self, new_tokens: int, context: int) -> float:
        if new_tokens <= 0:
            return 0.0
        pairs = new_tokens * context + new_tokens * (new_tokens + 1) // 2
        return self.prefill_fixed_s + max(
            pairs * self.prefill_pair_s, (context + new_tokens) * self.prefill_token_s
        )

    def iteration_s(
        self,
        num_tokens: int,
        kv_tokens_read: int = 0,
        prefills: Sequence[tuple[int, int]] = (),
        num_logits: int | None = None,
    ) -> float:
        """One iteration: `num_tokens` batched, decode attention over `kv_tokens_read` cached
        tokens, prefill chunks as (new_tokens, context). For tables and tests."""
        logits = num_tokens if num_logits is None else num_logits
        base, per_kv = self.affine(num_tokens, logits, kv_tokens_read > 0)
        return base + per_kv * kv_tokens_read + sum(self.prefill_s(c, p) for c, p in prefills)


def _at(table: np.ndarray, n: int) -> float:
    last = len(table) - 1
    if n <= last:
        return float(table[n])
    return float(table[last] + (n - last) * (table[last] - table[last - 1]))


def _attention_terms(model: StepModel, kv_dtype_bytes: int) -> dict[str, float]:
    """Attention reads the KV cache in its own dtype (fp8 KV with bf16 weights is common)."""
    a, g, e, tp = model.arch, model.gpu, model.eff, model.tp
    per_token = kv_bytes_per_token(a, tp, kv_dtype_bytes) / (
        g.hbm_bandwidth_bytes_s * e.attention_mem
    )
    return {
        "decode_fixed_s": a.layers * e.attention_overhead_s,
        "per_kv_token_s": per_token,
        "prefill_fixed_s": a.layers * e.attention_overhead_s,
        "prefill_pair_s": 4 * a.layers * a.heads * a.head_dim / tp
        / (g.fp16_dense_flops * e.attention_flops),
        "prefill_token_s": per_token,
    }


def _head_table(model: StepModel, max_tokens: int) -> np.ndarray:
    a, g, e, d, tp = model.arch, model.gpu, model.eff, model.dtype_bytes, model.tp
    k = np.arange(max_tokens + 1, dtype=float)
    head = op_time(lm_head_op(a, tp), k, g, e, d) + allreduce_time(k * a.vocab * d / 2, tp, g, e)
    head[0] = 0.0
    return head


def _comm_and_norm(model: StepModel, n: np.ndarray) -> np.ndarray:
    """All-reduces (two per layer and one after the embedding) and the final norm."""
    a, g, e, d, tp = model.arch, model.gpu, model.eff, model.dtype_bytes, model.tp
    comm = (2 * a.layers + 1) * allreduce_time(n * a.hidden * d, tp, g, e)
    return comm + op_time(layer_ops(a, tp)["input_layernorm"], n, g, e, d)


@functools.lru_cache(maxsize=64)
def roofline(
    arch: Architecture,
    gpu: GPU,
    tp: int,
    max_tokens: int,
    efficiency: Efficiency | None = None,
    overhead_s: float = OVERHEAD_S,
    kv_dtype_bytes: int = 2,
) -> TableTime:
    """Every term from the roofline model (sim/steptime.py), tables up to `max_tokens`.
    Weights and activations are 16-bit; the KV cache is `kv_dtype_bytes` per element."""
    model = StepModel(arch, gpu, tp, efficiency)
    e, d = model.eff, model.dtype_bytes
    n = np.arange(max(max_tokens, 1) + 1, dtype=float)
    layer = sum(op_time(op, n, gpu, e, d) for op in layer_ops(arch, tp).values())
    body = op_time(embedding_op(arch, tp), n, gpu, e, d) + arch.layers * layer
    body = body + _comm_and_norm(model, n)
    return _table(f"roofline {gpu.name} tp={tp}", body, model, overhead_s, kv_dtype_bytes)


def from_profile(
    profile: ProfileTable,
    arch: Architecture,
    gpu: GPU,
    tp: int,
    max_tokens: int,
    overhead_s: float = OVERHEAD_S,
    kv_dtype_bytes: int = 2,
) -> TableTime:
    """The token-wise layers from a measured table, the rest from the roofline on `gpu`."""
    model = StepModel(arch, gpu, tp, efficiency_for(gpu))
    emb, layer = profile.at_tp(tp, arch)
    n = np.arange(max(max_tokens, 1) + 1, dtype=float)
    body = _interp(emb, n) + arch.layers * _interp(layer, n) + _comm_and_norm(model, n)
    source = f"profile {profile.label} ({gpu.name} roofline for attention) tp={tp}"
    return _table(source, body, model, overhead_s, kv_dtype_bytes)


def _table(source: str, body: np.ndarray, model: StepModel, overhead_s: float,
           kv_dtype_bytes: int) -> TableTime:
    """A TableTime over `body` (no work at 0 tokens) with the roofline's head and attention."""
    body[0] = 0.0
    return TableTime(
        source=source,
        body=body,
        head=_head_table(model, len(body) - 1),
        overhead_s=overhead_s,
        **_attention_terms(model, kv_dtype_bytes),
    )


def _interp(points: tuple[np.ndarray, np.ndarray], n: np.ndarray) -> np.ndarray:
    """Piecewise-linear in the token count; below the first point, its value. Past the last,
    linear (large batches are compute-bound) with the slope from the point nearest half the
    last one's tokens: neighbouring points are a few tokens apart, and the slope between them
    is mostly measurement noise (flat, or several times too steep)."""
    x, y = points
    out = np.interp(n, x, y)
    if len(x) > 1:
        k = min(int(np.argmin(np.abs(x - x[-1] / 2))), len(x) - 2)
        slope = max((y[-1] - y[k]) / (x[-1] - x[k]), 0.0)
        beyond = n > x[-1]
        out[beyond] = y[-1] + (n[beyond] - x[-1]) * slope
    return out


# ------------------------------------------------------------------------------ profiles
#: Columns of a profile table (Vidur's layout): times in milliseconds.
TOKENS, TP = "num_tokens", "num_tensor_parallel_workers"
SHAPE = {"n_embd": "hidden", "n_expanded_embd": "intermediate", "n_head": "heads",
         "n_kv_head": "kv_heads"}


@dataclass(frozen=True, eq=False)
class ProfileTable:
    """Per-operator median seconds by (num_tokens, tp), read from a Vidur-layout `mlp.csv`."""

    path: Path
    rows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(repr=False)
    shape: dict[str, int] = field(repr=False)  # the model shape the table states, if any

    @property
    def label(self) -> str:
        """The file, named with its folder when it is Vidur's `mlp.csv`."""
        p = self.path
        return f"{p.parent.name}/{p.name}" if p.name == "mlp.csv" else p.name

    def at_tp(self, tp: int, arch: Architecture) -> tuple[tuple, tuple]:
        """(tokens, embedding s) and (tokens, one layer's s) at `tp`, checked against arch."""
        for column, attr in SHAPE.items():
            if column in self.shape and self.shape[column] != getattr(arch, attr):
                raise ValueError(
                    f"{self.path}: profiled {column}={self.shape[column]} but model "
                    f"{arch.name!r} has {attr}={getattr(arch, attr)}"
                )
        if tp not in self.rows:
            profiled = ", ".join(map(str, sorted(self.rows)))
            raise ValueError(f"{self.path}: no rows for tp={tp} (profiled: {profiled})")
        tokens, emb, layer = self.rows[tp]
        return (tokens, emb), (tokens, layer)


def profile_file(path: str | Path) -> Path:
    """The file a profile path names: itself, or the `mlp.csv` of a folder."""
    p = Path(path)
    return p / "mlp.csv" if p.is_dir() else p


def read_profile(path: str | Path) -> ProfileTable:
    """Read a profile: a Vidur-layout CSV, or a folder holding `mlp.csv`. Errors name the file
    and, for a bad value, its 1-based data row. Read once per process while it is unchanged."""
    p = profile_file(path)
    if not p.is_file():
        raise FileNotFoundError(f"step_time profile {p}: no such file")
    info = p.stat()
    return _read_profile(str(p.resolve()), info.st_mtime_ns, info.st_size)


@functools.lru_cache(maxsize=16)
def _read_profile(path: str, mtime_ns: int, size: int) -> ProfileTable:
    import pandas as pd

    p = Path(path)
    try:
        raw = pd.read_csv(p)
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        why = " ".join(str(exc).split())
        raise ValueError(f"{p}: not a readable CSV profile ({why})") from None
    ops = ["emb", *OPERATORS]
    need = [TOKENS, TP, *(f"time_stats.{o}.median" for o in ops)]
    missing = [c for c in need if c not in raw.columns]
    if missing:
        raise ValueError(
            f"{p}: missing column(s) {', '.join(missing)} (a profile has num_tokens, "
            "num_tensor_parallel_workers and time_stats.<op>.median in ms for emb and "
            f"{', '.join(OPERATORS)})"
        )
    table = raw[need].apply(pd.to_numeric, errors="coerce")
    bad = ~np.isfinite(table.to_numpy(dtype=float)).all(axis=1) | (table.to_numpy() < 0).any(axis=1)
    bad |= (table[TOKENS] < 1).to_numpy() | (table[TP] < 1).to_numpy()
    if bad.any():
        row = int(np.argmax(bad))
        raise ValueError(f"{p}: data row {row + 1}: a missing, negative or non-numeric value")
    shape = {}
    for column in SHAPE:
        if column in raw.columns:
            values = set(raw[column].tolist())
            if len(values) != 1:
                raise ValueError(f"{p}: {column} takes several values {sorted(values)}: "
                                 "a profile holds one model")
            shape[column] = int(values.pop())
    rows = {}
    for tp, g in operator_medians_ms(table).groupby("tp"):
        tokens = g["num_tokens"].to_numpy(dtype=float)
        emb = g["emb"].to_numpy(dtype=float) / 1e3
        layer = g[list(OPERATORS)].sum(axis=1).to_numpy() / 1e3
        rows[int(tp)] = (tokens, emb, layer)
    return ProfileTable(p, rows, shape)
