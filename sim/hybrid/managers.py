"""vLLM 0.33's single-type KV-cache managers (`v1/core/single_type_kv_cache_manager.py`), one
class per kind of KV-cache group, as the `hybrid` allocator (the coordinator over them) counts
blocks with them.

A manager stands for every planned group of one kind, block size and window: `groups` block
tables per request, each of the same length. What differs between kinds is only which leading
blocks a request may give back once `processed` tokens are computed (vLLM's
`get_num_skipped_tokens`), what its layers still read, where its counts stop being linear in a
request's length, and its admission cap (`max_admission_blocks_per_request`); everything else
(a table of ceil(tokens / block_size) blocks less the skipped ones) is vLLM's base class's.

Mamba state (`MambaManager`) is counted here in `mamba_cache_mode` "none": vLLM 0.33 sets the
Mamba block size to max_model_len there, so a request holds one state block per Mamba group
for its whole life (skipped tokens, n - 1, never reach a whole block). "align" is reachable
only with prefix caching (`MambaModelConfig.verify_and_update_config` turns "align" into
"none" when prefix caching is off, and `VllmConfig.validate_mamba_block_size` refuses a Mamba
block size other than max_model_len without it), and prefix caching keeps vLLM's block pool
block by block, Mamba tables included (`kvfrag.sim.hybrid.caching`, `sim.hybrid.prefix`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvfrag.sim.hybrid.planner import Group, Plan
from kvfrag.sim.layers import LayerStack, MambaState

#: Planned group kinds kept by the full-attention manager (MLA and promoted layers too).
FULL_KINDS = ("full", "mla")


@dataclass(frozen=True)
class Manager:
    """Full attention and MLA (vLLM's `FullAttentionManager`): every block kept until the
    request ends. The base of the other kinds."""

    block_size: int
    window: int  # W or C; 0 where the kind has none
    groups: int  # groups of this kind, block size and window
    token_bytes: int  # sum over those groups of their real layers' bytes per token
    cap: int | None  # max_admission_blocks_per_request (per group), None where uncapped
    state_bytes: int = 0  # sum over those groups of their real layers' state (Mamba)

    kind: ClassVar[str] = "full"
    #: Whether a running request's leading blocks can be freed before it ends.
    frees: ClassVar[bool] = False

    def skipped_blocks(self, processed: int) -> int:
        """Leading blocks freed once `processed` tokens are computed (per group)."""
        return 0

    def held(self, tokens: int, processed: int) -> int:
        """Blocks one group holds for `tokens` slots after freeing by `processed`."""
        return -(-tokens // self.block_size) - self.skipped_blocks(processed)

    def needed(self, tokens: int) -> int:
        """Tokens each layer of these groups still reads (its window of the stored ones)."""
        return tokens

    def most_blocks(self, tokens: int) -> int:
        """The most blocks one group holds at any length up to `tokens` (a bound)."""
        return -(-tokens // self.block_size)

    def most_taken(self, steps: int) -> int:
        """The most new blocks one group takes in `steps` decode steps."""
        return -(-steps // self.block_size)

    def peak_span(self) -> int:
        """Lengths before a request's last within which its count here peaks: full attention
        only grows (its peak is at the end); the windowed kinds repeat with the block size."""
        return 2 * self.block_size if self.frees else 0

    def progressions(self) -> list[tuple[int, int]]:
        """(r, mod): the lengths r mod `mod` where these groups' counts or needed tokens may
        stop being linear in the length: block boundaries, window edges, chunk starts."""
        return [(1, self.block_size)]

    def starts(self, lo: int, hi: int) -> list[int]:
        """Lengths in [lo, hi] at which these groups' counts or needed tokens may stop being
        linear in the length (`progressions`)."""
        out: list[int] = []
        for r, mod in self.progressions():
            out.extend(range(lo + (r - lo) % mod, hi + 1, mod))
        return out

    def next_free(self, tokens: int, final: int) -> int | None:
        """Steps from `tokens` (processed: tokens - 1) until a decode step frees a block (the
        step to length L frees by L - 1 processed tokens); None: none before `final`."""
        return None


@dataclass(frozen=True)
class SlidingWindowManager(Manager):
    """Sliding window W: the blocks wholly before token P - W + 1 are skipped."""

    kind: ClassVar[str] = "sliding_window"
    frees: ClassVar[bool] = True

    def skipped_blocks(self, processed: int) -> int:
        return max(0, processed - self.window + 1) // self.block_size

    def needed(self, tokens: int) -> int:
        return min(self.window, tokens)

    def most_blocks(self, tokens: int) -> int:
        return min(-(-tokens // self.block_size),
                   (self.window + 2 * self.block_size - 2) // self.block_size)

    def progressions(self) -> list[tuple[int, int]]:
        return [(1, self.block_size), (self.window % self.block_size, self.block_size)]

    def next_free(self, tokens: int, final: int) -> int | None:
        # skipped(L - 1) = (L - W) // bs for L >= W: up by one at L = W + k bs, k >= 1
        bs = self.block_size
        length = max(self.window + bs, tokens + 1 + (self.window - tokens - 1) % bs)
        return length - tokens if length <= final else None


@dataclass(frozen=True)
class ChunkedLocalManager(Manager):
    """Chunked local attention C: every block of the chunks before floor(P / C) x C."""

    kind: ClassVar[str] = "chunked_local"
    frees: ClassVar[bool] = True

    def skipped_blocks(self, processed: int) -> int:
        return processed // self.window * self.window // self.block_size

    def needed(self, tokens: int) -> int:
        return tokens - (tokens - 1) // self.window * self.window

    def most_blocks(self, tokens: int) -> int:
        return min(-(-tokens // self.block_size), self.window // self.block_size + 2)

    def progressions(self) -> list[tuple[int, int]]:
        return [(1, self.block_size), (1, self.window)]

    def next_free(self, tokens: int, final: int) -> int | None:
        c, base = self.window, self.skipped_blocks(tokens - 1)
        length = tokens + 1 + (1 - tokens - 1) % c  # the next chunk start: L - 1 = k C
        while length <= final:
            if self.skipped_blocks(length - 1) > base:
                return length - tokens
            length += c
        return None


@dataclass(frozen=True)
class MambaManager(Manager):
    """Mamba state in `mamba_cache_mode` "none": one state block per request per group, its
    block size max_model_len. vLLM skips n - 1 tokens (only the last token's state is read),
    so a block would be freed only past max_model_len tokens: never while a request runs.
    Its layers read their state, not tokens: token_bytes is 0 and `state_bytes` is what
    the model needs of the held page (the rest is padding to the one page size)."""

    kind: ClassVar[str] = "mamba"

    def skipped_blocks(self, processed: int) -> int:
        return max(0, processed - 1) // self.block_size

    def peak_span(self) -> int:
        return 0  # (one block from the first token to max_model_len)

    def most_taken(self, steps: int) -> int:
        return 0  # (its block, taken at admission, covers every length up to max_model_len)


_BY_KIND: dict[str, type[Manager]] = {
    m.kind: m for m in (Manager, SlidingWindowManager, ChunkedLocalManager, MambaManager)
}


def _key(g: Group) -> tuple[str, int, int]:
    """(kind, block size, window) of a planned group: groups alike share a manager."""
    kind = "full" if g.kind in FULL_KINDS else g.kind
    window = (g.window or 0) if kind in ("sliding_window", "chunked_local") else 0
    return kind, g.block_size, window


def managers_for(
    plan: Plan, stack: LayerStack, in_flight: int, max_model_len: int
) -> tuple[tuple[Manager, ...], list[int]]:
    """One manager per kind, block size and window of the plan's groups (vLLM's
    `get_manager_for_kv_cache_spec`, groups alike merged), and each planned group's manager
    index. `in_flight`: the tokens a step may have in flight (max_num_batched_tokens x
    concurrent batches), which sliding and chunked groups' admission caps allow for."""
    by_key: dict[tuple[str, int, int], list[int]] = {}
    for g in plan.groups:
        layers = [stack.layers[i] for i in g.layers]
        entry = by_key.setdefault(_key(g), [0, 0, 0])
        entry[0] += 1
        entry[1] += sum(layer.bytes_per_token for layer in layers)
        entry[2] += sum(layer.state_bytes for layer in layers if isinstance(layer, MambaState))
    keys = list(by_key)
    manager_of = [keys.index(_key(g)) for g in plan.groups]
    out: list[Manager] = []
    for (kind, bs, window), (groups, tb, state) in by_key.items():
        cap = None
        if kind == "sliding_window":
            cap = -(-min(window - 1 + in_flight, max_model_len) // bs) + 1
        elif kind == "chunked_local":
            cap = -(-min(window + in_flight, max_model_len) // bs)
        out.append(_BY_KIND[kind](bs, window, groups, tb, cap, state))
    return tuple(out), manager_of
