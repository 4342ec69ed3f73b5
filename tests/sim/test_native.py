"""The compiled hot path (setup.py, sim/_native.py) against the pure-Python modules it is
compiled from: the same records, byte for byte, for every allocator kind and engine feature;
and the switch that picks one or the other."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kvfrag.sim import _native

from kvfrag import sim

#: Runs every allocator kind through workloads that reach the engine's paths (sample groups,
#: beams, chunked prefill, preemption, prefix hits, compaction, static batching, skip
#: admission) and prints, per run, what a result writer would write: the summary and digests of
#: the two tables as CSV text (floats in full precision).
SCRIPT = r"""
import hashlib, json
from dataclasses import replace
import numpy as np, pandas as pd
import kvfrag.sim as sim
from kvfrag.sim.allocators import make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.geometry import KVGeometry

GEO = KVGeometry("t", layers=1, kv_heads=1, head_dim=4, dtype_bytes=2)  # 16 bytes a token
KINDS = [
    ("paged", {"block_size": 16}), ("paged", {"block_size": 5}),
    ("contiguous", {"reserve": "max_model_len"}), ("contiguous", {"reserve": "oracle"}),
    ("contiguous", {"reserve": "oracle", "compaction": True}),
    ("buddy", {"reserve": "pow2"}), ("prefix-caching", {"block_size": 8}),
    ("vattention", {"page_size": 256}), ("torch-caching", {"reserve": "oracle"}),
]

def workload(seed, groups):
    rng = np.random.default_rng(seed)
    n = 60
    wl = pd.DataFrame({
        "request_id": np.arange(n),
        "arrival_s": np.cumsum(rng.exponential(0.05, n)),
        "prompt_tokens": rng.integers(1, 90, n),
        "output_tokens": rng.integers(1, 120, n),
    })
    if groups:
        wl["n"] = rng.choice([1, 1, 3], n)
        wl["beam_width"] = np.where(wl["n"] > 1, 1, rng.choice([1, 1, 2], n))
    wl["hash_ids"] = [list(rng.integers(0, 3, 1 + p // 16)) for p in wl["prompt_tokens"]]
    wl.attrs["hash_block_tokens"] = 16
    return wl

def digest(frame):
    return hashlib.sha256(frame.to_csv(index=False).encode()).hexdigest()

base = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256,
                    step_time=StepTime(0.01, 1e-4, 1e-5))
configs = [base, replace(base, chunked_prefill=True, max_num_batched_tokens=64),
           replace(base, admission="skip", lookahead=4, watermark=0.05),
           replace(base, batching="static")]
out = {"compiled": sim.COMPILED, "runs": []}
for kind, opts in KINDS:
    for c, cfg in enumerate(configs):
        for groups in (False, True) if kind != "torch-caching" else (False,):
            alloc = make_allocator(kind, capacity=16 * 700, bytes_per_token=16,
                                   max_model_len=256, geometry=GEO, **opts)
            r = run(workload(c, groups), alloc, cfg)
            out["runs"].append([kind, opts, c, groups, repr(r.summary), digest(r.timeseries),
                                digest(r.requests)])
print(json.dumps(out))
"""


def _run(pure: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "KVFRAG_PURE"}
    if pure:
        env["KVFRAG_PURE"] = "1"
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=600, check=True)
    return json.loads(done.stdout)


@pytest.mark.skipif(not sim.COMPILED, reason="the engine is not compiled in this install")
def test_compiled_records_are_the_pure_ones():
    pure, compiled = _run(pure=True), _run(pure=False)
    assert pure["compiled"] is False and compiled["compiled"] is True
    assert len(pure["runs"]) == (8 * 2 + 1) * 4
    for a, b in zip(pure["runs"], compiled["runs"], strict=True):
        assert a == b, f"{a[:4]}: compiled and pure differ"


@pytest.mark.skipif(bool(os.environ.get("KVFRAG_PURE")), reason="KVFRAG_PURE: nothing compiled")
def test_an_install_with_a_c_compiler_compiled_the_engine():
    """Where a C compiler is present, `pip install` compiles the engine; a module that mypyc
    refuses makes setup.py install pure Python instead, silently but for one line of pip's
    build output: no extension at all then, which this catches (a stale one, as after an edit,
    is a developer's tree and passes)."""
    import sysconfig

    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler})")
    assert _native._compiled_stamp() is not None, (
        "the install did not compile the engine: `pip install -v -e .` says which module "
        "mypyc refused")


def test_kvfrag_pure_loads_the_sources():
    code = ("import kvfrag.sim as s, kvfrag.sim.engine as e, kvfrag.sim.allocators.paged as p;"
            "print(s.COMPILED, e.__file__, p.__file__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "KVFRAG_PURE": "1"}, check=True)
    flag, engine, paged = done.stdout.split()
    assert flag == "False" and engine.endswith("engine.py") and paged.endswith("paged.py")



@pytest.mark.parametrize("module", sorted(_native.HOT))
def test_every_hot_module_imports_first(module):
    """Each hot module imports as the first of a process: no cycle through the allocators
    package (the imports are the same compiled or not)."""
    name = "kvfrag.sim." + module.replace("/", ".")
    subprocess.run([sys.executable, "-c", f"import {name}"], check=True,
                   env={**os.environ, "KVFRAG_PURE": "1"})

def test_the_digest_follows_every_hot_source(tmp_path: Path):
    """An edit to any compiled module's source changes the digest, so a stale extension is
    never loaded in its place (choose() then loads the sources)."""
    src = Path(_native.__file__).parent
    copy = tmp_path / "sim"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    before = _native.digest(copy)
    assert before == _native.digest(src)
    for name in _native.HOT:
        path = copy / f"{name}.py"
        text = path.read_text()
        path.write_text(text + "\n")
        assert _native.digest(copy) != before, name
        path.write_text(text)
    assert _native.digest(copy) == before


def test_an_installed_extension_is_used_only_when_fresh():
    """Where extensions were built (an install that compiled), they are the ones loaded: a
    stale build would have made choose() fall back and warn."""
    from importlib.machinery import EXTENSION_SUFFIXES

    src = Path(_native.__file__).parent
    built = [p for p in src.glob("engine*") if p.name.endswith(tuple(EXTENSION_SUFFIXES))]
    if not built:
        pytest.skip("no compiled extensions in this install")
    if os.environ.get("KVFRAG_PURE"):
        pytest.skip("KVFRAG_PURE=1 asks for the pure-Python modules whatever is built")
    stamp = _native._compiled_stamp()
    assert (stamp == _native.digest(src)) == sim.COMPILED
