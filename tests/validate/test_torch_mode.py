"""Torch mode: its plumbing against a fake CUDA on any machine; the real thing on a GPU.

The fake stands in for `torch` with the torch-caching model itself as "the device", so a
replay must agree with the model exactly, and a fake that rounds differently must be caught
at the first operation where the two part. It also checks that the cap is set exactly and
that allocator settings and the memory fraction are restored.
"""

from __future__ import annotations

import sys
import types

import pandas as pd
import pytest
from kvfrag.sim.allocators import REGISTRY, make_allocator
from kvfrag.validate.outcome import Outcome

needs_model = pytest.mark.skipif("torch-caching" not in REGISTRY, reason="no torch-caching model")
MiB = 1 << 20


def fake_torch(total: int = 80 << 30, **model_options) -> types.ModuleType:
    """A `torch` whose CUDA allocator is the torch-caching model (options: how it differs)."""
    torch = types.ModuleType("torch")
    cuda = types.SimpleNamespace()
    state = {"expandable": False, "fraction": 1.0, "alloc": None, "settings": []}

    class OOM(RuntimeError):
        pass

    def rebuild():
        cap = int(state["fraction"] * total)
        state["alloc"] = make_allocator(
            "torch-caching", capacity=cap, bytes_per_token=1, max_model_len=1,
            expandable_segments=state["expandable"], **model_options,
        )

    class Tensor:
        def __init__(self, ptr):
            self.ptr, self.alloc = ptr, state["alloc"]

        def __del__(self):
            self.alloc.raw_free(self.ptr)

    def empty(n, dtype=None, device=None):
        assert device == "cuda"
        ptr = state["alloc"].raw_malloc(n)
        if ptr is None:
            raise OOM("CUDA out of memory. Tried to allocate")
        return Tensor(ptr)

    def set_fraction(f):
        state["fraction"] = f
        rebuild()

    def settings(text):
        state["settings"].append(text)
        state["expandable"] = text.endswith("True")
        rebuild()

    rebuild()
    cuda.synchronize = lambda: None
    cuda.empty_cache = lambda: state["alloc"].empty_cache()
    cuda.memory_reserved = lambda: state["alloc"].stats()["reserved_bytes.all.current"]
    cuda.memory_allocated = lambda: state["alloc"].stats()["allocated_bytes.all.current"]
    cuda.mem_get_info = lambda: (total, total)
    cuda.set_per_process_memory_fraction = set_fraction
    cuda.get_per_process_memory_fraction = lambda: state["fraction"]
    cuda.memory_stats = lambda: state["alloc"].stats()
    cuda.memory = types.SimpleNamespace(_set_allocator_settings=settings)
    cuda.OutOfMemoryError = OOM
    cuda.is_available = lambda: True
    torch.cuda = cuda
    torch.OutOfMemoryError = OOM
    torch.empty = empty
    torch.uint8 = "uint8"
    torch.__version__ = "fake"
    torch.state = state
    return torch


def slab_log(sizes_mib: list[float], frees: list[int]) -> pd.DataFrame:
    """A log admitting slabs of the given sizes; `frees` lists rids freed after all admits."""
    rows = []
    for rid, size in enumerate(sizes_mib):
        rows.append(("admit", rid, int(size * MiB)))
    rows += [("free", rid, int(sizes_mib[rid] * MiB)) for rid in frees]
    rows += [("admit", 100 + i, int(s * MiB)) for i, s in enumerate((3.0, 0.4, 30.0))]
    return pd.DataFrame(
        [
            {"seq": i, "t": float(i), "op": op, "rid": rid, "tokens": 1, "nbytes": n,
             "offset": -1, "blocks": [], "token_states": 0, "held_unwritten": 0, "free": 0}
            for i, (op, rid, n) in enumerate(rows)
        ]
    )


LOG = slab_log([13.5, 0.3, 0.7, 25.0, 2.5, 40.0, 1.5, 0.1], frees=[0, 2, 3, 6])


def run_fake(monkeypatch, torch, expandable, capacity=128 * MiB):
    from kvfrag.validate.torch_mode import replay_torch

    monkeypatch.setitem(sys.modules, "torch", torch)
    out = Outcome("x", "contiguous", "torch", "cuda", capacity)
    return replay_torch(LOG, out, expandable)


@needs_model
@pytest.mark.parametrize("expandable", [False, True])
def test_fake_device_agrees_with_model(monkeypatch, expandable):
    torch = fake_torch()
    out = run_fake(monkeypatch, torch, expandable)
    assert out.status == "pass", out.first_fail
    assert out.ops == len(LOG) and out.checks == len(LOG)
    assert out.figures["reserved"]["abs_err"] == 0
    assert out.series["meas_reserved"].max() > 0
    # settings restored, cap lifted, everything freed
    assert torch.state["settings"][-1] == "expandable_segments:False"
    assert torch.state["fraction"] == 1.0
    assert torch.cuda.memory_allocated() == 0


@needs_model
def test_tight_cap_gives_the_same_ooms(monkeypatch):
    torch = fake_torch()
    out = run_fake(monkeypatch, torch, False, capacity=64 * MiB)
    assert out.series["refused_meas"].any()
    assert out.status == "pass", out.first_fail


@needs_model
def test_divergence_is_reported_at_the_first_differing_op(monkeypatch):
    torch = fake_torch(roundup_power2_divisions=2)  # "torch" rounds, the model does not
    out = run_fake(monkeypatch, torch, False)
    assert out.status == "fail"
    assert out.first_fail_seq is not None
    assert "predicted" in out.first_fail


@needs_model
def test_samples_take_one_tensor_per_slab(monkeypatch):
    from kvfrag.validate.torch_mode import replay_torch

    log = LOG.copy()
    # Request 0 has two samples: its admit row lists two slabs and covers both in nbytes.
    log["offsets"] = [[0, 1 << 30] if rid == 0 else [] for rid in log["rid"]]
    log.loc[log["rid"] == 0, "nbytes"] *= 2
    single = run_fake(monkeypatch, fake_torch(), False).series.iloc[0]
    monkeypatch.setitem(sys.modules, "torch", fake_torch())
    out = replay_torch(log, Outcome("x", "contiguous", "torch", "cuda", 128 * MiB), False)
    assert out.status == "pass", out.first_fail
    first = out.series.iloc[0]
    assert first["nbytes"] == 2 * single["nbytes"] == 2 * int(13.5 * MiB)
    # two tensors of one slab each, not one of twice the size
    assert first["meas_allocated"] == 2 * single["meas_allocated"]
    assert first["meas_segments"] == 2 * single["meas_segments"]


def test_cap_fraction_is_exact():
    from kvfrag.validate.torch_mode import cap_fraction

    total = 150_754_820_096  # an H200's total memory
    for cap in (1, 4 << 30, 16 * MiB + 1, 123_456_789, total):
        assert int(cap_fraction(cap, total) * total) == cap


gpu = pytest.mark.gpu


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@gpu
@needs_model
@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
@pytest.mark.parametrize("expandable", [False, True])
def test_real_cuda_matches_model(expandable):
    from kvfrag.validate.torch_mode import replay_torch

    out = replay_torch(LOG, Outcome("x", "contiguous", "torch", "cuda", 128 * MiB), expandable)
    assert out.status == "pass", out.first_fail


@gpu
@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
def test_real_cuda_arena_and_paged(tmp_path):
    from kvfrag.cli import main

    rc = main(["validate", "scenarios/validate-tiny.yaml", "--device", "cuda", "--mode", "all",
               "-q", "-o", str(tmp_path / "v")])
    df = pd.read_csv(tmp_path / "v" / "validate.csv")
    arena = df[df["mode"].isin(["arena", "paged"])]
    assert (arena["status"] == "pass").all(), df[["label", "mode", "first_fail"]]
    assert rc in (0, 1)
