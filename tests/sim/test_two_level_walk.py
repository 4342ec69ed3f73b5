"""The two-level allocator's walk reads its managers as plain ints (`manager_code`,
`skipped_blocks`): the same counts as the managers' own methods."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators.two_level_plan import manager_code, skipped_blocks
from kvfrag.sim.hybrid.managers import (
    ChunkedLocalManager,
    MambaManager,
    Manager,
    SlidingWindowManager,
)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 4, 16, 64]), st.integers(1, 3000), st.integers(0, 5000),
       st.integers(0, 5000))
def test_skipped_and_held_are_the_managers(bs, window, tokens, processed):
    managers = [Manager(bs, 0, 1, 8, None), SlidingWindowManager(bs, window, 1, 8, None),
                ChunkedLocalManager(bs, window, 1, 8, None),
                MambaManager(8192, 0, 1, 0, None, 100)]
    for m in managers:
        code = manager_code(m)
        got = skipped_blocks(code, m.block_size, m.window, processed)
        assert got == m.skipped_blocks(processed)
        assert -(-tokens // m.block_size) - got == m.held(tokens, processed)
    assert [manager_code(m) for m in managers] == [0, 1, 2, 3]
