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
from typing import Annotated, Literal

import numpy as np
from kvfrag.workloads.readers import Format, TimeUnit
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

#: Standard-normal quantile at 0.99, for fitting a lognormal to a target p99.
Z99 = 2.3263478740408408


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

    def mapping(self) -> dict[str, str]:
        return self.model_dump(exclude_none=True)


# --- length distributions (tokens; continuous draws are rounded and floored at 1) ------------


class FixedLengths(_Model):
    kind: Literal["fixed"] = "fixed"
    value: PositiveInt


class UniformLengths(_Model):
    """Integers uniform on [low, high], both inclusive."""

    kind: Literal["uniform"] = "uniform"
    low: PositiveInt
    high: PositiveInt

    @model_validator(mode="after")
    def _ordered(self) -> UniformLengths:
        if self.low > self.high:
            raise ValueError(f"uniform: low {self.low} is above high {self.high}")
        return self


class NormalLengths(_Model):
    """Normal(mean, std) truncated to [min, max] by redrawing (so the mean shifts if it bites)."""

    kind: Literal["normal"] = "normal"
    mean: PositiveFloat
    std: float = Field(ge=0)
    min: PositiveInt = 1
    max: PositiveInt | None = None

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
    mean: PositiveFloat
    sigma: PositiveFloat | None = None
    p99: PositiveFloat | None = None

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
    mean: PositiveFloat


class ZipfLengths(_Model):
    """P(k) proportional to k**-a on 1..max (heavy-tailed; `a` may be <= 1 since it is bounded)."""

    kind: Literal["zipf"] = "zipf"
    a: PositiveFloat
    max: int = Field(ge=1, le=10_000_000)

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
    rate: PositiveFloat = Field(description="requests per second")


class PoissonArrivals(_Model):
    kind: Literal["poisson"] = "poisson"
    rate: PositiveFloat = Field(description="requests per second")


class GammaArrivals(_Model):
    """Gamma inter-arrival times: mean 1/rate, coefficient of variation `cv` (>1 is bursty)."""

    kind: Literal["gamma"] = "gamma"
    rate: PositiveFloat = Field(description="requests per second")
    cv: PositiveFloat


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
    users: PositiveInt
    think_s: float = Field(ge=0)
    think: Literal["fixed", "exponential"] = "exponential"
    stagger_s: float = Field(default=0.0, ge=0)


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
    hash_block_tokens: PositiveInt | None = None
    drop_bad_rows: bool = False
    arrival: ArrivalSpec | None = None


class SharedPrefix(_Model):
    """A system prompt of `tokens` tokens put before every prompt, one of `groups` different
    ones per request (drawn uniformly), so that prefix caching can find it again. Prompts get
    hash ids per `chunk_tokens` tokens: the system prompt's whole chunks are shared within a
    group, every other chunk is the request's own."""

    tokens: PositiveInt
    groups: PositiveInt = 1
    chunk_tokens: PositiveInt = 16


class SyntheticSpec(_Model):
    """`count` requests with independent (or rank-correlated) prompt and output lengths.

    `correlation` is the Gaussian-copula correlation between prompt and output length (the
    marginals stay exact). `max_tokens`, when set, is declared on every request and caps its
    output length.
    """

    count: PositiveInt
    prompt: LengthSpec
    output: LengthSpec
    correlation: float = Field(default=0.0, ge=-1, le=1)
    arrival: ArrivalSpec = AtOnceArrivals()
    max_tokens: PositiveInt | None = None
    shared_prefix: SharedPrefix | None = None


class Window(_Model):
    """Keep requests arriving in [start_s, end_s) (end open when None)."""

    start_s: float = Field(default=0.0, ge=0)
    end_s: PositiveFloat | None = None

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
    first_n: PositiveInt | None = None
    sample_n: PositiveInt | None = None
    tile: PositiveInt = 1
    tile_mode: Literal["sequential", "overlay"] = "sequential"
    rate_scale: PositiveFloat | None = None
    max_model_len: int | None = Field(default=None, ge=2)
    max_prompt_tokens: PositiveInt | None = None
    max_output_tokens: PositiveInt | None = None
    long_requests: Literal["clip", "reject"] = "reject"


class WorkloadSpec(_Model):
    trace: TraceSpec | None = None
    synthetic: SyntheticSpec | None = None
    transforms: TransformSpec = TransformSpec()
    n: PositiveInt | None = Field(default=None, description="samples per prompt, all requests")
    beam_width: PositiveInt | None = Field(default=None, description="beams, all requests")
    seed: int = 0

    @model_validator(mode="after")
    def _one_source(self) -> WorkloadSpec:
        if (self.trace is None) == (self.synthetic is None):
            raise ValueError("workload: give exactly one of trace or synthetic")
        return self
