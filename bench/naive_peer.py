"""kvfrag's event-driven engine against the per-iteration simulator a user would write.

Why: `sim.engine` advances decode-only stretches in closed form, so its cost grows with events
(admissions, completions, a block needed: ~1.5 per request), not with generated tokens. Issue
16 asks whether that is worth its complexity next to "the simulator a user would write in an
afternoon": a SimPy loop that yields one `env.timeout(dt)` per iteration and keeps a free-block
counter and each request's token count, nothing else (no accounting, no time series). Two such
peers are timed here:

- plain: a pure-Python loop over the running requests at every iteration;
- vectorised: the same loop with numpy arrays over the running requests, a few whole-array
  operations per iteration instead of a Python loop over requests.

For the comparison to be like for like, both peers implement kvfrag's own semantics for the
configuration benchmarked (paged blocks of 16 tokens, continuous batching, strict FCFS, whole
prompts in one iteration, a linear step time, preemption by recomputation, no watermark; the
per-iteration specification is sim/reference.py), and the script checks that they reproduce
kvfrag's records: the end time, every request's latency, the number of iterations and of
preemptions (exact counts, times to a relative 1e-9). It prints the mismatch and exits 1 when
they do not agree. The peers call no kvfrag code; kvfrag runs only to produce the records.

Workloads: the shape of bench/engine.py's (Poisson arrivals at 40 req/s, prompts 200-800,
llama-3-8b, 50 GB of KV) with output lengths of about 100, 1,000 and 10,000 tokens (+-10 %).
Memory binds at 1,000 and 10,000 tokens, so preemptions are exercised and checked.

Timing: only the simulation, on one core, one run each. kvfrag's `run` is timed whole (it also
builds its result frames: the requests table, the time series and the summary); each peer is
timed from the workload frame to its per-request finish times. Workload generation and the
agreement check are not timed.

    python bench/naive_peer.py [--scale X] [--seed N]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import simpy
from kvfrag.sim.allocators import make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.geometry import preset
from kvfrag.sim.units import parse_size

GEO = preset("llama-3-8b")
BLOCK = 16  # tokens per KV block (the paged allocator's block_size)
CAPACITY = parse_size("50GB")
STEP = StepTime(base_s=0.01, per_batched_token_s=2e-6, per_kv_token_s=1e-8)  # bench/engine.py's
MAX_NUM_SEQS = 512
RTOL = 1e-9  # times: the engine sums a stretch in closed form, the peers one iteration at a time


@dataclass(frozen=True)
class Case:
    """One benchmarked workload: outputs of about `output` tokens."""

    output: int
    requests: int  # at --scale 1
    max_model_len: int  # >= prompt + output - 1: no request is truncated or rejected


CASES = (Case(100, 20_000, 2048), Case(1_000, 10_000, 4096), Case(10_000, 500, 16384))
#: The issue's targets: kvfrag's speedup over the vectorised peer, per output length.
TARGETS = {100: 1.0, 1_000: 2.0, 10_000: 10.0}


@dataclass
class PeerResult:
    """What a naive peer records: no more than the agreement check needs."""

    end_s: float
    finished_s: np.ndarray  # per request, in workload order
    iterations: int
    preemptions: int


def workload(n: int, output: int, seed: int) -> pd.DataFrame:
    """N requests arriving at 40 req/s, prompts 200-800, outputs `output` +- 10 %:
    bench/engine.py's shape with a chosen output length."""
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / 40.0, n))
    spread = output // 10
    return pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": arrival - arrival[0],
            "prompt_tokens": rng.integers(200, 801, n),
            "output_tokens": rng.integers(output - spread, output + spread + 1, n),
        }
    )


def config(case: Case) -> EngineConfig:
    """Whole prompts in one iteration need a token budget of at least max_model_len."""
    return EngineConfig(
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=max(8192, case.max_model_len),
        step_time=STEP,
    )


def num_blocks() -> int:
    """Blocks in the KV budget (its tail too small for a block is never used)."""
    return CAPACITY // (BLOCK * GEO.bytes_per_token)


def check_workload(wl: pd.DataFrame, case: Case) -> None:
    """The peers model neither rejection nor truncation, and take arrivals in row order:
    make sure that is all this workload needs."""
    if not wl["arrival_s"].is_monotonic_increasing:
        raise SystemExit(f"{case}: arrivals out of order")
    final = wl["prompt_tokens"] + wl["output_tokens"] - 1
    if (wl["prompt_tokens"] >= case.max_model_len).any() or (final > case.max_model_len).any():
        raise SystemExit(f"{case}: a request reaches max_model_len; raise it")
    if (-(-final // BLOCK) > num_blocks()).any():
        raise SystemExit(f"{case}: a request needs more blocks than exist")


def _inputs(wl: pd.DataFrame) -> tuple[list[float], list[int], list[int]]:
    """Arrival times, prompt lengths and final slot counts as plain lists.

    vLLM's slot convention (sim/engine_requests.py `slot_request`): a slot holds a token the
    model has read; the prefill takes P slots and samples the first token, each decode step
    reads the last sampled token into a new slot, and the last sampled token is never read, so
    a request of O output tokens ends holding P + O - 1 slots."""
    prompt = wl["prompt_tokens"].tolist()
    final = [p + o - 1 for p, o in zip(prompt, wl["output_tokens"].tolist(), strict=True)]
    return wl["arrival_s"].to_numpy(float).tolist(), prompt, final


def plain_peer(wl: pd.DataFrame, blocks: int, cfg: EngineConfig) -> PeerResult:
    """The per-iteration loop in plain Python: running requests are [index, tokens] lists."""
    arrival, prefill, final = _inputs(wl)  # prefill: tokens to compute at (re)admission
    n, st = len(arrival), cfg.step_time
    finished = [math.nan] * n
    out = PeerResult(0.0, np.empty(0), 0, 0)
    env = simpy.Environment()

    def serve():
        free, nxt = blocks, 0
        queue: deque[int] = deque()
        running: list[list[int]] = []  # admission order: the last one is preempted first
        while True:
            while nxt < n and arrival[nxt] <= env.now:
                queue.append(nxt)
                nxt += 1
            if not running and not queue:
                if nxt == n:
                    return
                yield env.timeout(arrival[nxt] - env.now)
                continue
            # 1. Each decoder's next token needs a new block when its tokens fill whole blocks;
            # short of blocks, preempt the newest request (recompute its tokens and the last
            # sampled one, which had no slot yet). No admissions in such an iteration.
            need = 0
            for r in running:
                if r[1] % BLOCK == 0:
                    need += 1
            preempted = False
            while need > free:
                i, tokens = running.pop()
                free += -(-tokens // BLOCK)
                need -= tokens % BLOCK == 0
                prefill[i] = tokens + 1
                queue.appendleft(i)
                out.preemptions += 1
                preempted = True
            free -= need
            decoders = len(running)
            kv = 0  # tokens every running request holds after this iteration's allocations
            for r in running:
                r[1] += 1
                kv += r[1]
            # 2. Strict FCFS: admit whole prompts while sequences, token budget and blocks allow;
            # none after a preemption (vLLM's rule; never decisive here: the head is then the
            # request just preempted, and it needs more blocks than its preemption left free).
            budget, used = cfg.max_num_batched_tokens - decoders, 0
            while not preempted and queue and len(running) < cfg.max_num_seqs and used < budget:
                i = queue[0]
                p = prefill[i]
                take = -(-p // BLOCK)
                if p > budget - used or take > free:
                    break
                queue.popleft()
                free -= take
                used += p
                kv += p
                running.append([i, p])
            if not decoders and not used:
                continue  # it only preempted: the next iteration admits
            # 3. The iteration's time; 4. at its end, requests holding their final slots finish.
            yield env.timeout(st.base_s + st.per_batched_token_s * (decoders + used)
                              + st.per_kv_token_s * kv)
            out.iterations += 1
            still = []
            for r in running:
                if r[1] == final[r[0]]:
                    finished[r[0]] = env.now
                    free += -(-r[1] // BLOCK)
                else:
                    still.append(r)
            running = still

    env.process(serve())
    env.run()
    out.end_s, out.finished_s = env.now, np.array(finished)
    return out


def vectorised_peer(wl: pd.DataFrame, blocks: int, cfg: EngineConfig) -> PeerResult:
    """The same loop with numpy arrays over the running requests (in admission order)."""
    arrival, prefill, final = _inputs(wl)
    n, st = len(arrival), cfg.step_time
    finished = np.full(n, math.nan)
    idx = np.zeros(cfg.max_num_seqs, np.int64)  # running request i is idx[i], for i < m
    tok = np.zeros(cfg.max_num_seqs, np.int64)
    fin = np.zeros(cfg.max_num_seqs, np.int64)
    out = PeerResult(0.0, finished, 0, 0)
    env = simpy.Environment()

    def serve():
        free, nxt, m = blocks, 0, 0
        queue: deque[int] = deque()
        while True:
            while nxt < n and arrival[nxt] <= env.now:
                queue.append(nxt)
                nxt += 1
            if not m and not queue:
                if nxt == n:
                    return
                yield env.timeout(arrival[nxt] - env.now)
                continue
            need = int(np.count_nonzero(tok[:m] % BLOCK == 0))  # decoders needing a block
            preempted = False
            while need > free:  # preempt the newest (rare: scalar steps)
                m -= 1
                tokens = int(tok[m])
                free += -(-tokens // BLOCK)
                need -= tokens % BLOCK == 0
                prefill[int(idx[m])] = tokens + 1
                queue.appendleft(int(idx[m]))
                out.preemptions += 1
                preempted = True
            free -= need
            decoders = m
            tok[:m] += 1
            budget, used = cfg.max_num_batched_tokens - decoders, 0
            while not preempted and queue and m < cfg.max_num_seqs and used < budget:
                i = queue[0]
                p = prefill[i]
                take = -(-p // BLOCK)
                if p > budget - used or take > free:
                    break
                queue.popleft()
                free -= take
                used += p
                idx[m], tok[m], fin[m] = i, p, final[i]
                m += 1
            if not decoders and not used:
                continue
            kv = int(tok[:m].sum())
            yield env.timeout(st.base_s + st.per_batched_token_s * (decoders + used)
                              + st.per_kv_token_s * kv)
            out.iterations += 1
            done = tok[:m] == fin[:m]
            if done.any():
                finished[idx[:m][done]] = env.now
                free += int((-(-tok[:m][done] // BLOCK)).sum())
                keep = ~done
                k = int(keep.sum())
                idx[:k], tok[:k], fin[:k] = idx[:m][keep], tok[:m][keep], fin[:m][keep]
                m = k

    env.process(serve())
    env.run()
    out.end_s = env.now
    return out


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * max(abs(a), abs(b))


def disagreements(name: str, peer: PeerResult, records) -> tuple[list[str], float]:
    """How a peer's records differ from kvfrag's (empty: they agree), and the largest relative
    difference in its times (end time and latencies: rounding, as sums are taken differently)."""
    summary, reqs = records.summary, records.requests
    problems = []
    end = summary["sim_time_s"]
    if not _close(peer.end_s, end):
        problems.append(f"{name}: end time {peer.end_s!r} s, kvfrag {end!r} s")
    iterations = int(records.timeseries["iterations"].sum())
    if peer.iterations != iterations:
        problems.append(f"{name}: {peer.iterations} iterations, kvfrag {iterations}")
    if peer.preemptions != summary["preemptions"]:
        problems.append(f"{name}: {peer.preemptions} preemptions, kvfrag {summary['preemptions']}")
    if (reqs["status"] != "completed").any():
        problems.append(f"kvfrag: {int((reqs['status'] != 'completed').sum())} not completed")
    ours = peer.finished_s - reqs["arrival_s"].to_numpy(float)
    theirs = reqs["latency_s"].to_numpy(float)
    rel = np.abs(ours - theirs) / np.maximum(np.abs(ours), np.abs(theirs))
    bad = ~(rel <= RTOL)  # (NaN, a request one side never finished, is bad too)
    for i in np.flatnonzero(bad)[:5]:
        problems.append(f"{name}: request {int(reqs['request_id'].iloc[i])} latency "
                        f"{ours[i]!r} s, kvfrag {theirs[i]!r} s")
    if bad.sum() > 5:
        problems.append(f"{name}: ... {int(bad.sum())} request latencies differ in all")
    worst = max(abs(peer.end_s - end) / end, float(np.nanmax(rel, initial=0.0)))
    return problems, worst


def timed(repeat: int, fn: Callable, *args):
    """fn(*args) and its best wall seconds of `repeat` runs (the machine may be shared)."""
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn(*args)
        best = min(best, time.perf_counter() - start)
    return result, best


def kvfrag(wl: pd.DataFrame, case: Case, cfg: EngineConfig):
    """kvfrag's run on a fresh paged allocator (building one costs next to nothing)."""
    alloc = make_allocator("paged", capacity=CAPACITY, bytes_per_token=GEO.bytes_per_token,
                           max_model_len=case.max_model_len, block_size=BLOCK)
    return run(wl, alloc, cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the request counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="runs per simulator: best is kept")
    args = parser.parse_args()
    from kvfrag import sim

    print("kvfrag's engine: " + ("compiled (mypyc)" if sim.COMPILED else "pure Python") +
          " (KVFRAG_PURE=1 runs the pure-Python modules)")
    print(f"llama-3-8b, {CAPACITY / 1e9:g} GB of KV ({num_blocks():,} blocks of {BLOCK}), "
          f"max_num_seqs {MAX_NUM_SEQS}, FCFS, whole prompts, recompute preemption, "
          f"step {STEP.source}")
    print("Poisson 40 req/s, prompts 200-800, outputs +-10 %; wall s: best of "
          f"{args.repeat}, kvfrag's `run` whole (result frames included), the peers from the "
          "workload frame to their finish times")
    print(f"{'output':>7}{'requests':>9}{'mml':>6}{'iterations':>11}{'events':>8}{'it/ev':>6}"
          f"{'preempt':>8}{'kvfrag s':>9}{'plain s':>9}{'vector s':>9}{'x plain':>8}"
          f"{'x vector':>9}  agree (worst rel. time difference)")
    failed, speedups = [], {}
    for case in CASES:
        n = max(int(case.requests * args.scale), 1)
        wl = workload(n, case.output, args.seed)
        check_workload(wl, case)
        cfg = config(case)
        records, t_kvfrag = timed(args.repeat, kvfrag, wl, case, cfg)
        plain, t_plain = timed(args.repeat, plain_peer, wl, num_blocks(), cfg)
        vector, t_vector = timed(args.repeat, vectorised_peer, wl, num_blocks(), cfg)
        problems, worst = [], 0.0
        for name, peer in (("plain", plain), ("vectorised", vector)):
            more, rel = disagreements(name, peer, records)
            problems, worst = problems + more, max(worst, rel)
        failed += problems
        speedups[case.output] = t_vector / t_kvfrag
        s = records.summary
        iterations, events = int(records.timeseries["iterations"].sum()), int(s["events"])
        print(f"{case.output:>7,}{n:>9,}{case.max_model_len:>6}{iterations:>11,}{events:>8,}"
              f"{iterations / events:>6.1f}{int(s['preemptions']):>8,}{t_kvfrag:>9.2f}"
              f"{t_plain:>9.2f}{t_vector:>9.2f}{t_plain / t_kvfrag:>8.1f}"
              f"{t_vector / t_kvfrag:>9.1f}  {'yes' if not problems else 'NO'} ({worst:.0e})",
              flush=True)
        for line in problems:
            print(f"  MISMATCH {line}")
    print("issue 16 targets (kvfrag's speedup over the vectorised peer):")
    for output, target in TARGETS.items():
        got = speedups[output]
        met = got > target if target == 1.0 else got >= target
        what = "faster than" if target == 1.0 else f">= {target:g}x"
        print(f"  {output:>6,}-token outputs, {what} the vectorised peer: {got:.2f}x  "
              f"{'met' if met else 'NOT met'}")
    if failed:
        print(f"the peers disagree with kvfrag ({len(failed)} mismatches above)")
        sys.exit(1)


if __name__ == "__main__":
    main()
