"""Build kvfrag, compiling the simulator's hot path with mypyc where the machine can.

Everything else about the package is in pyproject.toml. This file adds one thing: the engine
and the allocators (`HOT` in sim/_native.py) are compiled to C extension modules by mypyc
(mypy's compiler, a build requirement fetched from the package registry like any other), which
makes a run 2.6-6x faster per event (bench/engine.py). The same .py files stay in the package and
remain the reference: `kvfrag.sim` loads them instead of the extensions whenever those are
absent, older than the sources (a stamp of the sources' digest is compiled in with them), or
KVFRAG_PURE=1 is set (sim/_native.py). So `pip install .` works on a machine without a C
compiler (the extensions are optional: a failed compile leaves pure Python), and an edited
source is never shadowed by a stale extension.

KVFRAG_PURE=1 at install time skips compiling altogether.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
STAGE = ROOT / "build" / "mypyc-src"


def _native():
    """sim/_native.py, loaded by path (the package is not importable while it is built): the
    list of hot modules and the digest its import-time check recomputes."""
    spec = importlib.util.spec_from_file_location("_kvfrag_native", ROOT / "sim" / "_native.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ext_modules() -> list:
    if os.environ.get("KVFRAG_PURE"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("kvfrag: mypyc not available; installing the pure-Python engine", file=sys.stderr)
        return []
    sim, native = ROOT / "sim", _native()
    (sim / "_stamp.py").write_text(
        '"""Written by setup.py: the digest of the sources compiled with it."""\n\n'
        f'DIGEST = "{native.digest(sim)}"\n'
    )
    # mypy names modules by their folders: stage the sources as kvfrag/sim/... (the installed
    # layout) so that `kvfrag.sim.engine` is what gets compiled.
    shutil.rmtree(STAGE, ignore_errors=True)
    (STAGE / "kvfrag").mkdir(parents=True)
    (STAGE / "kvfrag" / "__init__.py").write_text("")
    shutil.copytree(sim, STAGE / "kvfrag" / "sim",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    paths = [str(STAGE / "kvfrag" / "sim" / f"{name}.py") for name in (*native.HOT, "_stamp")]
    here = Path.cwd()
    os.chdir(STAGE)  # (mypyc writes its C into ./build; the module paths are then right)
    try:
        exts = mypycify(
            ["--ignore-missing-imports", "--follow-imports=silent", *paths],
            opt_level="3",
            group_name="kvfrag.sim._native",
        )
    except BaseException as exc:  # mypy reports type errors by SystemExit
        print(f"kvfrag: not compiling the engine ({exc!r}); installing pure Python",
              file=sys.stderr)
        return []
    finally:
        os.chdir(here)
    for ext in exts:
        ext.optional = True  # no C compiler: the pure-Python modules are used
        ext.sources = [s if os.path.isabs(s) else str(STAGE / s) for s in ext.sources]
        ext.include_dirs = [d if os.path.isabs(d) else str(STAGE / d) for d in ext.include_dirs]
    return exts


setup(ext_modules=ext_modules())
