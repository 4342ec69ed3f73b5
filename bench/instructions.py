"""Instructions per event, counted by valgrind (callgrind): engine cost figures that do not drift.

Why: this machine's speed drifts by 10-20 % within an hour, more than most changes to the hot
path save, so wall-time comparisons need alternating runs and repeats (bench/engine.py). The
instructions executed inside `kvfrag.sim.engine.run` are the same from one run to the next and
from one machine to another with the same build: an A/B of two builds is two numbers. They are
a proxy for time, not time (a cache miss costs more than an add), so targets stay judged in
seconds; this tells whether a change does less work, and where (callgrind's output file, with
`callgrind_annotate`, breaks the count down by C function).

Counted: each case of bench/engine.py (the same allocators, workloads and configuration, the
bench workload at `--requests`) and the three output lengths of bench/naive_peer.py (scaled by
`--scale`), one process each under `valgrind --tool=callgrind`, collecting only inside
`run` (its compiled symbol, so this needs the compiled engine: `pip install .` with a C
compiler, and valgrind on the PATH). A run under valgrind is about 50x slower than native.

    python bench/instructions.py [--requests N] [--scale X] [--only LABEL ...] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import engine as bench  # noqa: E402  (bench/engine.py: its cases, workload and configuration)
import naive_peer  # noqa: E402

SYMBOL = "CPyDef_engine___run"  # kvfrag.sim.engine.run, compiled by mypyc
PEERS = tuple((f"naive_peer {case.output:,}-token", case) for case in naive_peer.CASES)


def labels() -> list[str]:
    return [label for label, *_ in bench.KINDS] + [label for label, _ in PEERS]


def child(label: str, requests: int, scale: float) -> None:
    """Run one case (under valgrind: the parent's command) and print its event count."""
    from kvfrag.sim.allocators import make_allocator
    from kvfrag.sim.engine import run
    from kvfrag.sim.units import parse_size

    peers = dict(PEERS)
    if label in peers:
        case = peers[label]
        wl = naive_peer.workload(max(int(case.requests * scale), 1), case.output, 0)
        result = naive_peer.kvfrag(wl, case, naive_peer.config(case))
    else:
        _, kind, opts, which = next(k for k in bench.KINDS if k[0] == label)
        long = which == "mooncake"
        mml = 131072 if long else 8192
        config = replace(bench.CONFIG, chunked_prefill=True) if long else bench.CONFIG
        wl = bench.mooncake() if long else bench.workload(requests, 0)
        opts, geo = dict(opts), bench.GEO
        if kind in ("hybrid", "floor", "static-partition", "two-level"):  # (as bench/engine.py)
            from kvfrag.sim.hybrid_presets import stack as layer_stack

            stack = layer_stack(opts.pop("model", geo.name))
            assert stack is not None
            geo = stack.geometry()
            opts.update(stack=stack, max_num_batched_tokens=config.max_num_batched_tokens)
        alloc = make_allocator(kind, capacity=parse_size("50GB"),
                               bytes_per_token=geo.bytes_per_token, max_model_len=mml,
                               geometry=geo, **opts)
        result = run(wl, alloc, config)
    print(len(wl), int(result.summary["events"]))


def count(label: str, requests: int, scale: float, keep: Path | None) -> tuple[int, int, int]:
    """(requests, events, instructions) of one case."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
             f"--toggle-collect={SYMBOL}", sys.executable, __file__, "--child", label,
             "--requests", str(requests), "--scale", str(scale)],
            capture_output=True, text=True, check=False,
        )
        collected = re.search(r"Collected : (\d+)", proc.stderr)
        if proc.returncode or not collected:
            sys.exit(f"{label}: valgrind failed (exit {proc.returncode})\n{proc.stderr[-2000:]}")
        if keep is not None:
            shutil.copy(out, keep / (re.sub(r"[^A-Za-z0-9.-]+", "_", label) + ".callgrind"))
    n, events = map(int, proc.stdout.split()[-2:])
    return n, events, int(collected.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000, help="bench workload's size")
    parser.add_argument("--scale", type=float, default=0.2, help="naive_peer's request counts")
    parser.add_argument("--only", nargs="*", help=f"labels to count (of: {', '.join(labels())})")
    parser.add_argument("--keep", type=Path, help="keep each case's callgrind file in this folder")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.requests, args.scale)
        return
    from kvfrag import sim

    if not sim.COMPILED:
        sys.exit("the engine runs pure Python here: instructions are counted in its compiled "
                 "`run` (pip install . with a C compiler; KVFRAG_PURE unset)")
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not on the PATH (e.g. apt install valgrind)")
    unknown = set(args.only or ()) - set(labels())
    if unknown:
        sys.exit(f"unknown labels {sorted(unknown)}; valid: {', '.join(labels())}")
    if args.keep is not None:
        os.makedirs(args.keep, exist_ok=True)
    print(f"instructions inside kvfrag.sim.engine.run (callgrind); bench workload: "
          f"{args.requests:,} requests; naive_peer shapes at scale {args.scale:g}")
    print(f"{'case':<28}{'requests':>9}{'events':>9}{'M instr':>10}{'k instr/event':>15}"
          f"{'x paged-16':>11}")
    paged = None
    for label in labels():
        if (label not in args.only) if args.only else label in bench.ON_REQUEST:
            continue  # (the -pc rows only when named, as in bench/engine.py)
        n, events, instr = count(label, args.requests, args.scale, args.keep)
        per = instr / events
        if label == "paged-16":
            paged = per
        ratio = f"{per / paged:>11.2f}" if paged else f"{'':>11}"
        print(f"{label:<28}{n:>9,}{events:>9,}{instr / 1e6:>10.1f}{per / 1e3:>15.1f}{ratio}",
              flush=True)


if __name__ == "__main__":
    main()
