"""Engine speed: 100,000 requests of ~1,000 tokens under paged-16 and worst-case slabs.

Prints wall seconds, events, events/s, simulated tokens/s and the ratio of the engine's
per-event cost to a bare SimPy loop doing the same number of timeouts, measured in the same
run. Targets (one core): under 10 s each; per-event cost within 3x of bare SimPy.

    python bench/engine.py [--requests N] [--seed S]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd
import simpy

from sim.allocators import make_allocator
from sim.engine import EngineConfig, StepTime, run
from sim.geometry import preset
from sim.units import parse_size


def workload(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(200, 801, n)
    output = 1000 - prompt + rng.integers(-100, 101, n)
    arrival = np.cumsum(rng.exponential(1 / 40.0, n))  # 40 req/s: a saturated server
    return pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": arrival - arrival[0],
            "prompt_tokens": prompt,
            "output_tokens": np.maximum(output, 1),
        }
    )


def bare_simpy(events: int) -> float:
    env = simpy.Environment()

    def loop(env):
        for _ in range(events):
            yield env.timeout(0.01)

    env.process(loop(env))
    start = time.perf_counter()
    env.run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    wl = workload(args.requests, args.seed)
    tokens = int((wl["prompt_tokens"] + wl["output_tokens"]).sum())
    geo = preset("llama-3-8b")
    config = EngineConfig(
        max_num_seqs=512,
        max_num_batched_tokens=8192,
        step_time=StepTime(base_s=0.01, per_batched_token_s=2e-6, per_kv_token_s=1e-8),
    )
    print(f"workload: {len(wl):,} requests, {tokens:,} tokens, llama-3-8b, 50GB, mml 8192")
    header = f"{'allocator':<22}{'wall s':>8}{'events':>10}{'events/s':>11}"
    print(header + f"{'sim tok/s':>13}{'bare simpy s':>14}{'ratio':>7}{'completed':>11}")
    for label, kind, opts in (
        ("paged-16", "paged", {"block_size": 16}),
        ("slab max_model_len", "contiguous", {"reserve": "max_model_len"}),
    ):
        alloc = make_allocator(
            kind,
            capacity=parse_size("50GB"),
            bytes_per_token=geo.bytes_per_token,
            max_model_len=8192,
            **opts,
        )
        start = time.perf_counter()
        result = run(wl, alloc, config)
        wall = time.perf_counter() - start
        events = int(result.summary["events"])
        bare = bare_simpy(events)
        print(
            f"{label:<22}{wall:>8.2f}{events:>10,}{events / wall:>11,.0f}"
            f"{tokens / wall:>13,.0f}{bare:>14.3f}{wall / bare:>7.1f}"
            f"{result.summary['completed']:>11,}"
        )


if __name__ == "__main__":
    main()
