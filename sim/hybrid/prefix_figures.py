"""The bytes of the ids requests hold with prefix caching under the hybrid manager
(`sim.hybrid.caching`) and in two-level's own layout: token states, reserved, padding and out
of window, to the byte.

Kept apart from the allocator because it is a function of the state alone (the tables, the
requests' lengths, each group's kind and bytes): the allocator asks it at an instant, and
a look-ahead asks it of a copy of the state step after step (`HybridPrefixCaching._sums`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvfrag.sim.allocators.base import Live
from kvfrag.sim.hybrid.prefix import Kind, PrefixState


def held_figures(st: PrefixState, live_of: Mapping[int, Live], clock: int, kinds: Sequence[Kind],
                 kind_of: Sequence[int], tb: Sequence[int], sb: Sequence[int],
                 pages: Sequence[int]) -> tuple[int, int, int, int]:
    """(token_states, reserved, padding, out_of_window) of `st` at `clock`. A
    held id's tokens count once, as many as its holders' layers read at most: per group,
    the ids some holder reads whole (a set: shared ones once), the one at a window's edge
    read in part, and each table's last block, partly written (a request's own). Of the
    rest of internal: padding is each held id's page beyond its group's real slots (or
    beyond its Mamba state); out of window the tokens written in held ids that no holder
    reads (and the Mamba states held beside a request's current one); rounding, the
    unwritten slots no request will write, is what remains.

    `kinds[kind_of[g]]` is group g's kind, `tb[g]` its real layers' bytes per token, `sb[g]`
    its Mamba state's bytes (0: attention), `pages[g]` the bytes of its ids."""
    groups = len(tb)
    whole: list[set[int]] = [set() for _ in range(groups)]
    edge: list[dict[int, int]] = [{} for _ in range(groups)]
    tail = [0] * groups  # tokens in partly written last blocks
    unwritten = [0] * groups  # slots of the tables' last blocks past their tokens
    states = [0] * groups  # Mamba states counted (one per request's table)
    # held ids outside `whole`: before the read range (not freed yet) and partial tails;
    # and per Mamba group every held id
    extra: list[list[int]] = [[] for _ in range(groups)]
    reserved = token_states = 0
    for rid, tables in st.tables.items():
        live = live_of[rid]
        tokens = live.base + clock if live.decoding else live.base
        for g, table in enumerate(tables):
            if sb[g]:  # a Mamba group: its state (its page's rest is padding)
                held_ids = [b for b in table if b]
                if held_ids:
                    token_states += sb[g]
                    states[g] += 1
                    extra[g].extend(held_ids)
                continue
            k = kinds[kind_of[g]]
            bs = k.block_size
            lo = k.read_from(tokens)
            first, full = -(-lo // bs), tokens // bs
            if first <= full:
                whole[g].update(table[first:full])
            j = min(first, len(table)) - 1  # (the nulls a window left are a prefix)
            while j >= 0 and table[j]:
                extra[g].append(table[j])
                j -= 1
            extra[g].extend(b for b in table[max(full, first):] if b)
            if lo % bs and lo // bs < full:  # the window's edge falls inside a block
                b = table[lo // bs]
                n = min(tokens, (lo // bs + 1) * bs) - lo
                if b and n > edge[g].get(b, 0):
                    edge[g][b] = n
            if tokens % bs:
                tail[g] += tokens - max(full * bs, lo)
            reserved += max(0, min(live.final, len(table) * bs) - tokens) * tb[g]
            unwritten[g] += len(table) * bs - tokens
    padding = out = 0
    for g in range(groups):
        token_bytes, state_bytes, page = tb[g], sb[g], pages[g]
        bs = kinds[kind_of[g]].block_size
        if state_bytes:
            held = len(set(extra[g]))  # (a hit's state block may be shared)
            padding += held * (page - state_bytes)
            out += (held - states[g]) * state_bytes
            continue
        w = whole[g]
        w.discard(0)
        n = len(w) * bs + tail[g]
        n += sum(v for b, v in edge[g].items() if b not in w)
        token_states += n * token_bytes
        w.update(extra[g])
        held = len(w)
        padding += held * (page - bs * token_bytes)
        out += (held * bs - unwritten[g] - n) * token_bytes
    return token_states, reserved, padding, out
