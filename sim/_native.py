"""Compiled or pure Python: which implementation of the hot path `kvfrag.sim` loads.

setup.py compiles the engine and the allocators (`HOT`) with mypyc into extension modules that
sit beside their .py files, and compiles with them a stamp of those sources' digest. Python
prefers an extension module to a .py file of the same name, so an extension older than its
source would silently run old code. Before any of them is imported, `choose()` therefore
checks the stamp against the sources and, when the extensions are absent, stale, or
KVFRAG_PURE=1 is set, puts a finder first on `sys.meta_path` that loads every hot module from
its .py file. It is all or nothing: compiled modules share one library and expect each other's
compiled classes.

The allocator classes, and the classes their state is made of, carry
`@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)`: copy.deepcopy and pickle
then work on compiled instances as on pure ones (the property tests copy allocators), and a
user's Python subclass of a compiled allocator runs. (`serializable` alone is not enough:
mypyc then leaves a compiled subclass's `__init__` uncalled.) The frozen value classes
(`Request`, `Grant`, `Refusal`, `Accounting`) copy as themselves; keys of sorted containers are
module-level functions, not lambdas. Constructors take `object` where they check a user's value
(`base.positive_int`): a compiled `int` parameter would coerce or refuse it first.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import warnings
from importlib.abc import MetaPathFinder
from importlib.machinery import EXTENSION_SUFFIXES, ModuleSpec
from pathlib import Path

#: The compiled modules, relative to this package (setup.py's HOT: keep the two the same).
HOT = (
    "engine",
    "engine_config",
    "engine_log",
    "engine_records",
    "engine_requests",
    "floor_sum",
    "engine_walk",
    "engine_preempt",
    "engine_timing",
    "engine_recording",
    "spec_steps",
    "allocators/values",
    "allocators/base",
    "allocators/slab",
    "allocators/contiguous",
    "allocators/buddy",
    "allocators/paged",
    "allocators/prefix_keys",
    "allocators/prefix_caching",
    "allocators/vattention",
    "allocators/torch_blocks",
    "allocators/torch_caching",
    "allocators/hybrid",
    "allocators/floor",
    "allocators/static_partition",
    "hybrid/forms",
    "hybrid/cohort",
    "hybrid/lookahead",
    "allocators/two_level_pool",
    "allocators/two_level_plan",
    "allocators/two_level_bounds",
    "allocators/two_level",
    "model_view",
)
_NAMES = frozenset(f"{__package__}.{name.replace('/', '.')}" for name in HOT)


def digest(sim: Path) -> str:
    """The digest setup.py stamps into the compiled modules (the same computation)."""
    h = hashlib.sha256()
    for name in HOT:
        h.update(name.encode() + b"\0" + (sim / f"{name}.py").read_bytes() + b"\0")
    return h.hexdigest()


class _PureFinder(MetaPathFinder):
    """Loads the hot modules from their .py files, never from an extension beside them."""

    def find_spec(self, name, path, target=None):
        if name not in _NAMES:
            return None
        leaf = name.rpartition(".")[2]
        for entry in path or ():
            source = Path(entry) / f"{leaf}.py"
            if source.is_file():
                return importlib.util.spec_from_file_location(name, source)
        return None


def _compiled_stamp() -> str | None:
    """The digest the compiled modules were built from; None when there are none."""
    spec: ModuleSpec | None = importlib.util.find_spec(f"{__package__}._stamp")
    if spec is None or not str(spec.origin).endswith(tuple(EXTENSION_SUFFIXES)):
        return None
    try:
        return importlib.import_module(f"{__package__}._stamp").DIGEST
    except ImportError:  # an extension that does not load (another Python's build)
        return None


def choose() -> bool:
    """Decide once, before any hot module loads; True when the compiled ones are used."""
    if any(name in sys.modules for name in _NAMES):  # (decided already, e.g. re-imported)
        return not any(isinstance(f, _PureFinder) for f in sys.meta_path)
    compiled = False
    if not os.environ.get("KVFRAG_PURE"):
        stamp = _compiled_stamp()
        if stamp is not None:
            compiled = stamp == digest(Path(__file__).parent)
            if not compiled:
                warnings.warn(
                    "kvfrag's compiled engine is older than its sources: running the pure-Python"
                    " one (reinstall, e.g. `pip install -e .`, to compile it again)",
                    stacklevel=3,
                )
    if not compiled:
        sys.meta_path.insert(0, _PureFinder())
    return compiled
