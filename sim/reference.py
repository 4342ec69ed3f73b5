"""A plain per-iteration stepper with the engine's documented semantics: the specification
the fast engine (`sim.engine`) is held to, and what is compared with vLLM's own scheduler
iteration by iteration (`tests/oracle`).

It visits every iteration and sums the accounting x dt one iteration at a time: no decode
stretches, no closed forms, so its cost grows with generated tokens. Use it to check, not to
run workloads. With `trace` (a list), each iteration appends one record: when it started,
requests running and waiting after it, preemptions and admissions in it, bytes allocated
(blocks in use), and for prefix caching the tokens its admissions found cached, the idle
cached blocks it evicted and those left idle after it; and how it walked its running list:
`walked` (1 where a prompt partway ran ahead of a decoder: the walk in admission order),
`tokenless` (decoding sequences that took no token) and `given_back` (victims by priority
that had taken their token or chunk earlier in a walk). Tests read these where the fast
engine, compiled, cannot be observed from outside.

`cfg.policy == "priority"`: the queue in (priority, arrival, workload order), a preempted
request back in by that key, and the victim of a shortage the running request with the
largest (priority, arrival), the first of them in admission order; a victim that already has
its prefill chunk for this iteration gives it back.

`cfg.async_scheduling` (vLLM's AsyncScheduler, continuous batching; see `sim.engine`): a
request that stored its final token is done at the end of its iteration but keeps its memory
and its seat through the next iteration's scheduling, where it may be preempted (it still
finishes; its blocks go then); it is freed right after that scheduling. A pass that only
frees such requests takes no time and makes no record.

`cfg.speculative` (sim/speculative.py): every iteration walks the running list; a decoder takes
its sampled token and its drafts (cut to the token and input budgets), its slots grown to the
high-water mark of computed + scheduled + lookahead, and at the iteration's end its accepted
count gives it 1 + a tokens and rolls the rest back. Async, the rollback lands after the next
scheduling, and a request done by its last step is scheduled once more unless vLLM could tell.
A request's "c" is its computed tokens (vLLM's num_computed_tokens), "out" its outputs.

`cfg.max_time_s` stops the run as the engine does: no iteration starts at or past it (one
under way finishes), an idle wait ends there, and what is live then stays "running" or
"waiting".
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pandas as pd
from kvfrag.sim.allocators import PARTS, Reason, Request
from kvfrag.sim.engine_config import EngineConfig, async_modelled
from kvfrag.sim.speculative import acceptance_for, extra_slots

NEVER = {Reason.PROMPT_TOO_LONG, Reason.TOO_LARGE}
#: What an iteration's trace record counts (see the module's docstring).
COUNTS = ("preempted", "admitted", "prefix_hit_tokens", "walked", "tokenless", "given_back")


def reference(
    workload: pd.DataFrame, alloc, cfg: EngineConfig, trace: list | None = None
) -> dict:
    """Run `workload` on `alloc` one iteration at a time (continuous batching): the requests
    (status, times, preemptions, ...), the time-averaged parts and the simulated time."""
    st_ = cfg.step_time
    def lead(row) -> int:
        """Slots a request holds ahead of the tokens read: vLLM's convention (0: P slots
        after the prefill, P + O - 1 at the end), but groups fork with their first token's
        slot taken at admission (1)."""
        return int(int(getattr(row, "n", 1)) * int(getattr(row, "beam_width", 1)) > 1)

    spec = cfg.speculative
    if spec and any(lead(row) for row in workload.itertuples()):
        raise ValueError("speculative decoding: sample groups and beams (n > 1) not modelled")
    reqs = [
        {
            "rid": int(row.request_id),
            "req": Request(
                int(row.request_id),
                int(row.prompt_tokens),
                int(row.output_tokens) - 1 + lead(row) + extra_slots(
                    spec, int(row.prompt_tokens), int(row.output_tokens), alloc.max_model_len,
                    async_modelled(cfg, alloc)),
                n=int(getattr(row, "n", 1)) * int(getattr(row, "beam_width", 1)),
                beam=int(getattr(row, "beam_width", 1)) > 1,
                prefix=tuple(getattr(row, "hash_ids", ())),
                prefix_tokens=workload.attrs.get("hash_block_tokens", 0),
            ),
            "lead": lead(row),
            "arrival": float(row.arrival_s),
            "admitted": math.nan,
            "first": math.nan,
            "finished": math.nan,
            "status": "pending",
            "preemptions": 0,
            "recomputed": 0,
            "prefill": int(row.prompt_tokens),
            "hits": [],  # tokens found cached at each admission (resumptions too)
            "left": 0,
            "peak": 0,
            "priority": int(getattr(row, "priority", 0)),
            "order": order,
            # speculative decoding: tokens computed, outputs delivered, drafts it carries,
            # verifying steps so far, tokens scheduled in this iteration
            "c": 0, "out": 0, "drafts": 0, "verified": 0, "sched": 0,
            # async: the last step's outputs and rejected drafts, applied after the next
            # scheduling; "extra": done, but scheduled once more (vLLM could not tell)
            "inflight": 0, "rollback": 0, "extra": False,
            "discarded": 0,  # extra steps with drafts (vLLM's model verifies them, unread)
            "output": int(row.output_tokens),
        }
        for order, row in enumerate(workload.itertuples())
    ]
    by_rid = {r["rid"]: r for r in reqs}
    acceptance = acceptance_for(spec, workload) if spec else None
    look = spec.lookahead if spec else 0
    ds = spec.draft_slots if spec else 0

    def grow_to(r, tokens: int) -> int:
        """Speculative decoding: the slots r grows by so that it holds `tokens` past its
        computed ones and the lookahead (a high-water mark: rejections free nothing)."""
        want = min(r["c"] + tokens + look, alloc.max_model_len)
        return max(want - alloc.tokens(r["rid"]), 0)
    ref = Request(
        -1,
        max(int(np.median([r["req"].prompt for r in reqs])), 1),
        max(int(np.median([r["req"].output for r in reqs])), 1),
    )
    pending = sorted(reqs, key=lambda r: r["arrival"])
    queue: deque = deque()
    running: list = []
    prefilling: list = []
    integrals = dict.fromkeys(PARTS, 0.0)
    overreserved = 0.0  # integral of the over-reserved part of internal
    # integrals of internal's padding and out-of-window parts, from `waste_breakdown()`: the
    # live requests walked afresh at every iteration (not the allocators' running totals)
    waste = {"padding": 0.0, "out_of_window": 0.0}

    def add_waste(dt: float) -> None:
        now = alloc.waste_breakdown()
        for key in waste:
            waste[key] += now[key] * dt
    t, total = 0.0, 0.0
    preempted = [False]  # in this iteration
    counts = dict.fromkeys(COUNTS, 0)  # in this iteration
    idle = getattr(alloc, "idle_cached_blocks", lambda: 0)

    def seqs():
        return sum(r["req"].n for r in running)

    asynchronous = async_modelled(cfg, alloc)
    if asynchronous:
        alloc.set_async()
    # async: rid -> prefill tokens scheduled in this iteration, and in the previous one
    chunks_now: dict = {}
    chunks_prev: dict = {}

    def in_flight(r) -> int:
        """Async: r's tokens scheduled in the previous iteration, whose output is not applied
        yet (a decoder's token, a prompt's chunk): what `grow` frees by."""
        if not asynchronous:
            return 0
        return chunks_prev.get(r["rid"], int(alloc.is_decoding(r["rid"])))
    held: list = []  # async: done, holding memory and seat through the next scheduling
    fresh: set = set()  # rids whose prefill ended in the last iteration (they did not decode)

    def free(r, stored: int, scheduled: bool = False) -> None:
        """Free r's memory; async, a preempted request's KV is its processed tokens: those
        computed less the one in flight, when its last step decoded (`free_preempted`); one
        more when vLLM had scheduled its token in this step (policy priority)."""
        if asynchronous and r["rid"] not in fresh:
            alloc.free_preempted(r["rid"], stored - 1 + scheduled)
        else:
            alloc.free(r["rid"])

    by_priority = cfg.policy == "priority"

    def verify(done_prefill: list) -> None:
        """Speculative decoding, a step's output: a decode step of d drafts with a accepted
        gives 1 + a tokens and rolls its computed tokens back by d - a; a final prefill chunk
        gives the first token. Each that sampled carries k drafts into its next step."""
        for r in running:
            r["inflight"] = 0
            if not r["sched"]:
                continue
            if r in done_prefill:
                r["out"] += 1
                r["inflight"] = 1
            elif alloc.is_decoding(r["rid"]):
                d = r["sched"] - 1
                a = 0
                if d:
                    a = min(acceptance.count(r["rid"], r["verified"]), d)
                    r["verified"] += 1
                if asynchronous:  # (vLLM rolls back after the next scheduling)
                    r["rollback"] = d - a
                else:
                    r["c"] -= d - a
                r["out"] += 1 + a
                r["inflight"] = 1 + a
            else:
                continue  # a chunk partway through its prompt samples nothing
            r["drafts"] = spec.num_tokens

    def key(r) -> tuple:
        return (r["priority"], r["arrival"], r["order"])

    def enqueue(r, front: bool) -> None:
        """FCFS: at the back (an arrival) or the front (a preemption); priority: by key."""
        if not by_priority:
            queue.appendleft(r) if front else queue.append(r)
            return
        at = 0
        while at < len(queue) and key(queue[at]) < key(r):
            at += 1
        queue.insert(at, r)

    def victim():
        if not by_priority:
            return running[-1]
        return max(running, key=lambda r: (r["priority"], r["arrival"]))

    def preempt(r, unstepped=False, scheduled=False):
        stored = alloc.tokens(r["rid"]) - unstepped  # (a decoder stepped before its turn)
        if spec:  # (its slots run ahead of its computed tokens; async: less those rejected)
            stored, r["drafts"], r["sched"] = r["c"] - r["rollback"], 0, 0
            r["c"] = r["rollback"] = 0
        r["peak"] = max(r["peak"], alloc.allocated_bytes(r["rid"]))
        if r in held:  # async: its last token is in flight; it finishes, not resumed
            r["extra"] = False
            free(r, stored)
            held.remove(r)
            running.remove(r)
            r["preemptions"] += 1
            preempted[0] = True
            counts["preempted"] += 1
            return
        decoding = alloc.is_decoding(r["rid"])
        if decoding:
            free(r, stored, scheduled)
        else:
            alloc.free(r["rid"])
        running.remove(r)
        if r in prefilling:
            prefilling.remove(r)
        r["recomputed"] += stored
        r["preemptions"] += 1
        preempted[0] = True
        counts["preempted"] += 1
        if decoding:
            r["prefill"] = stored + 1 - r["lead"]  # and the last sampled token, slot-less
        r["status"] = "waiting"
        enqueue(r, front=True)

    def preempt_walked(v, took: set, granted: dict, done_prefill: list) -> tuple[int, int, float]:
        """Preempt v in a walk of the running list; under priority it may have been scheduled
        earlier in the walk: a decoder in `took` gives its token back (vLLM had scheduled it),
        a chunk in `granted` its tokens. Returns (sequences, prefill tokens, attention
        seconds) given back."""
        if v["rid"] in took or v["rid"] in granted:
            counts["given_back"] += 1
        if v["rid"] in took:
            took.discard(v["rid"])
            if spec:
                v["c"] -= v["sched"]
                back = v["sched"]
                preempt(v)
                return back, 0, 0.0
            preempt(v, 1, True)
            return v["req"].n, 0, 0.0
        if v["rid"] in granted:
            back, back_s = granted.pop(v["rid"])
            if v in done_prefill:
                done_prefill.remove(v)
            if spec:
                v["c"] -= back
            preempt(v, 0 if spec else back)
            return 0, back, back_s
        preempt(v)
        return 0, 0, 0.0

    def grow_walked(r, tokens: int, took: set, granted: dict,
                    done_prefill: list) -> tuple[bool, int, int, float]:
        """Grow r by `tokens` in a walk of the running list, preempting the victim of each
        refusal (`preempt_walked`) until it fits or r itself goes. Returns (whether it grew;
        the sequences, prefill tokens and attention seconds given back)."""
        n = back = 0
        back_s = 0.0
        while not alloc.grow(r["rid"], tokens, in_flight(r)):
            v = victim()
            dn, db, ds = preempt_walked(v, took, granted, done_prefill)
            n, back, back_s = n + dn, back + db, back_s + ds
            if v is r:
                return False, n, back, back_s
        return True, n, back, back_s

    def prefill_ahead() -> bool:
        """Whether a request partway through its prompt runs ahead of a decoder (admitted
        before it): vLLM then schedules that chunk before the decoder's token (FCFS or
        priority; otherwise every decoder goes first, as vLLM's order gives when no chunk is
        ahead)."""
        if not prefilling:
            return False
        later = running[running.index(prefilling[0]) + 1:]
        return any(alloc.is_decoding(r["rid"]) for r in later)

    def walk_running(cap: int, done_prefill: list, tokenless: list) -> tuple[int, int, float]:
        """vLLM's walk of its running list in admission order: each request takes its token
        or its prefill chunk and its blocks in turn while token budget is left (decoders past
        it take no token); a refusal preempts the newest running request (FCFS: not scheduled
        yet, or the request itself, which ends the walk) or the victim by priority (one
        scheduled already gives its token or chunk back; one that preempted itself lets the
        following ones go on). Returns (decoding sequences that took a token, prefill tokens,
        the chunks' attention seconds)."""
        total = cfg.max_num_batched_tokens
        stepped = chunks = 0
        seconds = 0.0
        took: set = set()  # rids that took their token in this walk
        granted: dict = {}  # rid -> (chunk, attention) granted in this walk

        def grow(r, tokens: int) -> bool:
            nonlocal stepped, chunks, seconds
            grew, n, back, back_s = grow_walked(r, tokens, took, granted, done_prefill)
            stepped, chunks, seconds = stepped - n, chunks - back, seconds - back_s
            return grew
        for r in list(running):
            if r["status"] != "running" and not r["extra"]:
                continue  # preempted by an earlier request's shortage
            n = r["req"].n
            if spec and alloc.is_decoding(r["rid"]):
                # its sampled token and drafts, cut to the token and input budgets and to
                # max_model_len (vLLM leaves room for the token it samples)
                tokens = min(1 + r["drafts"],
                             total - stepped - chunks - ds * (len(took) + len(granted) + 1),
                             alloc.max_model_len - r["c"] - 1)
                if tokens <= 0:
                    tokenless[0] += n
                    tokenless[1] += r["c"]
                    continue
                more = grow_to(r, tokens)
                if not more or grow(r, more):
                    r["c"] += tokens
                    r["sched"] = tokens
                    r["discarded"] += r["extra"] and tokens > 1
                    stepped += tokens
                    took.add(r["rid"])
                continue
            if alloc.is_decoding(r["rid"]):
                if stepped + chunks + n > total:
                    tokenless[0] += n
                    tokenless[1] += n * alloc.tokens(r["rid"])
                    chunks_now[r["rid"]] = 0  # (async: nothing of it in flight next step)
                    if asynchronous:
                        alloc.unscheduled(r["rid"])
                    continue
                if grow(r, 1):
                    stepped += n
                    took.add(r["rid"])
                continue
            left = total - stepped - chunks - ds * (len(took) + len(granted) + 1)
            if left <= 0:
                continue
            chunk = min(r["left"], left, cap or r["left"])
            if not (chunk := alloc.aligned_chunk(r["req"], r["prefill"] - r["left"], chunk,
                                                 r["prefill"], cfg.prefill_chunk_limit)):
                continue  # (Mamba "align" mode: no block boundary in reach this step)
            last = chunk == r["left"]
            spent = st_.prefill_s(chunk, r["prefill"] - r["left"])
            seconds += spent
            more = grow_to(r, chunk) if spec else chunk + r["lead"] * last
            if not more or grow(r, more):
                if spec:
                    r["c"] += chunk
                    r["sched"] = chunk
                r["left"] -= chunk
                chunks += chunk
                granted[r["rid"]] = (chunk, spent)
                chunks_now[r["rid"]] = chunk
                if last:
                    prefilling.remove(r)
                    done_prefill.append(r)
        return stepped, chunks, seconds

    stop = math.inf if cfg.max_time_s is None else cfg.max_time_s
    while True:
        while pending and pending[0]["arrival"] <= t:
            r = pending.pop(0)
            r["status"] = "waiting"
            enqueue(r, front=False)
        if t >= stop:  # (an iteration under way when the time runs out is finished first)
            break
        if not running and not queue:
            if not pending:
                break
            dt = min(pending[0]["arrival"], stop) - t
            acc = alloc.account(ref)
            for p in PARTS:
                integrals[p] += getattr(acc, p) * dt
            add_waste(dt)
            total += dt
            t = min(pending[0]["arrival"], stop)
            continue
        preempted[0] = False
        chunks_prev.clear()
        chunks_prev.update(chunks_now)
        chunks_now.clear()
        counts.update(dict.fromkeys(COUNTS, 0))
        evictions = alloc.evictions
        # vLLM's long-prefill cap, waived when one request runs or waits
        cap = cfg.long_prefill_token_threshold if len(running) + len(queue) > 1 else 0
        used = 0
        attention = 0.0  # prefill chunks' attention, when the step time counts it apart
        done_prefill = []
        tokenless = [0, 0]  # decoding sequences that took no token, and their tokens
        for r in running:
            r["sched"] = 0
        ahead = prefill_ahead()
        walked = False
        if ahead or spec:  # vLLM's walk of its running list: a prefill chunk before a decoder
            # (speculative decoding: always, each decoder taking its own tokens)
            decoders, used, attention = walk_running(cap, done_prefill, tokenless)
            counts.update(walked=int(ahead), tokenless=tokenless[0])
        else:
            # Priority, a decoder short of a block: vLLM's walk, each decoder taking its slot
            # in admission order; a victim that took its slot already gives its token back.
            walked = by_priority and alloc.n_decoding and alloc.steps_until_full() == 0
            if walked:
                stepped: set = set()
                for r in list(running):
                    if r["status"] != "running" or not alloc.is_decoding(r["rid"]):
                        continue
                    if grow_walked(r, 1, stepped, {}, done_prefill)[0]:
                        stepped.add(r["rid"])
            while not walked and alloc.n_decoding and alloc.steps_until_full() == 0:
                alloc.evict_idle()  # (the decoders before the shortage took every free block)
                preempt(victim())
            decoders = alloc.decoding_weight
            if decoders and not walked:
                assert alloc.step(1)
        budget = cfg.max_num_batched_tokens - decoders
        granted: dict = {}  # rid -> (chunk, attention) given this iteration
        for r in ([] if ahead or spec else list(prefilling)):
            if used >= budget:
                break
            if r["status"] != "running":
                continue
            chunk = min(r["left"], budget - used, cap or r["left"])
            if not (chunk := alloc.aligned_chunk(r["req"], r["prefill"] - r["left"], chunk,
                                                 r["prefill"], cfg.prefill_chunk_limit)):
                continue  # (Mamba "align" mode: no block boundary in reach this step)
            last = chunk == r["left"]
            seconds = st_.prefill_s(chunk, r["prefill"] - r["left"])
            attention += seconds
            ok = True
            while not alloc.grow(r["rid"], chunk + r["lead"] * last, in_flight(r)):
                v = victim()
                # a decoder after r in admission order: no token this iteration (priority:
                # one before r gives its token back, and so does a prefill chunk before r)
                unstepped = int(v is not r and alloc.is_decoding(v["rid"]))
                if unstepped:
                    decoders -= v["req"].n
                    budget += v["req"].n
                elif v["rid"] in granted:
                    unstepped, back = granted.pop(v["rid"])
                    used -= unstepped
                    attention -= back
                    if v in done_prefill:
                        done_prefill.remove(v)
                # (a decoder before r in admission order: vLLM had scheduled its token)
                before = by_priority and unstepped == 1 and running.index(v) < running.index(r)
                preempt(v, unstepped, before)
                if v is r:
                    ok = False
                    break
            if ok:
                r["left"] -= chunk
                used += chunk
                granted[r["rid"]] = (chunk, seconds)
                chunks_now[r["rid"]] = chunk
                if last:
                    prefilling.remove(r)
                    done_prefill.append(r)
        i = 0
        # the token budget a request can still take; speculative decoding with a draft model:
        # one input slot more for each request scheduled (`draft_slots`)
        scheduled = sum(1 for r in running if r["sched"]) if ds else 0
        while (
            not preempted[0] and i < len(queue) and seqs() < cfg.max_num_seqs
            and (room := budget - used - ds * (scheduled + 1)) > 0
        ):
            r = queue[i]
            if r["req"].n > cfg.max_num_seqs:
                del queue[i]
                r["status"], r["finished"] = "rejected", t
                continue
            if seqs() + r["req"].n > cfg.max_num_seqs:
                break
            hit = alloc.cached_prefix_tokens(r["req"], r["prefill"])
            work = r["prefill"] - hit
            want = cap if 0 < cap < work else work
            chunk = min(want, room) if cfg.chunked_prefill else want
            if chunk <= room and not (chunk := alloc.aligned_chunk(
                    r["req"], hit, chunk, r["prefill"], cfg.prefill_chunk_limit)):
                break  # (Mamba "align" mode: no block boundary in reach this step)
            whole = chunk == work
            # the whole sequence (reserve_full_isl) or the first chunk must fit
            first = hit + chunk + r["lead"] * whole
            full = alloc.admission_bytes(
                r["req"], r["prefill"] + r["lead"] if cfg.reserve_full_isl else first, hit
            )
            keep = alloc.watermark_bytes(cfg.watermark) if cfg.watermark and running else 0
            gate = cfg.chunked_prefill or keep or cap
            if chunk > room:
                reason = Reason.PROMPT_TOO_LONG if r["req"].prompt >= alloc.max_model_len else None
            elif gate and (
                alloc.too_large(r["req"])
                or alloc.bytes_for(r["req"], r["prefill"] + r["lead"]) > alloc.pool_bytes()
            ):
                reason = Reason.TOO_LARGE
            elif gate and full + keep > alloc.free_bytes():
                reason = Reason.OUT_OF_MEMORY  # the whole prompt must fit, and the watermark
            else:
                slots = (min(hit + chunk + look, alloc.max_model_len) if spec
                         else hit + chunk + r["lead"] * whole)
                grant = alloc.admit(r["req"], slots, decoding=False)
                reason = None if grant else grant.reason
                if grant:
                    del queue[i]
                    used += chunk
                    chunks_now[r["rid"]] = chunk
                    attention += st_.prefill_s(chunk, hit)
                    counts["admitted"] += 1
                    counts["prefix_hit_tokens"] += hit
                    r["hits"].append(hit)
                    if math.isnan(r["admitted"]):
                        r["admitted"] = t
                    r["status"] = "running"
                    r["left"] = r["prefill"] - hit - chunk
                    r["c"], r["sched"], r["drafts"] = hit + chunk, chunk, 0
                    scheduled += 1
                    running.append(r)
                    (done_prefill if whole else prefilling).append(r)
                    continue
            if reason in NEVER:
                del queue[i]
                r["status"], r["finished"] = "rejected", t
                continue
            i += 1
            if cfg.admission == "fcfs" or i >= cfg.lookahead:
                break
        released = bool(held)
        for r in sorted(held, key=lambda r: r["rid"]):  # async: step k-1's output applied
            r["peak"] = max(r["peak"], alloc.allocated_bytes(r["rid"]))  # (an extra step grew)
            alloc.free(r["rid"])
            running.remove(r)
        held.clear()
        for r in running if spec and asynchronous else ():
            r["c"] -= r["rollback"]  # (step k-1's rejected drafts, known now)
            r["rollback"] = 0
        if not decoders and not used:
            assert (not running and not queue) or preempted[0] or released
            continue  # everything waiting was rejected, or it only preempted: no iteration
        tokens = decoders + used
        base, per_kv = st_.affine(tokens, min(decoders + len(done_prefill), tokens), decoders > 0)
        if spec:  # (slots run ahead of the tokens: the scheduled decoders' contexts)
            kv = sum(r["c"] for r in running if (r["sched"] and alloc.is_decoding(r["rid"]))
                     or not (st_.decode_kv_only or alloc.is_decoding(r["rid"])))
        else:
            kv = (alloc.decoding_sequence_tokens() if st_.decode_kv_only
                  else alloc.sequence_tokens())
            kv -= tokenless[1]  # (decoders that took no token read nothing)
        dt = base + per_kv * kv + attention
        acc = alloc.account(queue[0]["req"] if queue else ref)
        acc.check()
        for p in PARTS:
            integrals[p] += getattr(acc, p) * dt
        overreserved += alloc.overreserved_bytes() * dt
        add_waste(dt)
        total += dt
        t += dt
        fresh = set()
        for r in done_prefill:
            if r["status"] == "running":
                alloc.set_decoding(r["rid"], True)
                fresh.add(r["rid"])
                if math.isnan(r["first"]):
                    r["first"] = t
        if spec:
            verify(done_prefill)
        # Requests done together free in rid order (prefix caching: the order idle blocks
        # are evicted in).
        for r in sorted(running, key=lambda r: r["rid"]):
            rid = r["rid"]
            if spec and alloc.is_decoding(rid) and r["out"] >= r["output"]:
                r["status"], r["finished"] = "completed", t
                r["generated"] = r["output"]
                r["peak"] = max(r["peak"], alloc.allocated_bytes(rid))
                if asynchronous:
                    # freed after the next scheduling; vLLM schedules it once more unless the
                    # one token its step in flight surely gives reaches the output's length
                    r["extra"] = r["out"] - r["inflight"] + 1 < r["output"]
                    if not r["extra"]:
                        alloc.set_decoding(rid, False)
                    held.append(r)
                    continue
                alloc.free(rid)
                running.remove(r)
            elif spec:
                continue
            elif alloc.is_decoding(rid) and alloc.tokens(rid) == alloc.final_tokens(rid):
                r["status"], r["finished"] = "completed", t
                r["generated"] = r["req"].n * (alloc.tokens(rid) - r["req"].prompt + 1 - r["lead"])
                r["peak"] = max(r["peak"], alloc.allocated_bytes(rid))
                if asynchronous:  # freed after the next iteration's scheduling
                    alloc.set_decoding(rid, False)
                    held.append(r)
                    continue
                alloc.free(rid)
                running.remove(r)
        if trace is not None:
            trace.append(
                {
                    "start": t - dt,
                    "scheduled_tokens": decoders + used,
                    "running": len(running),
                    "waiting": len(queue),
                    **counts,
                    # blocks in use (idle cached blocks count as free)
                    "allocated_bytes": alloc.capacity - alloc.free_bytes(),
                    "evictions": alloc.evictions - evictions,
                    "idle_cached_blocks": idle(),
                }
            )
    for rid in alloc.rids():  # still holding memory when the run stopped (max_time_s)
        by_rid[rid]["peak"] = max(by_rid[rid]["peak"], alloc.allocated_bytes(rid))
    cap = alloc.capacity
    if total:
        fractions = {p: integrals[p] / (cap * total) for p in PARTS}
        fractions["internal_overreservation"] = overreserved / (cap * total)
        for key, area in waste.items():
            fractions[f"internal_{key}"] = area / (cap * total)
    else:  # no time passed: the allocator's state at that instant
        acc = alloc.account(ref)
        fractions = {p: getattr(acc, p) / cap for p in PARTS}
        fractions["internal_overreservation"] = alloc.overreserved_bytes() / cap
        now = alloc.waste_breakdown()
        for key in waste:
            fractions[f"internal_{key}"] = now[key] / cap
    return {"requests": by_rid, "fractions": fractions, "time": total}
