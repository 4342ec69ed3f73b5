"""The registry: allocators built by name, with errors that list what is valid; constructor
validation; and the small pieces of arithmetic the allocators rest on."""

from __future__ import annotations

import pytest
from kvfrag.sim.allocators import (
    REGISTRY,
    TAKES_GEOMETRY,
    BuddyAllocator,
    ContiguousAllocator,
    PagedAllocator,
    allocator_class,
    make_allocator,
    options_of,
)
from kvfrag.sim.allocators.slab import next_pow2
from kvfrag.sim.floor_sum import _prefix_sums
from kvfrag.sim.geometry import KVGeometry

COMMON = {"capacity": 4096, "bytes_per_token": 2, "max_model_len": 64}
# A geometry matching COMMON's 2 bytes per token, for kinds that need one (vattention).
TINY = KVGeometry("tiny", layers=1, kv_heads=1, head_dim=1, dtype_bytes=1)


def test_registry_kinds():
    # Other kinds may join the registry; these three are the modeled slab/paged allocators.
    expected = {"contiguous": ContiguousAllocator, "buddy": BuddyAllocator, "paged": PagedAllocator}
    assert expected.items() <= REGISTRY.items()
    for kind, cls in REGISTRY.items():
        assert cls.kind == kind
        assert allocator_class(kind) is cls
        assert isinstance(make_allocator(kind, **COMMON, geometry=TINY), cls)


def test_options_of():
    assert options_of("contiguous") == ["reserve", "placement", "compaction", "bandwidth"]
    assert options_of("buddy") == ["reserve"]
    assert options_of("paged") == ["block_size"]


def _constructor_params(cls: type) -> list[str]:
    """The parameters of `cls.__init__` as written in its source (compiled classes keep no
    signature to inspect), from the first class in its MRO that defines one. The source is
    found from the module's name under the `kvfrag.sim` package, not from the module's
    `__file__`: a compiled module first imported by another compiled one (paged, by the
    hybrid cohort) gets a `__file__` that mypyc builds from its full name, which is not where
    it lies."""
    import ast
    from pathlib import Path

    import kvfrag.sim

    root = Path(kvfrag.sim.__file__).parent
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        relative = klass.__module__.removeprefix("kvfrag.sim.").replace(".", "/")
        tree = ast.parse((root / f"{relative}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == klass.__name__:
                init = next(f for f in node.body
                            if isinstance(f, ast.FunctionDef) and f.name == "__init__")
                args = init.args
                return [a.arg for a in (*args.args, *args.kwonlyargs)][1:]
    raise AssertionError(f"{cls.__name__} defines no __init__")


@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_options_match_the_constructors(kind):
    """The registry's written-out options are each constructor's keyword arguments."""
    params = _constructor_params(REGISTRY[kind])
    assert params[:3] == ["capacity", "bytes_per_token", "max_model_len"]
    rest = [p for p in params[3:] if p != "geometry"]
    assert options_of(kind) == rest
    assert (kind in TAKES_GEOMETRY) == ("geometry" in params)


def test_unknown_kind_lists_valid_kinds():
    with pytest.raises(ValueError, match="unknown allocator kind 'slab'") as err:
        make_allocator("slab", **COMMON)
    valid = ", ".join(sorted(REGISTRY))
    assert f"(valid: {valid})" in str(err.value)
    assert {"buddy", "contiguous", "paged"} <= set(valid.split(", "))
    with pytest.raises(ValueError, match="unknown allocator kind 'Paged'") as err:
        allocator_class("Paged")
    assert f"(valid: {valid})" in str(err.value)


@pytest.mark.parametrize(
    ("kind", "option", "valid"),
    [
        ("paged", "reserve", "valid: block_size"),
        ("buddy", "placement", "valid: reserve"),
        ("contiguous", "block_size", "valid: reserve, placement, compaction, bandwidth"),
    ],
)
def test_unknown_option_lists_valid_options(kind, option, valid):
    with pytest.raises(ValueError, match=f"no option '{option}'") as err:
        make_allocator(kind, **COMMON, **{option: 1})
    assert valid in str(err.value)


RESERVES = "max_model_len, pow2_output, pow2_final, oracle, max_tokens"


@pytest.mark.parametrize(
    ("kind", "option", "value", "valid"),
    [
        ("contiguous", "reserve", "worst", RESERVES),
        ("buddy", "reserve", "Pow2", RESERVES),
        ("contiguous", "placement", "first_fit", "first-fit, best-fit, worst-fit, next-fit"),
    ],
)
def test_unknown_policy_lists_valid_values(kind, option, value, valid):
    with pytest.raises(ValueError, match=f"unknown .* '{value}'") as err:
        make_allocator(kind, **COMMON, **{option: value})
    assert f"(valid: {valid})" in str(err.value)


@pytest.mark.parametrize("kind", sorted(REGISTRY))
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("capacity", 0),
        ("capacity", -5),
        ("bytes_per_token", 0),
        ("max_model_len", True),
        ("capacity", 10.0),
        ("bytes_per_token", "2"),
    ],
)
def test_constructor_rejects_bad_sizes(kind, field, value):
    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        make_allocator(kind, **{**COMMON, field: value})


@pytest.mark.parametrize("block_size", [0, -1, 1.5, True])
def test_paged_rejects_bad_block_size(block_size):
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        make_allocator("paged", **COMMON, block_size=block_size)


def test_policies_accept_enum_strings():
    a = make_allocator("contiguous", **COMMON, reserve="oracle", placement="best-fit")
    assert a.reserve.value == "oracle" and a.placement.value == "best-fit"
    assert make_allocator("paged", **COMMON).block_size == 16  # vLLM's default


def test_next_pow2_and_buddy_order():
    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 25, 32, 33, 2048)] == [
        1,
        2,
        4,
        4,
        8,
        32,
        32,
        64,
        2048,
    ]
    assert [BuddyAllocator.order(n) for n in (1, 2, 3, 4, 5, 25, 32, 33)] == [
        0,
        1,
        2,
        2,
        3,
        5,
        5,
        6,
    ]


@pytest.mark.parametrize("bs", [1, 2, 3, 7, 16])
def test_paged_prefix_sums(bs):
    for y in range(0, 5 * bs + 3):
        assert _prefix_sums(y, bs) == (
            sum(t // bs for t in range(y)),
            sum(t * (t // bs) for t in range(y)),
        )


def test_buddy_top_blocks_of_odd_budget():
    # 13 slots = 8 + 4 + 1; bytes beyond the last whole slot are never allocatable.
    a = make_allocator("buddy", capacity=13 * 3 + 2, bytes_per_token=3, max_model_len=8)
    assert a.slots == 13
    assert a.free_blocks() == [(0, 3), (8, 2), (12, 0)]
    acc = a.account()
    acc.check()
    assert acc.usable_free == 13 * 3 and acc.external == 2
    # Fewer bytes than one slot: nothing ever fits.
    tiny = make_allocator("buddy", capacity=2, bytes_per_token=3, max_model_len=8)
    assert tiny.slots == 0 and tiny.free_blocks() == []
    tiny.account().check()
