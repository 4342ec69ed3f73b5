"""What contiguous and buddy allocators share: one slab per request, sized at admission.

A slab allocator must decide at admission how many tokens to set aside, before the request
has generated anything. The reservation policy is that guess:
- `max_model_len`: the worst case, what a server that knows nothing must assume;
- `pow2_output`: the prompt plus its output rounded up to a power of two (knows the output
  within 2x): the PagedAttention paper's Orca (Pow2), "a true output length of 25 reserves 32
  positions for outputs"; the output here is the slots it takes (one less than the tokens
  generated: the last sampled one is never stored);
- `pow2_final`: the whole final length rounded up to a power of two (`pow2`, its old name, is
  kept as an alias). On a buddy allocator, which rounds every slab to a power of two anyway,
  it reserves what `oracle` does;
- `oracle`: exactly the final length (Orca's Oracle: the best a slab can do);
- `max_tokens`: prompt + the request's declared output limit (max_model_len when undeclared).
Every reservation is capped at max_model_len. A request whose real final length exceeds its
reservation ends at the reservation, as a server enforcing max_tokens would end it.

The slab never changes size, so between admissions the allocated bytes are constant and
`step` only moves the decode clock. Slabs cannot share: a request with n samples (parallel
sampling) gets n slabs, each holding its own copy of the prompt's keys and values.
"""

from __future__ import annotations

from abc import abstractmethod
from enum import Enum
from typing import TypeVar

from kvfrag.sim.allocators.base import Allocator, Grant, Live, Reason, Refusal, Request
from mypy_extensions import mypyc_attr


class Reserve(str, Enum):
    MAX_MODEL_LEN = "max_model_len"
    POW2_OUTPUT = "pow2_output"
    POW2_FINAL = "pow2_final"
    ORACLE = "oracle"
    MAX_TOKENS = "max_tokens"

    @classmethod
    def _missing_(cls, value: object) -> Reserve | None:
        return cls.POW2_FINAL if value == "pow2" else None  # the old name


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


E = TypeVar("E", bound=Enum)


def parse_enum(enum: type[E], value: str | E, what: str) -> E:
    """Turn a user's string into an enum member, listing the valid names when it is not one."""
    try:
        return enum(value)
    except ValueError:
        valid = ", ".join(m.value for m in enum)
        raise ValueError(f"unknown {what} {value!r} (valid: {valid})") from None


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class SlabAllocator(Allocator):
    """One fixed-size slab per request; subclasses say where slabs go and how big they are."""

    def __init__(
        self,
        capacity: object,
        bytes_per_token: object,
        max_model_len: object,
        reserve: Reserve | str = Reserve.MAX_MODEL_LEN,
    ) -> None:
        super().__init__(capacity, bytes_per_token, max_model_len)
        self.reserve = parse_enum(Reserve, reserve, "reservation policy")
        self._held = 0  # sum of slab bytes
        self._written = 0  # sum of min(A, b*F): bytes that will hold tokens
        self._over = 0  # sum of min(A, b*R) - min(A, b*F): reserved past the final length

    def reservation_tokens(self, req: Request) -> int:
        mml = self.max_model_len
        if self.reserve is Reserve.MAX_MODEL_LEN:
            tokens = mml
        elif self.reserve is Reserve.POW2_FINAL:
            tokens = next_pow2(req.final)
        elif self.reserve is Reserve.POW2_OUTPUT:
            tokens = req.prompt + (next_pow2(req.output) if req.output else 0)
        elif self.reserve is Reserve.ORACLE:
            tokens = req.final
        else:
            tokens = req.prompt + req.max_tokens if req.max_tokens else mml
        return min(tokens, mml)

    @abstractmethod
    def slab_bytes(self, tokens: int) -> int:
        """Bytes of the slab that holds a reservation of `tokens` tokens."""

    @abstractmethod
    def _place(self, nbytes: int) -> int | None:
        """Find room for `nbytes`; return its offset, or None when no hole fits."""

    @abstractmethod
    def _unplace(self, offset: int, nbytes: int) -> None:
        """Return a slab's bytes to the free space (coalescing as the structure allows)."""

    @abstractmethod
    def _max_slab(self) -> int:
        """The largest slab an empty allocator could hold."""

    def bytes_for(self, req: Request, tokens: int) -> int:
        return req.n * self.slab_bytes(min(self.reservation_tokens(req), self.max_model_len))

    def _admit(self, live: Live, tokens: int) -> Grant | Refusal:
        rid, copies = live.req.rid, live.req.n
        one = self.slab_bytes(live.cap)
        nbytes = copies * one
        free = self.capacity - self._held
        if one > self._max_slab() or nbytes > self.capacity:
            return Refusal(rid, Reason.TOO_LARGE, nbytes, free, "slab larger than the budget")
        if nbytes > free:
            return Refusal(rid, Reason.OUT_OF_MEMORY, nbytes, free)
        offsets: list[int] = []
        for _ in range(copies):  # one slab per sample, all or none
            offset = self._place(one)
            if offset is None:
                for placed in offsets:
                    self._unplace(placed, one)
                detail = "no free hole is large enough"
                return Refusal(rid, Reason.FRAGMENTED, nbytes, free, detail)
            offsets.append(offset)
        live.offset, live.nbytes = offsets[0], nbytes
        live.extra = offsets[1:] or None
        self._held += nbytes
        self._written += copies * min(one, self.bytes_per_token * live.final)
        self._over += copies * self._overreserved(one, live)
        return Grant(rid, nbytes, live.cap, offset=offsets[0])

    def _grow(self, live: Live, old: int, new: int) -> Grant | Refusal:
        return Grant(live.req.rid, 0, live.cap, offset=live.offset)

    def _release(self, live: Live) -> None:
        one = live.nbytes // live.req.n
        for offset in (live.offset, *(live.extra or ())):
            self._unplace(offset, one)
        self._held -= live.nbytes
        self._written -= live.req.n * min(one, self.bytes_per_token * live.final)
        self._over -= live.req.n * self._overreserved(one, live)

    def _overreserved(self, one: int, live: Live) -> int:
        """Bytes of one slab of `one` bytes reserved for tokens its request never reaches."""
        b = self.bytes_per_token
        return min(one, b * live.cap) - min(one, b * live.final)

    def overreserved_bytes(self) -> int:
        return self._over

    def allocated_bytes(self, rid: int) -> int:
        return self._get(rid).nbytes

    def slab_offsets(self, rid: int) -> tuple[int, ...]:
        live = self._get(rid)
        return (live.offset, *(live.extra or ()))

    def slabs(self) -> list[tuple[int, int, int]]:
        """(offset, bytes, rid) of every live slab (one per sample), by offset."""
        return sorted(
            (offset, lv.nbytes // lv.req.n, rid)
            for rid, lv in self._live.items()
            for offset in (lv.offset, *(lv.extra or ()))
        )

    def _allocated_total(self) -> int:
        return self._held

    def _internal_total(self) -> int:
        return self._held - self._written

    def _unit(self, probe: Request | None) -> int:
        """The placement unit free space is judged by: the probe's slab, or one token."""
        if probe is None:
            return self.slab_bytes(1)
        return self.slab_bytes(min(self.reservation_tokens(probe), self.max_model_len))
