"""A scenario: one model, one KV budget, one workload, several allocators to compare.

`Scenario` is the validated, frozen form of a scenario file (the `kvfrag` package parses the
YAML, points errors at lines, and applies `--set`); `run(scenario)` is a pure function that
builds the workload once per distinct workload spec and runs every allocator at every sweep
point on it, returning records. Nothing here reads YAML or writes files.

A sweep maps dotted keys to lists of values; the runs are their cartesian product. Keys walk
the scenario's fields (`kv_budget`, `engine.max_num_seqs`, `workload.synthetic.arrival.rate`);
in the allocator list an element is named by its label (`allocators.paged-16.block_size`).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import pandas as pd
from kvfrag.sim import hf_config
from kvfrag.sim.allocators import TAKES_GEOMETRY, Allocator, make_allocator, options_of
from kvfrag.sim.allocators.paged import MAX_BLOCK_SIZE
from kvfrag.sim.architecture import PRESETS as ARCHITECTURES
from kvfrag.sim.architecture import Architecture
from kvfrag.sim.engine import run as run_engine
from kvfrag.sim.engine_config import EngineConfig, IterationTime, StepTime
from kvfrag.sim.engine_records import RunResult
from kvfrag.sim.geometry import CONTEXT_LENGTHS, PRESETS, KVGeometry, preset
from kvfrag.sim.hardware import GPU, batch_defaults, gpu
from kvfrag.sim.hardware import PRESETS as GPUS
from kvfrag.sim.hybrid_presets import ARCHITECTURES as HYBRID_ARCHITECTURES
from kvfrag.sim.hybrid_presets import CONTEXT_LENGTHS as HYBRID_CONTEXT_LENGTHS
from kvfrag.sim.hybrid_presets import STACKS
from kvfrag.sim.layers import FullAttention, LayerStack
from kvfrag.sim.memory import kv_budget
from kvfrag.sim.model_forms import HfModelSpec, LayeredModelSpec
from kvfrag.sim.presets import lookup, nearest
from kvfrag.sim.timing import OVERHEAD_S, from_profile, read_profile, roofline
from kvfrag.sim.units import (
    MAX_SIZE,
    check_size,
    clip_quoted,
    excerpt,
    format_size,
    parse_rate,
    parse_size,
)
from kvfrag.workloads import Workload, WorkloadSpec, build_workload
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
    MAX_SWEEP_RUNS,
    MAX_TIME_S,
    MAX_TIMED_TOKENS,
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
    Field,
    PrivateAttr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

#: Longest max_model_len modeled (tokens); a larger one is a typo. Every bound of a scenario's
#: numbers is in `workloads.spec` ("bounds"), this one included.
MAX_MODEL_LEN = MAX_TOKENS
#: A scenario name is one folder name of the results: no separators, not hidden (leading dots
#: are the staging folders'), nothing a shell or a spreadsheet would read specially.
NAME_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$")
#: Allocator labels reach summary.csv and file names: no formula starts (=, +, -, @) there.
LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+@-]{0,63}$")


class SweepPointError(ValueError):
    """A sweep point that does not validate: which (1-based), its values, and why."""

    def __init__(self, index: int, values: dict[str, Any], data: dict[str, Any], exc: ValueError):
        super().__init__(f"sweep point {index} ({show_values(values)}): {exc}")
        self.index, self.values, self.data, self.exc = index, values, data, exc


def show_values(values: dict[str, Any]) -> str:
    """`key=value, ...` of a sweep point, each value cut to a readable length."""

    def one(v: Any) -> str:
        if isinstance(v, str):
            text = v[:41]
        elif isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
            text = f"<a {len(str(v))}-digit number>"
        else:
            text = json.dumps(v, default=str)
        return text if len(text) <= 40 else text[:37] + "..."

    return ", ".join(f"{k}={one(v)}" for k, v in values.items())


def check_name(value: str) -> str:
    """A scenario name usable as one path component of the results folder."""
    if not NAME_RE.match(value):
        raise ValueError(
            f"name {excerpt(value)} is not a valid scenario name: one folder name of letters, "
            "digits, '.', '_' and '-', not starting with '.', at most 100 characters"
        )
    return value


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
    # vLLM's async scheduling (its server's default). None: true, but false in a scenario with
    # a hybrid allocator (not modelled for it yet: all its allocators then run synchronously,
    # compared on one scheduler); `Scenario.async_scheduling` resolves it
    async_scheduling: bool | None = None
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


class Scenario(_Frozen):
    name: str = "scenario"
    description: str = ""
    # A GPU (sim.hardware preset or custom): vLLM's batch defaults, the step time, and the
    # kv_budget when none is given. Budget and time are per GPU of `tp`.
    hardware: str | HardwareSpec | None = None
    tp: whole(1, MAX_TP) = 1  # tensor parallelism: KV heads and weights split across tp GPUs
    gpu_memory_utilization: number(0, 1, above=True) = 0.9  # for a derived kv_budget
    model: str | ModelForm
    kv_budget: int | str | GpuBudget | None = None  # per GPU; None: derived from hardware
    max_model_len: whole(1, MAX_TOKENS)
    workload: WorkloadSpec
    engine: EngineSpec = EngineSpec()
    allocators: list[AllocatorSpec] = Field(min_length=1)
    sweep: dict[str, list[Any]] = Field(default_factory=dict)
    #: Whether `max_model_len` was the model preset's own (the scenario left it out).
    _model_len_default: bool = PrivateAttr(default=False)

    @model_validator(mode="wrap")
    @classmethod
    def _model_len(cls, data: Any, handler: Callable[[Any], Scenario]) -> Scenario:
        """`max_model_len` left out (or null): the preset's own context length, as vLLM
        takes it (`context_length`); a model that is not a preset has none to give."""
        default = isinstance(data, dict) and data.get("max_model_len") is None
        if default:
            model = data.get("model")
            known = context_length(model) if isinstance(model, str) else _hf_length(model)
            if known is not None:
                data = {**data, "max_model_len": known}
            elif isinstance(model, dict) and "hf_config" in model:
                raise FieldError(("max_model_len",), "required: the model's config.json names "
                                 "no context length (max_position_embeddings or the like): "
                                 "give it, e.g. max_model_len: 8192")
            elif not isinstance(model, str) or model in MODEL_PRESETS:
                raise FieldError(("max_model_len",), "required for a model that is not a "
                                 "preset (a preset carries its own context length): give it, "
                                 "e.g. max_model_len: 8192")
        scenario = handler(data)
        scenario._model_len_default = default
        return scenario

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name(value)

    @field_validator("hardware")
    @classmethod
    def _hardware(cls, value: str | HardwareSpec | None) -> str | HardwareSpec | None:
        if isinstance(value, str):
            lookup(GPUS, value, "hardware")
        elif value is not None:
            value.gpu()
        return value

    @field_validator("model")
    @classmethod
    def _preset(cls, value: Any) -> Any:
        if isinstance(value, str):
            lookup(MODEL_PRESETS, value, "model")  # (the list of presets is the message)
        return value

    @field_validator("kv_budget", mode="before")
    @classmethod
    def _budget_size(cls, value: Any) -> Any:
        """A size is read here (a mapping is a GpuBudget's, checked by it)."""
        if value is None or isinstance(value, dict | GpuBudget):
            return value
        return _size(value, "kv_budget", positive=True)

    @field_validator("kv_budget")
    @classmethod
    def _budget(cls, value: int | str | GpuBudget | None) -> int | GpuBudget | None:
        if isinstance(value, GpuBudget):
            value.bytes()
        return value

    @field_validator("allocators")
    @classmethod
    def _labels(cls, value: list[AllocatorSpec], info: ValidationInfo) -> list[AllocatorSpec]:
        labels = [a.label for a in value]
        dupes = sorted({x for x in labels if labels.count(x) > 1})
        if dupes:
            raise ValueError(f"allocator labels must be unique; repeated: {', '.join(dupes)}")
        return value

    @model_validator(mode="after")
    def _layout(self) -> Scenario:
        """A Mamba hybrid's state (a page per request, not per token) has a place only in the
        `hybrid` allocator: vLLM cannot run such a model without its hybrid KV-cache manager
        (a Mamba layer cannot be promoted to full attention), and kvfrag does not price the
        state as per-token KV in the other layouts."""
        stack = self.stack
        if stack is not None and stack.mamba_layers:
            for i, spec in enumerate(self.allocators):
                if spec.kind != "hybrid":
                    raise FieldError(("allocators", i), f"allocator {spec.label!r}: {spec.kind} "
                                     f"cannot hold the Mamba state of {stack.name} "
                                     f"({stack.mamba_layers} layers; vLLM runs a Mamba hybrid "
                                     "only with its hybrid KV-cache manager): use kind hybrid")
        return self

    @model_validator(mode="after")
    def _hardware_needs(self) -> Scenario:
        """What timing from the hardware, tp and a derived budget need, said once at load."""
        step = self.engine.step_time
        if isinstance(step, ProfileSpec | RooflineSpec) and self.hardware is None:
            raise FieldError(("engine", "step_time"), "a profile or roofline step time needs "
                             "`hardware` (the attention and LM head are timed on it)")
        if self.kv_budget is None and self.hardware is None:
            raise FieldError(("kv_budget",), "give a size (e.g. 12GiB), or name `hardware` "
                             "to derive it from the GPU's memory and the model's weights")
        stack = self.stack
        kv_heads = sorted({a.kv_heads for a in stack.layers if isinstance(a, FullAttention)}
                          ) if stack is not None else [self.full_geometry.kv_heads]
        for kv in kv_heads:
            if self.tp > 1 and kv % self.tp and self.tp % kv:
                raise FieldError(("tp",), f"tp={self.tp} must divide the model's kv_heads "
                                 f"({kv}) or be a multiple of it")
        if (self.hardware is not None and self._timed_by_hardware) or self.kv_budget is None:
            arch = self.architecture
            if arch is None:
                raise FieldError(("model",), "timing on `hardware` and a derived kv_budget "
                                 "need the model's hidden, intermediate, heads and vocab")
            if arch.heads % self.tp:
                raise FieldError(("tp",), f"tp={self.tp} must divide the model's heads "
                                 f"({arch.heads})")
        return self

    @model_validator(mode="after")
    def _allocators(self) -> Scenario:
        """Build each allocator once, so option values are checked now, not later."""
        geo = self.geometry
        for i, spec in enumerate(self.allocators):
            if spec.kind in TAKES_GEOMETRY and not _takes_stack(spec.kind) and not geo.uniform:
                raise FieldError(("allocators", i), f"allocator {spec.label!r}: {spec.kind} lays "
                                 "out one K and one V buffer per layer, all of one shape; "
                                 f"the layers of {geo.name} are not alike (an MLA latent, or "
                                 "layers of different heads)")
            try:
                build_allocator(self, spec)
            except (TypeError, ValueError, ArithmeticError) as exc:
                raise FieldError(
                    ("allocators", i), f"allocator {spec.label!r}: {clip_quoted(str(exc))}"
                ) from None
        return self

    @model_validator(mode="after")
    def _engine(self) -> Scenario:
        seqs, tokens = self._batch_limits()
        e = self.engine
        if e.long_prefill_token_threshold > self.max_model_len:
            raise FieldError(("engine", "long_prefill_token_threshold"),
                             f"{e.long_prefill_token_threshold:,} must be at most max_model_len "
                             f"({self.max_model_len:,}), as vLLM requires")
        if e.async_scheduling and self._has_hybrid:
            raise FieldError(("engine", "async_scheduling"), "async scheduling is not modelled "
                             "for the hybrid allocator yet: leave the key out or set it false")
        if e.policy == "priority" and e.admission != "fcfs":
            raise FieldError(("engine", "admission"), "must be fcfs with engine.policy "
                             "priority (vLLM's priority queue admits in its own order)")
        if seqs > tokens:  # (at the one given, max_num_seqs when both are)
            which = "max_num_seqs" if e.max_num_seqs else "max_num_batched_tokens"
            raise FieldError(("engine", which), f"max_num_seqs ({seqs:,}) must be at most "
                             f"max_num_batched_tokens ({tokens:,})")
        if self.hardware is not None and self._timed_by_hardware and tokens > MAX_TIMED_TOKENS:
            # (none given: without chunked prefill, the token budget is max_model_len's)
            loc = ("engine", "max_num_batched_tokens") if e.max_num_batched_tokens else (
                "max_model_len",)
            raise FieldError(loc, f"a step time from `hardware` tabulates every batch of up to "
                             f"max_num_batched_tokens ({tokens:,}) tokens; at most "
                             f"{MAX_TIMED_TOKENS:,} (or give engine.step_time coefficients)")
        try:
            cfg = self.engine_config()
        except (OSError, ValueError) as exc:
            if not isinstance(self.engine.step_time, ProfileSpec):
                raise
            # (the profile is read here, once, so a bad one is reported at its line)
            raise FieldError(("engine", "step_time", "profile"), str(exc)) from None
        if not cfg.chunked_prefill and cfg.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"engine.max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) unless engine.chunked_prefill is true"
            )
        return self

    @model_validator(mode="after")
    def _finite(self) -> Scenario:
        """No inf or nan anywhere (workload and allocator options included): they would run
        and give NaN summaries."""
        bad = _non_finite(self.model_dump(mode="python"), ())
        if bad is not None:
            loc, value = bad
            raise FieldError(loc, f"must be a finite number, not {value}")
        return self

    @field_validator("sweep")
    @classmethod
    def _sweep(cls, value: dict[str, list[Any]], info: ValidationInfo) -> dict[str, list[Any]]:
        """Refused before any point is made: a sweep of more than MAX_SWEEP_RUNS runs
        (points x allocators), counted from the lengths of its lists."""
        for key, values in value.items():
            if not values:
                raise ValueError(f"sweep key {excerpt(key)} has no values")
        points = math.prod(len(v) for v in value.values())
        allocators = len(info.data.get("allocators") or ()) or 1
        if points * allocators > MAX_SWEEP_RUNS:
            raise ValueError(
                f"{points:,} points x {allocators} allocator(s) = {points * allocators:,} runs; "
                f"a scenario runs at most {MAX_SWEEP_RUNS:,} (split the sweep across scenarios)"
            )
        return value

    # ----------------------------------------------------------- derived
    @property
    def model_len_default(self) -> bool:
        """Whether `max_model_len` is the model preset's own (the scenario left it out)."""
        return self._model_len_default

    @property
    def model_len_per_point(self) -> bool:
        """Whether each sweep point takes its own model's context length: the scenario left
        `max_model_len` out and sweeps the model."""
        return self._model_len_default and any(
            k == "model" or k.startswith("model.") for k in self.sweep)

    @property
    def stack(self) -> LayerStack | None:
        """The model as typed layers, where it is given so (a layered preset, a layered model,
        a config.json); None for a full-attention preset or `layers: N` model, whose
        `KVGeometry` says it all."""
        m = self.model
        if isinstance(m, str):
            return STACKS.get(m)
        return None if isinstance(m, ModelSpec) else m.stack()

    @property
    def full_geometry(self) -> KVGeometry:
        """The model's KV shape over all its GPUs. A layered model's is its all-full fallback
        (`LayerStack.geometry`: every attention layer keeps every token, MLA one latent)."""
        stack = self.stack
        if stack is not None:
            return stack.geometry()
        if isinstance(self.model, str):
            return preset(self.model)
        m = self.model
        assert isinstance(m, ModelSpec)
        return KVGeometry(m.name, m.layers, m.kv_heads, m.head_dim, m.dtype_bytes)

    @property
    def geometry(self) -> KVGeometry:
        """The KV shape one GPU stores: KV heads split `tp` ways (replicated when fewer; an
        MLA latent whole on every GPU)."""
        stack = self.stack
        if stack is not None:
            return stack.shard(self.tp).geometry()
        geo = self.full_geometry
        if self.tp == 1:
            return geo
        return replace(geo, kv_heads=max(geo.kv_heads // self.tp, 1))

    @property
    def gpu(self) -> GPU | None:
        if self.hardware is None:
            return None
        return gpu(self.hardware) if isinstance(self.hardware, str) else self.hardware.gpu()

    @property
    def architecture(self) -> Architecture | None:
        """The model's matrices (a preset's, or a custom model's when given)."""
        if isinstance(self.model, str):
            return ARCHITECTURES.get(self.model) or HYBRID_ARCHITECTURES.get(self.model)
        if isinstance(self.model, LayeredModelSpec):
            return None  # (its matrices are not given: no timing from `hardware`)
        return self.model.architecture()

    @property
    def _timed_by_hardware(self) -> bool:
        return self.engine.step_time is None or isinstance(
            self.engine.step_time, ProfileSpec | RooflineSpec
        )

    @property
    def budget_bytes(self) -> int:
        """Bytes of KV cache on one GPU: as given, or derived the way vLLM does it."""
        kv = self.kv_budget
        if kv is None:
            return self.budget_breakdown()["kv_budget"]
        return kv.bytes() if isinstance(kv, GpuBudget) else int(kv)

    def budget_breakdown(self) -> dict[str, int]:
        """A derived budget and its terms, per GPU (sim.memory.kv_budget)."""
        seqs, tokens = self._batch_limits()
        return kv_budget(self.gpu, self.architecture, self.tp, self.gpu_memory_utilization,
                         tokens, seqs)

    def _batch_limits(self) -> tuple[int, int]:
        e = self.engine
        seqs, tokens = batch_defaults(self.gpu)
        if not e.chunked_prefill:
            tokens = max(tokens, self.max_model_len)  # a whole prompt must fit one iteration
        return e.max_num_seqs or seqs, e.max_num_batched_tokens or tokens

    def step_time(self, max_tokens: int) -> IterationTime:
        """The step-time model: linear coefficients, a profile, or the hardware's roofline."""
        spec, hw = self.engine.step_time, self.gpu
        if isinstance(spec, StepTimeSpec):
            return StepTime(**spec.model_dump())
        if hw is None:
            return StepTime()  # a flat 20 ms: no hardware to time on
        arch = self.architecture
        assert arch is not None  # checked at validation
        kv_dtype = self.full_geometry.dtype_bytes
        if isinstance(spec, ProfileSpec):
            return from_profile(read_profile(spec.profile), arch, hw, self.tp, max_tokens,
                                spec.overhead_s, kv_dtype)
        overhead = spec.overhead_s if spec is not None else OVERHEAD_S
        return roofline(arch, hw, self.tp, max_tokens, overhead_s=overhead,
                        kv_dtype_bytes=kv_dtype)

    @property
    def _has_hybrid(self) -> bool:
        return any(spec.kind == "hybrid" for spec in self.allocators)

    @property
    def async_scheduling(self) -> bool:
        """`engine.async_scheduling` resolved: vLLM's default (true) unless an allocator is
        hybrid, whose async scheduling is not modelled yet (then false, for all of them)."""
        e = self.engine.async_scheduling
        return (not self._has_hybrid) if e is None else e

    def engine_config(self) -> EngineConfig:
        e = self.engine
        seqs, tokens = self._batch_limits()
        return EngineConfig(
            max_num_seqs=seqs,
            max_num_batched_tokens=tokens,
            batching=e.batching,
            chunked_prefill=e.chunked_prefill,
            admission=e.admission,
            lookahead=e.lookahead,
            watermark=e.watermark,
            long_prefill_token_threshold=e.long_prefill_token_threshold,
            reserve_full_isl=e.scheduler_reserve_full_isl,
            policy=e.policy,
            async_scheduling=self.async_scheduling,
            step_time=self.step_time(tokens),
            max_time_s=e.max_time_s,
        )

    def points(self) -> list[tuple[dict[str, Any], Scenario]]:
        """Every sweep point: the swept values and the scenario they give (no sweep: one).
        A point that does not validate raises `SweepPointError`."""
        return list(self.iter_points())

    def iter_points(self) -> Iterator[tuple[dict[str, Any], Scenario]]:
        if not self.sweep:
            yield {}, self
            return
        keys = list(self.sweep)
        base = self.model_dump(mode="python", exclude={"sweep"}, exclude_unset=False)
        if self.model_len_per_point:
            del base["max_model_len"]  # (each point's model gives its own)
        product = itertools.product(*(self.sweep[k] for k in keys))
        for index, combo in enumerate(product, start=1):
            data = copy.deepcopy(base)
            values = dict(zip(keys, combo, strict=True))
            try:
                for key, value in values.items():
                    set_path(data, key, value)
                point = Scenario.model_validate(data)
            except ValueError as exc:  # ValidationError included
                raise SweepPointError(index, values, data, exc) from None
            yield values, point


def set_path(data: dict[str, Any], key: str, value: Any) -> None:
    """Set a dotted key in a scenario's raw data; list elements are named by their label."""
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            labels = [el.get("label") for el in node if isinstance(el, dict)]
            matches = [el for el in node if isinstance(el, dict) and el.get("label") == part]
            if not matches:
                hint = nearest(part, [x for x in labels if x])
                raise ValueError(
                    f"{key}: no allocator labelled {part!r}"
                    + (f"; did you mean {hint!r}?" if hint else "")
                    + f" (labels: {', '.join(x for x in labels if x)})"
                )
            if last:
                raise ValueError(f"{key}: cannot replace a whole list element")
            node = matches[0]
            continue
        if not isinstance(node, dict):
            raise ValueError(f"{key}: {'.'.join(parts[:i])} is not a mapping")
        if last:
            node[part] = value
        else:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]


def _non_finite(node: Any, loc: tuple[str | int, ...]) -> tuple[tuple, float] | None:
    """(location, value) of the first inf or nan in dumped scenario data, if any."""
    if isinstance(node, float) and not math.isfinite(node):
        return loc, node
    if isinstance(node, dict):
        items: Any = node.items()
    elif isinstance(node, list | tuple):
        items = enumerate(node)
    else:
        return None
    for key, value in items:
        found = _non_finite(value, (*loc, key))
        if found is not None:
            return found
    return None


# ------------------------------------------------------------------------ running
@dataclass
class PointRun:
    """One allocator at one sweep point."""

    point: int
    sweep: dict[str, Any]
    label: str
    kind: str
    scenario: Scenario
    result: RunResult


#: What building a workload can leave out (`workloads.Workload` counts), per summary row.
WORKLOAD_COUNTS = ("dropped_rows", "clipped", "rejected_long")


@dataclass
class ScenarioResult:
    scenario: Scenario
    workloads: dict[int, Workload]  # by sweep point
    runs: list[PointRun]

    def summary(self) -> pd.DataFrame:
        """One row per allocator x sweep point, with the sweep values as columns, and what
        building the point's workload dropped, clipped or rejected (kept on record, not only
        printed). Values stay native (a swept mapping or list as itself; `options` a dict of
        the allocator's scenario options): summary.json keeps them so, and
        `kvfrag.results.summary_table` lays them out for summary.csv and the terminal."""
        rows = []
        for r in self.runs:
            s = r.scenario
            workload = self.workloads.get(r.point)
            counts = {
                f"workload_{name}": int(getattr(workload, name, 0) or 0)
                for name in WORKLOAD_COUNTS
            }
            counts["workload_arrival_rate"] = _arrival_rate(workload)
            rows.append(
                {
                    "label": r.label,
                    "kind": r.kind,
                    "point": r.point,
                    **r.sweep,
                    "model": s.geometry.name,
                    "hardware": s.gpu.name if s.gpu is not None else "",
                    "tp": s.tp,
                    "step_time": s.engine_config().step_time.source,
                    "kv_budget_bytes": s.budget_bytes,
                    **r.result.summary,
                    "options": dict(sorted(_allocator(s, r.label).options.items())),
                    **counts,
                }
            )
        return pd.DataFrame(rows)

    def frames(self, which: str) -> pd.DataFrame:
        """`timeseries` or `requests` of every run, with label and point columns."""
        parts = []
        for r in self.runs:
            df = getattr(r.result, which)
            parts.append(df.assign(label=r.label, point=r.point))
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def _arrival_rate(workload: Workload | None) -> float:
    """Requests per second that arrived (open loop: (n - 1) / span; NaN when undefined): the
    rate the run served, after any filter."""
    if workload is None or len(workload.requests) < 2 or "user_id" in workload.requests:
        return float("nan")  # (closed loop: arrivals follow completions)
    arrivals = workload.requests["arrival_s"].dropna().to_numpy()
    span = float(arrivals.max() - arrivals.min()) if len(arrivals) > 1 else 0.0
    return (len(arrivals) - 1) / span if span > 0 else float("nan")


def _allocator(scenario: Scenario, label: str) -> AllocatorSpec:
    return next(a for a in scenario.allocators if a.label == label)


def iter_runs(scenario: Scenario) -> Iterator[tuple[int, dict[str, Any], Scenario, AllocatorSpec]]:
    for i, (values, point) in enumerate(scenario.points()):
        for spec in point.allocators:
            yield i, values, point, spec


def run(
    scenario: Scenario,
    base_dir: Path | None = None,
    on_run: Callable[[str], None] | None = None,
) -> ScenarioResult:
    """Run every allocator at every sweep point; `on_run(label)` is told as each finishes."""
    base_dir = Path(".") if base_dir is None else base_dir
    cache: dict[str, Workload] = {}
    workloads: dict[int, Workload] = {}
    runs = []
    for i, values, point, spec in iter_runs(scenario):
        key = point.workload.model_dump_json() + f"|{point.max_model_len}"
        if key not in cache:
            cache[key] = build_workload(point.workload, base_dir, None, point.max_model_len)
        workloads[i] = cache[key]
        result = run_point(point, spec, workloads[i].requests)
        runs.append(PointRun(i, values, spec.label, spec.kind, point, result))
        if on_run is not None:
            on_run(spec.label)
    return ScenarioResult(scenario, workloads, runs)


def _takes_stack(kind: str) -> bool:
    """Whether `kind` lays out the model's typed layers itself (the hybrid allocator), so
    that layers that are not alike need no uniform geometry."""
    return "stack" in options_of(kind)


def allocator_options(point: Scenario, spec: AllocatorSpec) -> dict[str, Any]:
    """`spec`'s options, with what the scenario sets for a kind that takes a stack: the
    model's layers as one GPU of `tp` keeps them (a full-attention model as alike layers), and
    the engine's max_num_batched_tokens (the tokens in flight of the planner and of the
    admission cap)."""
    options = spec.options
    if _takes_stack(spec.kind):
        stack = point.stack
        # (None: a full-attention model, whose sharded geometry the allocator reads as such)
        options["stack"] = None if stack is None else stack.shard(point.tp)
        options["max_num_batched_tokens"] = point._batch_limits()[1]
    return options


def build_allocator(point: Scenario, spec: AllocatorSpec) -> Allocator:
    """A fresh allocator of `spec` for one sweep point (its budget, model and max_model_len)."""
    geo = point.geometry
    allocator = make_allocator(
        spec.kind,
        capacity=point.budget_bytes,
        bytes_per_token=geo.bytes_per_token,
        max_model_len=point.max_model_len,
        geometry=geo,
        **allocator_options(point, spec),
    )
    stack = point.stack
    if stack is not None and not _takes_stack(spec.kind):
        # (it keeps every token in every layer: token states as the layers read them)
        allocator.view_model(stack.shard(point.tp))
    return allocator


def run_point(
    point: Scenario,
    spec: AllocatorSpec,
    requests: pd.DataFrame,
    progress: Callable[[int, int], None] | None = None,
    capacity: bool = True,
) -> RunResult:
    """One allocator at one sweep point, on its workload's request table (the unit of work
    of `run` and of `sim.sweep`'s executors). A torch-caching run carries the allocator's
    PyTorch memory snapshot at its end (`RunResult.snapshot`, see `sim.snapshot`).
    `progress(done, total)`: requests retired so far, as `sim.engine.run` reports them.
    With `capacity`, the summary carries the saturating replay's figures (`sim.capacity`)
    after `max_running`."""
    from kvfrag.sim.capacity import saturate
    from kvfrag.sim.snapshot import TorchCachingAllocator, snapshot

    allocator = build_allocator(point, spec)
    config = point.engine_config()
    result = run_engine(requests, allocator, config, progress)
    if isinstance(allocator, TorchCachingAllocator):
        result.snapshot = snapshot(allocator)
    if capacity:
        fields = saturate(requests, lambda: build_allocator(point, spec), config)
        summary: dict[str, float | int | str] = {}
        for key, value in result.summary.items():
            summary[key] = value
            if key == "max_running":
                summary.update(fields)
        result.summary = summary
    return result


#: Block sizes vLLM 0.33's attention kernels run on NVIDIA GPUs: multiples of 16. A backend
#: takes a block size that is a multiple of one of its kernel block sizes
#: (vllm/v1/attention/backend.py, AttentionBackend.supports_block_size, and "block_size not
#: supported" in validate_configuration), which get_supported_kernel_block_sizes gives as
#: MultipleOf(16) for FlashAttention (v1/attention/backends/flash_attn.py) and Triton
#: (triton_attn.py), [16, 32, 64] for FlashInfer (flashinfer.py); MLA backends ask more
#: (FlashMLA 64, CUTLASS MLA 128: v1/attention/backends/mla/). vLLM's own default is 16
#: (config/cache.py, CacheConfig.DEFAULT_BLOCK_SIZE).
VLLM_BLOCK_MULTIPLE = 16


def block_size_warnings(specs: Iterable[AllocatorSpec]) -> list[str]:
    """One line per allocator label given a `block_size` vLLM 0.33 cannot run (not a multiple
    of `VLLM_BLOCK_MULTIPLE`), every such size of its sweep points named: a warning, not an
    error (kvfrag may model what vLLM does not)."""
    odd: dict[str, set[int]] = {}
    for spec in specs:
        size = spec.options.get("block_size")
        if isinstance(size, int) and size % VLLM_BLOCK_MULTIPLE:
            odd.setdefault(spec.label, set()).add(size)
    return [
        f"allocator {label!r}: block_size {', '.join(map(str, sorted(sizes)))} is not one vLLM "
        f"0.33's attention kernels run (multiples of {VLLM_BLOCK_MULTIPLE}: 16, 32, 64, ...); "
        "modelled all the same"
        for label, sizes in odd.items()
    ]


def count_runs(scenario: Scenario) -> int:
    return len(scenario.points()) * len(scenario.allocators)
