"""The search behind `kvfrag plan`: the highest arrival rate at which a latency target holds.

Pure logic, no files and no simulator: a `Search` proposes the next value of the search
variable (a trace's `rate_scale`, or a synthetic workload's arrival rate) and is told whether
the target held there; `run_searches` drives many searches together, one probe each per round,
so that a round's runs (every allocator, every grid setting) can go out in parallel.

How a search decides. It probes the scenario's own value first, then brackets: doubling while
the target holds (or halving while it fails) until it changes; then it bisects the bracket in
log space until its ends are within the relative precision. Its answer is the bracket's lower
end: the target held there and at every lower value probed, and failed at the upper end (a
rate at most `precision` higher). Latency percentiles are noisy in the rate, so a value above
the first failure may happen to hold again: it is never probed, and never the answer. Every
probe is a seeded, deterministic simulation, so the same scenario and target give the same
probes and the same answer, whatever ran them.

A probe meets the target when every request completed (none rejected, none left unfinished)
and each percentile given is at most its bound; a percentile that cannot be computed (no
request decoded a second token, for TPOT) fails.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the command line loads pandas only when a command runs)
    import pandas as pd

#: The metrics a target bounds, as the summary names them (`p99_ttft_s`), and how they read.
METRICS = {"ttft": "TTFT", "tpot": "TPOT"}
PERCENTILES = (50, 90, 99)
#: Doublings (or halvings) from the scenario's own rate before a search gives up bracketing:
#: 2**20 is a factor of about a million either way.
MAX_STEPS = 20
#: Significant digits of a probed value: readable in plan.csv and on a `--set`, and far finer
#: than any precision asked for.
DIGITS = 6
#: Relative precision: 0.1 % to 100 % (a bracket no wider than 2x).
MIN_PRECISION, MAX_PRECISION = 0.001, 1.0

_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*(ms|s)\s*$")


def parse_duration(text: str, what: str) -> float:
    """`2s`, `500ms`, `0.05s` -> seconds (> 0, at most a day); anything else is one line."""
    m = _DURATION_RE.match(text) if len(text) <= 40 else None
    if m is None:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise ValueError(f"{what}: {shown!r} is not a duration; write e.g. 2s or 50ms")
    value = float(m.group(1) + (f"e{m.group(2)}" if m.group(2) else ""))
    seconds = value / 1000 if m.group(3) == "ms" else value
    if not 0 < seconds <= 86_400:
        raise ValueError(f"{what}: {text.strip()} must be above 0 and at most 86400s (a day)")
    return seconds


def parse_precision(text: str) -> float:
    """`2%` or `0.02` -> 0.02, from MIN_PRECISION to MAX_PRECISION."""
    raw = text.strip()
    percent = raw.endswith("%")
    try:
        value = float(raw.removesuffix("%")) if len(raw) <= 20 else math.nan
    except ValueError:
        value = math.nan
    if percent:
        value /= 100
    if not MIN_PRECISION <= value <= MAX_PRECISION:  # (NaN fails too)
        shown = raw if len(raw) <= 20 else raw[:17] + "..."
        raise ValueError(f"--precision: {shown!r} is not a precision from 0.1% to 100% "
                         "(write e.g. 2% or 0.02)")
    return value


@dataclass(frozen=True)
class Target:
    """One bound: the `percentile`th percentile of `metric` (ttft or tpot) at most `seconds`."""

    metric: str
    percentile: int
    seconds: float

    @property
    def column(self) -> str:
        """The summary's column (`p99_ttft_s`)."""
        return f"p{self.percentile}_{self.metric}_s"

    @property
    def name(self) -> str:
        return f"p{self.percentile} {METRICS[self.metric]}"

    def describe(self) -> str:
        return f"{self.name} <= {format_seconds(self.seconds)}"


def format_seconds(seconds: float) -> str:
    """`2 s`, `50 ms`, `1.25 s`: milliseconds below a second."""
    if not math.isfinite(seconds):
        return "n/a"
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    return f"{seconds:.3g} s"


def per_request_limits(targets: Iterable[Target]) -> dict[str, float]:
    """The bound a single request is held to, per metric: the one given at the highest
    percentile (a request over it is one that target counts against)."""
    best: dict[str, Target] = {}
    for t in targets:
        if t.metric not in best or t.percentile > best[t.metric].percentile:
            best[t.metric] = t
    return {m: t.seconds for m, t in best.items()}


@dataclass(frozen=True)
class Verdict:
    met: bool
    why: str  # empty when met; else the first reason it is not, in one phrase


def judge(summary: Mapping[str, object], targets: Iterable[Target]) -> Verdict:
    """Whether a run's summary meets every target. Rejected or unfinished requests fail it:
    a server that turns requests away or never answers them does not serve that rate."""
    total = int(summary.get("requests", 0) or 0)
    rejected = int(summary.get("rejected", 0) or 0)
    unfinished = int(summary.get("unfinished", 0) or 0)
    if rejected:
        reasons = [f"{k.removeprefix('rejected_')}: {int(v):,}" for k, v in summary.items()
                   if k.startswith("rejected_") and isinstance(v, int | float) and v]
        why = f" ({', '.join(reasons)})" if reasons else ""
        return Verdict(False, f"{rejected:,} of {total:,} requests rejected{why}")
    if unfinished:
        return Verdict(False, f"{unfinished:,} of {total:,} requests unfinished")
    for t in targets:
        value = _float(summary.get(t.column))
        if not math.isfinite(value):
            return Verdict(False, f"no {t.name} (no request " + (
                "decoded a second token)" if t.metric == "tpot" else "completed)"))
        if value > t.seconds:
            return Verdict(False, f"{t.name} {format_seconds(value)} > "
                                  f"{format_seconds(t.seconds)}")
    return Verdict(True, "")


def _float(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


#: The request columns goodput needs (what a probe keeps of its request table).
GOODPUT_COLUMNS = ("arrival_s", "finished_s", "status", "generated_tokens", "ttft_s", "tpot_s")


def goodput(requests: pd.DataFrame, targets: Iterable[Target]) -> tuple[float, float]:
    """(requests/s, tokens/s) completed within the per-request limits (`per_request_limits`;
    a request with no TPOT, one output token, is within any TPOT limit), over the run's span
    from the first arrival to the last completion (the span of its throughput)."""
    import numpy as np

    if not len(requests):
        return 0.0, 0.0
    done = requests[requests["status"] == "completed"]
    if not len(done):
        return 0.0, 0.0
    ok = np.ones(len(done), dtype=bool)
    for metric, limit in per_request_limits(targets).items():
        values = done[f"{metric}_s"].to_numpy(dtype=float)
        ok &= np.isnan(values) | (values <= limit)
    span = float(done["finished_s"].max()) - float(requests["arrival_s"].min())
    if not span > 0:
        return 0.0, 0.0
    tokens = float(done["generated_tokens"].to_numpy()[ok].sum())
    return float(ok.sum()) / span, tokens / span


def round_value(value: float) -> float:
    """`value` to DIGITS significant digits."""
    return float(f"{value:.{DIGITS}g}")


#: How a search ended.
FOUND = "found"  # bracketed to the precision
ABOVE = "met at every rate probed"  # up to the cap: the answer is a lower bound
NEVER = "missed at every rate probed"  # down to the floor: no answer
FAILED = "a run failed"


@dataclass
class Search:
    """Bracket, then bisect, the highest value of the search variable that meets a target.

    `start` is the scenario's own value; the search stays within [`lowest`, `highest`] and
    MAX_STEPS doublings or halvings of `start`. `probes` maps each value probed to whether it
    met the target.
    """

    start: float
    precision: float
    lowest: float = 0.0
    highest: float = math.inf
    probes: dict[float, bool] = field(default_factory=dict)
    lo: float | None = None  # highest value that met, every lower probe meeting too
    hi: float | None = None  # lowest value that failed
    status: str | None = None  # None while searching
    error: str = ""

    def __post_init__(self) -> None:
        self.start = round_value(self.start)
        self.lowest = max(self.lowest, self.start / 2**MAX_STEPS)
        self.highest = min(self.highest, self.start * 2**MAX_STEPS)

    def next(self) -> float | None:
        """The value to probe next, or None when the search is over (`status` says how)."""
        if self.status is not None:
            return None
        if not self.probes:
            return self.start
        lo, hi = self.lo, self.hi
        if hi is None:  # the target held at every value probed: grow
            assert lo is not None
            value = round_value(lo * 2)
            if value > self.highest:
                return self._end(ABOVE)
        elif lo is None:  # it failed at every value probed: shrink
            value = round_value(hi / 2)
            if value < self.lowest:
                return self._end(NEVER)
        else:
            if hi <= lo * (1 + self.precision):
                return self._end(FOUND)
            value = round_value(math.sqrt(lo * hi))
            if not lo < value < hi:  # (closer than the rounding: as precise as it gets)
                return self._end(FOUND)
        return value

    def tell(self, value: float, met: bool) -> None:
        """The probe at `value` met the target, or not."""
        self.probes[value] = met
        if met and (self.lo is None or value > self.lo) and (self.hi is None or value < self.hi):
            self.lo = value
        elif not met and (self.hi is None or value < self.hi):
            self.hi = value

    def fail(self, error: str) -> None:
        """A probe's run raised: the search cannot go on."""
        self.error = error
        self._end(FAILED)

    def _end(self, status: str) -> None:
        self.status = status
        return None

    @property
    def answer(self) -> float | None:
        """The highest value found to meet the target (a lower bound when `status` is ABOVE);
        None when none did."""
        return self.lo if self.status in (FOUND, ABOVE) else None


#: One round's probes: (search id, value) -> met, or the error string of a run that raised.
Round = Callable[[list[tuple[Hashable, float]]], Mapping[tuple[Hashable, float], bool | str]]


def run_searches(searches: Mapping[Hashable, Search], probe: Round) -> int:
    """Drive every search to its end, one probe per unfinished search per round, all of a
    round's probes handed to `probe` together; returns the number of rounds."""
    rounds = 0
    while True:
        asks = [(sid, v) for sid, s in searches.items() if (v := s.next()) is not None]
        if not asks:
            return rounds
        rounds += 1
        outcome = probe(asks)
        for sid, value in asks:
            met = outcome.get((sid, value), "no result")
            if isinstance(met, str):
                searches[sid].fail(met)
            else:
                searches[sid].tell(value, bool(met))
