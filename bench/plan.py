"""How long `kvfrag plan` takes on a 2,000-request trace: wall time, rounds, runs, per run.

Plans the shipped scenario azure-conv-llama3-8b (the Azure chat trace's 2,000-request sample,
llama-3-8b on an H100's roofline, four KV layouts) for p99 TTFT <= 2 s and p99 TPOT <= 50 ms,
end to end as a user runs it (scenario, workloads, workers, staging, results folder, figure),
with each number of workers asked for, and checks that every one wrote the same plan.csv.

    python bench/plan.py [--jobs 1 2] [--requests N] [--precision 2%]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from kvfrag.cli import main as kvfrag

SCENARIO = "azure-conv-llama3-8b"
TARGET = ["--ttft-p99", "2s", "--tpot-p99", "50ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[os.cpu_count() or 1],
                        help="worker counts to time (default: all cores)")
    parser.add_argument("--requests", type=int, default=2000,
                        help="the trace's first N requests (default 2000: all of the sample)")
    parser.add_argument("--precision", default="2%")
    args = parser.parse_args()
    sets = ["--set", f"workload.transforms.first_n={args.requests}"]
    print(f"kvfrag plan {SCENARIO} {' '.join(TARGET)} --precision {args.precision} "
          f"({args.requests:,} requests, {os.cpu_count()} cores)")
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        for jobs in args.jobs:
            out = Path(tmp) / f"j{jobs}"
            started = time.perf_counter()
            status = kvfrag(["plan", SCENARIO, *TARGET, *sets, "--precision", args.precision,
                             "-j", str(jobs), "-q", "-o", str(out)])
            seconds = time.perf_counter() - started
            if status != 0:
                sys.exit(f"kvfrag plan exited {status}")
            probes = pd.read_csv(out / "plan.csv")
            answers = pd.read_csv(out / "answer.csv")
            rounds = int(answers["probes"].max())
            print(f"-j {jobs}: {seconds:.1f} s, {rounds} rounds, {len(probes)} runs, "
                  f"{seconds / len(probes):.2f} s per run")
            for _, row in answers.iterrows():
                print(f"    {row['label']:<12} {row['rate_req_s']:6.2f} req/s "
                      f"(x{row['x_scenario_rate']:.3g}), goodput {row['goodput_req_s']:.2f} "
                      f"req/s, {row['status']}")
            tables.append(probes)
    for other in tables[1:]:
        pd.testing.assert_frame_equal(tables[0], other)
    if len(tables) > 1:
        print("every worker count wrote the same plan.csv")


if __name__ == "__main__":
    main()
