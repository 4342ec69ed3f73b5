"""A scenario: one model, one KV budget, one workload, several allocators to compare.

`Scenario` is the validated, frozen form of a scenario file (the `kvfrag` package parses the
YAML, points errors at lines, and applies `--set`): its parts' specs (sim/scenario_parts.py)
checked against each other, its sweep points, and the allocator each of its labels builds.
Running it is sim/scenario_run.py's `run(scenario)`. Nothing here reads YAML or writes files.

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
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from kvfrag.sim.allocators import TAKES_GEOMETRY, Allocator, make_allocator, options_of
from kvfrag.sim.architecture import PRESETS as ARCHITECTURES
from kvfrag.sim.architecture import Architecture
from kvfrag.sim.engine_config import EngineConfig, IterationTime, StepTime
from kvfrag.sim.geometry import KVGeometry, preset
from kvfrag.sim.hardware import GPU, batch_defaults, gpu
from kvfrag.sim.hardware import PRESETS as GPUS
from kvfrag.sim.hybrid_presets import ARCHITECTURES as HYBRID_ARCHITECTURES
from kvfrag.sim.hybrid_presets import STACKS
from kvfrag.sim.layers import FullAttention, LayerStack
from kvfrag.sim.memory import kv_budget
from kvfrag.sim.model_forms import LayeredModelSpec
from kvfrag.sim.presets import lookup, nearest
from kvfrag.sim.scenario_parts import (
    MODEL_PRESETS,
    AllocatorSpec,
    EngineSpec,
    GpuBudget,
    HardwareSpec,
    ModelForm,
    ModelSpec,
    ProfileSpec,
    RooflineSpec,
    StepTimeSpec,
    _Frozen,
    _hf_length,
    _size,
    context_length,
)
from kvfrag.sim.speculative import Speculative
from kvfrag.sim.speculative_spec import draft_geometry, draft_stack, mtp_layers, refusal
from kvfrag.sim.timing import OVERHEAD_S, from_profile, read_profile, roofline
from kvfrag.sim.units import (
    clip_quoted,
    excerpt,
)
from kvfrag.workloads import WorkloadSpec
from kvfrag.workloads.spec import (
    MAX_SWEEP_RUNS,
    MAX_TIMED_TOKENS,
    MAX_TOKENS,
    MAX_TP,
    FieldError,
    number,
    whole,
)
from pydantic import (
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

#: A scenario name is one folder name of the results: no separators, not hidden (leading dots
#: are the staging folders'), nothing a shell or a spreadsheet would read specially.
NAME_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$")


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
        layouts that lay out the model's layers themselves (the `hybrid` and `two-level`
        allocators, a pool per layer type in `static-partition`, the `floor`'s exact need):
        vLLM cannot run such a model without its hybrid KV-cache manager (a Mamba layer cannot
        be promoted to full attention), and kvfrag does not price the state as per-token KV
        in the other layouts."""
        stack = self.stack
        if stack is not None and stack.mamba_layers:
            for i, spec in enumerate(self.allocators):
                if not _takes_stack(spec.kind):
                    raise FieldError(("allocators", i), f"allocator {spec.label!r}: {spec.kind} "
                                     f"cannot hold the Mamba state of {stack.name} "
                                     f"({stack.mamba_layers} layers; vLLM runs a Mamba hybrid "
                                     "only with its hybrid KV-cache manager): use kind hybrid "
                                     "(or static-partition, floor)")
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
    def _speculative(self) -> Scenario:
        """What speculative decoding is not modelled with (async scheduling, static batching,
        the hybrid and prefix-caching allocators, n > 1), refused at its field."""
        spec = self.engine.speculative
        if spec is not None:
            problem = refusal(spec, self)
            if problem is not None:
                raise FieldError(*problem)
        return self

    @model_validator(mode="after")
    def _engine(self) -> Scenario:
        seqs, tokens = self._batch_limits()
        e = self.engine
        if e.long_prefill_token_threshold > self.max_model_len:
            raise FieldError(("engine", "long_prefill_token_threshold"),
                             f"{e.long_prefill_token_threshold:,} must be at most max_model_len "
                             f"({self.max_model_len:,}), as vLLM requires")
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
        MLA latent whole on every GPU), the draft's KV layers included (`draft_layers`)."""
        stack = self.kv_stack
        if stack is not None:
            return stack.geometry()
        geo = self.full_geometry
        if self.tp > 1:
            geo = replace(geo, kv_heads=max(geo.kv_heads // self.tp, 1))
        return draft_geometry(geo, self.draft_layers, self._draft_layer())

    @property
    def kv_stack(self) -> LayerStack | None:
        """The layers one GPU of `tp` keeps KV for: the model's (`stack`), then the draft's
        (speculative decoding: vLLM puts them in the target's KV group, so every block holds
        them too); None where `stack` is."""
        stack = self.stack
        if stack is None:
            return None
        return draft_stack(stack.shard(self.tp), self.draft_layers, self._draft_layer())

    def _draft_layer(self) -> FullAttention | None:
        """A named draft model's KV layer on one GPU, in the model's KV dtype (None: the
        draft copies the target's layers)."""
        spec = self.engine.speculative
        if spec is None:
            return None
        return spec.draft_layer(self.tp, self.full_geometry.dtype_bytes)

    @property
    def speculative(self) -> Speculative | None:
        """`engine.speculative` as the engine takes it (its seed defaults to the workload's)."""
        spec = self.engine.speculative
        return None if spec is None else spec.resolve(self.workload.seed)

    @property
    def draft_layers(self) -> int:
        """KV layers of the speculative draft (0 without one): `engine.speculative.draft_layers`,
        else the method's default (EAGLE 1, MTP the model's MTP layers, n-gram 0)."""
        spec = self.engine.speculative
        return 0 if spec is None else spec.draft_layer_count(mtp_layers(self.model))

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
        spec = self.engine.speculative
        draft = None if spec is None else spec.draft_architecture()
        return kv_budget(self.gpu, self.architecture, self.tp, self.gpu_memory_utilization,
                         tokens, seqs, draft=draft)

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
    def async_scheduling(self) -> bool:
        """`engine.async_scheduling` resolved: vLLM's server default (true) when left out."""
        e = self.engine.async_scheduling
        return True if e is None else e

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
            speculative=self.speculative,
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
    """Set a dotted key in a scenario's raw data; list elements are named by their label.
    Under `sweep` the rest of the key is one key, as a sweep names what it varies by its
    dotted path (`sweep.engine.chunked_prefill` sets sweep's "engine.chunked_prefill")."""
    parts = key.split(".")
    if parts[0] == "sweep" and len(parts) > 2:
        parts = ["sweep", ".".join(parts[1:])]
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


def _takes_stack(kind: str) -> bool:
    """Whether `kind` lays out the model's typed layers itself (the hybrid allocator), so
    that layers that are not alike need no uniform geometry."""
    return "stack" in options_of(kind)


def allocator_options(point: Scenario, spec: AllocatorSpec) -> dict[str, Any]:
    """`spec`'s options, with what the scenario sets for a kind that takes a stack: the
    model's layers as one GPU of `tp` keeps them (a full-attention model as alike layers), and
    the engine's max_num_batched_tokens (the tokens in flight of the planner and of the
    admission cap) and, unless given, its concurrent batches: vLLM's `max_concurrent_batches`,
    2 with async scheduling, else 1."""
    options = spec.options
    if _takes_stack(spec.kind):
        stack = point.stack
        # (None: a full-attention model, whose sharded geometry the allocator reads as such)
        options["stack"] = None if stack is None else stack.shard(point.tp)
        options["max_num_batched_tokens"] = point._batch_limits()[1]
        if "concurrent_batches" in options_of(spec.kind):
            options.setdefault("concurrent_batches", 2 if point.async_scheduling else 1)
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
    stack = point.kv_stack
    if stack is not None and not _takes_stack(spec.kind):
        # (it keeps every token in every layer: token states as the layers read them)
        allocator.view_model(stack)
    return allocator
