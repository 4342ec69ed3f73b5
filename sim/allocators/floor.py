"""The exact-need floor: an allocator that holds what the running requests need and nothing
else, byte for byte, with no blocks and no holes: the least any layout could hold.

Per live request of L stored tokens, its need (`need`) is, layer by layer:

- full attention and MLA: every token (L x the layer's bytes per token);
- sliding window W: the last min(W, L) tokens;
- chunked local C: the tokens of the chunk of its last token, L - floor((L - 1) / C) x C;
- Mamba: its state (the layer's state bytes, unpadded), whatever L.

This is what every allocator counts as `token_states` on a hybrid model (the hybrid allocator
by each layer's real kind, the others through `sim.model_view`), so the floor's token_states
equals theirs for the same live requests.

What is in flight. A prefill chunk of c tokens after `old` computed ones reads, in a sliding
layer, the W - 1 tokens before each of its positions: min(old, W - 1) + c tokens are held
while it is computed, not only the window of the last; a chunked-local layer reads from the
start of the chunk of its first position: c + (old mod C) tokens. The floor holds those from
the chunk's allocation (`admit` or `grow`) until the request's next one or until it joins the
decode cohort (after its last chunk), and counts the bytes beyond the need as `reserved`. A
decode step (c = 1) holds nothing beyond the need, so a decoder holds exactly its need (the
bytes given back as a request joins the cohort count as a free: the engine tries a request
refused for memory again after one). Every
layout must hold as much: vLLM frees a window's blocks only by the tokens processed before
the allocation (the hybrid allocator holds every block of the chunk's reads and more), and
the other layouts keep every token. So the floor stays a lower bound at every instant (the
property test `tests/sim/test_floor_bound.py` holds every allocator to it).

Accounting: token_states = the need; reserved = the in-flight bytes beyond it; internal =
external = 0; usable_free = free = capacity less both. A request is admitted (and a chunk
grown) when what it then holds fits in the free bytes; a decode step is refused when the
decoders' needs after it exceed the budget. The need grows per decode step by every
full-attention and MLA layer, by a sliding layer only while the request is shorter than its
window, and by a chunked layer within its chunk (dropping to one token at a chunk start).

The running sums follow the base class: stored tokens are linear in the decode clock, and the
tokens the sliding and chunked layers no longer read are a `ModelView` of the stack (out of
window bytes as segments in the clock), so the need is bytes_per_token x tokens less the
view's total, plus the Mamba states; nothing walks the decoders. `steps_until_full` bounds the
growth by the slope of the segments now (a slope that only falls as decoders pass their
windows) and looks exactly only where that bound reaches the budget.

`bytes_for(req, tokens)` is the most the request holds while its first `tokens` tokens are
prefilled in chunks of at most `max_num_batched_tokens` (a sliding layer W - 1 + chunk tokens,
a chunked layer C - 1 + chunk), the admission gate's figure; never more than the hybrid
allocator's capped figure. Sample groups (n > 1) are not modelled (as with the hybrid
allocator).
"""

from __future__ import annotations

from kvfrag.sim.allocators.base import (
    Allocator,
    Grant,
    Live,
    Reason,
    Refusal,
    Request,
    positive_int,
)
from kvfrag.sim.geometry import KVGeometry
from kvfrag.sim.layers import ChunkedLocal, FullAttention, LayerStack, SlidingWindow
from kvfrag.sim.model_view import ModelView
from mypy_extensions import mypyc_attr


def stack_of(stack: object, geometry: KVGeometry | None, bytes_per_token: int) -> LayerStack:
    """The model's layers: `stack`, or a plain full-attention model's `geometry` as alike
    layers. Raises ValueError when there is neither or it disagrees with bytes_per_token."""
    if stack is None and geometry is not None and geometry.token_bytes is None:
        layer = FullAttention(geometry.kv_heads, geometry.head_dim, geometry.dtype_bytes)
        stack = LayerStack(geometry.name, (layer,) * geometry.layers)
    if not isinstance(stack, LayerStack):
        raise ValueError("this allocator needs the model's layers (a LayerStack)")
    if bytes_per_token != stack.full_bytes_per_token:
        raise ValueError(
            f"bytes_per_token is {bytes_per_token}, but model {stack.name!r} keeps "
            f"{stack.full_bytes_per_token} bytes per token with every layer full"
        )
    return stack


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class FloorAllocator(Allocator):
    """Exactly the running requests' need, byte for byte (see the module)."""

    kind = "floor"

    def __init__(
        self,
        capacity: object,
        bytes_per_token: object,
        max_model_len: object,
        stack: object = None,
        max_num_batched_tokens: object = 8192,
        geometry: KVGeometry | None = None,
    ) -> None:
        super().__init__(capacity, bytes_per_token, max_model_len)
        self.stack = stack_of(stack, geometry, self.bytes_per_token)
        self.chunk_limit = positive_int("max_num_batched_tokens", max_num_batched_tokens)
        sliding: dict[int, int] = {}
        chunked: dict[int, int] = {}
        for layer in self.stack.layers:
            if isinstance(layer, SlidingWindow):
                sliding[layer.window] = sliding.get(layer.window, 0) + layer.bytes_per_token
            elif isinstance(layer, ChunkedLocal):
                chunked[layer.chunk] = chunked.get(layer.chunk, 0) + layer.bytes_per_token
        #: (window, bytes per token of its layers), and likewise (chunk, bytes)
        self.sliding = tuple(sorted(sliding.items()))
        self.chunked = tuple(sorted(chunked.items()))
        self.growing = self.stack.growing_bytes_per_token
        self.state = self.stack.state_bytes_per_request
        self._view = ModelView.of(self.stack)  # (what sliding and chunked layers no longer read)
        self._extra: dict[int, int] = {}  # rid -> bytes held beyond its need (a chunk in flight)
        self._extra_sum = 0
        self._version = 0
        self._full_memo: tuple[int, int, int | None] | None = None

    # ------------------------------------------------------------- per request
    def need(self, tokens: int) -> int:
        """Bytes a request of `tokens` stored tokens needs (see the module)."""
        out = self.growing * tokens + self.state
        for w, b in self.sliding:
            out += b * min(w, tokens)
        for c, b in self.chunked:
            out += b * (tokens - (tokens - 1) // c * c)
        return out

    def computing(self, old: int, new: int) -> int:
        """Bytes a request holds while the tokens from `old` to `new` are computed (the reads
        of a chunk: `need(new)` when new = old + 1)."""
        out = self.growing * new + self.state
        for w, b in self.sliding:
            out += b * (min(old, w - 1) + new - old)
        for c, b in self.chunked:
            out += b * (new - old // c * c)
        return out

    def allocated_bytes(self, rid: int) -> int:
        live = self._get(rid)
        return self.need(self._tokens_of(live)) + self._extra.get(rid, 0)

    def bytes_for(self, req: Request, tokens: int) -> int:
        """The most a request holds while its first `tokens` are prefilled in chunks of at
        most `max_num_batched_tokens`, and while it decodes to `tokens` (an upper bound on
        each layer's part: a sliding layer's W - 1 + chunk, a chunked one's C - 1 + chunk)."""
        m = self.chunk_limit
        out = self.growing * tokens + self.state
        for w, b in self.sliding:
            out += b * min(tokens, w - 1 + m)
        for c, b in self.chunked:
            out += b * min(tokens, c - 1 + m)
        return out

    # -------------------------------------------------------------------- hooks
    def _admit(self, live: Live, tokens: int) -> Grant | Refusal:
        rid = live.req.rid
        if live.req.n > 1:
            raise ValueError(
                f"request {rid}: the floor allocator does not model sample groups (n > 1) yet"
            )
        held = self.computing(0, tokens)
        free = self.free_bytes()
        if held > self.capacity:
            return Refusal(rid, Reason.TOO_LARGE, held, free, "needs more than the budget")
        if held > free:
            return Refusal(rid, Reason.OUT_OF_MEMORY, held, free)
        self._set_extra(rid, held - self.need(tokens))
        return Grant(rid, held, live.cap)

    def _grow(self, live: Live, old: int, new: int) -> Grant | Refusal:
        rid = live.req.rid
        held = self.computing(old, new)
        more = held - self.need(old) - self._extra.get(rid, 0)
        free = self.free_bytes()
        if more > free:
            return Refusal(rid, Reason.OUT_OF_MEMORY, more, free)
        self._set_extra(rid, held - self.need(new))
        return Grant(rid, max(more, 0), live.cap)

    def _set_extra(self, rid: int, extra: int) -> None:
        self._extra_sum += extra - self._extra.get(rid, 0)
        if extra:
            self._extra[rid] = extra
        else:
            self._extra.pop(rid, None)
        self._version += 1

    def _release(self, live: Live) -> None:
        self._extra_sum -= self._extra.pop(live.req.rid, 0)
        self._version += 1

    def _cohort_changed(self, live: Live, decoding: bool) -> None:
        if decoding and self._extra.get(live.req.rid, 0):
            # Its last chunk is computed: the need alone. Memory comes back without a free
            # or a step, so it counts as a free (what the engine watches before it tries a
            # request refused for memory again).
            self._set_extra(live.req.rid, 0)
            self.frees += 1
        self._version += 1

    def view_model(self, stack: LayerStack) -> None:
        raise ValueError("the floor counts its model's layers itself (its `stack` option)")

    # ----------------------------------------------------------------- totals
    def _need_total(self) -> int:
        """The need of every live request now (running sums: see the module)."""
        total = self.bytes_per_token * self._linear_tokens() + self.state * len(self._live)
        view = self._view
        return total if view is None else total - view.total(self._clock)

    def _allocated_total(self) -> int:
        return self._need_total() + self._extra_sum

    def _internal_total(self) -> int:
        return 0

    def _usable_free(self, probe: Request | None) -> int:
        return self.capacity - self._allocated_total()

    def _largest_hole(self) -> int:
        return self._usable_free(None)

    def parts(self, probe: Request | None = None) -> tuple[int, int, int, int, int]:
        need = self._need_total()
        return (need, self._extra_sum, 0, 0, self.capacity - need - self._extra_sum)

    def integrals(
        self, n: int, probe: Request | None, w0: float, w1: float
    ) -> tuple[float, float, float, float, float, float]:
        weight = n * w0 + w1 * n * (n - 1) / 2
        jw = w0 * n * (n + 1) / 2 + w1 * (n - 1) * n * (n + 1) / 3  # sum_j j * w_j
        need = (self.bytes_per_token * (self._linear_tokens() * weight + self._dec_weight * jw)
                + self.state * len(self._live) * weight)
        view = self._view
        if view is not None:
            need -= view.integral(n, w0, w1, self._clock)
        reserved = self._extra_sum * weight
        return (need, reserved, 0.0, 0.0, self.capacity * weight - need - reserved, 0.0)

    def waste_parts(self) -> tuple[int, int]:
        return (0, 0)

    def waste_integrals(self, n: int, w0: float, w1: float) -> tuple[float, float]:
        return (0.0, 0.0)

    def waste_breakdown(self) -> dict[str, int]:
        return {"overreservation": 0, "padding": 0, "out_of_window": 0, "rounding": 0}

    # ------------------------------------------------------------- the cohort
    def _at(self, k: int) -> tuple[int, int]:
        """(allocated bytes at clock k, the growth per step of the segments then): k at or
        after the clock, no admission, grow or free before it."""
        dec = self.bytes_per_token * self._dec_weight
        total = (self.bytes_per_token * (self._fixed_tokens + self._phase_sum) + dec * k
                 + self.state * len(self._live) + self._extra_sum)
        view = self._view
        if view is None:
            return total, dec
        out, slope = view.at(k)
        return total - out, dec - slope

    def steps_until_full(self) -> int | None:
        """The steps the decoders can take before their need passes the budget: exact below
        `steps_until_done`, at least it past it; None when it never grows. The growth per
        step only falls as decoders pass their windows (a chunk start drops the need), so
        from any clock the need stays under its value there plus that growth per step: a
        stretch it keeps under the budget is passed over whole, and only a step where the
        bound reaches the budget is looked at exactly."""
        memo = self._full_memo
        if memo is not None and memo[0] == self._clock and memo[1] == self._version:
            return memo[2]
        done = self.steps_until_done()
        result: int | None = None
        if done is not None:
            j = 0
            while j < done:
                k = self._clock + j
                held, growth = self._at(k)
                if growth <= 0:
                    j = -1
                    break
                room = (self.capacity - held) // growth
                if room > 0:
                    j += room
                elif self._at(k + 1)[0] > self.capacity:
                    break
                else:
                    j += 1
            result = None if j < 0 else j
        self._full_memo = (self._clock, self._version, result)
        return result

    def steps_until_shrink(self) -> int | None:
        """On a model with chunked-local layers, steps until a decoder may cross a chunk
        start (a lower bound: the next end of a segment of the view); else None (a decoder's
        need only grows)."""
        view = self._view
        if view is None or not self.chunked:
            return None
        end = view.next_end(self._clock)
        return None if end is None else max(1, end - self._clock)
