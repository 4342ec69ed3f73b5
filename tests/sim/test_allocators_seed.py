"""The seed arithmetic, at the allocator level: the numbers the project's story rests on."""

from __future__ import annotations

import pytest
from kvfrag.sim.allocators import Reason, Request, make_allocator
from kvfrag.sim.geometry import preset
from kvfrag.sim.units import parse_size

GiB = 2**30
LLAMA3 = preset("llama-3-8b").bytes_per_token  # 128 KiB
LLAMA2 = preset("llama-2-7b").bytes_per_token  # 512 KiB
OPT13 = preset("opt-13b").bytes_per_token  # 800 KiB


def test_geometry_constants():
    assert (LLAMA3, LLAMA2, OPT13) == (131072, 524288, 819200)


@pytest.mark.parametrize("placement", ["first-fit", "best-fit", "worst-fit", "next-fit"])
def test_50gb_llama3_worst_case_contiguous_is_46_slabs(placement):
    capacity = parse_size("50GB")
    a = make_allocator(
        "contiguous",
        capacity=capacity,
        bytes_per_token=LLAMA3,
        max_model_len=8192,
        reserve="max_model_len",
        placement=placement,
    )
    n = 0
    while result := a.admit(Request(n, 100, 100)):
        assert result.nbytes == GiB  # 8192 tokens x 128 KiB: one GiB per slab
        n += 1
    assert n == 46  # 50e9 // 2**30, not 50
    assert result.reason is Reason.OUT_OF_MEMORY
    assert a.free_bytes() == capacity - 46 * GiB < GiB
    assert [off for off, _, _ in a.slabs()] == [i * GiB for i in range(46)]
    a.account().check()


def test_50gb_llama3_paged16_fits_378_thousand_token_requests():
    capacity = parse_size("50GB")
    a = make_allocator(
        "paged", capacity=capacity, bytes_per_token=LLAMA3, max_model_len=8192, block_size=16
    )
    assert a.block_bytes == 2 * 2**20
    assert a.num_blocks == 23841  # 50e9 // 2 MiB
    n = 0
    while result := a.admit(Request(n, 200, 800), tokens=1000, decoding=False):
        assert len(result.blocks) == 63  # ceil(1000 / 16)
        n += 1
    assert n == 378
    assert result.reason is Reason.OUT_OF_MEMORY
    assert a.free_blocks() == 23841 - 1 - 378 * 63 < 63  # (less the null block)
    acc = a.account()
    acc.check()
    assert acc.token_states == 378 * 1000 * LLAMA3
    # Versus the worst-case contiguous allocator on the same budget: 8x the requests.
    assert n > 8 * 46


def test_512_token_chat_in_4096_token_slab_is_87_5_percent_empty():
    a = make_allocator(
        "contiguous", capacity=8 * 4096 * LLAMA2, bytes_per_token=LLAMA2, max_model_len=4096
    )
    chat = Request(0, 256, 256)
    assert a.admit(chat, tokens=512)
    acc = a.account()
    acc.check()
    assert acc.allocated == 4096 * LLAMA2 == 2 * GiB
    assert acc.token_states / acc.allocated == 0.125  # 87.5 % empty
    assert acc.internal == (4096 - 512) * LLAMA2  # never written: the chat ends at 512
    assert acc.reserved == 0
    for rid in range(1, 8):
        assert a.admit(Request(rid, 256, 256), tokens=512)
    acc = a.account()
    acc.check()
    assert acc.allocated == 16 * GiB
    assert acc.token_states == 2 * GiB
    assert acc.usable_free == acc.external == 0
    refusal = a.admit(Request(8, 10, 10))
    assert not refusal and refusal.reason is Reason.OUT_OF_MEMORY


@pytest.mark.parametrize("placement", ["first-fit", "best-fit", "worst-fit", "next-fit"])
def test_constructed_fragmentation(placement):
    """Holes add up to more than the request needs, yet none fits it."""
    b = LLAMA2
    a = make_allocator(
        "contiguous",
        capacity=100 * b,
        bytes_per_token=b,
        max_model_len=100,
        reserve="oracle",
        placement=placement,
    )
    for rid in range(4):  # four 25-token slabs: [0,25) [25,50) [50,75) [75,100)
        assert a.admit(Request(rid, 5, 20)).offset == 25 * rid * b
    a.free(0)
    a.free(2)
    assert a.holes() == [(0, 25 * b), (50 * b, 25 * b)]
    need = Request(9, 10, 30)  # 40 tokens: less than the 50 free, more than any hole
    refusal = a.admit(need)
    assert not refusal
    assert refusal.reason is Reason.FRAGMENTED
    assert refusal.free == 50 * b > refusal.needed == 40 * b
    acc = a.account(need)
    acc.check()
    assert acc.free == 50 * b
    assert acc.usable_free == 0  # no hole holds a 40-token slab
    assert acc.external == 50 * b > 0
    assert acc.largest_hole == 25 * b
    assert acc.hole_index == pytest.approx(0.5) and acc.hole_index > 0
    # Judged by a 10-token request the same memory is usable: 2 slabs per hole, 5 tokens over.
    small = a.account(Request(10, 5, 5))
    assert small.usable_free == 40 * b and small.external == 10 * b


def test_buddy_opt13b_12gib():
    a = make_allocator(
        "buddy", capacity=parse_size("12GiB"), bytes_per_token=OPT13, max_model_len=2048
    )
    assert a.slots == 15728  # 12 GiB // 800 KiB
    assert [k for _, k in a.free_blocks()] == [13, 12, 11, 10, 8, 6, 5, 4]
    n = 0
    while result := a.admit(Request(n, 100, 100)):
        assert result.nbytes == 2048 * OPT13
        n += 1
    assert n == 7  # 8192 + 4096 + 2048 slots hold 4 + 2 + 1 worst-case requests
    assert result.reason is Reason.OUT_OF_MEMORY
    acc = a.account(Request(99, 100, 100))
    acc.check()
    assert acc.usable_free == 0  # the 1,392 free slots are in blocks too small for 2048
    assert acc.external == parse_size("12GiB") - 7 * 2048 * OPT13


def test_buddy_pow2_rounds_25_tokens_to_32_slots():
    a = make_allocator(
        "buddy",
        capacity=parse_size("12GiB"),
        bytes_per_token=OPT13,
        max_model_len=2048,
        reserve="pow2",
    )
    req = Request(0, 10, 15)  # 25 tokens
    assert a.reservation_tokens(req) == 32
    grant = a.admit(req)
    assert grant.nbytes == 32 * OPT13
    assert a.final_tokens(0) == 25
    acc = a.account()
    acc.check()
    assert acc.internal == (32 - 25) * OPT13
    assert acc.reserved == (25 - 10) * OPT13
    assert acc.token_states == 10 * OPT13


def test_the_papers_pow2_rounds_the_output_not_the_final_length():
    """PagedAttention's Orca (Pow2): "if the true output length is 25, it reserves 32
    positions for outputs". A request generating 25 tokens stores 24 past its prompt (the last
    sampled token is never stored), rounded up to 32."""
    from kvfrag.sim.allocators.slab import Reserve
    from kvfrag.sim.engine_requests import slot_request

    b = 10
    req, _ = slot_request(0, 100, 25, None, 1, False, (), 0)
    assert (req.prompt, req.output) == (100, 24)
    sizes = {}
    for kind in ("contiguous", "buddy"):
        for reserve in ("pow2_output", "pow2_final", "oracle"):
            a = make_allocator(kind, capacity=4096 * b, bytes_per_token=b, max_model_len=2048,
                               reserve=reserve)
            assert a.admit(req, 100, decoding=False)
            sizes[kind, reserve] = a.allocated_bytes(0) // b
    assert sizes["contiguous", "pow2_output"] == 100 + 32
    assert sizes["contiguous", "pow2_final"] == 128  # next_pow2(124): within 2x of it all
    assert sizes["contiguous", "oracle"] == 124
    # A buddy allocator rounds every slab up to a power of two: the final-length rounding
    # then reserves exactly what oracle does, the paper's Pow2 more.
    assert sizes["buddy", "pow2_output"] == 256
    assert sizes["buddy", "pow2_final"] == sizes["buddy", "oracle"] == 128
    assert Reserve("pow2") is Reserve.POW2_FINAL  # the old name
