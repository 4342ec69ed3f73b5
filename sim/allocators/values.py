"""The protocol's values: what an allocator is asked (`Request`), what it answers (`Grant`,
`Refusal` with its `Reason`), what it reports (`Accounting`, the five `PARTS`), and the state
it keeps per live request (`Live`). `kvfrag.sim.allocators.base` re-exports them beside the
`Allocator` class that uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import ClassVar, Final

from mypy_extensions import mypyc_attr

#: The five parts of the budget, in the order plots stack them.
PARTS = ("token_states", "reserved", "internal", "external", "usable_free")


class Reason(str, Enum):
    """Why an allocation was refused."""

    OUT_OF_MEMORY = "out_of_memory"  # fewer free bytes than the allocation needs
    FRAGMENTED = "fragmented"  # enough free bytes in total, but no single place fits
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt leaves no room for output under max_model_len
    TOO_LARGE = "too_large"  # would not fit even in an empty allocator


def _fields_repr(obj: object, names: tuple[str, ...]) -> str:
    """`Name(a=1, b=2)`, as a dataclass prints itself."""
    args = ", ".join(f"{name}={getattr(obj, name)!r}" for name in names)
    return f"{type(obj).__name__}({args})"


# Request, Grant, Refusal and Live are plain classes, not dataclasses: compiled (setup.py), a
# dataclass keeps its generated, interpreted __init__ (a frozen one sets every field through
# object.__setattr__), and the engine makes one or more of each per request. The first three
# are values (`_Value`), never changed once made (`Final`: mypy, and so the compiled build,
# refuses an assignment).


class _Value:
    """Equality, hash and repr by the fields a subclass names (as a frozen dataclass has them),
    and a deep copy that is the value itself (immutable: a copy may share it; compiled, it
    could not be rebuilt)."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    def _key(self) -> tuple:
        return tuple(getattr(self, name) for name in self.FIELDS)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__ or not isinstance(other, _Value):
            return False
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return _fields_repr(self, self.FIELDS)

    def __deepcopy__(self, memo: dict) -> _Value:
        return self


class Request(_Value):
    """What an allocator may know of a request: its lengths and any declared output limit.

    `output` counts the tokens stored past the prompt, which the engine derives from a served
    request's output length (`sim.engine_requests.slot_request`: one less, as the last sampled
    token is never stored); `max_tokens` likewise bounds stored tokens past the prompt.
    """

    FIELDS: ClassVar[tuple[str, ...]] = (
        "rid", "prompt", "output", "max_tokens", "n", "beam", "prefix", "prefix_tokens",
    )

    def __init__(
        self,
        rid: int,
        prompt: int,
        output: int,
        max_tokens: int | None = None,
        n: int = 1,  # sequences sharing the prompt, generated in lockstep
        beam: bool = False,  # the n sequences are beams (they share more than the prompt)
        prefix: tuple[int, ...] = (),  # hash chain of the prompt, one hash per chunk of tokens
        prefix_tokens: int = 0,  # tokens per hashed chunk (512 in the Mooncake trace)
    ) -> None:
        if prompt < 1 or output < 0:
            raise ValueError(f"request {rid}: prompt must be >= 1 token and output >= 0")
        if n < 1:
            raise ValueError(f"request {rid}: n must be >= 1")
        if n > 1 and output < 1:
            raise ValueError(f"request {rid}: a group of {n} stores >= 1 output token")
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"request {rid}: max_tokens must be >= 0")
        self.rid: Final = rid
        self.prompt: Final = prompt
        self.output: Final = output
        self.max_tokens: Final = max_tokens
        self.n: Final = n
        self.beam: Final = beam
        self.prefix: Final = prefix
        self.prefix_tokens: Final = prefix_tokens

    @property
    def final(self) -> int:
        """Tokens stored once every output token is generated."""
        return self.prompt + self.output


class Grant(_Value):
    """A successful operation: what it newly allocated."""

    FIELDS: ClassVar[tuple[str, ...]] = ("rid", "nbytes", "capacity_tokens", "offset", "blocks")

    def __init__(
        self,
        rid: int,
        nbytes: int,  # bytes newly allocated by this operation
        capacity_tokens: int,  # tokens the request may store in total (its truncation point)
        offset: int | None = None,  # slab allocators: byte offset of the slab
        blocks: tuple[int, ...] = (),  # paged: block ids newly handed out
    ) -> None:
        self.rid: Final = rid
        self.nbytes: Final = nbytes
        self.capacity_tokens: Final = capacity_tokens
        self.offset: Final = offset
        self.blocks: Final = blocks

    def __bool__(self) -> bool:
        return True


class Refusal(_Value):
    """A refused operation and why; nothing was changed."""

    FIELDS: ClassVar[tuple[str, ...]] = ("rid", "reason", "needed", "free", "detail")

    def __init__(
        self,
        rid: int,
        reason: Reason,
        needed: int,  # bytes the operation needed
        free: int,  # bytes free at the time (`free_bytes()`)
        detail: str = "",
    ) -> None:
        self.rid: Final = rid
        self.reason: Final = reason
        self.needed: Final = needed
        self.free: Final = free
        self.detail: Final = detail

    def __bool__(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Accounting:
    """The budget split into its five parts, in bytes, at one instant."""


    capacity: int
    token_states: int
    reserved: int
    internal: int
    external: int
    usable_free: int
    largest_hole: int
    live: int

    @property
    def free(self) -> int:
        return self.external + self.usable_free

    @property
    def allocated(self) -> int:
        return self.capacity - self.free

    @property
    def hole_index(self) -> float:
        """1 - largest_hole / free: 0 when all free memory is one hole (or none is free)."""
        return 1.0 - self.largest_hole / self.free if self.free else 0.0

    def check(self) -> None:
        """Raise AssertionError unless the parts are non-negative and sum to the capacity."""
        parts = [getattr(self, p) for p in PARTS]
        if any(p < 0 for p in parts) or sum(parts) != self.capacity:
            raise AssertionError(f"accounting identity broken: {self}")

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __deepcopy__(self, memo: dict) -> Accounting:
        return self  # immutable: a copy may share it (compiled, it could not be rebuilt)


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class Live:
    """One live request inside an allocator (a plain class: see Request)."""

    def __init__(
        self,
        req: Request,
        final: int,  # effective final length: min(true final, capacity in tokens)
        cap: int,  # tokens the request may ever store (reservation, or max_model_len)
        base: int,  # tokens stored, or the phase c (tokens = c + clock) while decoding
        decoding: bool,
        nbytes: int = 0,  # bytes held (slab allocators; paged keeps its own block counts)
        offset: int = -1,  # slab allocators: byte offset
        table: list[int] | None = None,  # paged: materialised block ids
        extra: list[int] | None = None,  # slab allocators: offsets of the other samples' slabs
        shared: int = 0,  # paged: prompt tokens in full blocks, kept once for all samples
        cached: int = 0,  # prefix caching: tokens of the cached blocks its table starts with
    ) -> None:
        self.req = req
        self.final = final
        self.cap = cap
        self.base = base
        self.decoding = decoding
        self.nbytes = nbytes
        self.offset = offset
        self.table = table
        self.extra = extra
        self.shared = shared
        self.cached = cached

    @property
    def weight(self) -> int:
        return self.req.n

    def __repr__(self) -> str:
        return _fields_repr(self, ("req", "final", "cap", "base", "decoding", "nbytes", "offset",
                                   "table", "extra", "shared", "cached"))


def positive_int(name: str, value: object) -> int:
    """`value` if it is a positive integer (not a bool); else a ValueError naming `name`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value
