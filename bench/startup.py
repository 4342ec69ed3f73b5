"""Fixed cost of the command line: `kvfrag --help` against a bare Python start.

    python bench/startup.py

Prints the median wall time of 7 runs of each. The CLI imports the simulator (pandas,
pydantic, SimPy) only when a command runs, so --help costs little more than Python itself.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time


def median_wall(cmd: list[str], runs: int = 7) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    bare = median_wall([sys.executable, "-c", "pass"])
    help_ = median_wall([sys.executable, "-m", "kvfrag.cli", "--help"])
    print(f"bare python      {bare * 1000:7.1f} ms")
    print(f"kvfrag --help    {help_ * 1000:7.1f} ms  ({help_ / bare:.1f}x a bare start)")


if __name__ == "__main__":
    main()
