"""Every number of a scenario is bounded where it is read: 1e30, 2**63, -1 and `true` in any
numeric field are one line on stderr naming the field and its range, exit status 2, at once,
with nothing written; a sweep too large to run is refused before it is expanded; no message
echoes more than an excerpt of a bad value."""

from __future__ import annotations

import argparse
import time
import typing
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from kvfrag.sim import model_forms
from kvfrag.sim import scenario as sc
from kvfrag.sim import scenario_parts as parts
from kvfrag.sim.units import parse_size
from kvfrag.workloads import spec, synthetic, transforms
from kvfrag.workloads.table import Workload, WorkloadError
from pydantic import BaseModel, ValidationError

from kvfrag.args import positive
from kvfrag.cli import main
from kvfrag.config import ScenarioError, load_scenario

ROOT = Path(__file__).resolve().parents[2]

#: quickstart.yaml with its model and GPU spelled out, so that their fields can be set.
BASE = yaml.safe_load((ROOT / "scenarios" / "quickstart.yaml").read_text()) | {
    "hardware": {"name": "a100", "memory_bytes": "40GiB", "hbm_bandwidth_bytes_s": 1.555e12,
                 "fp16_dense_flops": 3.12e14, "interconnect_bytes_s": 6e11},
    "model": {"name": "llama-3-8b", "layers": 32, "kv_heads": 8, "head_dim": 128,
              "hidden": 4096, "intermediate": 14336, "heads": 32, "vocab": 128256},
}

SYNTH = ["workload.trace=null", "workload.synthetic={count: 30, prompt: {kind: uniform, low: 10, "
         "high: 200}, output: {kind: fixed, value: 50}}"]


def _dist(form: str) -> list[str]:
    return [*SYNTH, f"workload.synthetic.prompt={form}"]


def _arrival(form: str) -> list[str]:
    return [*SYNTH, f"workload.synthetic.arrival={form}"]


def _alloc(form: str) -> list[str]:
    return [f"allocators=[{form}]"]


LINEAR = ["engine.step_time={base_s: 0.02}"]
BUDGET = ["kv_budget={gpu_memory: 40GiB, weights: 16GB}"]
CLOSED = "{kind: closed_loop, users: 2, think_s: 1}"
#: (dotted key, --set items that make the key's field exist, the model and field it reaches).
CASES: list[tuple[str, list[str], type[BaseModel] | str, str]] = [
    ("tp", [], sc.Scenario, "tp"),
    ("gpu_memory_utilization", [], sc.Scenario, "gpu_memory_utilization"),
    ("kv_budget", [], sc.Scenario, "kv_budget"),
    ("max_model_len", [], sc.Scenario, "max_model_len"),
    ("model.layers", [], parts.ModelSpec, "layers"),
    ("model.kv_heads", [], parts.ModelSpec, "kv_heads"),
    ("model.head_dim", [], parts.ModelSpec, "head_dim"),
    ("model.dtype_bytes", [], parts.ModelSpec, "dtype_bytes"),
    ("model.hidden", [], parts.ModelSpec, "hidden"),
    ("model.intermediate", [], parts.ModelSpec, "intermediate"),
    ("model.heads", [], parts.ModelSpec, "heads"),
    ("model.vocab", [], parts.ModelSpec, "vocab"),
    ("hardware.memory_bytes", [], parts.HardwareSpec, "memory_bytes"),
    ("hardware.hbm_bandwidth_bytes_s", [], parts.HardwareSpec, "hbm_bandwidth_bytes_s"),
    ("hardware.fp16_dense_flops", [], parts.HardwareSpec, "fp16_dense_flops"),
    ("hardware.interconnect_bytes_s", [], parts.HardwareSpec, "interconnect_bytes_s"),
    ("kv_budget.gpu_memory", BUDGET, parts.GpuBudget, "gpu_memory"),
    ("kv_budget.utilization", BUDGET, parts.GpuBudget, "utilization"),
    ("kv_budget.weights", BUDGET, parts.GpuBudget, "weights"),
    ("kv_budget.activations", BUDGET, parts.GpuBudget, "activations"),
    ("engine.max_num_seqs", [], parts.EngineSpec, "max_num_seqs"),
    ("engine.max_num_batched_tokens", [], parts.EngineSpec, "max_num_batched_tokens"),
    ("engine.lookahead", [], parts.EngineSpec, "lookahead"),
    ("engine.watermark", [], parts.EngineSpec, "watermark"),
    ("engine.long_prefill_token_threshold", [], parts.EngineSpec, "long_prefill_token_threshold"),
    ("engine.max_time_s", [], parts.EngineSpec, "max_time_s"),
    ("engine.step_time.base_s", LINEAR, parts.StepTimeSpec, "base_s"),
    ("engine.step_time.per_batched_token_s", LINEAR, parts.StepTimeSpec, "per_batched_token_s"),
    ("engine.step_time.per_kv_token_s", LINEAR, parts.StepTimeSpec, "per_kv_token_s"),
    ("engine.step_time.overhead_s", ["engine.step_time={roofline: true}"], parts.RooflineSpec,
     "overhead_s"),
    ("workload.n", [], spec.WorkloadSpec, "n"),
    ("workload.beam_width", [], spec.WorkloadSpec, "beam_width"),
    ("workload.seed", [], spec.WorkloadSpec, "seed"),
    ("workload.transforms.first_n", [], spec.TransformSpec, "first_n"),
    ("workload.transforms.sample_n", [], spec.TransformSpec, "sample_n"),
    ("workload.transforms.tile", [], spec.TransformSpec, "tile"),
    ("workload.transforms.rate_scale", [], spec.TransformSpec, "rate_scale"),
    ("workload.transforms.max_model_len", [], spec.TransformSpec, "max_model_len"),
    ("workload.transforms.max_prompt_tokens", [], spec.TransformSpec, "max_prompt_tokens"),
    ("workload.transforms.max_output_tokens", [], spec.TransformSpec, "max_output_tokens"),
    ("workload.transforms.window.start_s", [], spec.Window, "start_s"),
    ("workload.transforms.window.end_s", [], spec.Window, "end_s"),
    ("workload.trace.hash_block_tokens", [], spec.TraceSpec, "hash_block_tokens"),
    ("workload.synthetic.count", SYNTH, spec.SyntheticSpec, "count"),
    ("workload.synthetic.correlation", SYNTH, spec.SyntheticSpec, "correlation"),
    ("workload.synthetic.max_tokens", SYNTH, spec.SyntheticSpec, "max_tokens"),
    ("workload.synthetic.shared_prefix.tokens", SYNTH, spec.SharedPrefix, "tokens"),
    ("workload.synthetic.shared_prefix.groups", SYNTH, spec.SharedPrefix, "groups"),
    ("workload.synthetic.shared_prefix.chunk_tokens", SYNTH, spec.SharedPrefix, "chunk_tokens"),
    ("workload.synthetic.output.value", SYNTH, spec.FixedLengths, "value"),
    ("workload.synthetic.prompt.low", SYNTH, spec.UniformLengths, "low"),
    ("workload.synthetic.prompt.high", SYNTH, spec.UniformLengths, "high"),
    *[(f"workload.synthetic.prompt.{f}", _dist("{kind: normal, mean: 100, std: 10}"),
       spec.NormalLengths, f) for f in ("mean", "std", "min", "max")],
    *[(f"workload.synthetic.prompt.{f}", _dist("{kind: lognormal, mean: 100, sigma: 1}"),
       spec.LognormalLengths, f) for f in ("mean", "sigma")],
    ("workload.synthetic.prompt.p99", _dist("{kind: lognormal, mean: 100, p99: 500}"),
     spec.LognormalLengths, "p99"),
    ("workload.synthetic.prompt.mean", _dist("{kind: exponential, mean: 100}"),
     spec.ExponentialLengths, "mean"),
    *[(f"workload.synthetic.prompt.{f}", _dist("{kind: zipf, a: 1.2, max: 1000}"),
       spec.ZipfLengths, f) for f in ("a", "max")],
    ("workload.synthetic.arrival.rate", _arrival("{kind: constant, rate: 1}"),
     spec.ConstantArrivals, "rate"),
    ("workload.synthetic.arrival.rate", _arrival("{kind: poisson, rate: 1}"),
     spec.PoissonArrivals, "rate"),
    *[(f"workload.synthetic.arrival.{f}", _arrival("{kind: gamma, rate: 1, cv: 2}"),
       spec.GammaArrivals, f) for f in ("rate", "cv")],
    *[(f"workload.synthetic.arrival.{f}", _arrival(CLOSED), spec.ClosedLoopArrivals, f)
      for f in ("users", "think_s", "stagger_s")],
    ("workload.trace.arrival.rate", ["workload.trace.arrival={kind: poisson, rate: 1}"],
     spec.PoissonArrivals, "rate"),
    ("allocators.a.block_size", _alloc("{label: a, kind: paged, block_size: 16}"),
     "allocator option", "block_size"),
    ("allocators.a.block_size", _alloc("{label: a, kind: prefix-caching, block_size: 16}"),
     "allocator option", "block_size"),
    ("allocators.a.bandwidth", _alloc("{label: a, kind: contiguous, compaction: true}"),
     "allocator option", "bandwidth"),
    ("allocators.a.page_size", _alloc("{label: a, kind: vattention}"),
     "allocator option", "page_size"),
    ("allocators.a.max_split_size_mb", _alloc("{label: a, kind: torch-caching}"),
     "allocator option", "max_split_size_mb"),
    ("allocators.a.roundup_power2_divisions", _alloc("{label: a, kind: torch-caching}"),
     "allocator option", "roundup_power2_divisions"),
    ("allocators.a.block_size", _alloc("{label: a, kind: hybrid, block_size: 16}"),
     "allocator option", "block_size"),
    ("allocators.a.concurrent_batches", _alloc("{label: a, kind: hybrid}"),
     "allocator option", "concurrent_batches"),
]
#: Numeric fields reached another way (a profile step time needs a profile file).
#: A layered model's fields (list elements without labels: `--set model=...` whole, below).
LAYERED = {
    "sliding": "{name: m, layers: [{type: sliding_window, count: 5, window: 1024, kv_heads: 8, "
               "head_dim: 128}, {type: full, count: 1, kv_heads: 8, head_dim: 128}], repeat: 2}",
    "chunked": "{name: m, kv_heads: 8, head_dim: 128, layers: [{type: chunked_local, count: 3, "
               "chunk: 8192}, {type: full}], num_layers: 8}",
    "mla": "{name: m, layers: [{type: mla, latent: 512, rope: 64}], repeat: 4}",
    "mamba": "{name: m, kv_heads: 8, head_dim: 128, layers: [{type: mamba, count: 3, "
             "state_bytes: 1MiB}, {type: full}]}",
}
#: (form, a piece of it, that piece with the hostile value {v} in, the model and field reached).
LAYERED_CASES: list[tuple[str, str, str, type[BaseModel], str]] = [
    ("sliding", "count: 5", "count: {v}", model_forms.LayerGroup, "count"),
    ("sliding", "window: 1024, kv_heads: 8", "window: 1024, kv_heads: {v}",
     model_forms.LayerGroup, "kv_heads"),
    ("sliding", "kv_heads: 8, head_dim: 128}], repeat", "kv_heads: 8, head_dim: {v}}], repeat",
     model_forms.LayerGroup, "head_dim"),
    ("sliding", "window: 1024", "window: {v}", model_forms.LayerGroup, "window"),
    ("chunked", "chunk: 8192", "chunk: {v}", model_forms.LayerGroup, "chunk"),
    ("mla", "latent: 512", "latent: {v}", model_forms.LayerGroup, "latent"),
    ("mla", "rope: 64", "rope: {v}", model_forms.LayerGroup, "rope"),
    ("mamba", "state_bytes: 1MiB", "state_bytes: {v}", model_forms.LayerGroup, "state_bytes"),
    ("sliding", "repeat: 2", "repeat: {v}", model_forms.LayeredModelSpec, "repeat"),
    ("chunked", "num_layers: 8", "num_layers: {v}", model_forms.LayeredModelSpec, "num_layers"),
    ("chunked", "{name: m, kv_heads: 8", "{name: m, kv_heads: {v}",
     model_forms.LayeredModelSpec, "kv_heads"),
    ("chunked", "head_dim: 128, layers", "head_dim: {v}, layers",
     model_forms.LayeredModelSpec, "head_dim"),
    ("mla", "name: m,", "name: m, dtype_bytes: {v},", model_forms.LayeredModelSpec,
     "dtype_bytes"),
]
ELSEWHERE = {(parts.ProfileSpec, "overhead_s"), (spec.SyntheticSpec, "priority")} | {
    (w, f) for *_, w, f in LAYERED_CASES}
#: What every numeric field refuses: 1e30 (YAML reads it as a string), 2**63, -1 (correlation:
#: -1.5, as -1 is in its range) and a boolean.
HOSTILE = ["1e30", str(2**63), "-1", "true"]
LOADED: set[tuple[str, ...]] = set()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bounds") / "bounds.yaml"
    path.write_text(yaml.safe_dump(BASE, sort_keys=False))
    return path


def _run(capsys, base: Path, out: Path, sets: list[str]) -> tuple[int, str, float]:
    argv = ["run", str(base), "--set", "workload.transforms.first_n=30"]
    for item in sets:
        argv += ["--set", item]
    start = time.perf_counter()
    code = main([*argv, "-o", str(out), "-q", "--no-plots", "-j", "1"])
    return code, capsys.readouterr().err, time.perf_counter() - start


@pytest.mark.parametrize(
    ("key", "given", "where", "field"),
    CASES,
    ids=[f"{k}-{w if isinstance(w, str) else w.__name__}" for k, _, w, _ in CASES],
)
def test_every_numeric_field_refuses_absurd_values_in_one_line(
    capsys, tmp_path, base, key, given, where, field
):
    if tuple(given) not in LOADED:  # the field exists: the scenario loads as given
        load_scenario(base, ["workload.transforms.first_n=30", *given])
        LOADED.add(tuple(given))
    out = tmp_path / "out"
    for raw in HOSTILE:
        value = "-1.5" if raw == "-1" and field == "correlation" else raw
        code, err, took = _run(capsys, base, out, [*given, f"{key}={value}"])
        lines = err.splitlines()
        assert code == 2, (value, err)
        assert len(lines) == 1, (value, err)
        line = lines[0]
        assert line.startswith(f"kvfrag: error: --set '{key}={value}': "), line
        assert field in line, line
        assert any(word in line for word in ("must be", "at most", "a size is")), line
        for leak in ("Error", "Traceback", "np.", "int64", "C long", "object expected"):
            assert leak not in line, line
        assert took < 5, (value, took)
        assert not out.exists()


@pytest.mark.parametrize(
    ("form", "piece", "hostile", "where", "field"), LAYERED_CASES,
    ids=[f"{w.__name__}.{f}" for *_, w, f in LAYERED_CASES],
)
def test_a_layered_models_numbers_are_bounded_too(capsys, tmp_path, base, form, piece, hostile,
                                                   where, field):
    out = tmp_path / "out"
    assert LAYERED[form].count(piece) == 1
    given = ["hardware=null", *LINEAR]  # (timing from hardware needs a model's matrices)
    if form != "mamba":  # (Mamba layers need the hybrid allocator: refused as they are)
        load_scenario(base, [*given, f"model={LAYERED[form]}"])
    for value in HOSTILE:
        model = LAYERED[form].replace(piece, hostile.replace("{v}", value))
        code, err, took = _run(capsys, base, out, [*given, f"model={model}"])
        lines = err.splitlines()
        assert code == 2 and len(lines) == 1, (value, err)
        assert field in lines[0] and "model" in lines[0], lines[0]
        assert any(word in lines[0] for word in ("must be", "at most", "a size")), lines[0]
        for leak in ("Error", "Traceback", "np.", "int64", "C long", "object expected"):
            assert leak not in lines[0], lines[0]
        assert took < 5 and not out.exists()


@pytest.mark.parametrize(("key", "expected"), [
    ("model.kv_heads", "from 1 to 1,024, not 1e+30"),
    ("engine.max_time_s", "at most 1,000,000,000 (seconds), not 1e+30"),
    ("engine.step_time.base_s", "from 0 to 3,600 (seconds), not 1e+30"),
    ("workload.transforms.tile", "from 1 to 100,000,000, not 1e+30"),
    ("kv_budget", "867361737988.4 EiB is larger than kvfrag models (at most 1.0 PiB)"),
    ("allocators.paged-16.block_size", "from 1 to 4,194,304, not 1e+30"),
])
def test_a_float_beyond_range_is_refused_too(base, key, expected):
    """1.0e+30 is a float in YAML (1e30, without the dot, a string)."""
    given = LINEAR if key.startswith("engine.step_time") else []
    with pytest.raises(ScenarioError) as info:
        load_scenario(base, [*given, f"{key}=1.0e+30"])
    assert str(info.value).endswith(expected)


def _numeric(annotation: typing.Any) -> bool:
    if annotation in (int, float):
        return True
    return any(_numeric(a) for a in typing.get_args(annotation))


def _models() -> list[type[BaseModel]]:
    modules = (sc, parts, spec, model_forms)
    found = [m for module in modules for m in vars(module).values()
             if isinstance(m, type) and issubclass(m, BaseModel)
             and m.__module__ in {module.__name__ for module in modules}]
    assert len(found) > 20
    return found


def test_the_cases_walk_every_numeric_field_of_the_schema():
    numeric = {(m, name) for m in _models() for name, f in m.model_fields.items()
               if _numeric(f.annotation)}
    covered = {(w, f) for _, _, w, f in CASES if not isinstance(w, str)} | ELSEWHERE
    assert numeric - covered == set()
    assert covered - numeric == set()


@pytest.mark.parametrize("value", ["1e30", str(2**63), "true"])
@pytest.mark.parametrize("pair", ["[[{v}, 1]]", "[[0, {v}]]"], ids=["value", "weight"])
def test_a_synthetic_priority_pair_is_bounded_too(capsys, tmp_path, base, pair, value):
    """Priorities are [[value, weight], ...]: each number of a pair is refused in one line
    (-1 is a priority like any other; as a weight it is refused, below)."""
    out = tmp_path / "out"
    key = "workload.synthetic.priority"
    for form in [pair.format(v=value), *(["[[0, -1]]"] if value == "true" else [])]:
        code, err, _ = _run(capsys, base, out, [*SYNTH, f"{key}={form}"])
        lines = err.splitlines()
        assert code == 2 and len(lines) == 1, (form, err)
        assert f"{key}[0][" in lines[0] and "must be a" in lines[0], lines[0]
        assert "Error" not in lines[0] and "Traceback" not in lines[0], lines[0]
        assert not out.exists()


@pytest.mark.parametrize("value", [1e30, 2**63, -1, True, float("nan")])
def test_a_profile_overhead_is_bounded_too(value):
    with pytest.raises(ValidationError, match=r"overhead_s\n.*must be a"):
        parts.ProfileSpec.model_validate({"profile": "mlp.csv", "overhead_s": value})


def test_a_sweep_of_a_billion_points_is_refused_before_it_is_expanded(tmp_path, base):
    ten = "[" + ", ".join(str(i) for i in range(1, 11)) + "]"
    keys = ["engine.lookahead", "workload.seed", "engine.max_num_seqs", "tp", "max_model_len",
            "workload.n", "workload.beam_width", "engine.max_time_s", "workload.transforms.tile"]
    item = "sweep={" + ", ".join(f"{k}: {ten}" for k in keys) + "}"
    start = time.perf_counter()
    with pytest.raises(ScenarioError) as info:
        load_scenario(base, [item])
    assert time.perf_counter() - start < 0.5
    assert str(info.value).endswith(
        "sweep: 1,000,000,000 points x 4 allocator(s) = 4,000,000,000 runs; a scenario runs at "
        "most 10,000 (split the sweep across scenarios)"
    )


def test_the_sweep_limit_counts_runs_points_times_allocators(tmp_path, base):
    values = "[" + ", ".join(str(i) for i in range(1, 2502)) + "]"  # 2,501 x 4 = 10,004
    with pytest.raises(ScenarioError, match=r"sweep: 2,501 points x 4 allocator\(s\) = 10,004"):
        load_scenario(base, [f"sweep={{workload.seed: {values}}}"])
    data = BASE | {"sweep": {"workload.seed": list(range(2501))}}
    with pytest.raises(ValidationError, match="at most 10,000"):
        sc.Scenario.model_validate(data)
    ok = load_scenario(base, ["sweep={workload.seed: [1, 2, 3]}"]).scenario
    assert len(ok.points()) == 3


def test_booleans_are_not_numbers_in_sweeps_or_sizes(base):
    with pytest.raises(ScenarioError, match=r"point 2 \(engine\.max_num_seqs=true\): must be a "
                       r"whole number from 1 to 1,048,576, not the boolean true$"):
        load_scenario(base, ["sweep={engine.max_num_seqs: [4, true]}"])
    for bad in (True, False):
        with pytest.raises(ValueError, match="boolean"):
            parse_size(bad)
    assert parse_size(4096.0) == 4096 and parse_size("1e9") == 10**9


@pytest.mark.parametrize("option", ["hybrid_kv_cache_manager", "prefix_caching"])
@pytest.mark.parametrize("value", ["1", "0", "'yes'", "null", "1e30"])
def test_a_hybrid_allocators_switches_are_booleans(capsys, tmp_path, base, option, value):
    """1, "yes" or null is not read as true or false: one line naming the option."""
    out = tmp_path / "out"
    form = f"{{label: a, kind: hybrid, {option}: {value}}}"
    code, err, _ = _run(capsys, base, out, _alloc(form))
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, err
    assert f"{option} must be true or false, not" in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.parametrize(("option", "field"), [("stack", "`model`"), (
    "max_num_batched_tokens", "engine.max_num_batched_tokens")])
def test_what_the_scenario_sets_is_not_a_hybrid_option(base, option, field):
    with pytest.raises(ScenarioError, match=rf"{option} is not an option here: the scenario's "
                       rf"{field} sets it"):
        load_scenario(base, _alloc(f"{{label: a, kind: hybrid, {option}: 16}}"))


def test_numbers_written_as_strings_are_still_numbers(base):
    s = load_scenario(base, ["engine.step_time={base_s: '2e-2', per_kv_token_s: 1e-7}",
                             "workload.transforms.tile='3'"]).scenario
    assert s.engine.step_time.base_s == 0.02 and s.engine.step_time.per_kv_token_s == 1e-7
    assert s.workload.transforms.tile == 3


def test_a_huge_value_is_quoted_as_an_excerpt(base):
    """A 50 MB string in a field gives a short line, wherever the message is made."""
    huge = "x" * 50_000_000
    data = BASE | {"tp": huge}
    for where, value in [("tp", huge), ("model", huge), ("hardware", huge), ("kv_budget", huge),
                         ("name", huge), ("allocators", [{"label": "a", "kind": huge}]),
                         ("allocators", [{"label": "a", "kind": "paged", huge: 1}]),
                         ("allocators", [{"label": "a", "kind": "buddy", "reserve": huge}])]:
        data = BASE | {where: value}
        with pytest.raises(ValidationError) as info:
            sc.Scenario.model_validate(data)
        for error in info.value.errors():
            assert len(error["msg"]) < 400, (where, error["msg"][:200])
    item = "description=" + "y" * 60_000
    with pytest.raises(ScenarioError) as err:
        load_scenario(base, [item, "tp=" + "z" * 60_000])
    assert len(str(err.value)) < 300


def test_step_time_tables_are_bounded_when_timed_on_hardware(base):
    with pytest.raises(ScenarioError, match=r"engine\.max_num_batched_tokens: a step time from "
                       r"`hardware` tabulates .* at most 4,194,304"):
        load_scenario(base, ["engine.max_num_batched_tokens=10000000"])
    s = load_scenario(base, [*LINEAR, "engine.max_num_batched_tokens=10000000"]).scenario
    assert s.engine_config().max_num_batched_tokens == 10_000_000


def test_a_tiled_trace_is_refused_before_it_is_copied():
    rows = pd.DataFrame({"request_id": [0, 1], "arrival_s": [0.0, 1.0], "prompt_tokens": [5, 6],
                         "output_tokens": [3, 4]})
    workload = Workload(requests=rows, source="t", notes=(), has_arrivals=True)
    start = time.perf_counter()
    with pytest.raises(WorkloadError, match=r"2 requests tiled 100,000,000 times"):
        transforms.tile(workload, spec.MAX_REQUESTS)
    assert time.perf_counter() - start < 0.5


def test_synthetic_lengths_and_hash_ids_stay_in_range():
    rng = np.random.default_rng(0)
    wild = spec.LognormalLengths(mean=2**31, sigma=10)
    draws = synthetic.sample_lengths(wild, 10_000, rng)
    assert draws.min() >= 1 and draws.max() <= spec.MAX_TOKENS
    with pytest.raises(WorkloadError, match="hash ids; at most 100,000,000"):
        synthetic.shared_prefix_hashes(np.full(100, 2**31), 16, 1, 1, rng)
    with pytest.raises(ValidationError, match="over 100,000,000 hash ids"):
        spec.SyntheticSpec.model_validate({
            "count": 1000, "prompt": {"kind": "fixed", "value": 10},
            "output": {"kind": "fixed", "value": 10},
            "shared_prefix": {"tokens": 2**31, "chunk_tokens": 1}})


@pytest.mark.parametrize("text", ["0", "-1", "true", "1e3", "9" * 5000, str(2**21)])
def test_command_line_counts_are_bounded(text):
    with pytest.raises(argparse.ArgumentTypeError) as info:
        positive(text)
    assert len(str(info.value)) < 150
    assert positive("8") == 8
