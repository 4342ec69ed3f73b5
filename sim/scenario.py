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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import pandas as pd
from kvfrag.sim.allocators import Allocator, make_allocator, options_of
from kvfrag.sim.architecture import PRESETS as ARCHITECTURES
from kvfrag.sim.architecture import Architecture
from kvfrag.sim.engine import EngineConfig, IterationTime, RunResult, StepTime
from kvfrag.sim.engine import run as run_engine
from kvfrag.sim.geometry import PRESETS, KVGeometry, preset
from kvfrag.sim.hardware import GPU, batch_defaults, gpu
from kvfrag.sim.hardware import PRESETS as GPUS
from kvfrag.sim.memory import kv_budget
from kvfrag.sim.presets import lookup, nearest
from kvfrag.sim.timing import OVERHEAD_S, from_profile, read_profile, roofline
from kvfrag.sim.units import check_size, format_size, parse_size
from kvfrag.workloads import Workload, WorkloadSpec, build_workload
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PositiveInt,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

#: Longest max_model_len modeled (tokens); a larger one is a typo.
MAX_MODEL_LEN = 2**31
#: A scenario name is one folder name of the results: no separators, not hidden (leading dots
#: are the staging folders'), nothing a shell or a spreadsheet would read specially.
NAME_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$")
#: Allocator labels reach summary.csv and file names: no formula starts (=, +, -, @) there.
LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+@-]{0,63}$")


class FieldError(ValueError):
    """A model-level problem with one field inside: `loc` says which, for the error's line."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


class SweepPointError(ValueError):
    """A sweep point that does not validate: which (1-based), its values, and why."""

    def __init__(self, index: int, values: dict[str, Any], data: dict[str, Any], exc: ValueError):
        super().__init__(f"sweep point {index} ({show_values(values)}): {exc}")
        self.index, self.values, self.data, self.exc = index, values, data, exc


def show_values(values: dict[str, Any]) -> str:
    """`key=value, ...` of a sweep point, each value cut to a readable length."""

    def one(v: Any) -> str:
        text = v if isinstance(v, str) else json.dumps(v, default=str)
        return text if len(text) <= 40 else text[:37] + "..."

    return ", ".join(f"{k}={one(v)}" for k, v in values.items())


def check_name(value: str) -> str:
    """A scenario name usable as one path component of the results folder."""
    if not NAME_RE.match(value):
        raise ValueError(
            f"name {value[:120]!r} is not a valid scenario name: one folder name of letters, "
            "digits, '.', '_' and '-', not starting with '.', at most 100 characters"
        )
    return value


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSpec(_Frozen):
    """A custom model; a preset is named by a plain string instead. The KV geometry (layers,
    kv_heads, head_dim) is all memory needs; timing from `hardware` and a derived kv_budget
    also need the matrices (hidden, intermediate, heads, vocab, gated_mlp)."""

    name: str = "custom"
    layers: PositiveInt
    kv_heads: PositiveInt
    head_dim: PositiveInt
    dtype_bytes: PositiveInt = 2
    hidden: PositiveInt | None = None
    intermediate: PositiveInt | None = None  # width of one MLP matrix
    heads: PositiveInt | None = None
    vocab: PositiveInt | None = None
    gated_mlp: bool = True

    def architecture(self) -> Architecture | None:
        """The architecture, or None when its matrices are not given."""
        if None in (self.hidden, self.intermediate, self.heads, self.vocab):
            return None
        return Architecture(self.name, self.hidden, self.intermediate, self.layers, self.heads,
                            self.kv_heads, self.head_dim, self.vocab, self.gated_mlp)


class HardwareSpec(_Frozen):
    """A custom GPU: the fields of sim.hardware.GPU (a preset is named by a string)."""

    name: str = "custom-gpu"
    memory_bytes: int | str
    hbm_bandwidth_bytes_s: float = Field(gt=0)
    fp16_dense_flops: float = Field(gt=0)
    interconnect_bytes_s: float = Field(gt=0)

    @field_validator("memory_bytes")
    @classmethod
    def _memory(cls, value: int | str) -> int:
        return check_size(parse_size(value), "memory_bytes")

    def gpu(self) -> GPU:
        return GPU(self.name, int(self.memory_bytes), self.hbm_bandwidth_bytes_s,
                   self.fp16_dense_flops, self.interconnect_bytes_s)


class GpuBudget(_Frozen):
    """KV budget as a server computes it: GPU memory x utilization - weights - activations."""

    gpu_memory: int | str
    utilization: float = Field(default=0.9, gt=0, le=1)
    weights: int | str = 0
    activations: int | str = 0

    @field_validator("gpu_memory", "weights", "activations")
    @classmethod
    def _size(cls, value: int | str, info: ValidationInfo) -> int:
        return check_size(parse_size(value), str(info.field_name))

    def bytes(self) -> int:
        budget = int(self.gpu_memory * self.utilization) - self.weights - self.activations
        if budget <= 0:
            raise ValueError(
                f"kv_budget: gpu_memory x utilization leaves {format_size(budget)} after weights"
                " and activations"
            )
        return budget


class StepTimeSpec(_Frozen):
    """Linear coefficients (sim.engine.StepTime); `kvfrag calibrate` fits them to a server."""

    base_s: float = Field(default=0.02, ge=0)
    per_batched_token_s: float = Field(default=0.0, ge=0)
    per_kv_token_s: float = Field(default=0.0, ge=0)


class ProfileSpec(_Frozen):
    """Token-wise layer times measured per operator (Vidur's `mlp.csv` layout), interpolated;
    attention and the LM head from the roofline of the scenario's `hardware`."""

    profile: str
    overhead_s: float = Field(default=OVERHEAD_S, ge=0)


class RooflineSpec(_Frozen):
    """The roofline of the scenario's `hardware` (the default when it names one); written
    out to change its per-iteration CPU overhead."""

    roofline: Literal[True] = True
    overhead_s: float = Field(default=OVERHEAD_S, ge=0)


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


class EngineSpec(_Frozen):
    """Where a scenario is silent, vLLM 0.33's defaults: chunked prefill on, and the batch
    limits of the scenario's `hardware` class (`sim.hardware.batch_defaults`); without
    chunked prefill the token budget is at least max_model_len."""

    max_num_seqs: PositiveInt | None = None
    max_num_batched_tokens: PositiveInt | None = None
    batching: str = "continuous"
    chunked_prefill: bool = True
    admission: str = "fcfs"
    lookahead: PositiveInt = 64
    watermark: float = Field(default=0.0, ge=0, lt=1)
    # None: the roofline of `hardware` when the scenario names one, else a flat 20 ms
    step_time: StepTimeForm | None = None
    max_time_s: float | None = Field(default=None, gt=0)


class AllocatorSpec(BaseModel):
    """One allocator to compare: a label, a registry kind, and that kind's options."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)

    label: str
    kind: str

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
                    f"allocator {self.label!r} ({self.kind}) has no option {name!r}"
                    + (f"; did you mean {hint!r}?" if hint else "")
                    + f" (valid: {', '.join(valid) or 'none'})"
                )
        return self


class Scenario(_Frozen):
    name: str = "scenario"
    description: str = ""
    # A GPU (sim.hardware preset or custom): vLLM's batch defaults, the step time, and the
    # kv_budget when none is given. Budget and time are per GPU of `tp`.
    hardware: str | HardwareSpec | None = None
    tp: PositiveInt = 1  # tensor parallelism: KV heads and weights split across tp GPUs
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)  # for a derived kv_budget
    model: str | ModelSpec
    kv_budget: int | str | GpuBudget | None = None  # per GPU; None: derived from hardware
    max_model_len: PositiveInt
    workload: WorkloadSpec
    engine: EngineSpec = EngineSpec()
    allocators: list[AllocatorSpec] = Field(min_length=1)
    sweep: dict[str, list[Any]] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name(value)

    @field_validator("max_model_len")
    @classmethod
    def _max_len(cls, value: int) -> int:
        if value > MAX_MODEL_LEN:
            raise ValueError(
                f"max_model_len {value} is larger than kvfrag models (at most 2**31 tokens)"
            )
        return value

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
    def _preset(cls, value: str | ModelSpec) -> str | ModelSpec:
        if isinstance(value, str):
            lookup(PRESETS, value, "model", "layers, kv_heads, head_dim")
        return value

    @field_validator("kv_budget")
    @classmethod
    def _budget(cls, value: int | str | GpuBudget | None) -> int | GpuBudget | None:
        if value is None:
            return None
        if isinstance(value, GpuBudget):
            value.bytes()
            return value
        size = parse_size(value)
        if size <= 0:
            raise ValueError("kv_budget must be positive")
        return check_size(size, "kv_budget")

    @field_validator("allocators")
    @classmethod
    def _labels(cls, value: list[AllocatorSpec], info: ValidationInfo) -> list[AllocatorSpec]:
        labels = [a.label for a in value]
        dupes = sorted({x for x in labels if labels.count(x) > 1})
        if dupes:
            raise ValueError(f"allocator labels must be unique; repeated: {', '.join(dupes)}")
        return value

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
        geo = self.full_geometry
        if self.tp > 1 and geo.kv_heads % self.tp and self.tp % geo.kv_heads:
            raise FieldError(("tp",), f"tp={self.tp} must divide the model's kv_heads "
                             f"({geo.kv_heads}) or be a multiple of it")
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
        geo, capacity = self.geometry, self.budget_bytes
        for i, spec in enumerate(self.allocators):
            try:
                make_allocator(
                    spec.kind,
                    capacity=capacity,
                    bytes_per_token=geo.bytes_per_token,
                    max_model_len=self.max_model_len,
                    geometry=geo,
                    **spec.options,
                )
            except (TypeError, ValueError, OverflowError) as exc:
                raise FieldError(("allocators", i), f"allocator {spec.label!r}: {exc}") from None
        return self

    @model_validator(mode="after")
    def _engine(self) -> Scenario:
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
    def _sweep(cls, value: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in value.items():
            if not values:
                raise ValueError(f"sweep key {key!r} has no values")
        return value

    # ----------------------------------------------------------- derived
    @property
    def full_geometry(self) -> KVGeometry:
        """The model's KV shape over all its GPUs."""
        if isinstance(self.model, str):
            return preset(self.model)
        m = self.model
        return KVGeometry(m.name, m.layers, m.kv_heads, m.head_dim, m.dtype_bytes)

    @property
    def geometry(self) -> KVGeometry:
        """The KV shape one GPU stores: KV heads split `tp` ways (replicated when fewer)."""
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
            return ARCHITECTURES.get(self.model)
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


def build_allocator(point: Scenario, spec: AllocatorSpec) -> Allocator:
    """A fresh allocator of `spec` for one sweep point (its budget, model and max_model_len)."""
    geo = point.geometry
    return make_allocator(
        spec.kind,
        capacity=point.budget_bytes,
        bytes_per_token=geo.bytes_per_token,
        max_model_len=point.max_model_len,
        geometry=geo,
        **spec.options,
    )


def run_point(
    point: Scenario,
    spec: AllocatorSpec,
    requests: pd.DataFrame,
    progress: Callable[[int, int], None] | None = None,
) -> RunResult:
    """One allocator at one sweep point, on its workload's request table (the unit of work
    of `run` and of `sim.sweep`'s executors). A torch-caching run carries the allocator's
    PyTorch memory snapshot at its end (`RunResult.snapshot`, see `sim.snapshot`).
    `progress(done, total)`: requests retired so far, as `sim.engine.run` reports them."""
    from kvfrag.sim.snapshot import TorchCachingAllocator, snapshot

    allocator = build_allocator(point, spec)
    result = run_engine(requests, allocator, point.engine_config(), progress)
    if isinstance(allocator, TorchCachingAllocator):
        result.snapshot = snapshot(allocator)
    return result


def count_runs(scenario: Scenario) -> int:
    return len(scenario.points()) * len(scenario.allocators)
