"""Sweep throughput: a 200-point sweep with 1, 2 and all local workers, and the speed-up.

block_size (5) x kv_budget (4) x arrival rate (10) = 200 points of one paged allocator on
a few hundred synthetic requests (one workload per arrival rate: 10 built, each once). Each
configuration runs `kvfrag run` end to end (workloads, workers, staging every point,
assembling the results folder; no plots) and prints points/s and the speed-up over one
worker. It also checks that every configuration wrote the same summary.csv.

    python bench/sweep.py [--requests N] [--repeat R] [--ray]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import yaml

from kvfrag.cli import main as kvfrag

SCENARIO = {
    "name": "bench-sweep",
    "model": "llama-3-8b",
    "kv_budget": "2GiB",
    "max_model_len": 4096,
    "workload": {
        "synthetic": {
            "count": 300,
            "prompt": {"kind": "lognormal", "mean": 600, "p99": 3000},
            "output": {"kind": "exponential", "mean": 250},
            "arrival": {"kind": "poisson", "rate": 4.0},
        },
        "transforms": {"max_model_len": 4096, "long_requests": "clip"},
        "seed": 1,
    },
    "engine": {"step_time": {"base_s": 0.01, "per_batched_token_s": 0.0001}},
    "allocators": [{"label": "paged", "kind": "paged", "block_size": 16}],
    "sweep": {
        "allocators.paged.block_size": [8, 16, 32, 64, 128],
        "kv_budget": ["1GiB", "2GiB", "4GiB", "8GiB"],
        "workload.synthetic.arrival.rate": [1, 2, 3, 4, 6, 8, 10, 12, 16, 20],
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per workload")
    parser.add_argument("--repeat", type=int, default=1, help="best of R runs per setting")
    parser.add_argument("--ray", action="store_true", help="also time a local Ray instance")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    settings = [("local", 1), ("local", 2), ("local", cores)]
    if args.ray:
        settings.append(("ray", cores))
    scenario = dict(SCENARIO)
    scenario["workload"]["synthetic"]["count"] = args.requests
    points = 1
    for values in scenario["sweep"].values():
        points *= len(values)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench-sweep.yaml"
        path.write_text(yaml.safe_dump(scenario, sort_keys=False))
        print(f"{points} points, {args.requests} requests per workload, {cores} core(s)")
        base = None
        summary = None
        seen = set()
        for executor, jobs in settings:
            if (executor, jobs) in seen:
                continue
            seen.add((executor, jobs))
            best, cpu = float("inf"), float("inf")
            for r in range(args.repeat):
                out = Path(tmp) / f"{executor}-{jobs}-{r}"
                cmd = ["run", str(path), "-o", str(out), "-q", "--no-plots", "-j", str(jobs)]
                cpu0 = _cpu()
                start = time.perf_counter()
                rc = kvfrag([*cmd, "--executor", executor])
                best = min(best, time.perf_counter() - start)
                cpu = min(cpu, _cpu() - cpu0)
                if rc != 0:
                    sys.exit(f"kvfrag run failed ({rc})")
                csv = (out / "summary.csv").read_bytes()
                if summary is not None and csv != summary:
                    sys.exit(f"{executor} x{jobs}: summary.csv differs from one worker's")
                summary = csv
            rate = points / best
            base = base or rate
            name = f"{executor}, {jobs} worker(s)" + (" (all)" if jobs == cores else "")
            used = f"{cpu:6.1f} s" if executor == "local" else "     - "  # Ray's are not ours
            print(
                f"{name:<26} {best:7.2f} s wall  {used} CPU  {rate:6.1f} points/s  "
                f"speed-up {rate / base:4.2f}x"
            )
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(f"(load average now {load:.1f} on {cores} core(s): other work skews the speed-up)")


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the worker processes)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


if __name__ == "__main__":
    main()
