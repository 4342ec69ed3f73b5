"""kvfrag's simulator core: KV geometry, modeled allocators with exact accounting, the engine.

Nothing here writes files or draws: `run(...)` returns records and the edges (the `kvfrag`
package) write and plot them. `sim` never imports `kvfrag` or `validate`.
"""
