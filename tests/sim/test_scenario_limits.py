"""Limits that keep absurd input from exhausting memory: every number a scenario reads is checked
against its range (booleans are not numbers); the paged pool's free ids cost the
same however many blocks there are, and hand out exactly the ids a full list would."""

from __future__ import annotations

import random
import time
import tracemalloc

import pytest
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
        assert a.block_table(0) == tuple(range(1, 8))  # (block 0: the null block)
        assert a.block_table(1) == (8, 9, 10)
        a.free(0)
        assert a.admit(Request(2, 20, 5), 20)
        assert a.block_table(2) == (1, 2)  # the freed ids, first block first
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert a.num_blocks == 2**46
    assert a.free_blocks() == 2**46 - 1 - 5
    assert peak < 1_000_000
    assert time.perf_counter() - start < 5


def test_check_number_says_the_range_and_refuses_booleans():
    from kvfrag.workloads.spec import BoundError, check_number

    assert check_number(16, 1, 1024, whole=True) == 16
    assert check_number("1e3", 1, 1024, whole=True) == 1000  # YAML reads 1e3 as a string
    assert check_number(16.0, 1, 1024, whole=True) == 16
    assert check_number("2e-2", 0, 3600) == 0.02
    cases = [
        (True, {"whole": True}, "must be a whole number from 1 to 1,024, not the boolean true"),
        (2**63, {"whole": True}, "from 1 to 1,024, not 9223372036854775808"),
        (10**400, {"whole": True}, "not a 401-digit number"),
        (2.5, {"whole": True}, "not 2.5"),
        (float("inf"), {}, "must be a finite number from 1 to 1,024, not inf"),
        ("nan", {}, "must be a finite number from 1 to 1,024, not 'nan'"),
        (0, {"above": True}, "must be a number above 1 and at most 1,024, not 0"),
        ("1e99999999999999999999999999", {}, "not '1e99999999999999999999999999'"),
        ("x" * 1000, {}, "not '" + "x" * 76 + "...'"),
        ([1, 2], {}, "not a list"),
    ]
    for value, kw, message in cases:
        with pytest.raises(BoundError) as info:
            check_number(value, 1, 1024, **kw)
        assert str(info.value).endswith(message), str(info.value)


def test_the_model_refuses_booleans_and_huge_numbers_without_the_yaml_layer():
    from kvfrag.sim.scenario import Scenario
    from pydantic import ValidationError

    data = {
        "model": {"layers": 2, "kv_heads": 2, "head_dim": 64}, "kv_budget": "4MiB",
        "max_model_len": 1024, "allocators": [{"label": "p", "kind": "paged", "block_size": 16}],
        "workload": {"synthetic": {"count": 4, "prompt": {"kind": "fixed", "value": 8},
                                   "output": {"kind": "fixed", "value": 8}}},
    }
    assert Scenario.model_validate(data).budget_bytes == 4 * 2**20
    for path, value in [(("kv_budget",), True), (("max_model_len",), True),
                        (("model", "kv_heads"), 2**63), (("model", "head_dim"), 1e30),
                        (("engine",), {"max_num_seqs": True})]:
        bad = {**data, path[0]: value if len(path) == 1 else {**data[path[0]], path[1]: value}}
        with pytest.raises(ValidationError):
            Scenario.model_validate(bad)
