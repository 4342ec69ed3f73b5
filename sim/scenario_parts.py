"""The parts of a scenario: the frozen, validated specs of its model, hardware, KV budget, step
time, engine and allocators, each checking its own fields (`Scenario` in sim/scenario.py checks
them against each other). Bad values raise pydantic's errors, which `kvfrag.config` points at
the file's lines."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from kvfrag.sim import hf_config
from kvfrag.sim.allocators import options_of
from kvfrag.sim.allocators.paged import MAX_BLOCK_SIZE
from kvfrag.sim.architecture import Architecture
from kvfrag.sim.geometry import CONTEXT_LENGTHS, PRESETS, KVGeometry
from kvfrag.sim.hardware import GPU
from kvfrag.sim.hybrid_presets import CONTEXT_LENGTHS as HYBRID_CONTEXT_LENGTHS
from kvfrag.sim.hybrid_presets import STACKS
from kvfrag.sim.model_forms import HfModelSpec, LayeredModelSpec
from kvfrag.sim.presets import nearest
from kvfrag.sim.speculative_spec import SpeculativeSpec
from kvfrag.sim.timing import OVERHEAD_S
from kvfrag.sim.units import (
    MAX_SIZE,
    check_size,
    clip_quoted,
    excerpt,
    format_size,
    parse_rate,
    parse_size,
)
from kvfrag.workloads.spec import (
    MAX_BANDWIDTH,
    MAX_DTYPE_BYTES,
    MAX_FLOPS,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    MAX_NUM_SEQS,
    MAX_REQUESTS,
    MAX_ROUNDUP_DIVISIONS,
    MAX_STEP_S,
    MAX_TIME_S,
    MAX_TOKEN_S,
    MAX_TOKENS,
    MAX_TP,
    MAX_VOCAB,
    MIN_BANDWIDTH,
    MIN_FLOPS,
    FieldError,
    check_number,
    number,
    show,
    whole,
)
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

#: Longest max_model_len modeled (tokens); a larger one is a typo. Every bound of a scenario's
#: numbers is in `workloads.spec` ("bounds"), this one included.
MAX_MODEL_LEN = MAX_TOKENS
#: Allocator labels reach summary.csv and file names: no formula starts (=, +, -, @) there.
LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+@-]{0,63}$")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


#: Step-time terms: a whole iteration's, and one token's.
StepSeconds = number(0, MAX_STEP_S, unit="seconds")
TokenSeconds = number(0, MAX_TOKEN_S, unit="seconds per token")


def _size(value: Any, what: str, positive: bool = False) -> int:
    """A byte size, read before pydantic's int (which would take `true` as 1 byte) and
    bounded by MAX_SIZE."""
    low = "1 B" if positive else "0 B"
    try:
        size = check_size(parse_size(value), what)
    except ValueError as exc:
        if "at most" in str(exc):  # (a size too large: the message gives the limit)
            raise
        text = str(exc).removesuffix(" (write e.g. 50GB or 12GiB)")
        span = f"{low} to {format_size(MAX_SIZE)}"
        raise ValueError(f"{text} (a size is {span}, e.g. 12GiB)") from None
    if positive and size <= 0:
        raise ValueError(f"{what} must be a size from {low} to {format_size(MAX_SIZE)}, not 0")
    return size


class ModelSpec(_Frozen):
    """A custom model; a preset is named by a plain string instead. The KV geometry (layers,
    kv_heads, head_dim) is all memory needs; timing from `hardware` and a derived kv_budget
    also need the matrices (hidden, intermediate, heads, vocab, gated_mlp)."""

    name: str = "custom"
    layers: whole(1, MAX_LAYERS)
    kv_heads: whole(1, MAX_HEADS)
    head_dim: whole(1, MAX_HEAD_DIM)
    dtype_bytes: whole(1, MAX_DTYPE_BYTES) = 2
    hidden: whole(1, MAX_HIDDEN) | None = None
    intermediate: whole(1, MAX_INTERMEDIATE) | None = None  # width of one MLP matrix
    heads: whole(1, MAX_HEADS) | None = None
    vocab: whole(1, MAX_VOCAB) | None = None
    gated_mlp: bool = True

    @model_validator(mode="after")
    def _shape(self) -> ModelSpec:
        """The geometry and the matrices must agree (heads a multiple of kv_heads, ...):
        checked here, so the error is at `model`."""
        try:
            KVGeometry(self.name, self.layers, self.kv_heads, self.head_dim, self.dtype_bytes)
            self.architecture()
        except ValueError as exc:
            raise ValueError(clip_quoted(str(exc))) from None
        return self

    def architecture(self) -> Architecture | None:
        """The architecture, or None when its matrices are not given."""
        if None in (self.hidden, self.intermediate, self.heads, self.vocab):
            return None
        return Architecture(self.name, self.hidden, self.intermediate, self.layers, self.heads,
                            self.kv_heads, self.head_dim, self.vocab, self.gated_mlp)


#: Every model preset by name: the full-attention ones (`sim.geometry`) and the layered ones
#: (`sim.hybrid_presets`).
MODEL_PRESETS: dict[str, object] = {**PRESETS, **STACKS}


def _hf_length(model: Any) -> int | None:
    """The context length of `model: {hf_config: ...}` as read (`hf_config.context_length`);
    None for any other form, or a config that names none."""
    ref = model.get("hf_config") if isinstance(model, dict) else None
    config = ref.get("config") if isinstance(ref, dict) else getattr(ref, "config", None)
    if not isinstance(config, dict):
        return None
    try:
        return hf_config.context_length(config)
    except hf_config.HfConfigError as exc:
        raise FieldError(("model", "hf_config"), f"{_ref_path(ref)}: {exc}") from None


def _ref_path(ref: Any) -> str:
    return str(ref.get("path") if isinstance(ref, dict) else getattr(ref, "path", "config.json"))


def context_length(model: str) -> int | None:
    """A model preset's own context length (tokens), what vLLM 0.33 defaults max_model_len to;
    None for a name that is not a preset."""
    return CONTEXT_LENGTHS.get(model) or HYBRID_CONTEXT_LENGTHS.get(model)


def _model_form(value: Any) -> str:
    """Which written-out model a mapping is, by its keys (so errors speak of that form)."""
    if isinstance(value, dict):
        if "hf_config" in value:
            return "hf-model"
        return "layered-model" if isinstance(value.get("layers"), list) else "custom-model"
    return {HfModelSpec: "hf-model", LayeredModelSpec: "layered-model"}.get(
        type(value), "custom-model")  # (anything else: the custom form's type error)


ModelForm = Annotated[
    Annotated[ModelSpec, Tag("custom-model")]
    | Annotated[LayeredModelSpec, Tag("layered-model")]
    | Annotated[HfModelSpec, Tag("hf-model")],
    Discriminator(_model_form),
]


class HardwareSpec(_Frozen):
    """A custom GPU: the fields of sim.hardware.GPU (a preset is named by a string)."""

    name: str = "custom-gpu"
    memory_bytes: int | str
    hbm_bandwidth_bytes_s: number(MIN_BANDWIDTH, MAX_BANDWIDTH, unit="bytes per second")
    fp16_dense_flops: number(MIN_FLOPS, MAX_FLOPS, unit="FLOP per second")
    interconnect_bytes_s: number(MIN_BANDWIDTH, MAX_BANDWIDTH, unit="bytes per second")

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _memory(cls, value: Any) -> int:
        return _size(value, "memory_bytes", positive=True)

    def gpu(self) -> GPU:
        return GPU(self.name, int(self.memory_bytes), self.hbm_bandwidth_bytes_s,
                   self.fp16_dense_flops, self.interconnect_bytes_s)


class GpuBudget(_Frozen):
    """KV budget as a server computes it: GPU memory x utilization - weights - activations."""

    gpu_memory: int | str
    utilization: number(0, 1, above=True) = 0.9
    weights: int | str = 0
    activations: int | str = 0

    @field_validator("gpu_memory", "weights", "activations", mode="before")
    @classmethod
    def _size(cls, value: Any, info: ValidationInfo) -> int:
        return _size(value, str(info.field_name))

    def bytes(self) -> int:
        budget = int(self.gpu_memory * self.utilization) - self.weights - self.activations
        if budget <= 0:
            raise ValueError(
                f"kv_budget: gpu_memory x utilization leaves {format_size(budget)} after weights"
                " and activations"
            )
        return budget


class StepTimeSpec(_Frozen):
    """Linear coefficients (sim.engine_config.StepTime); `kvfrag calibrate` fits them to a
    server."""

    base_s: StepSeconds = 0.02
    per_batched_token_s: TokenSeconds = 0.0
    per_kv_token_s: TokenSeconds = 0.0


class ProfileSpec(_Frozen):
    """Token-wise layer times measured per operator (Vidur's `mlp.csv` layout), interpolated;
    attention and the LM head from the roofline of the scenario's `hardware`."""

    profile: str
    overhead_s: StepSeconds = OVERHEAD_S


class RooflineSpec(_Frozen):
    """The roofline of the scenario's `hardware` (the default when it names one); written
    out to change its per-iteration CPU overhead."""

    roofline: Literal[True] = True
    overhead_s: StepSeconds = OVERHEAD_S


def _step_time_form(value: Any) -> str:
    """Which step_time form a mapping is, by its keys (so errors speak of that form only)."""
    if isinstance(value, dict):
        return "profile" if "profile" in value else "roofline" if "roofline" in value else "linear"
    return {ProfileSpec: "profile", RooflineSpec: "roofline"}.get(type(value), "linear")


StepTimeForm = Annotated[
    Annotated[StepTimeSpec, Tag("linear")]
    | Annotated[ProfileSpec, Tag("profile")]
    | Annotated[RooflineSpec, Tag("roofline")],
    Discriminator(_step_time_form),
]


#: Scheduler limits of vLLM's older V0 scheduler that vLLM 0.33's v1 scheduler does not have.
NOT_IN_VLLM_V1 = ("max_num_partial_prefills", "max_long_partial_prefills")


class EngineSpec(_Frozen):
    """Where a scenario is silent, vLLM 0.33's defaults: chunked prefill on, and the batch
    limits of the scenario's `hardware` class (`sim.hardware.batch_defaults`); without
    chunked prefill the token budget is at least max_model_len."""

    max_num_seqs: whole(1, MAX_NUM_SEQS) | None = None
    max_num_batched_tokens: whole(1, MAX_TOKENS) | None = None
    batching: str = "continuous"
    chunked_prefill: bool = True
    admission: str = "fcfs"
    lookahead: whole(1, MAX_REQUESTS) = 64
    watermark: number(0, 1, below=True) = 0.0
    # vLLM's per-request cap on a step's prefill tokens (0: off, vLLM's default); at most
    # max_model_len, as vLLM requires
    long_prefill_token_threshold: whole(0, MAX_TOKENS) = 0
    # vLLM's full-sequence admission gate (on by default in vLLM 0.33)
    scheduler_reserve_full_isl: bool = True
    # vLLM's scheduling policy: fcfs, or priority (the request table's `priority` column)
    policy: Literal["fcfs", "priority"] = "fcfs"
    # vLLM's async scheduling (its server's default). None: true; `Scenario.async_scheduling`
    # resolves it
    async_scheduling: bool | None = None
    # vLLM's speculative decoding (sim/speculative_spec.py): method, num_tokens drafts per
    # decode step, their acceptance, the draws' seed, the draft's KV layers. None: off.
    # Modelled with the synchronous scheduler: async_scheduling left out then resolves false
    speculative: SpeculativeSpec | None = None
    # None: the roofline of `hardware` when the scenario names one, else a flat 20 ms
    step_time: StepTimeForm | None = None
    max_time_s: number(0, MAX_TIME_S, above=True, unit="seconds") | None = None


    @model_validator(mode="before")
    @classmethod
    def _not_in_v1(cls, data: Any) -> Any:
        """vLLM's limits on concurrent partial prefills: refused by name, not as unknown."""
        if isinstance(data, dict):
            for key in NOT_IN_VLLM_V1:
                if key in data:
                    raise FieldError((key,), "vLLM 0.33's v1 scheduler has no such limit (it "
                                     "lets any number of prefills run partway); leave it out")
        return data


class AllocatorSpec(BaseModel):
    """One allocator to compare: a label, a registry kind, and that kind's options."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)

    label: str
    kind: str

    @field_validator("kind")
    @classmethod
    def _kind(cls, value: str) -> str:
        try:  # (an unknown kind: the error that lists the valid ones; no kind is that long)
            options_of(value if len(value) <= 100 else value[:100] + "...")
        except ValueError as exc:
            raise ValueError(clip_quoted(str(exc))) from None
        return value

    @field_validator("label")
    @classmethod
    def _label(cls, value: str) -> str:
        if not LABEL_RE.match(value):
            raise ValueError(
                f"label {value[:80]!r}: use letters, digits, '.', '_', '+', '@' and '-', "
                "starting with a letter or digit, at most 64 characters"
            )
        return value

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _known(self) -> AllocatorSpec:
        valid = options_of(self.kind)  # raises with the list of valid kinds
        for name in self.options:
            if name not in valid:
                hint = nearest(name, valid)
                raise ValueError(
                    f"allocator {self.label!r} ({self.kind}) has no option {excerpt(name)}"
                    + (f"; did you mean {hint!r}?" if hint else "")
                    + f" (valid: {', '.join(valid) or 'none'})"
                )
        for name, value in self.options.items():
            if name in FROM_SCENARIO:
                raise ValueError(f"allocator {self.label!r} ({self.kind}): {name} is not an "
                                 f"option here: the scenario's {FROM_SCENARIO[name]} sets it")
            try:
                _check_option(name, value)
            except ValueError as exc:
                raise ValueError(f"allocator {self.label!r}: {name} {exc}") from None
        return self


#: Allocator options that are whole numbers, and their ranges (concurrent batches in flight:
#: pipeline stages at most, so no more than GPUs).
_WHOLE_OPTIONS = {
    "block_size": (1, MAX_BLOCK_SIZE),
    "roundup_power2_divisions": (1, MAX_ROUNDUP_DIVISIONS),
    "concurrent_batches": (1, MAX_TP),
}
#: Allocator options that are true or false (1, "yes" or null is refused, not read as one).
_BOOL_OPTIONS = frozenset({"hybrid_kv_cache_manager", "prefix_caching"})
#: Constructor options a scenario fills in from its own fields (the hybrid allocator's model
#: and token budget), so that they cannot disagree with the model and engine that run.
FROM_SCENARIO = {"stack": "`model`", "max_num_batched_tokens": "engine.max_num_batched_tokens"}


def _check_option(name: str, value: Any) -> None:
    """The type and range of an allocator option that is a number, a size or a name, checked
    before the allocator is built (it checks the rest: names, booleans, powers of two), so
    that `true`, 1e30 or 2.5 is one clear line. Raises ValueError("must be ...")."""
    if name in _WHOLE_OPTIONS:
        check_number(value, *_WHOLE_OPTIONS[name], whole=True)
    elif name == "prefix_cache_retention_interval" and value is not None:
        check_number(value, 0, MAX_MODEL_LEN, whole=True, unit="tokens")
    elif name in _BOOL_OPTIONS and not isinstance(value, bool):
        raise ValueError(f"must be true or false, not {show(value)}")
    elif name == "bandwidth":
        rate = parse_rate(value) if isinstance(value, str) else value
        check_number(rate, MIN_BANDWIDTH, MAX_BANDWIDTH, unit="bytes per second")
    elif name == "max_split_size_mb" and value is not None:
        check_number(value, 20, MAX_SIZE // 2**20, above=True, unit="MiB")
    elif name == "page_size":
        try:
            size = parse_size(value)
        except ValueError:
            size = 0
        if not 1 <= size <= MAX_SIZE:
            raise ValueError(f"must be a size from 1 B to {format_size(MAX_SIZE)} (e.g. 2MiB), "
                             f"not {show(value)}")
    elif name in ("reserve", "placement") and (not isinstance(value, str) or len(value) > 100):
        raise ValueError(f"must be a name, not {show(value)}")
