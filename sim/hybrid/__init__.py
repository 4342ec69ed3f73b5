"""vLLM's hybrid KV-cache manager, reproduced: its planning (`plan`), and its single-type
managers (`managers`: one class per kind of KV-cache group, full, sliding window, chunked
local, Mamba state), which the `hybrid` allocator coordinates.

`plan(stack, budget_bytes, ...)` answers what vLLM 0.33 decides before serving a hybrid model:
how its layers are grouped, what one block id costs, how many tokens a block holds in each
group, and how many block ids a memory budget buys. `tests/oracle/test_hybrid_planner_oracle.py`
checks it against vLLM's own planner.
"""

from kvfrag.sim.hybrid.planner import Group, Plan, plan

__all__ = ["Group", "Plan", "plan"]
