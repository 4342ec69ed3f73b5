"""The workload part of a scenario, as frozen pydantic models (YAML -> these -> `build_workload`).

A `WorkloadSpec` names exactly one source — a `trace` (a file, or `sample:NAME`) or a
`synthetic` description — plus `transforms`, an optional scenario-wide `n` (samples per prompt)
and a `seed`. Length distributions and arrival processes are discriminated unions on `kind`:

    workload:
      synthetic:
        count: 2000
        prompt: {kind: lognormal, mean: 1000, p99: 6000}
        output: {kind: empirical, path: sample:sharegpt-8k}
        correlation: 0.3
        arrival: {kind: gamma, rate: 4.0, cv: 3.0}
      transforms: {max_model_len: 8192, long_requests: clip}
      seed: 7

Relative paths are resolved against the scenario file's directory by `build_workload`.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

import numpy as np
from kvfrag.workloads.readers import MAX_ROWS, Format, TimeUnit
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

#: Standard-normal quantile at 0.99, for fitting a lognormal to a target p99.
Z99 = 2.3263478740408408

# --- bounds -----------------------------------------------------------------------------------
# Every number of a scenario has a range that kvfrag models, checked where the scenario is
# validated, so that a typo (1e30, 2**63, `true`) is one clear line and never a run that
# exhausts memory or time, a NaN summary or an OverflowError. They live here, at the bottom of
# the import graph, so that these models and sim.scenario's read the same constants; byte
# sizes are bounded by `sim.units.MAX_SIZE` (1 PiB). README "Scenario files" lists them all.

#: Requests in one workload (synthetic count, first_n, sample_n, a tiled workload, closed-loop
#: users): as many rows as a trace may have (`readers.MAX_ROWS`, 10**8): the table alone is
#: gigabytes there, and the simulation takes hours.
MAX_REQUESTS = MAX_ROWS
#: Tokens of one sequence (max_model_len, every length): 2**31 is beyond any model's context,
#: and a prompt plus an output plus a system prompt still fits an int64 many times over.
MAX_TOKENS = 2**31
#: Simulated seconds (max_time_s, window bounds): 10**9 s is 31.7 years, and float64 seconds
#: still resolve 0.1 us there.
MAX_TIME_S = 1e9
#: A closed-loop user's think time and the stagger of first requests: 10**6 s, 11.6 days.
MAX_THINK_S = 1e6
#: Arrival rates, requests per second: from one request in 11.6 days to one a nanosecond, so
#: that the arrival times of MAX_REQUESTS requests stay finite, distinct float64 seconds.
MIN_RATE, MAX_RATE = 1e-6, 1e9
#: rate_scale: the same factor of 10**6 either way.
MIN_RATE_SCALE, MAX_RATE_SCALE = 1e-6, 1e6
#: A gamma process's coefficient of variation: 10**-3 (clockwork) to 10**3 (one burst); beyond,
#: the gamma shape 1/cv**2 underflows or overflows.
MIN_CV, MAX_CV = 1e-3, 1e3
#: A lognormal's sigma (of log length): at 10 the draws already span e**60; more overflows.
MAX_SIGMA = 10.0
#: A zipf exponent: at 100 only length 1 is ever drawn; more only underflows.
MAX_ZIPF_A = 100.0
#: A zipf's largest length: its weight table is 8 bytes a length (80 MB here).
MAX_ZIPF_MAX = 10_000_000
#: Samples per prompt (n) and beams (beam_width): 1,024 sequences per request, 8x the largest
#: n the OpenAI API takes (128).
MAX_SEQS_PER_REQUEST = 1024
#: Hash ids a synthetic shared prefix gives in all (count x chunks per prompt): each is a
#: Python int in a list, some 40 bytes, so 10**8 of them are 4 GB.
MAX_HASH_IDS = 100_000_000
#: The workload's seed: it is written into summary tables as an int64.
MAX_SEED = 2**63 - 1

#: A model (sim.scenario_parts.ModelSpec): well beyond the largest published ones (126 layers, 128
#: heads, head_dim 256, hidden 18,432, MLP 73,728, vocab 256k), so that bytes per token
#: (layers x kv_heads x head_dim x 2 x dtype_bytes <= 2**36) and weights stay exact, small ints.
MAX_LAYERS = 1024
MAX_HEADS = 1024  # heads and kv_heads
MAX_HEAD_DIM = 4096
MAX_DTYPE_BYTES = 8  # fp64; presets use 1 (fp8), 2 (fp16/bf16) and 4 (fp32)
MAX_HIDDEN = 131_072
MAX_INTERMEDIATE = 1_048_576
MAX_VOCAB = 4_194_304
#: Tensor parallelism: GPUs one model is split across.
MAX_TP = 1024

#: A GPU (sim.scenario_parts.HardwareSpec), per second: from 1 MB/s and 1 GFLOP/s (slower than any
#: accelerator a million-fold) to 1 PB/s and 1 EFLOP/s (faster a hundred-fold), so that roofline
#: step times stay finite and non-zero.
MIN_BANDWIDTH, MAX_BANDWIDTH = 1e6, 1e15
MIN_FLOPS, MAX_FLOPS = 1e9, 1e18

#: The engine (sim.scenario_parts.EngineSpec): max_num_seqs (vLLM's defaults are 256 and 1,024).
MAX_NUM_SEQS = 1_048_576
#: Speculative decoding (engine.speculative): drafts per decode step (vLLM's EAGLE and MTP
#: runs use 1 to 8; 1,024 is far past any proposer) and (accepted count, weight) pairs.
MAX_DRAFT_TOKENS = 1024
MAX_ACCEPTANCE_PAIRS = 1025
#: max_num_batched_tokens when the step time comes from `hardware` (roofline or profile): its
#: tables hold every batch size up to it, 2 s and 0.5 GB to build at 2**22.
MAX_TIMED_TOKENS = 2**22
#: A step-time term that is a whole iteration (base_s, overhead_s): an hour.
MAX_STEP_S = 3600.0
#: A step-time term per token (per_batched_token_s, per_kv_token_s): a second, 10**4 x any
#: measured one; with MAX_TOKENS tokens an iteration stays finite.
MAX_TOKEN_S = 1.0

#: Allocator options (sim.scenario_parts.AllocatorSpec): a block (block_size) is at most
#: `sim.allocators.paged.MAX_BLOCK_SIZE` tokens (2**22); a compaction copies at a `bandwidth`
#: from MIN_BANDWIDTH to MAX_BANDWIDTH; torch's max_split_size_mb is at most the largest size
#: (`sim.units.MAX_SIZE`) in MiB, and its roundup_power2_divisions at most 2**20 (steps of under
#: a byte for a MiB block).
MAX_ROUNDUP_DIVISIONS = 2**20

#: Runs of one scenario (sweep points x allocators), refused before the sweep is expanded: each
#: is validated at load and simulated after; split a larger sweep across scenarios.
MAX_SWEEP_RUNS = 10_000


class BoundError(ValueError):
    """A number outside its range: the message says the range and (an excerpt of) the value."""


_NUMBER_RE = re.compile(
    r"^[+-]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][+-]?[0-9]+)?$"
)
_NON_FINITE = ("inf", "infinity", "nan")


def _bound(x: float) -> str:
    """A bound as people read it: 1,024 and 1,000,000,000; 1e-06 and 1e+15."""
    if float(x).is_integer() and abs(x) < 1e12:
        return f"{int(x):,}"
    return f"{x:g}"


def show(value: Any) -> str:
    """A bad value, short: a number as written, a boolean as YAML writes it, a string as an
    excerpt of at most 80 characters, any other thing by its kind. (`sim.units.excerpt` is
    its twin on the simulator's side: this package imports nothing from there.)"""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int):
        return str(value) if value.bit_length() <= 128 else f"a {len(str(value))}-digit number"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        text = repr(value[:81])
        return text if len(value) <= 80 else text[:77] + "...'"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a {type(value).__name__}"


def _range(low: float, high: float, above: bool, below: bool) -> str:
    if not above and not below:
        return f"from {_bound(low)} to {_bound(high)}"
    return (f"{'above' if above else 'at least'} {_bound(low)} and "
            f"{'below' if below else 'at most'} {_bound(high)}")


def check_number(
    value: Any,
    low: float,
    high: float,
    *,
    whole: bool = False,
    above: bool = False,
    below: bool = False,
    unit: str = "",
) -> int | float:
    """`value` as an int (`whole`) or a float, if it is a number in the range; else a
    BoundError that says the range. Booleans are not numbers (YAML's `true` is not 1);
    numeric strings are (YAML reads `1e-3`, without a dot, as one)."""
    infinite = (isinstance(value, float) and not math.isfinite(value)) or (
        isinstance(value, str) and value.strip().lstrip("+-").lower() in _NON_FINITE)
    kind = "a whole number" if whole else "a finite number" if infinite else "a number"
    rule = f"must be {kind} {_range(low, high, above, below)}{f' ({unit})' if unit else ''}"
    exact: Decimal | None = None
    if isinstance(value, bool) or infinite:
        pass
    elif isinstance(value, int | float):
        exact = Decimal(value)
    elif isinstance(value, str) and len(value) <= 80 and _NUMBER_RE.match(value.strip()):
        try:
            exact = Decimal(value.strip())
        except InvalidOperation:  # "1__0", an exponent beyond Decimal's
            exact = None
    if exact is None:
        raise BoundError(f"{rule}, not {show(value)}")
    lo, hi = Decimal(str(low)), Decimal(str(high))  # (as written: 1e-3 is 0.001, exactly)
    too_low = exact <= lo if above else exact < lo
    too_high = exact >= hi if below else exact > hi
    if too_low or too_high:
        raise BoundError(f"{rule}, not {show(value)}")
    if whole:
        if exact != exact.to_integral_value():
            raise BoundError(f"{rule}, not {show(value)}")
        return int(exact)
    return float(value) if isinstance(value, float) else float(exact)


def whole(low: int, high: int) -> Any:
    """An int field bounded to [low, high] (booleans refused)."""

    def check(value: Any) -> int:
        return int(check_number(value, low, high, whole=True))

    return Annotated[int, BeforeValidator(check)]


def number(
    low: float, high: float, *, above: bool = False, below: bool = False, unit: str = ""
) -> Any:
    """A float field bounded to [low, high] (`above`/`below`: that end excluded), finite,
    booleans refused."""

    def check(value: Any) -> float:
        return float(check_number(value, low, high, above=above, below=below, unit=unit))

    return Annotated[float, BeforeValidator(check)]


#: Synthetic priorities: values within int64 with room to spare, and how many may be listed.
MAX_PRIORITY = 10**9
MAX_PRIORITIES = 1000


class FieldError(ValueError):
    """A model-level problem with one field inside: `loc` says which, for the error's line."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


#: Field types, by what they count.
Requests = whole(1, MAX_REQUESTS)
Tokens = whole(1, MAX_TOKENS)
PerRequest = whole(1, MAX_SEQS_PER_REQUEST)
Seconds = number(0, MAX_TIME_S, unit="seconds")
Priority = whole(-MAX_PRIORITY, MAX_PRIORITY)
Weight = number(0, 1e9, above=True)
Rate = number(MIN_RATE, MAX_RATE, unit="requests per second")
Length = number(0, MAX_TOKENS, above=True, unit="tokens")


class _Model(BaseModel):
    """Unknown keys are errors, and so are inf/NaN floats (`.inf`, `.nan` or "inf" in YAML):
    bounds like `gt=0` let infinity through, and NaN would poison every sampled value."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ColumnMap(_Model):
    """Which source column holds each request field (for traces in any other layout)."""

    prompt_tokens: str
    output_tokens: str
    arrival: str | None = None
    max_tokens: str | None = None
    n: str | None = None
    hash_ids: str | None = None
    priority: str | None = None
    accepted_drafts: str | None = None

    def mapping(self) -> dict[str, str]:
        return self.model_dump(exclude_none=True)


# --- length distributions (tokens; continuous draws are rounded and floored at 1) ------------


class FixedLengths(_Model):
    kind: Literal["fixed"] = "fixed"
    value: Tokens


class UniformLengths(_Model):
    """Integers uniform on [low, high], both inclusive."""

    kind: Literal["uniform"] = "uniform"
    low: Tokens
    high: Tokens

    @model_validator(mode="after")
    def _ordered(self) -> UniformLengths:
        if self.low > self.high:
            raise ValueError(f"uniform: low {self.low} is above high {self.high}")
        return self


class NormalLengths(_Model):
    """Normal(mean, std) truncated to [min, max] by redrawing (so the mean shifts if it bites)."""

    kind: Literal["normal"] = "normal"
    mean: Length
    std: number(0, MAX_TOKENS, unit="tokens")
    min: Tokens = 1
    max: Tokens | None = None

    @model_validator(mode="after")
    def _bounds(self) -> NormalLengths:
        if self.max is not None and self.max < self.min:
            raise ValueError(f"normal: max {self.max} is below min {self.min}")
        return self


class LognormalLengths(_Model):
    """Lognormal with the given arithmetic `mean` and either `sigma` (of log length) or `p99`.

    With `p99` the sigma is fitted so the distribution has exactly that mean and 99th
    percentile; that needs mean < p99 < mean * exp(Z99**2 / 2) (about 14.96 x mean).
    """

    kind: Literal["lognormal"] = "lognormal"
    mean: Length
    sigma: number(0, MAX_SIGMA, above=True) | None = None
    p99: Length | None = None

    @model_validator(mode="after")
    def _one_shape(self) -> LognormalLengths:
        if (self.sigma is None) == (self.p99 is None):
            raise ValueError("lognormal: give exactly one of sigma or p99")
        if self.p99 is not None:
            ratio = math.log(self.p99 / self.mean)
            if not 0 < ratio < Z99**2 / 2:
                raise ValueError(
                    f"lognormal: no lognormal has mean {self.mean} and p99 {self.p99}; "
                    f"p99 must lie between the mean and {math.exp(Z99**2 / 2):.2f} x the mean"
                )
        return self

    def log_params(self) -> tuple[float, float]:
        """(mu, sigma) of the underlying normal."""
        if self.sigma is not None:
            sigma = self.sigma
        else:
            # mean = exp(mu + s^2/2), p99 = exp(mu + Z99 s)  =>  s^2/2 - Z99 s + ln(p99/mean) = 0
            ratio = math.log(self.p99 / self.mean)  # type: ignore[operator]
            sigma = Z99 - math.sqrt(Z99**2 - 2 * ratio)
        return math.log(self.mean) - sigma**2 / 2, sigma


class ExponentialLengths(_Model):
    kind: Literal["exponential"] = "exponential"
    mean: Length


class ZipfLengths(_Model):
    """P(k) proportional to k**-a on 1..max (heavy-tailed; `a` may be <= 1 since it is bounded)."""

    kind: Literal["zipf"] = "zipf"
    a: number(0, MAX_ZIPF_A, above=True)
    max: whole(1, MAX_ZIPF_MAX)

    def mean(self) -> float:
        k = np.arange(1, self.max + 1, dtype=np.float64)
        weights = k**-self.a
        return float((k * weights).sum() / weights.sum())


class EmpiricalLengths(_Model):
    """Resample (with replacement) one length column of a trace.

    `field` defaults to the role of the distribution: prompt_tokens for `prompt`, output_tokens
    for `output`.
    """

    kind: Literal["empirical"] = "empirical"
    path: str
    field: Literal["prompt_tokens", "output_tokens"] | None = None
    format: Format = "auto"
    columns: ColumnMap | None = None


LengthSpec = Annotated[
    FixedLengths | UniformLengths | NormalLengths | LognormalLengths | ExponentialLengths
    | ZipfLengths | EmpiricalLengths,
    Field(discriminator="kind"),
]


# --- arrival processes (first request at t=0) -------------------------------------------------


class AtOnceArrivals(_Model):
    """Every request arrives at t=0 (an offline batch)."""

    kind: Literal["at_once"] = "at_once"


class ConstantArrivals(_Model):
    kind: Literal["constant"] = "constant"
    rate: Rate


class PoissonArrivals(_Model):
    kind: Literal["poisson"] = "poisson"
    rate: Rate


class GammaArrivals(_Model):
    """Gamma inter-arrival times: mean 1/rate, coefficient of variation `cv` (>1 is bursty)."""

    kind: Literal["gamma"] = "gamma"
    rate: Rate
    cv: number(MIN_CV, MAX_CV)


class ReplayArrivals(_Model):
    """Arrival times of a trace: its own (no `path`) or another trace's (`path`).

    When the other trace is shorter, its arrivals repeat back to back.
    """

    kind: Literal["replay"] = "replay"
    path: str | None = None
    format: Format = "auto"
    columns: ColumnMap | None = None
    time_unit: TimeUnit | None = None


class ClosedLoopArrivals(_Model):
    """`users` concurrent users, each sending its next request `think_s` after the previous ends.

    Requests go to users round robin. First requests are spread evenly over [0, stagger_s).
    Think times are fixed or exponential with mean `think_s`.
    """

    kind: Literal["closed_loop"] = "closed_loop"
    users: Requests
    think_s: number(0, MAX_THINK_S, unit="seconds")
    think: Literal["fixed", "exponential"] = "exponential"
    stagger_s: number(0, MAX_THINK_S, unit="seconds") = 0.0


ArrivalSpec = Annotated[
    AtOnceArrivals | ConstantArrivals | PoissonArrivals | GammaArrivals | ReplayArrivals
    | ClosedLoopArrivals,
    Field(discriminator="kind"),
]


# --- sources, transforms, the whole workload --------------------------------------------------


class TraceSpec(_Model):
    """A trace file; `arrival` replaces its arrivals (required for length-only tables)."""

    path: str
    format: Format = "auto"
    columns: ColumnMap | None = None
    time_unit: TimeUnit | None = None
    hash_block_tokens: Tokens | None = None
    drop_bad_rows: bool = False
    arrival: ArrivalSpec | None = None


class SharedPrefix(_Model):
    """A system prompt of `tokens` tokens put before every prompt, one of `groups` different
    ones per request (drawn uniformly), so that prefix caching can find it again. Prompts get
    hash ids per `chunk_tokens` tokens: the system prompt's whole chunks are shared within a
    group, every other chunk is the request's own."""

    tokens: Tokens
    groups: Requests = 1
    chunk_tokens: Tokens = 16


class SyntheticSpec(_Model):
    """`count` requests with independent (or rank-correlated) prompt and output lengths.

    `correlation` is the Gaussian-copula correlation between prompt and output length (the
    marginals stay exact). `max_tokens`, when set, is declared on every request and caps its
    output length. `priority`, [[value, weight], ...], draws each request's vLLM priority
    (weights relative), after every other column, so that the rest of the table is the same
    with or without it.
    """

    count: Requests
    prompt: LengthSpec
    output: LengthSpec
    correlation: number(-1, 1) = 0.0
    arrival: ArrivalSpec = AtOnceArrivals()
    max_tokens: Tokens | None = None
    shared_prefix: SharedPrefix | None = None
    priority: list[tuple[Priority, Weight]] | None = Field(
        default=None, min_length=1, max_length=MAX_PRIORITIES)

    @model_validator(mode="after")
    def _hash_ids(self) -> SyntheticSpec:
        """A shared prefix's hash ids are lists in memory: at least count x its chunks."""
        sp = self.shared_prefix
        if sp is not None and self.count * -(-sp.tokens // sp.chunk_tokens) > MAX_HASH_IDS:
            raise FieldError(
                ("shared_prefix", "chunk_tokens"),
                f"{self.count:,} prompts of {sp.tokens:,} shared tokens in chunks of "
                f"{sp.chunk_tokens:,} are over {MAX_HASH_IDS:,} hash ids; use fewer requests "
                "or larger chunks",
            )
        return self


class Window(_Model):
    """Keep requests arriving in [start_s, end_s) (end open when None)."""

    start_s: Seconds = 0.0
    end_s: number(0, MAX_TIME_S, above=True, unit="seconds") | None = None

    @model_validator(mode="after")
    def _ordered(self) -> Window:
        if self.end_s is not None and self.end_s <= self.start_s:
            raise ValueError(f"window: end_s {self.end_s} is not after start_s {self.start_s}")
        return self


class TransformSpec(_Model):
    """Applied in this order: window, first_n, sample_n, tile, rate_scale, then the length
    bounds; with an arrival process of the scenario's own (synthetic, or a trace's
    `arrival`), the length bounds come first and the arrivals are drawn for the requests
    they keep, so a rate is the rate of the requests served.

    `max_model_len` (the smaller of this and the engine's, when both are set) bounds
    prompt + output tokens; `max_prompt_tokens` and `max_output_tokens` bound each part (vLLM's
    benchmark filters ShareGPT to prompt <= 1024 and prompt + output <= 2048). Longer
    requests are clipped or rejected (`long_requests`) and counted.
    """

    window: Window | None = None
    first_n: Requests | None = None
    sample_n: Requests | None = None
    tile: Requests = 1
    tile_mode: Literal["sequential", "overlay"] = "sequential"
    rate_scale: number(MIN_RATE_SCALE, MAX_RATE_SCALE) | None = None
    max_model_len: whole(2, MAX_TOKENS) | None = None
    max_prompt_tokens: Tokens | None = None
    max_output_tokens: Tokens | None = None
    long_requests: Literal["clip", "reject"] = "reject"


class WorkloadSpec(_Model):
    trace: TraceSpec | None = None
    synthetic: SyntheticSpec | None = None
    transforms: TransformSpec = TransformSpec()
    n: PerRequest | None = Field(default=None, description="samples per prompt, all requests")
    beam_width: PerRequest | None = Field(default=None, description="beams, all requests")
    seed: whole(0, MAX_SEED) = 0

    @model_validator(mode="after")
    def _one_source(self) -> WorkloadSpec:
        if (self.trace is None) == (self.synthetic is None):
            raise ValueError("workload: give exactly one of trace or synthetic")
        return self

    @model_validator(mode="after")
    def _tiled(self) -> WorkloadSpec:
        """A tiled workload stays within MAX_REQUESTS, as far as its size is known before it
        is built (a trace's rows are counted again when it is tiled)."""
        t = self.transforms
        known = [n for n in (t.first_n, t.sample_n) if n is not None]
        if self.synthetic is not None:
            known.append(self.synthetic.count)
        if t.tile > 1 and known and min(known) * t.tile > MAX_REQUESTS:
            raise FieldError(
                ("transforms", "tile"),
                f"{min(known):,} requests tiled {t.tile:,} times are "
                f"{min(known) * t.tile:,}; a workload has at most {MAX_REQUESTS:,}",
            )
        return self
