"""Step time from the hardware: a roofline model of one iteration, calibrated to kernel times.

An iteration of a dense transformer is (a) the token-wise layers, whose cost depends only on
how many tokens the batch carries, and (b) attention, whose cost depends on how many cached
tokens every sequence reads. For (a) each operator is a roofline:

    time = max(bytes / (HBM bandwidth x eff_mem), FLOPs / (dense peak x eff_flops)) + overhead

with the GPU's data-sheet peaks (sim/hardware.py) and the model's matrices
(sim/architecture.py). One token through a projection streams the whole weight matrix from
HBM (memory-bound: decode), 32,768 tokens multiply it 32,768 times (compute-bound: prefill);
the max() switches between the two at the GPU's ridge point. For the projections the max is a
smooth one, (mem^p + compute^p)^(1/p) with p fitted (about 1.5): measured kernels near the
ridge are slower than either bound alone, and a hard max under-predicts them by ~15 %.
Element-wise operators (norms, rotary embedding, activation, residual add) are memory-bound.
Tensor parallelism `tp` shards the projections, the MLP, rotary embedding and the activation
across GPUs (Megatron-style); the norms and residual add run replicated on every GPU, and each
layer pays two all-reduces of its activations (after the output and MLP down projections).

The efficiencies and per-kernel overheads of (a) are FITTED to Vidur's measured per-operator
times (see `fit` and bench/step_time.py; ../shared/profiles/vidur-compute/SOURCE.md). Those
measurements hold no attention kernel and no collective, so the attention and all-reduce
efficiencies here are ASSUMPTIONS (typical FlashAttention / paged-attention and NCCL figures),
stated in `Efficiency`, not calibrated.

The shape the engine needs: for a fixed batch of `n` tokens the iteration takes

    tokenwise(n) + allreduce(n) + decode attention: a + c x (KV tokens read) + prefill chunks

which is affine in the KV tokens read, so a decode-only stretch (n fixed, KV read growing by n
each iteration) still sums in closed form. `StepModel.affine` returns that (base, c) pair.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
from kvfrag.sim.architecture import PRESETS as ARCHITECTURES
from kvfrag.sim.architecture import Architecture
from kvfrag.sim.hardware import GPU
from kvfrag.sim.hardware import PRESETS as GPUS

#: Per-layer operators, in Vidur's names (its `mlp.csv` columns), in execution order.
OPERATORS = (
    "input_layernorm",
    "attn_pre_proj",  # QKV projection
    "attn_rope",
    "attn_post_proj",  # output projection
    "post_attention_layernorm",
    "mlp_up_proj",  # gate and up together when gated
    "mlp_act",  # SiLU x up (gated) or ReLU
    "mlp_down_proj",
    "add",  # residual add
)
GEMMS = frozenset({"attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj"})


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the data-sheet peaks kernels reach, and fixed per-kernel costs.

    gemm_*, elementwise_* and embedding_* are fitted (`fit`); the rest are assumptions: there
    is no measured attention kernel or all-reduce to fit them to.
    """

    gemm_mem: float  # projections streaming weights + activations, of HBM bandwidth
    gemm_flops: float  # projections' matrix multiplies, of the dense FP16 peak
    gemm_overhead_s: float  # per projection kernel: launch, tail, small-matrix inefficiency
    gemm_sharpness: float  # p of the smooth max (mem^p + compute^p)^(1/p); inf: a hard max
    elementwise_mem: float  # norms, rotary embedding, activation, residual add
    elementwise_overhead_s: float
    embedding_mem: float  # the embedding lookup (a gather: poor bandwidth)
    embedding_overhead_s: float
    # Assumed, not fitted (no measurements in the calibration data):
    attention_mem: float = 0.7  # decode attention reading the KV cache (paged attention)
    attention_flops: float = 0.5  # prefill attention (FlashAttention-2 reaches 50-70 %)
    attention_overhead_s: float = 5e-6  # per layer and attention kernel
    interconnect: float = 0.7  # of one direction's link bandwidth (NCCL ring bus bandwidth)
    allreduce_latency_s: float = 10e-6  # per collective (small-message latency)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if name == "gemm_sharpness":
                if not value >= 1:
                    raise ValueError(f"efficiency {name} must be >= 1, got {value!r}")
            elif not math.isfinite(value) or value < 0:
                raise ValueError(f"efficiency {name} must be finite and >= 0, got {value!r}")
            elif not name.endswith("_s") and not 0 < value <= 1:
                raise ValueError(f"efficiency {name} must be in (0, 1], got {value!r}")


# Fitted by `fit` on every Vidur model of that GPU (bench/step_time.py prints the fit and the
# leave-one-model-out errors; tests/sim/test_steptime.py checks these still match a fresh fit).
# Vidur's "a100" is an 80 GB card: at one token its large MLP projections read their weights
# at 1.57-1.65 TB/s, above the 40 GB card's 1,555 GB/s peak. The SXM (2,039 GB/s) and PCIe
# (1,935 GB/s) 80 GB cards are not told apart by the data: we use a100-80gb (SXM), and
# gemm_mem absorbs the difference. Its "h100" is the SXM card (2.75-3.02 TB/s measured; the
# PCIe card's peak is 2.0 TB/s).
FITTED: dict[str, Efficiency] = {
    "a100-80gb": Efficiency(
        gemm_mem=0.800, gemm_flops=0.735, gemm_overhead_s=5.08e-6, gemm_sharpness=1.53,
        elementwise_mem=0.471, elementwise_overhead_s=3.82e-6,
        embedding_mem=0.154, embedding_overhead_s=3.79e-6,
    ),
    "h100-80gb": Efficiency(
        gemm_mem=0.905, gemm_flops=0.740, gemm_overhead_s=4.38e-6, gemm_sharpness=1.48,
        elementwise_mem=0.581, elementwise_overhead_s=3.32e-6,
        embedding_mem=0.196, embedding_overhead_s=2.90e-6,
    ),
}


def efficiency_for(gpu: GPU) -> Efficiency:
    """The efficiencies to use on `gpu`: fitted where Vidur measured that chip, else assumed.

    - a100-40gb: the a100-80gb fit (same chip; efficiencies are fractions of each card's own
      peaks, so the 40 GB card's lower bandwidth still counts).
    - h200: the h100-80gb fit (same GH100 chip, faster HBM3e). An assumption.
    - anything else (l40s, mi300x, custom): the lower of the A100 and H100 fits, factor by
      factor, and the higher overheads. An assumption, and a pessimistic one.
    """
    if gpu.name in FITTED:
        return FITTED[gpu.name]
    borrowed = {"a100-40gb": "a100-80gb", "h200": "h100-80gb"}.get(gpu.name)
    if borrowed is not None:
        return FITTED[borrowed]
    return _conservative(FITTED.values())


def _conservative(effs: Iterable[Efficiency]) -> Efficiency:
    effs = list(effs)
    return Efficiency(
        **{
            name: (max if name.endswith("_s") else min)(getattr(e, name) for e in effs)
            for name in vars(effs[0])
        }
    )


# ------------------------------------------------------------------------------ operators
@dataclass(frozen=True)
class OpShape:
    """One operator on one GPU: elements it reads once per call (weights), elements it reads
    and writes per token (activations), FLOPs per token."""

    kind: str  # "gemm", "elementwise" or "embedding"
    weight_elems: float
    act_elems_per_token: float
    flops_per_token: float


def _check_tp(arch: Architecture, tp: int) -> None:
    if not isinstance(tp, (int, np.integer)) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if arch.heads % tp:
        raise ValueError(f"model {arch.name!r}: tp={tp} must divide heads ({arch.heads})")


def layer_ops(arch: Architecture, tp: int = 1) -> dict[str, OpShape]:
    """The per-layer operators of `arch` on one of `tp` GPUs (Megatron-style sharding).

    Query heads, the MLP's intermediate width and the activation are split `tp` ways; KV heads
    too, down to one per GPU (fewer KV heads than GPUs are replicated). Norms and the residual
    add work on the full hidden vector on every GPU.
    """
    _check_tp(arch, tp)
    h, hd = arch.hidden, arch.head_dim
    q = arch.heads * hd / tp
    kv = max(arch.kv_heads / tp, 1) * hd
    inter = arch.intermediate / tp
    up = arch.mlp_up_matrices * inter

    def gemm(k: float, m: float) -> OpShape:  # [tokens, k] @ [k, m]
        return OpShape("gemm", k * m, k + m, 2 * k * m)

    def elementwise(weights: float, per_token: float) -> OpShape:
        return OpShape("elementwise", weights, per_token, 0.0)

    return {
        "input_layernorm": elementwise(h, 2 * h),  # read x, write norm(x)
        "attn_pre_proj": gemm(h, q + 2 * kv),
        "attn_rope": elementwise(0, 2 * (q + kv)),  # rotate q and k in place
        "attn_post_proj": gemm(q, h),
        "post_attention_layernorm": elementwise(h, 2 * h),
        "mlp_up_proj": gemm(h, up),
        "mlp_act": elementwise(0, up + inter),  # read gate and up, write their product
        "mlp_down_proj": gemm(inter, h),
        "add": elementwise(0, 3 * h),  # read two, write one
    }


def embedding_op(arch: Architecture, tp: int = 1) -> OpShape:
    """The embedding lookup (vocab-parallel: each GPU gathers its share, all-reduce joins)."""
    _check_tp(arch, tp)
    return OpShape("embedding", 0, 2 * arch.hidden, 0.0)


def lm_head_op(arch: Architecture, tp: int = 1) -> OpShape:
    """The LM head: a [hidden x vocab/tp] projection of each sampled position."""
    _check_tp(arch, tp)
    v = arch.vocab / tp
    return OpShape("gemm", arch.hidden * v, arch.hidden + v, 2 * arch.hidden * v)


def op_time(
    op: OpShape,
    num_tokens: float | np.ndarray,
    gpu: GPU,
    eff: Efficiency,
    dtype_bytes: int = 2,
) -> float | np.ndarray:
    """Seconds for `op` over `num_tokens` tokens: the roofline plus the kernel overhead.

    Vectorized over num_tokens (and over op fields given as arrays), for fitting.
    """
    nbytes = (op.weight_elems + num_tokens * op.act_elems_per_token) * dtype_bytes
    if op.kind == "gemm":
        mem = nbytes / (gpu.hbm_bandwidth_bytes_s * eff.gemm_mem)
        compute = num_tokens * op.flops_per_token / (gpu.fp16_dense_flops * eff.gemm_flops)
        return _smooth_max(mem, compute, eff.gemm_sharpness) + eff.gemm_overhead_s
    if op.kind == "elementwise":
        return nbytes / (gpu.hbm_bandwidth_bytes_s * eff.elementwise_mem) + (
            eff.elementwise_overhead_s
        )
    if op.kind == "embedding":
        return nbytes / (gpu.hbm_bandwidth_bytes_s * eff.embedding_mem) + (
            eff.embedding_overhead_s
        )
    raise ValueError(f"unknown operator kind {op.kind!r} (gemm, elementwise, embedding)")


def _smooth_max(a: float | np.ndarray, b: float | np.ndarray, p: float) -> float | np.ndarray:
    """(a^p + b^p)^(1/p): max(a, b) far from a == b, up to 2^(1/p) x max(a, b) where they meet.

    A kernel near the ridge point is neither purely memory- nor compute-bound: loads and
    multiplies overlap imperfectly, and a hard max under-predicts there (by ~15 % on A100).
    """
    if math.isinf(p):
        return np.maximum(a, b)
    hi = np.maximum(a, b)
    return hi * (1 + (np.minimum(a, b) / hi) ** p) ** (1 / p)


def allreduce_time(nbytes: float, tp: int, gpu: GPU, eff: Efficiency) -> float:
    """One ring all-reduce of `nbytes` over `tp` GPUs (0 when tp = 1). An assumption.

    Each GPU sends (and receives) 2 (tp-1)/tp of the buffer; the data sheet's interconnect
    figure counts both directions, so one direction gets half of it.
    """
    if tp == 1:
        return 0.0
    one_way = gpu.interconnect_bytes_s / 2 * eff.interconnect
    return 2 * (tp - 1) / tp * nbytes / one_way + eff.allreduce_latency_s


# ------------------------------------------------------------------------------ attention
def kv_bytes_per_token(arch: Architecture, tp: int = 1, dtype_bytes: int = 2) -> float:
    """Bytes of K and V one cached token takes on one of `tp` GPUs (all layers)."""
    _check_tp(arch, tp)
    return arch.layers * 2 * max(arch.kv_heads / tp, 1) * arch.head_dim * dtype_bytes


def decode_attention_time(kv_bytes: float, gpu: GPU, eff: Efficiency, layers: int) -> float:
    """Decode attention over `kv_bytes` of cached K and V (one GPU's share, all layers).

    Memory-bound: each decoding sequence reads its whole KV once per iteration and does
    ~2 x heads/kv_heads FLOPs per byte, far below any GPU's ridge point. Affine in kv_bytes.
    The efficiency is an assumption (no measured attention kernel).
    """
    return layers * eff.attention_overhead_s + kv_bytes / (
        gpu.hbm_bandwidth_bytes_s * eff.attention_mem
    )


def prefill_attention_time(
    arch: Architecture,
    new_tokens: int,
    context: int,
    gpu: GPU,
    eff: Efficiency,
    tp: int = 1,
    dtype_bytes: int = 2,
) -> float:
    """Causal attention of a prefill chunk of `new_tokens` after `context` cached tokens.

    Compute-bound for any real chunk (FLOPs grow with chunk x context); the roofline's memory
    side is reading the context's and chunk's K and V. The efficiency is an assumption.
    """
    if new_tokens <= 0:
        return 0.0
    flops = arch.attention_flops(new_tokens, context) / tp
    nbytes = (context + new_tokens) * kv_bytes_per_token(arch, tp, dtype_bytes)
    return arch.layers * eff.attention_overhead_s + max(
        flops / (gpu.fp16_dense_flops * eff.attention_flops),
        nbytes / (gpu.hbm_bandwidth_bytes_s * eff.attention_mem),
    )


# ------------------------------------------------------------------------------ models
@dataclass(frozen=True)
class TokenwiseModel:
    """Seconds of the token-wise (non-attention) work of one iteration on `gpu`."""

    arch: Architecture
    gpu: GPU
    efficiency: Efficiency | None = None  # None: efficiency_for(gpu)
    dtype_bytes: int = 2

    @property
    def eff(self) -> Efficiency:
        return self.efficiency if self.efficiency is not None else efficiency_for(self.gpu)

    def layer_times(self, num_tokens: int, tp: int = 1) -> dict[str, float]:
        """Per-operator seconds of one layer (Vidur's operators) over `num_tokens` tokens."""
        eff = self.eff
        return {
            name: float(op_time(op, num_tokens, self.gpu, eff, self.dtype_bytes))
            for name, op in layer_ops(self.arch, tp).items()
        }

    def layer_time(self, num_tokens: int, tp: int = 1) -> float:
        """Seconds of one layer's token-wise operators (no attention kernel, no all-reduce)."""
        return sum(self.layer_times(num_tokens, tp).values())

    def time(self, num_tokens: int, tp: int = 1, num_logits: int | None = None) -> float:
        """Seconds of one iteration's token-wise work over `num_tokens` batched tokens.

        Embedding, every layer's operators and all-reduces, the final norm and the LM head
        over `num_logits` positions (those sampled: one per decoding sequence and per prefill
        that completes in this step; default num_tokens, an upper bound). Never decreasing in
        num_tokens.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens == 0:
            return 0.0
        logits = num_tokens if num_logits is None else num_logits
        if not 0 <= logits <= num_tokens:
            raise ValueError(f"num_logits must be in [0, num_tokens], got {num_logits}")
        eff, a, g, d = self.eff, self.arch, self.gpu, self.dtype_bytes
        activation = num_tokens * a.hidden * d
        # two all-reduces per layer (attention out, MLP down), one after the embedding
        comm = (2 * a.layers + 1) * allreduce_time(activation, tp, g, eff)
        norm = layer_ops(a, tp)["input_layernorm"]
        t = (
            op_time(embedding_op(a, tp), num_tokens, g, eff, d)
            + a.layers * self.layer_time(num_tokens, tp)
            + comm
            + op_time(norm, num_tokens, g, eff, d)
        )
        if logits:
            t += op_time(lm_head_op(a, tp), logits, g, eff, d)
            # gather the logits' vocab shards on one GPU: (tp-1)/tp of them cross its link,
            # what an all-reduce of half the bytes moves
            t += allreduce_time(logits * a.vocab * d / 2, tp, g, eff)
        return float(t)


@dataclass(frozen=True)
class StepModel:
    """One iteration on `tp` GPUs of one kind: token-wise work plus attention.

    iteration_time(n, kv) = tokenwise(n) + decode_attention(kv) + prefill chunks; for a fixed
    batch that is base + per_kv_token_s x kv, which is what the engine integrates.
    """

    arch: Architecture
    gpu: GPU
    tp: int = 1
    efficiency: Efficiency | None = None
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        _check_tp(self.arch, self.tp)

    @property
    def eff(self) -> Efficiency:
        return self.efficiency if self.efficiency is not None else efficiency_for(self.gpu)

    @property
    def tokenwise(self) -> TokenwiseModel:
        return TokenwiseModel(self.arch, self.gpu, self.efficiency, self.dtype_bytes)

    @property
    def per_kv_token_s(self) -> float:
        """Seconds per cached token a decoding sequence reads (one GPU's share, all layers)."""
        kv = kv_bytes_per_token(self.arch, self.tp, self.dtype_bytes)
        return kv / (self.gpu.hbm_bandwidth_bytes_s * self.eff.attention_mem)

    def affine(self, num_tokens: int, num_logits: int | None = None,
               decoding: bool = True) -> tuple[float, float]:
        """(base_s, per_kv_token_s) of an iteration carrying `num_tokens` tokens whose decode
        attention reads some number of cached tokens: time = base + per_kv_token x KV read.

        Prefill chunks' attention is not in `base`: add `prefill_attention_s` per chunk.
        """
        base = self.tokenwise.time(num_tokens, self.tp, num_logits)
        if decoding:
            base += self.arch.layers * self.eff.attention_overhead_s
        return base, self.per_kv_token_s

    def prefill_attention_s(self, new_tokens: int, context: int = 0) -> float:
        return prefill_attention_time(self.arch, new_tokens, context, self.gpu, self.eff,
                                      self.tp, self.dtype_bytes)

    def iteration_s(
        self,
        num_tokens: int,
        kv_tokens_read: int = 0,
        prefills: Sequence[tuple[int, int]] = (),
        num_logits: int | None = None,
    ) -> float:
        """Seconds of one iteration: `num_tokens` batched tokens, decode attention over
        `kv_tokens_read` cached tokens, and prefill chunks given as (new_tokens, context)."""
        base, per_kv = self.affine(num_tokens, num_logits, decoding=kv_tokens_read > 0)
        return (
            base
            + per_kv * kv_tokens_read
            + sum(self.prefill_attention_s(c, p) for c, p in prefills)
        )


# ------------------------------------------------------------------------------ calibration
#: Vidur's folder names -> our presets (../shared/profiles/vidur-compute/<gpu>/<org>/<model>).
VIDUR_GPUS = {"a100": "a100-80gb", "h100": "h100-80gb"}
VIDUR_MODELS = {
    "meta-llama/Llama-2-7b-hf": "llama-2-7b",
    "meta-llama/Meta-Llama-3-8B": "llama-3-8b",
    "meta-llama/Llama-2-70b-hf": "llama-2-70b",
    "meta-llama/Meta-Llama-3-70B": "llama-3-70b",
    "codellama/CodeLlama-34b-Instruct-hf": "codellama-34b",
    "Qwen/Qwen-72B": "qwen-72b",
}


def operator_medians_ms(raw: pd.DataFrame) -> pd.DataFrame:
    """A Vidur-layout table (`mlp.csv`) as per-operator median milliseconds, one row per
    (num_tokens, tp): columns num_tokens, tp, emb and OPERATORS. Repeated rows (some token
    counts were measured twice) are reduced to their median."""
    ops = ["emb", *OPERATORS]
    med = raw.rename(
        columns={f"time_stats.{o}.median": o for o in ops} | {"num_tensor_parallel_workers": "tp"}
    )
    return med.groupby(["num_tokens", "tp"], as_index=False)[ops].median()


def load_vidur_profiles(root: str | Path) -> pd.DataFrame:
    """Vidur's per-operator medians, one row per (gpu, model, num_tokens, tp), in SECONDS.

    Repeated (num_tokens, tp) rows are reduced to their median. Each file's layer shape is
    checked against our architecture preset, so a mismatched preset fails loudly.
    """
    root = Path(root)
    frames = []
    for path in sorted(root.glob("*/*/*/mlp.csv")):
        vgpu, org, vmodel = path.parts[-4:-1]
        gpu_name = VIDUR_GPUS.get(vgpu)
        model = VIDUR_MODELS.get(f"{org}/{vmodel}")
        if gpu_name is None or model is None:
            raise ValueError(f"{path}: no preset for Vidur's {vgpu!r} / {org}/{vmodel}")
        raw = pd.read_csv(path)
        a = ARCHITECTURES[model]
        want = (a.heads, a.kv_heads, a.hidden, a.intermediate, a.gated_mlp)
        cols = ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "use_gated_mlp"]
        got = {tuple(r) for r in raw[cols].itertuples(index=False)}
        if got != {want}:
            raise ValueError(f"{path}: shape {sorted(got)} is not preset {model!r}'s {want}")
        ops = ["emb", *OPERATORS]
        med = operator_medians_ms(raw)
        med[ops] = med[ops] / 1e3  # ms -> s
        med.insert(0, "model", model)
        med.insert(0, "gpu", gpu_name)
        frames.append(med)
    if not frames:
        raise FileNotFoundError(f"no Vidur profiles (*/*/*/mlp.csv) under {root}")
    return pd.concat(frames, ignore_index=True)


def _design(df: pd.DataFrame, names: Sequence[str]) -> tuple[np.ndarray, list[OpShape]]:
    """The rows' token counts and, per operator in `names`, an OpShape whose fields are
    arrays over the rows (each row's model and tp): what `op_time` evaluates in one go."""
    keys = df[["model", "tp"]].drop_duplicates().reset_index(drop=True)
    shapes = [_all_ops(ARCHITECTURES[m], int(tp)) for m, tp in keys.itertuples(index=False)]
    row_key = df[["model", "tp"]].merge(keys.reset_index(), on=["model", "tp"], how="left")
    idx = row_key["index"].to_numpy()
    ops = []
    for name in names:
        field = {
            f: np.array([getattr(s[name], f) for s in shapes], dtype=float)[idx]
            for f in ("weight_elems", "act_elems_per_token", "flops_per_token")
        }
        ops.append(OpShape(_kind_of(name), **field))
    return df["num_tokens"].to_numpy(dtype=float), ops


def _kind_of(name: str) -> str:
    return "embedding" if name == "emb" else "gemm" if name in GEMMS else "elementwise"


def _predict(design: tuple[np.ndarray, list[OpShape]], gpu: GPU, eff: Efficiency) -> np.ndarray:
    """Predicted seconds, shape (rows, operators), of a `_design` on one GPU."""
    n, ops = design
    return np.stack([op_time(op, n, gpu, eff) for op in ops], axis=1)


def _all_ops(arch: Architecture, tp: int) -> dict[str, OpShape]:
    return {"emb": embedding_op(arch, tp), **layer_ops(arch, tp)}


#: Which Efficiency fields each operator kind's fit moves.
FIT_FIELDS = {
    "gemm": ("gemm_mem", "gemm_flops", "gemm_overhead_s", "gemm_sharpness"),
    "elementwise": ("elementwise_mem", "elementwise_overhead_s"),
    "embedding": ("embedding_mem", "embedding_overhead_s"),
}
_START = Efficiency(0.8, 0.7, 5e-6, 4.0, 0.5, 5e-6, 0.3, 5e-6)


def _nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, step: float = 0.3,
                 iters: int = 400, tol: float = 1e-9) -> np.ndarray:
    """Minimize f from x0 (a plain Nelder-Mead; numpy only, scipy is not a dependency)."""
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        xr = centroid + (centroid - worst)
        fr = f(xr)
        if fr < values[0]:
            xe = centroid + 2 * (centroid - worst)
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (worst - centroid)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:  # shrink toward the best
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0])
                                          for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


def _token_weights(df: pd.DataFrame) -> np.ndarray:
    """Row weights giving every power-of-two band of num_tokens the same total weight.

    Vidur samples num_tokens linearly (steps of 8 and more up to 4,096 or 32,768), so 9 of 10
    points are prefill-sized; unweighted, the fit would neglect the decode batches (1-256
    tokens) that most iterations of a serving run carry.
    """
    band = np.floor(np.log2(df["num_tokens"].to_numpy(dtype=float)))
    _, inverse, counts = np.unique(band, return_inverse=True, return_counts=True)
    w = 1.0 / counts[inverse]
    return w / w.mean()


def fit(df: pd.DataFrame, gpu: GPU, start: Efficiency = _START) -> Efficiency:
    """Fit the efficiencies and overheads to the measured operator times of one GPU's rows.

    Each operator kind is fitted on its own operators (projections: bandwidth and FLOP
    efficiencies, overhead, smooth-max sharpness; the element-wise ones and the embedding:
    efficiency and overhead), minimizing the mean absolute log ratio of predicted to measured
    time over every (model, num_tokens, tp, operator): relative error, robust to the few noisy
    points. Rows are weighted so that each power-of-two band of num_tokens counts the same
    (`_token_weights`). The efficiencies are kept <= 1 and the sharpness >= 1.
    """
    eff = start
    for kind, fields_ in FIT_FIELDS.items():
        names = [n for n in ("emb", *OPERATORS) if _kind_of(n) == kind]
        design = _design(df, names)
        measured = np.log(df[names].to_numpy(dtype=float))
        weight = _token_weights(df)[:, None]

        def loss(x: np.ndarray, fields_=fields_, design=design, measured=measured,
                 weight=weight, base=eff) -> float:
            trial = dict(zip(fields_, np.exp(x), strict=True))
            if any(v > 1 for k, v in trial.items() if not k.endswith(("_s", "sharpness"))) or (
                trial.get("gemm_sharpness", 1) < 1
            ):
                return math.inf
            pred = _predict(design, gpu, replace(base, **trial))
            return float(np.mean(weight * np.abs(np.log(pred) - measured)))

        x = _nelder_mead(loss, np.log([getattr(eff, k) for k in fields_]))
        x = _nelder_mead(loss, x)  # a restart escapes a collapsed simplex
        eff = replace(eff, **dict(zip(fields_, (float(v) for v in np.exp(x)), strict=True)))
    return eff


def layer_predictions(df: pd.DataFrame, effs: dict[str, Efficiency]) -> np.ndarray:
    """Predicted seconds of one layer (the sum of Vidur's per-layer operators) per row."""
    out = np.empty(len(df))
    for gpu_name, idx in df.groupby("gpu").indices.items():
        sub = df.iloc[idx]
        out[idx] = _predict(_design(sub, OPERATORS), GPUS[gpu_name], effs[gpu_name]).sum(axis=1)
    return out


def layer_shape(arch: Architecture) -> tuple[int, int, int, int, int, bool]:
    """What Vidur's per-layer operators see of a model: two models with equal shapes (e.g.
    Llama-2-70B and Llama-3-70B) have the same per-layer kernel times."""
    return (arch.hidden, arch.intermediate, arch.heads, arch.kv_heads, arch.head_dim,
            arch.gated_mlp)


def cross_validate(df: pd.DataFrame) -> pd.DataFrame:
    """Leave one model out: each model's points predicted by a fit on the GPU's other models.

    Models with the same layer shape as the held-out one are held out with it (Llama-2-70B and
    Llama-3-70B share every per-layer matrix: keeping one while testing the other would test
    nothing). Returns one row per (gpu, model, num_tokens, tp): measured layer seconds (the
    sum of the per-layer operators), `fit_pred` (fitted on all of the GPU's models, the
    shipped constants' way), `heldout_pred` (fitted without this model's shape), and their
    relative errors `fit_err`, `heldout_err`.
    """
    out = df[["gpu", "model", "num_tokens", "tp"]].copy()
    out["measured"] = df[list(OPERATORS)].sum(axis=1).to_numpy()
    out["fit_pred"] = np.nan
    out["heldout_pred"] = np.nan
    shape = df["model"].map(lambda m: layer_shape(ARCHITECTURES[m]))
    for gpu_name, g in df.groupby("gpu"):
        gpu = GPUS[gpu_name]
        full = fit(g, gpu)
        out.loc[g.index, "fit_pred"] = layer_predictions(g, {gpu_name: full})
        for model in g["model"].unique():
            same = shape[g.index] == layer_shape(ARCHITECTURES[model])
            train, test = g[~same], g[g["model"] == model]
            eff = fit(train, gpu)
            out.loc[test.index, "heldout_pred"] = layer_predictions(test, {gpu_name: eff})
    out["fit_err"] = (out["fit_pred"] / out["measured"] - 1).abs()
    out["heldout_err"] = (out["heldout_pred"] / out["measured"] - 1).abs()
    return out
