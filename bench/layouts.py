"""Requests at once at saturation, per layout, against the exact-need floor: every hybrid preset.

For each model with layer types (`sim/hybrid_presets.py`, the full-attention control left out)
at one context: the traffic and engine of `scenarios/hybrid-layouts.yaml` (the Mooncake
conversation sample, each request clipped to the context; vLLM's batch limits) on one KV
budget, run once per layout with the saturating replay (`sim/capacity.py`: the requests
running at once when the queue never empties). Prints, per model, each layout's capacity and
its share of the floor's, and the share of the budget its requests' needs fill (`tokens`).
The floor (`floor`) holds what the running requests need and nothing else: no layout holds
more requests at once. A layout that cannot run a model (vLLM runs a Mamba hybrid only with
its hybrid manager) prints why. A model whose own context is shorter runs at its own.

Issue 35's targets: `two-level` within 3 % of the floor at 32K for every hybrid preset, and
above vLLM's `hybrid` wherever vLLM pads layers or inflates blocks.

    python bench/layouts.py [--context 32768] [--budget 24GiB] [--models NAME ...]
                            [--layouts LABEL ...]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvfrag.sim.allocators import REGISTRY
from kvfrag.sim.hybrid_presets import CONTEXT_LENGTHS, STACKS
from kvfrag.sim.scenario_run import run

from kvfrag.config import ScenarioError, load_scenario

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "hybrid-layouts.yaml"

#: label -> the allocator's scenario entry (flow style)
LAYOUTS = {
    "floor": "{label: floor, kind: floor}",
    "hybrid": "{label: hybrid, kind: hybrid, block_size: 16}",
    "two-level": "{label: two-level, kind: two-level, block_size: 16}",
    "static-partition": "{label: static-partition, kind: static-partition, block_size: 16}",
    "fallback": "{label: fallback, kind: hybrid, hybrid_kv_cache_manager: false}",
}
MODELS = [name for name, s in STACKS.items() if s.hybrid]


def _kind(entry: str) -> str:
    return entry.split("kind: ")[1].split(",")[0].rstrip("}")


def capacity(model: str, context: int, budget: str, layout: str) -> tuple[float, float] | str:
    """(capacity_requests, token_states share) of one layout, or why it cannot run."""
    sets = [f"model={model}", f"max_model_len={context}", f"kv_budget={budget}", "sweep={}",
            f"allocators=[{LAYOUTS[layout]}]"]
    try:
        scenario = load_scenario(SCENARIO, sets).scenario
    except ScenarioError as exc:
        return str(exc).rsplit(": ", 1)[-1][:60]
    row = run(scenario, base_dir=SCENARIO.parent).summary().iloc[0]
    return float(row["capacity_requests"]), float(row["token_states_frac"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--budget", default="24GiB")
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--layouts", nargs="*",
                        default=[k for k, entry in LAYOUTS.items() if _kind(entry) in REGISTRY])
    args = parser.parse_args()
    print(f"KV budget {args.budget}, context {args.context:,} (or the model's own, if shorter); "
          "capacity: requests at once at saturation (share of the floor's); tokens: the share "
          "of the budget the requests' needs fill")
    print(f"{'model':<20} {'context':>8} " + " ".join(f"{x:>24}" for x in args.layouts))
    for model in args.models:
        context = min(args.context, CONTEXT_LENGTHS.get(model, args.context))
        start = time.perf_counter()
        cells, floor = [], None
        for layout in args.layouts:
            got = capacity(model, context, args.budget, layout)
            if isinstance(got, str):
                cells.append(f"{'n/a':>24}")
                continue
            cap, tokens = got
            if layout == "floor":
                floor = cap
            share = f"{cap / floor:6.1%}" if floor else "     -"
            cells.append(f"{cap:8.1f} ({share}) {tokens:6.1%}")
        print(f"{model:<20} {context:>8,} " + " ".join(cells)
              + f"   [{time.perf_counter() - start:.0f} s]")


if __name__ == "__main__":
    main()
