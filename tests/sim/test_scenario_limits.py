"""Limits that keep absurd input from exhausting memory: the paged pool's free ids cost the
same however many blocks there are, and hand out exactly the ids a full list would."""

from __future__ import annotations

import random
import time
import tracemalloc

from kvfrag.sim.allocators import make_allocator
from kvfrag.sim.allocators.base import Request
from kvfrag.sim.allocators.paged import FreeIds


def test_free_ids_match_the_list_they_replace():
    rng = random.Random(7)
    for size in (0, 1, 5, 64):
        ref = list(range(size - 1, -1, -1))
        ids = FreeIds(size)
        for _ in range(2000):
            op = rng.random()
            if op < 0.4 and ref:
                assert ids.pop() == ref.pop()
            elif op < 0.7 and ref:
                n = rng.randint(1, len(ref))
                want = ref[-n:][::-1]
                del ref[-n:]
                assert ids.take(n) == want
            else:
                taken = [b for b in range(size) if b not in ref]
                back = rng.sample(taken, min(len(taken), rng.randint(0, 3)))
                ref.extend(back)  # (pushed in turn: the last on top, the first popped)
                ids.give(back[::-1])
            assert len(ids) == len(ref)
            assert list(ids) == ref
    assert [9] + FreeIds(3) == [9, 2, 1, 0]  # noqa: RUF005 - tests keep `list + _stack`


def test_a_petabyte_paged_pool_is_small_and_quick():
    tracemalloc.start()
    start = time.perf_counter()
    try:
        a = make_allocator("paged", capacity=2**50, bytes_per_token=1, max_model_len=4096,
                           block_size=16)
        assert a.admit(Request(0, 100, 50), 100)
        assert a.admit(Request(1, 40, 10), 40)
        assert a.block_table(0) == tuple(range(7))
        assert a.block_table(1) == (7, 8, 9)
        a.free(0)
        assert a.admit(Request(2, 20, 5), 20)
        assert a.block_table(2) == (0, 1)  # the freed ids, first block first
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert a.num_blocks == 2**46
    assert a.free_blocks() == 2**46 - 5
    assert peak < 1_000_000
    assert time.perf_counter() - start < 5
