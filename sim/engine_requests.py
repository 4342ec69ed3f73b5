"""The requests, in and out of a run. `_Inputs` holds the request table as compact columns and
makes a request's engine state (`_Req`, told to the allocator by `slot_request`'s convention)
when it arrives; `_Arrivals` orders those not arrived yet; `_Outcomes` takes a request's figures
into the result columns when it retires, and makes the request table at the end. Engine state
exists only for the requests in flight: memory follows them, not the workload's length.
Compiled with the engine (sim/_native.py): these are read and written at every event.
"""

from __future__ import annotations

import math
from array import array
from heapq import heappop, heappush
from typing import Final

import numpy as np
import pandas as pd
from kvfrag.sim.allocators.base import Request
from kvfrag.sim.speculative import SpecState, Speculative, extra_slots


class _Req:
    """Engine-side state of one request."""

    __slots__ = (
        "admitted",
        "arrival",
        "final",
        "finished",
        "first_token",
        "frag_refused",
        "generated",
        "hits",
        "idx",
        "lead",
        "moves",
        "offset",
        "offsets",
        "output",
        "peak",
        "preemptions",
        "prefill",
        "prefill_left",
        "priority",
        "reason",
        "recomputed",
        "released",
        "req",
        "spec",
        "status",
        "think",
        "user",
    )

    def __init__(self, idx: int, req: Request, arrival: float, output: int, lead: int) -> None:
        self.idx = idx
        self.req = req
        self.output = output  # output tokens the request generates (its trace length)
        self.lead = lead  # slots taken ahead of the token that fills them (see `slot_request`)
        self.arrival = arrival
        self.admitted = math.nan
        self.first_token = math.nan
        self.finished = math.nan
        self.released = math.nan  # when its memory was given back (static: with its batch)
        self.status = "pending"
        self.reason = ""
        self.preemptions = 0
        self.recomputed = 0
        self.peak = 0
        self.prefill = req.prompt  # tokens to prefill on (re)admission
        self.prefill_left = 0
        self.frag_refused = False
        self.generated = 0
        self.hits = 0  # prompt tokens found in the prefix cache at its first admission
        self.offset = math.nan
        self.offsets: tuple[int, ...] = ()  # each sequence's slab (slab allocators, n > 1)
        # Where its (first) slab was placed, as (time, offset): each admission, then each
        # compaction move; None unless the allocator compacts (see `Engine.track_moves`).
        self.moves: list[tuple[float, int]] | None = None
        self.final = 0
        self.user = -1
        self.think = 0.0
        self.priority = 0  # vLLM's request priority (policy "priority": lowest first)
        self.spec: SpecState | None = None  # speculative decoding's progress


class _Arrivals:
    """Requests not yet arrived, earliest first (ties: workload order): the open-loop ones as
    a cursor over their indices sorted once by time, and the closed-loop ones, which are
    timed only when the user's previous request ends, in a heap. `next_s` (inf when none is
    left) is what the loop compares with the clock at every turn."""

    def __init__(self, arrival: np.ndarray, idx: np.ndarray) -> None:
        order = idx[np.argsort(arrival[idx], kind="stable")]
        self.times = array("d", arrival[order].tobytes())
        self.order = array("q", order.astype(np.int64).tobytes())
        self.at = 0
        self.heap: list[tuple[float, int]] = []  # (time, idx) of closed-loop requests
        self.left = len(order)
        self.next_s = math.inf
        self._next()

    def _next(self) -> None:
        at = self.at
        t = self.times[at] if at < len(self.times) else math.inf
        if self.heap and self.heap[0] < (t, self.order[at] if at < len(self.order) else 0):
            t = self.heap[0][0]
        self.next_s = t

    def pop(self) -> int:
        """The index of the earliest request; it has arrived."""
        at, heap = self.at, self.heap
        if at < len(self.times):
            t: float = self.times[at]
            idx: int = self.order[at]
            if not heap or (t, idx) < heap[0]:
                self.at = at + 1
                self.left -= 1
                self._next()
                return idx
        idx = heappop(heap)[1]
        self.left -= 1
        self._next()
        return idx

    def push(self, t: float, idx: int) -> None:
        heappush(self.heap, (t, idx))
        self.left += 1
        self._next()


def slot_request(
    rid: int,
    prompt: int,
    output: int,
    max_tokens: int | None,
    n: int,
    beam: bool,
    prefix: tuple[int, ...],
    prefix_tokens: int,
) -> tuple[Request, int]:
    """What the allocator is told of a request that generates `output` tokens, and its lead.

    vLLM's convention: a slot holds the KV of a token the model has read. The prefill takes
    the prompt's P slots and samples the first token; each decode step reads the last sampled
    token (taking its slot) and samples the next; the last sampled token is never read. A
    request therefore holds P slots after its prefill and P + O - 1 at the end, and its
    allocator request stores `output - 1` tokens past the prompt (a `max_tokens` limit alike).
    Sample groups and beams keep one slot ahead (lead 1): their sequences fork at the first
    sampled token, so they are admitted with its slot (P + 1) and end at P + O (vLLM v1 runs
    the n samples of a request as n requests sharing the prompt's cached blocks; there is no
    fork to compare with).
    """
    lead = 1 if n > 1 else 0
    stored = output - 1 + lead
    limit = None if max_tokens is None else max_tokens - 1 + lead
    req = Request(rid, prompt, stored, limit, n=n, beam=beam, prefix=prefix,
                  prefix_tokens=prefix_tokens)
    return req, lead


class _Inputs:
    """A request table as compact columns (see `workloads` for its columns): what `_Req`s
    are made of when each request arrives."""

    def __init__(self, workload: pd.DataFrame, spec: Speculative | None = None,
                 max_model_len: int = 0, asynchronous: bool = False) -> None:
        # speculative decoding: each request's allocator request holds `extra_slots` more
        self.spec, self.max_model_len, self.asynchronous = spec, max_model_len, asynchronous
        for col in ("arrival_s", "prompt_tokens", "output_tokens"):
            if col not in workload.columns:
                raise ValueError(f"workload has no column {col!r}")
        n = self.n = len(workload)

        def ints(name: str, default: int) -> array:
            """An integer column (missing values: `default`) as an array: its items come out
            as Python ints, fast, and take 8 bytes each."""
            if name not in workload:
                return array("q", bytes(8 * n)) if default == 0 else array("q", [default] * n)
            col = workload[name]
            col = col.fillna(default) if col.hasnans else col
            return array("q", col.to_numpy(dtype=np.int64).tobytes())

        self.rid = ints("request_id", 0) if "request_id" in workload else array("q", range(n))
        # (the checks over every request in numpy: a loop over array items boxes each one,
        # about half a second at a million requests)
        if len(np.unique(np.frombuffer(self.rid, dtype=np.int64))) != n:
            raise ValueError("workload request ids are not unique")
        self.arrival = array("d", workload["arrival_s"].to_numpy(dtype=float).tobytes())
        self.prompt = ints("prompt_tokens", 0)
        self.output = ints("output_tokens", 0)
        self.max_tokens = workload.get("max_tokens")
        self.users = ints("user_id", -1)
        self.think = (array("d", workload["think_s"].to_numpy(dtype=float).tobytes())
                      if "think_s" in workload else None)
        samples, beams = ints("n", 1), ints("beam_width", 1)
        several = np.frombuffer(samples, dtype=np.int64) > 1
        wide = np.frombuffer(beams, dtype=np.int64) > 1
        both = np.flatnonzero(several & wide)
        if len(both):
            i = int(both[0])
            raise ValueError(f"request {self.rid[i]}: n and beam_width are both above 1")
        self.samples, self.beams = samples, beams
        self.has_priority = "priority" in workload
        self.priority = ints("priority", 0)
        self.hashes = workload["hash_ids"].to_numpy() if "hash_ids" in workload else None
        self.chunk = int(workload.attrs.get("hash_block_tokens", 0) or 0)
        self.groups = bool(several.any() or wide.any())

    def __len__(self) -> int:
        return self.n

    def make(self, i: int) -> _Req:
        mt = None
        if self.max_tokens is not None and not pd.isna(self.max_tokens.iat[i]):
            mt = int(self.max_tokens.iat[i])
        k, width = self.samples[i], self.beams[i]
        hashes, chunk = self.hashes, self.chunk
        prefix = tuple(map(int, hashes[i])) if hashes is not None and chunk else ()
        extra = 0
        if self.spec is not None:
            extra = extra_slots(self.spec, self.prompt[i], self.output[i], self.max_model_len,
                                self.asynchronous)
        req, lead = slot_request(
            self.rid[i], self.prompt[i], self.output[i] + extra,
            None if mt is None else mt + extra, max(k, width), width > 1, prefix,
            chunk if prefix else 0,
        )
        r = _Req(i, req, self.arrival[i], self.output[i], lead)
        if self.spec is not None:
            r.spec = SpecState()
        r.priority = self.priority[i]
        if self.users[i] >= 0:
            r.user = self.users[i]
            r.think = self.think[i] if self.think is not None else 0.0
        return r

    def reference_request(self) -> Request:
        """The workload's median request: what free space is judged by when nobody waits."""
        if not self.n:
            return Request(-1, 1, 1)
        prompt = int(np.median(np.frombuffer(self.prompt, dtype=np.int64)))
        groups = np.maximum(np.frombuffer(self.samples, dtype=np.int64),
                            np.frombuffer(self.beams, dtype=np.int64)) > 1
        out = np.frombuffer(self.output, dtype=np.int64)
        stored = out - 1 + groups  # (slot_request)
        if self.spec is not None:  # (and the slots speculative decoding may take)
            most = extra_slots(self.spec, 0, 0, 1 << 62, self.asynchronous)
            room = self.max_model_len - np.frombuffer(self.prompt, dtype=np.int64) - out + 1
            stored = stored + np.minimum(most, np.maximum(room, 0))
        return Request(-1, max(prompt, 1), max(int(np.median(stored)), 1))


#: Request states and refusal reasons, in the codes the result columns hold them by.
_STATUS = ("pending", "waiting", "running", "completed", "rejected")
_STATUS_CODE: Final = {status: code for code, status in enumerate(_STATUS)}


class _Outcomes:
    """The per-request result columns, filled as requests retire (and, at the end, from those
    still in flight); a request never made keeps the defaults of a fresh `_Req`."""

    def __init__(self, inputs: _Inputs) -> None:
        n = len(inputs)
        self.inputs = inputs
        self.arrival = array("d", inputs.arrival)  # (closed loop: set when the user sends it)
        nan = array("d", [math.nan]) * n
        self.admitted, self.first_token, self.finished, self.released, self.offset = (
            array("d", nan) for _ in range(5)
        )
        zeros = bytes(8 * n)
        self.preemptions, self.recomputed, self.peak, self.final, self.hits, self.generated = (
            array("q", zeros) for _ in range(6)
        )
        self.status = bytearray(n)  # codes into _STATUS: 0, pending
        self.reasons: dict[int, str] = {}  # idx -> reason, for the rejected
        self.offsets: dict[int, tuple[int, ...]] = {}  # idx -> each sequence's slab offset
        self.moves: dict[int, list[tuple[float, int]]] = {}  # idx -> placements (compaction)
        self.frag_refused = bytearray(n)

    def store(self, r: _Req) -> None:
        # (a column already holds its default, NaN or 0, until stored: defaults are skipped,
        # as storing costs a boxed item each, and most requests are never preempted, ...)
        i = r.idx
        self.arrival[i] = r.arrival
        self.admitted[i] = r.admitted
        self.first_token[i] = r.first_token
        self.finished[i] = r.finished
        self.released[i] = r.released
        if not math.isnan(r.offset):
            self.offset[i] = r.offset
        if r.preemptions:
            self.preemptions[i] = r.preemptions
            self.recomputed[i] = r.recomputed
        self.peak[i] = r.peak
        self.final[i] = r.final
        if r.hits:
            self.hits[i] = r.hits
        if r.generated:
            self.generated[i] = r.generated
        self.status[i] = _STATUS_CODE[r.status]
        if r.reason:
            self.reasons[i] = r.reason
        if r.offsets:
            self.offsets[i] = r.offsets
        if r.moves:
            self.moves[i] = r.moves
        if r.frag_refused:
            self.frag_refused[i] = 1

    def frame(self, at_end: np.ndarray, moved: bool = False) -> pd.DataFrame:
        """The request table; `moved` (the allocator compacted): with where each slab was over
        time (`slab_move_t_s`, `slab_move_offset_bytes`)."""
        inp = self.inputs
        n = len(inp)

        def col(values: array | bytearray, dtype: type) -> np.ndarray:
            return np.frombuffer(values, dtype=dtype) if n else np.zeros(0, dtype=dtype)

        status = np.array(_STATUS, dtype=object)[np.frombuffer(self.status, dtype=np.uint8)]
        reason = np.full(n, "", dtype=object)
        for i, why in self.reasons.items():
            reason[i] = why
        offset = col(self.offset, np.float64)
        if n and not np.isnan(offset).any():  # every request placed in a slab: integers
            offset = offset.astype(np.int64)
        arrival = col(self.arrival, np.float64)
        admitted = col(self.admitted, np.float64)
        first_token = col(self.first_token, np.float64)
        finished = col(self.finished, np.float64)
        generated = col(self.generated, np.int64)
        # Time per output token after the first (each sequence's tokens).
        seqs = np.maximum(col(inp.samples, np.int64), col(inp.beams, np.int64))
        per_seq = np.where(status == "completed", generated / seqs, 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = (finished - first_token) / (per_seq - 1)
        # (the frame in one go: a column set afterwards costs pandas a copy of its index)
        requests = pd.DataFrame(
            {
                "request_id": col(inp.rid, np.int64),
                "arrival_s": arrival,
                "prompt_tokens": col(inp.prompt, np.int64),
                "output_tokens": col(inp.output, np.int64),
                "status": status,
                "reason": reason,
                "admitted_s": admitted,
                "first_token_s": first_token,
                "finished_s": finished,
                "released_s": col(self.released, np.float64),
                "tokens_at_end": at_end,
                "preemptions": col(self.preemptions, np.int64),
                "recomputed_tokens": col(self.recomputed, np.int64),
                "peak_bytes": col(self.peak, np.int64),
                "offset_bytes": offset,
                "final_tokens": col(self.final, np.int64),
                "frag_refused": col(self.frag_refused, np.bool_),
                "prefix_hit_tokens": col(self.hits, np.int64),
                "generated_tokens": generated,
                "queueing_s": admitted - arrival,
                "latency_s": finished - arrival,
                "ttft_s": first_token - arrival,
                "tpot_s": np.where(per_seq >= 2, tpot, math.nan),
            }
        )
        if inp.has_priority:  # the workload's priorities, for latency per priority
            requests["priority"] = col(inp.priority, np.int64)
        if inp.groups:  # where each sequence's slab was (slab allocators; [] for the others)
            requests["slab_offsets_bytes"] = [list(self.offsets.get(i, ())) for i in range(n)]
        if moved:  # each placement of its (first) slab: admissions, then compaction moves
            moves = [self.moves.get(i, ()) for i in range(n)]
            requests["slab_move_t_s"] = [[float(t) for t, _ in m] for m in moves]
            requests["slab_move_offset_bytes"] = [[int(o) for _, o in m] for m in moves]
        return requests
