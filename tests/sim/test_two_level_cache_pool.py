"""The two-level pool with prefix caching (`sim/allocators/two_level_cache_pool.py`): with one
small page per large page it is vLLM's block pool (`sim.hybrid.prefix.BlockPool`) id for id;
with several types, over random operations, its counts agree with its pages, no small page is
lost or handed out twice, `large_needed` is exact, and the eviction order is the module's; an
allocation given its room (`allow`) still fits, opening large pages before evicting in place."""

from __future__ import annotations

import random

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators.two_level_cache_pool import TwoLevelCachePool
from kvfrag.sim.hybrid.prefix import BlockPool

OPS = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 1 << 16)), max_size=120)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 12), ops=OPS)
def test_one_small_page_per_large_page_is_vllms_block_pool(n, ops):
    """Takes, frees (a table last first), hits and caching alike on both: the same ids, free
    counts, lookups and evictions (the null block is large page 0)."""
    ref, pool = BlockPool(n), TwoLevelCachePool(n + 1, [1], True)
    tables: list[list[int]] = []
    for op, x in ops:
        if op == 0:  # a table of k new ids
            k = x % 4 + 1
            if k > ref.free_count():
                assert not pool.fits([k])
                continue
            assert pool.fits([k])
            got = ref.take(k)
            out: list[int] = []
            assert pool.take_many(0, k, -1, out)
            assert out == got
            tables.append(got)
        elif op == 1 and tables:  # a table freed, last first
            table = tables.pop(x % len(tables))
            assert pool.free(0, table[::-1]) == ref.free(table[::-1])
        elif op == 2 and tables:  # a held id cached under a key
            table = tables[x % len(tables)]
            b, key = table[x % len(table)], x % 7
            ref.insert(key, b)
            pool.insert(0, key, b)
        elif op == 3:  # a hit on key x % 7
            key = x % 7
            b = ref.lookup(key)
            assert pool.lookup(0, key) == (b or -1)
            if b:
                ref.touch([b])
                pool.touch(0, [b])
                tables.append([b])
        assert pool.usable_large_pages() == ref.free_count()
        assert pool.evictions == ref.evictions
        assert [sid for _t, sid in pool.evicted] == ref.evicted
        pool.check()


def _random_ops(pool: TwoLevelCachePool, ops: list[tuple[int, int]],
                tables: list[tuple[int, list[int]]]):
    """Random takes (hinted by the table's last page), frees, caching and hits on `pool`,
    `tables` kept as (type, small pages) per holder; yields after each."""
    types = len(pool.per)
    for op, x in ops:
        t = x % types
        if op == 0:
            k = x // types % 5 + 1
            own = [tb for tb in tables if tb[0] == t]
            table = own[x % len(own)][1] if own and x % 3 else None
            out: list[int] = []
            ok = pool.take_many(t, k, table[-1] if table else -1, out)
            if table is None:
                tables.append((t, out))
            else:
                table.extend(out)
            if not ok:
                assert pool.usable_large_pages() == 0 and pool.local(t) == 0
        elif op == 1 and tables:
            tt, ids = tables.pop(x % len(tables))
            pool.free(tt, ids[::-1])
        elif op == 2 and tables:
            tt, ids = tables[x % len(tables)]
            if ids:
                pool.insert(tt, ("k", x % 9), ids[x % len(ids)])
        elif op == 3:
            sid = pool.lookup(t, ("k", x % 9))
            if sid >= 0:
                pool.touch(t, [sid])
                tables.append((t, [sid]))
        elif op == 4 and tables:  # the head of a table freed (a window passing)
            tt, ids = tables[x % len(tables)]
            drop = x % (len(ids) + 1)
            pool.free(tt, ids[:drop][::-1])
            del ids[:drop]
        elif op == 5 and tables:  # a table cached whole, its head freed: idle pages pinned
            tt, ids = tables[x % len(tables)]
            for i, sid in enumerate(ids):
                pool.insert(tt, ("k", (x + i) % 9), sid)
            drop = len(ids) // 2
            pool.free(tt, ids[:drop][::-1])
            del ids[:drop]
        yield


def _check_tables(pool: TwoLevelCachePool, tables: list[tuple[int, list[int]]]) -> None:
    """Every holder's small page held, counted once per holder, inside a large page of its
    type; and the budget adds up: per type, its large pages' slots are held, free or idle."""
    pool.check()
    holders: dict[tuple[int, int], int] = {}
    for t, ids in tables:
        for sid in ids:
            holders[t, sid] = holders.get((t, sid), 0) + 1
            assert pool.owner[sid // pool.per[t]] == t
    assert holders == {(t, sid): r for t in range(len(pool.per))
                       for sid, r in pool.ref[t].items()}
    for t, per in enumerate(pool.per):
        owned = [lid for lid, o in pool.owner.items() if o == t]
        idle = sum(bin(pool.idle_slots[lid]).count("1") for lid in owned)
        free = sum(bin(pool.mask[lid]).count("1") for lid in owned)
        assert len(owned) * per == len(pool.ref[t]) + idle + free


PERS = st.lists(st.integers(1, 5), min_size=1, max_size=3)
TYPED_OPS = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1 << 16)), max_size=120)


def _taken_with_room(pool: TwoLevelCachePool, want: list[int], shuffle) -> int:
    """Take `want[t]` pages per type on a copy of the pool, in an order `shuffle` makes, with
    the room the pool allows them: every take succeeds and the room is never spent past 0.
    Returns the room spent."""
    roomy = pool.copy()
    roomy.allow(want)
    room = roomy.room
    takes = [t for t, k in enumerate(want) for _ in range(k)]
    shuffle(takes)
    assert min((roomy.take(t, -1) for t in takes), default=0) >= 0
    assert 0 <= roomy.room <= room
    roomy.check()
    return room - roomy.room


@settings(max_examples=80, deadline=None)
@given(per=PERS, n=st.integers(1, 8), ops=TYPED_OPS, need=st.lists(st.integers(0, 12), min_size=3,
                                                               max_size=3), order=st.randoms())
def test_random_operations_keep_the_pool_exact(per, n, ops, need, order):
    """After every operation: the invariants; and `fits(need)` is whether takes of that many
    pages per type, in any order of types, all succeed (tried on a copy)."""
    pool = TwoLevelCachePool(n, per, False)
    need = need[:len(per)]
    tables: list[tuple[int, list[int]]] = []
    for _ in _random_ops(pool, ops, tables):
        _check_tables(pool, tables)
        trial, light = pool.copy(), pool.light_copy()
        free_large = list(pool.free_large)
        steps = [t for t, k in enumerate(need) for _ in range(k)]
        order.shuffle(steps)
        got = [trial.take(t, -1) for t in steps]
        assert (min(got, default=0) >= 0) == pool.fits(need), (need, pool.large_needed(need))
        assert [light.take(t, -1) for t in steps] == got  # (a look-ahead's copy alike)
        for want in (need, [k // 4 for k in need]):  # with its room, it fits still
            if pool.fits(want):
                event(f"room spent {min(_taken_with_room(pool, want, order.shuffle), 1)}")
        assert light.evicted == trial.evicted[len(pool.evicted):]
        light.check()
        for t, sid in zip(steps, got, strict=True):  # (the copy's frees leave the pool be)
            if sid >= 0:
                light.free(t, [sid])
        light.check()
        assert list(pool.free_large) == free_large
    for t, ids in list(tables):  # no leak: everything freed, every large page usable again
        pool.free(t, ids[::-1])
    pool.check()
    assert pool.usable_large_pages() == n
    assert sum(len(r) for r in pool.ref) == 0


@pytest.mark.parametrize("seed", range(4))
def test_room_keeps_an_allocation_that_fits(seed):
    """Long runs of random operations (idle pages pinned often): an allocation that fits,
    given its room (`allow`), takes all its pages in any order of types, room never spent
    past 0; and it does spend room (a large page opened before an eviction in place)."""
    rng = random.Random(seed)
    spent = 0
    for _ in range(40):
        per = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
        pool = TwoLevelCachePool(rng.randint(1, 8), per, False)
        ops = [(rng.randint(0, 5), rng.randint(0, 1 << 16)) for _ in range(120)]
        tables: list[tuple[int, list[int]]] = []
        for _ in _random_ops(pool, ops, tables):
            for want in ([rng.randint(0, 12) for _ in per], [rng.randint(0, 3) for _ in per]):
                if pool.fits(want):
                    spent += _taken_with_room(pool, want, rng.shuffle) > 0
    assert spent > 0


def test_eviction_order():
    """A type takes its free slots, then its idle pages in held large pages, then a spare
    slot of its evictable large pages, then a fresh large page, and evicts a whole large page
    (the least recently made evictable) last."""
    pool = TwoLevelCachePool(3, [2, 1], False)
    a = [pool.take(0, -1) for _ in range(4)]  # type 0: large pages 0 and 1, full
    assert a == [0, 1, 2, 3]
    for i, sid in enumerate(a):
        pool.insert(0, i, sid)
    pool.free(0, [a[1]])  # idle in held large page 0
    pool.free(0, [a[3], a[2]])  # large page 1 evictable
    assert pool.local(0) == 1 and pool.usable_large_pages() == 2
    assert pool.take(0, -1) == a[1]  # its own idle page first (evicted)
    assert pool.lookup(0, 1) == -1 and pool.evicted == [(0, 1)]
    assert pool.take(1, -1) == 2  # type 1: the fresh large page 2
    assert pool.take(1, -1) == 1  # then large page 1, evicted whole
    assert pool.evicted == [(0, 1), (0, 2), (0, 3)]  # (a large page's in slot order)
    assert pool.lookup(0, 2) == pool.lookup(0, 3) == -1 and pool.take(1, -1) == -1
    pool.free(1, [1])
    pool.check()
    assert pool.free_large_pages() == 1  # (uncached: straight back to the shared pool)


def test_room_opens_a_large_page_before_evicting_in_place():
    """With room left by the allocation (`allow`), a type out of free slots opens a fresh
    large page rather than evict its idle page in a held large page, while its idle pages
    there are fewer than the room's large pages hold; without room, or past that, it evicts
    in place (the module's order)."""
    pool = TwoLevelCachePool(4, [2], False)
    a = [pool.take(0, -1) for _ in range(2)]  # large page 0, full
    pool.insert(0, "x", a[1])
    pool.free(0, [a[1]])  # idle in held large page 0
    assert pool.local(0) == 1 and pool.usable_large_pages() == 3
    plain = pool.copy()
    assert plain.take(0, -1) == a[1] and plain.evictions == 1  # (no room: in place)
    pool.allow([1])
    assert pool.room == 3
    assert pool.take(0, -1) == 2 and pool.evictions == 0  # fresh large page 1
    assert pool.room == 2 and pool.lookup(0, "x") == a[1]
    pool.check()
    pool.room = 0
    assert pool.take(0, -1) == 3  # (its free slot)
    cap = TwoLevelCachePool(4, [2], False)
    b = [cap.take(0, -1) for _ in range(4)]  # large pages 0 and 1, full
    for i in (1, 3):
        cap.insert(0, i, b[i])
        cap.free(0, [b[i]])  # two idle pages in held large pages: one large page's worth
    cap.allow([1])
    assert cap.room == 2
    assert cap.take(0, -1) == 4 and cap.room == 1  # 2 < 2 * 2: a fresh large page
    assert cap.take(0, -1) == 5  # (its free slot)
    assert cap.take(0, -1) == b[1] and cap.evictions == 1  # 2 >= 2 * 1: in place
    cap.check()


def test_a_hit_on_an_evictable_page_holds_its_large_page_again():
    pool = TwoLevelCachePool(2, [3], False)
    ids: list[int] = []
    assert pool.take_many(0, 2, -1, ids) and ids == [0, 1]
    pool.insert(0, "x", 0)
    pool.insert(0, "y", 1)
    pool.free(0, [1, 0])
    assert pool.usable_large_pages() == 2 and pool.local(0) == 0
    pool.touch(0, [pool.lookup(0, "y")])
    assert pool.usable_large_pages() == 1 and pool.local(0) == 2  # (a free slot, idle "x")
    pool.check()
    assert pool.take(0, 1) == 2  # the free slot beside it, then "x" evicted
    assert pool.take(0, 2) == 0 and pool.lookup(0, "x") == -1
    pool.check()



def test_a_light_copy_leaves_the_pool_be():
    """Takes and frees on a look-ahead's copy change nothing of the pool (nor its shared
    pool's stack of freed large pages), and it finds nothing cached."""
    pool = TwoLevelCachePool(4, [1], False)
    ids: list[int] = []
    assert pool.take_many(0, 3, -1, ids)
    pool.insert(0, "x", ids[0])
    pool.free(0, ids[::-1])  # (large pages 2 and 1 back in one chunk, 0 idle)
    before = (list(pool.free_large), pool.usable_large_pages(), dict(pool.stamp[0]))
    light = pool.light_copy()
    got = [light.take(0, -1) for _ in range(4)]
    assert got == [2, 1, 3, 0] and light.evictions == 1 and light.cache is None
    light.free(0, got[:1])
    light.check()
    pool.check()
    assert (list(pool.free_large), pool.usable_large_pages(), dict(pool.stamp[0])) == before
    assert pool.lookup(0, "x") == 0 and pool.evictions == 0
