"""The engine's configuration: how the server batches, admits and times iterations.

`EngineConfig` holds the scheduler's keys (vLLM's names where vLLM has them) and refuses
inconsistent ones when it is made. `IterationTime` is what prices one iteration: `StepTime`
(linear coefficients) here, sim/timing.py's `TableTime` (from the hardware) the other kind.
`async_modelled` says whether a run schedules asynchronously (sim/engine.py's docstring says
what that changes). Compiled with the engine (sim/_native.py): the loop reads these at every turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvfrag.sim.allocators.base import Allocator
from kvfrag.sim.speculative import Speculative


class IterationTime(Protocol):
    """How long one iteration takes: base + per_kv_token_s x KV tokens read + the prefill
    chunks' attention. `StepTime` (linear coefficients) and sim/timing.py's `TableTime` (from
    the hardware) are the two kinds."""

    @property
    def decode_kv_only(self) -> bool:
        """True: the KV read is the decoding sequences' tokens, prefill chunks pay
        `prefill_s`; False: every token running requests hold, and `prefill_s` is 0."""
        ...

    def affine(self, num_tokens: int, num_logits: int, decoding: bool) -> tuple[float, float]:
        """(base_s, per_kv_token_s) of an iteration with `num_tokens` batched tokens that
        samples `num_logits` positions; `decoding`: some sequence decodes in it."""
        ...

    def prefill_s(self, new_tokens: int, context: int) -> float:
        """Attention of one prefill chunk of `new_tokens` after `context` cached tokens."""
        ...

    @property
    def source(self) -> str:
        """What the figures come from, in a few words (for the summary)."""
        ...


@dataclass(frozen=True)
class StepTime:
    """Seconds per iteration: base + per_batched_token x batched + per_kv_token x KV read,
    where the KV read is every token running requests hold (prefills' included)."""

    @property
    def decode_kv_only(self) -> bool:
        return False

    base_s: float = 0.02
    per_batched_token_s: float = 0.0
    per_kv_token_s: float = 0.0

    def affine(self, num_tokens: int, num_logits: int, decoding: bool) -> tuple[float, float]:
        return self.base_s + self.per_batched_token_s * num_tokens, self.per_kv_token_s

    def prefill_s(self, new_tokens: int, context: int) -> float:
        return 0.0

    @property
    def source(self) -> str:
        return (f"linear base_s={self.base_s:g} per_batched_token_s={self.per_batched_token_s:g}"
                f" per_kv_token_s={self.per_kv_token_s:g}")

    def __post_init__(self) -> None:
        if min(self.base_s, self.per_batched_token_s, self.per_kv_token_s) < 0:
            raise ValueError("step time coefficients must be >= 0")
        if self.base_s + self.per_batched_token_s <= 0:
            raise ValueError("an iteration must take time: base_s or per_batched_token_s > 0")


@dataclass(frozen=True)
class EngineConfig:
    """How the server batches, admits and times iterations."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    batching: str = "continuous"  # or "static"
    chunked_prefill: bool = False
    admission: str = "fcfs"  # or "skip"
    lookahead: int = 64  # with admission="skip": how deep into the queue to look
    watermark: float = 0.0  # fraction of the budget an admission leaves free while others run
    # vLLM's cap on one request's prefill tokens in a step (0: none), waived when a single
    # request runs or waits; it chunks prompts even with chunked_prefill off, as in vLLM.
    long_prefill_token_threshold: int = 0
    # vLLM's admission gate: the whole prompt (less its cached prefix) must fit, not only the
    # first chunk (vLLM's scheduler_reserve_full_isl, on by default).
    reserve_full_isl: bool = True
    # vLLM's async scheduling (its server's default): each step is scheduled before the
    # previous step's output is applied (see sim/engine.py's docstring). Continuous batching
    # only; not modelled for the hybrid allocator yet, which runs synchronously.
    async_scheduling: bool = True
    # vLLM's scheduling policy: "fcfs", or "priority" (the request table's `priority` column,
    # lowest first; preemption by priority too)
    policy: str = "fcfs"
    # vLLM's speculative decoding (sim/speculative.py): k drafts a decode step, lookahead
    # slots, accepted counts per request. None: off
    speculative: Speculative | None = None
    step_time: IterationTime = field(default_factory=StepTime)
    max_time_s: float | None = None  # stop the simulation here (None: run to the end)
    log_allocations: bool = False  # record every allocation for `validate` (costs O(running))

    def __post_init__(self) -> None:
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be continuous or static, got {self.batching!r}")
        if self.admission not in ("fcfs", "skip"):
            raise ValueError(f"admission must be fcfs or skip, got {self.admission!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be fcfs or priority, got {self.policy!r}")
        if self.policy == "priority" and self.admission != "fcfs":
            raise ValueError("policy priority admits in vLLM's order: admission must be fcfs")
        if self.max_num_seqs < 1 or self.lookahead < 1:
            raise ValueError("max_num_seqs and lookahead must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError("watermark must be in [0, 1)")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.speculative is not None and self.batching != "continuous":
            raise ValueError("speculative decoding needs continuous batching")

    @property
    def prefill_chunk_limit(self) -> int:
        """The most tokens one prefill chunk may take (vLLM's `max_prefill_tokens`)."""
        return min(self.max_num_batched_tokens,
                   self.long_prefill_token_threshold or self.max_num_batched_tokens)


#: Allocator kinds whose behaviour under async scheduling is not modelled yet: they run as
#: vLLM's synchronous scheduler would. None today (the hybrid allocator frees its windows by
#: the tokens processed, `Allocator.set_async`).
ASYNC_NOT_MODELLED: frozenset[str] = frozenset()


def async_modelled(config: EngineConfig, allocator: Allocator) -> bool:
    """Whether a run schedules asynchronously: asked for, continuous batching (a static batch
    frees together once its last member is done, so a finished member's extra step changes
    nothing), and an allocator whose async behaviour is modelled."""
    return (config.async_scheduling and config.batching == "continuous"
            and allocator.kind not in ASYNC_NOT_MODELLED)
