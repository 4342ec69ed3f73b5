"""Speculative decoding as vLLM 0.33's scheduler sees it: drafts, lookahead slots, acceptance.

A decode step of a request carries the token it sampled last and up to k drafts (``1 + k``
tokens from the token budget, drafts cut to what the budget leaves). The target model verifies
them: ``a`` drafts accepted give ``1 + a`` new tokens; the rejected ones roll the request's
computed tokens back and free no block. Every allocation reserves ``lookahead`` slots past the
scheduled tokens (k for EAGLE, MTP and a draft model, whose proposer writes the drafts' KV; 0
for n-gram), prefill chunks included, so a request's blocks are the high-water mark of
``computed + scheduled + lookahead``. A draft model also costs each scheduled request one input
slot of the batch. tests/oracle/test_spec_driver.py pins each of these facts on vLLM itself.

How many drafts a step accepts is the workload's, not the scheduler's: a rate (each draft
accepted with probability p until the first rejection: ``P(a = j) = p^j (1 - p)`` for j < k,
``p^k`` for all k), a distribution of accepted counts, or per-request counts given in the
request table (``accepted_drafts``). Draws are per request and in the order of its verifying
steps, from a generator seeded by (seed, request id), so both engines and the oracle see the
same sequence whatever else runs beside the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Methods and the lookahead slots each allocation reserves past the scheduled tokens.
METHODS = ("eagle", "mtp", "draft_model", "ngram")


@dataclass(frozen=True)
class Speculative:
    """``engine.speculative``: k drafts per decode step by `method`, accepted as `rate`,
    `distribution` ((accepted count, weight) pairs) or the request table's column."""

    method: str
    num_tokens: int
    rate: float | None = None
    distribution: tuple[tuple[int, float], ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative.method {self.method!r}: one of {', '.join(METHODS)}")
        if self.num_tokens < 1:
            raise ValueError("speculative.num_tokens must be at least 1")
        if self.rate is not None and not 0.0 <= self.rate <= 1.0:
            raise ValueError("speculative.acceptance rate must lie in [0, 1]")
        for a, w in self.distribution:
            if not 0 <= a <= self.num_tokens or w < 0:
                raise ValueError(f"speculative.acceptance distribution: accepted counts in "
                                 f"0..{self.num_tokens}, weights >= 0 (got {a}: {w})")
        if self.distribution and not sum(w for _, w in self.distribution) > 0:
            raise ValueError("speculative.acceptance distribution: weights sum to 0")

    @property
    def lookahead(self) -> int:
        """KV slots past the scheduled tokens (vLLM's ``num_lookahead_tokens``)."""
        return 0 if self.method == "ngram" else self.num_tokens

    @property
    def draft_slots(self) -> int:
        """Input slots of the batch a scheduled request costs beyond its tokens (vLLM's
        ``max_num_new_slots_for_drafting``)."""
        return 1 if self.method == "draft_model" else 0

    @property
    def from_column(self) -> bool:
        """Whether accepted counts come from the request table (`accepted_drafts`)."""
        return self.rate is None and not self.distribution


class Acceptance:
    """Accepted-draft counts, request by request, in the order of its verifying steps.

    `given`: request id -> counts from the request table (used as they are, then read again
    from the start); otherwise draws from `spec` (rate or distribution), made in blocks and
    kept (one array per request), so that a request's j-th count is the same however it is
    asked for.
    """

    BLOCK = 64

    def __init__(self, spec: Speculative, given: dict[int, Sequence[int]] | None = None):
        self.spec = spec
        self._given = {rid: np.asarray(c, dtype=np.int64) for rid, c in (given or {}).items()}
        self._drawn: dict[int, np.ndarray] = {}
        self._gens: dict[int, np.random.Generator] = {}
        if spec.distribution:
            values = np.array([a for a, _ in spec.distribution], dtype=np.int64)
            weights = np.array([w for _, w in spec.distribution], dtype=np.float64)
            self._values, self._p = values, weights / weights.sum()

    def counts(self, rid: int, start: int, n: int) -> np.ndarray:
        """Counts of verifying steps start .. start + n - 1 of request `rid`."""
        if self.spec.from_column:
            c = self._given.get(rid)
            if c is None or not len(c):
                raise ValueError(f"request {rid}: no accepted_drafts counts")
            return c[np.arange(start, start + n) % len(c)]
        have = self._drawn.get(rid)
        if have is None or len(have) < start + n:
            more = max(start + n - (0 if have is None else len(have)), self.BLOCK)
            new = self._draw(rid, more)
            have = new if have is None else np.concatenate([have, new])
            self._drawn[rid] = have
        return have[start:start + n]

    def count(self, rid: int, index: int) -> int:
        """Count `index` of request `rid`: what the reference engine and the fast engine's
        walk ask, one verifying step at a time."""
        return int(self.counts(rid, index, 1)[0])

    def forget(self, rid: int) -> None:
        """Drop what was drawn for a request that is over (memory follows the requests in
        flight)."""
        self._drawn.pop(rid, None)
        self._gens.pop(rid, None)

    def _draw(self, rid: int, n: int) -> np.ndarray:
        gen = self._gens.get(rid)
        if gen is None:
            gen = self._gens[rid] = np.random.default_rng([self.spec.seed, rid])
        k = self.spec.num_tokens
        if self.spec.distribution:
            return gen.choice(self._values, size=n, p=self._p)
        p = float(self.spec.rate or 0.0)
        if p >= 1.0:
            return np.full(n, k, dtype=np.int64)
        if p <= 0.0:
            return np.zeros(n, dtype=np.int64)
        # successes before the first failure, at most k
        return np.minimum(gen.geometric(1.0 - p, size=n) - 1, k).astype(np.int64)


class SpecState:
    """A request's progress under speculative decoding, beside the slots its allocator holds
    (which run ahead of it: drafts, lookahead, rejected tokens' slots)."""

    __slots__ = ("computed", "decoding", "delivered", "drafts", "extra", "inflight", "rollback",
                 "scheduled", "slot", "verified")

    def __init__(self) -> None:
        self.computed = 0  # tokens whose KV is stored (vLLM's num_computed_tokens)
        # past its prefill (the fast engine keeps it out of the allocator's decode cohort,
        # which advances every decoder one token a step: each grows on its own here)
        self.decoding = False
        self.delivered = 0  # output tokens so far
        self.drafts = 0  # drafts it carries into its next step (k once it has sampled)
        self.scheduled = 0  # tokens scheduled for it in this iteration
        self.verified = 0  # steps that verified drafts: the next accepted count's index
        # Async scheduling: the outputs of its step in flight and its rejected drafts (vLLM
        # rolls them back after the next scheduling), and whether, done, it is scheduled once
        # more (vLLM could not tell it was done)
        self.inflight = 0
        self.rollback = 0
        self.extra = False
        # Its slot in the fast engine's arrays while they hold its state (sim/spec_steps.py:
        # these fields are then stale), else -1
        self.slot = -1


def extra_slots(spec: Speculative | None, prompt: int, output: int, max_model_len: int,
                asynchronous: bool = False) -> int:
    """Slots a request may hold past the P + O - 1 its tokens need: the last step's drafts
    and the lookahead (async scheduling: also the drafts of the step in flight, taken as
    accepted, and the step vLLM schedules after the last one), within max_model_len (vLLM
    caps the slots it allocates there)."""
    if spec is None:
        return 0
    extra = spec.num_tokens + spec.lookahead + (spec.num_tokens + 1) * asynchronous
    return min(extra, max(max_model_len - prompt - output + 1, 0))


def acceptance_for(spec: Speculative, workload) -> Acceptance:
    """The accepted counts of a run over `workload` (a request table): drawn, or its
    `accepted_drafts` column when the spec says so."""
    if not spec.from_column:
        return Acceptance(spec)
    if "accepted_drafts" not in workload:
        raise ValueError("speculative acceptance 'column': the request table has no "
                         "accepted_drafts column")
    rids = workload["request_id"] if "request_id" in workload else range(len(workload))
    return Acceptance(spec, {int(rid): [int(a) for a in counts]
                             for rid, counts in zip(rids, workload["accepted_drafts"],
                                                    strict=True)})
