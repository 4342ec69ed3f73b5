"""kvfrag's simulator core: KV geometry, modeled allocators with exact accounting, the engine.

Nothing here writes files or draws: `run(...)` returns records and the edges (the `kvfrag`
package) write and plot them. `sim` never imports `kvfrag` or `validate`.
"""

from kvfrag.sim._native import choose as _choose

#: True when the engine and the allocators run compiled (mypyc, see setup.py), False when they
#: run as pure Python (not compiled, stale, or KVFRAG_PURE=1): the results are the same.
COMPILED: bool = _choose()
