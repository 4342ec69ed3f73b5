"""The bytes of the ids requests hold with prefix caching under the hybrid manager
(`sim.hybrid.caching`) and in two-level's own layout: token states, reserved, padding and out
of window, to the byte.

Kept apart from the allocator because it is a function of the state alone (the tables, the
requests' lengths, each group's kind and bytes): the allocator asks it at an instant, and
a look-ahead asks it of a copy of the state step after step (`HybridPrefixCaching._sums`).

`held_figures` counts: an id held by one request only (almost all of them) is counted from
its table's positions, with no set; the few ids held by several (reference count > 1, each in
some request's hit, `PrefixState.hits`) are counted once by a correction. `held_figures_walk`
collects every table's ids in sets, the definition the counts are pinned against
(tests/sim/test_hybrid_prefix_figures.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvfrag.sim.allocators.base import Live
from kvfrag.sim.hybrid.prefix import Kind, PrefixState, leading_nulls


def held_figures_walk(st: PrefixState, live_of: Mapping[int, Live], clock: int,
                      kinds: Sequence[Kind], kind_of: Sequence[int], tb: Sequence[int],
                      sb: Sequence[int], pages: Sequence[int]) -> tuple[int, int, int, int]:
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


def _shared(st: PrefixState, groups: int) -> list[dict[int, int]]:
    """Per group, the ids two requests or more hold and their reference counts: each is in
    some request's hit positions (`PrefixState.hits`)."""
    out: list[dict[int, int]] = [{} for _ in range(groups)]
    if not st.hits:
        return out
    ref = st.pool.ref
    for rid, n in st.hits.items():
        for g, table in enumerate(st.tables[rid]):
            shared = out[g]
            for b in table[:n]:
                if b and b not in shared:
                    r = ref[b]
                    if r > 1:
                        shared[b] = r
    return out


def held_figures(st: PrefixState, live_of: Mapping[int, Live], clock: int, kinds: Sequence[Kind],
                 kind_of: Sequence[int], tb: Sequence[int], sb: Sequence[int],
                 pages: Sequence[int], apart: bool = False) -> tuple[int, int, int, int]:
    """`held_figures_walk`'s figures, counted without collecting ids (see the module). A
    request's tables of one kind are alike (the same length, nulls and window: each
    operation treats them alike), so one of them is counted for all, but for the ids two
    requests or more hold. An attention table's nulls are a prefix (a window frees from
    the front); an id in a read range is read whole by each holder whose range has it.
    `apart`: some request's tables are out of `st` with their ids still held (reference
    counts then exceed the tables' holders): the walk answers."""
    if apart:
        return held_figures_walk(st, live_of, clock, kinds, kind_of, tb, sb, pages)
    groups = len(tb)
    shared = _shared(st, groups)
    # the attention kinds and their groups; Mamba groups on their own
    members = [[g for g in range(groups) if kind_of[g] == ki and not sb[g]]
               for ki in range(len(kinds))]
    # (per attention kind: how its read range starts (0 full, 1 sliding, 2 chunked: as
    # `Kind.read_from`), its window, block size, groups, first group, counts, whether some
    # group of it has shared ids)
    reads = {"full": 0, "sliding_window": 1, "chunked_local": 2}
    attention = [(reads[kinds[ki].kind], kinds[ki].window, kinds[ki].block_size, gs, gs[0])
                 for ki, gs in enumerate(members) if gs]
    mamba = [g for g in range(groups) if sb[g]]
    # per attention kind (one of its tables' counts): ids read whole, non-null ids, tokens
    # of window-edge ids, tokens in partly written last blocks, slots of the last blocks
    # past their tokens, slots still to be written
    count = {first_g: [0, 0, 0, 0, 0, 0] for *_, first_g in attention}
    runs = [(read, window, bs, gs, first_g, count[first_g], any(shared[g] for g in gs))
            for read, window, bs, gs, first_g in attention]
    states = [0] * groups  # Mamba states counted (one per request's table)
    held_mamba = [0] * groups
    # shared ids: holders whose table has the id outside its read range; the most tokens a
    # holder reads of it at its window's edge (and those the kind's count gave it)
    outside: list[dict[int, int]] = [{} for _ in range(groups)]
    edge_of: list[dict[int, int]] = [{} for _ in range(groups)]
    edge_fix = [0] * groups
    token_states = 0
    # (tables, tokens, final) per request
    reqs = []
    for rid, tables in st.tables.items():
        live = live_of[rid]
        reqs.append((tables, live.base + clock if live.decoding else live.base, live.final))
    for read, window, bs, gs, first_g, c, any_shared in runs:
        if not any_shared:
            c[:] = _plain_counts(reqs, read, window, bs, first_g)
            continue
        for tables, tokens, final in reqs:
            table = tables[first_g]
            size = len(table)
            lo, first, full, f, z = _span(table, tokens, read, window, bs)
            c[1] += size - z
            top = full if full < size else size
            if top > first and top > z:
                c[0] += top - (first if first > z else z)
            edge = lo // bs if lo % bs and lo // bs < full else -1
            n_edge = 0
            if edge >= 0 and table[edge]:  # the window's edge falls inside a block
                n_edge = min(tokens, (edge + 1) * bs) - lo
                c[2] += n_edge
            slots = size * bs
            if tokens % bs:
                c[3] += tokens - (full * bs if full * bs > lo else lo)
            c[4] += slots - tokens
            if final > tokens and slots > tokens:
                c[5] += (final if final < slots else slots) - tokens
            for g in gs:
                sh = shared[g]
                if not sh:
                    continue
                table = tables[g]
                out_g = outside[g]
                for b in table[z:f]:
                    if b in sh:
                        out_g[b] = out_g.get(b, 0) + 1
                for b in table[max(full, first):]:
                    if b in sh:
                        out_g[b] = out_g.get(b, 0) + 1
                if n_edge and table[edge] in sh:
                    b = table[edge]
                    edge_fix[g] -= n_edge
                    if n_edge > edge_of[g].get(b, 0):
                        edge_of[g][b] = n_edge
    for g in mamba:  # its state (its page's rest is padding)
        for tables, _, _ in reqs:
            table = tables[g]
            n_ids = len(table) - table.count(0)
            if n_ids:
                token_states += sb[g]
                states[g] += 1
                held_mamba[g] += n_ids
    reserved = padding = out = 0
    for g in range(groups):
        token_bytes, state_bytes, page = tb[g], sb[g], pages[g]
        k = kinds[kind_of[g]]
        bs = k.block_size
        if state_bytes:
            n_held = held_mamba[g] - sum(r - 1 for r in shared[g].values())
            padding += n_held * (page - state_bytes)
            out += (n_held - states[g]) * state_bytes
            continue
        n_whole, n_held, edge, tail, unwritten, to_write = count[members[kind_of[g]][0]]
        edge += edge_fix[g]
        for b, r in shared[g].items():
            n_held -= r - 1
            readers = r - outside[g].get(b, 0)  # holders reading it whole
            if readers > 1:
                n_whole -= readers - 1
            elif readers <= 0:
                edge += edge_of[g].get(b, 0)
        n = n_whole * bs + tail + edge
        token_states += n * token_bytes
        reserved += to_write * token_bytes
        padding += n_held * (page - bs * token_bytes)
        out += (n_held * bs - unwritten - n) * token_bytes
    return token_states, reserved, padding, out


def _span(table: list[int], tokens: int, read: int, window: int,
          bs: int) -> tuple[int, int, int, int, int]:
    """(lo, first, full, f, z) of an attention table at `tokens`: the first token its layers
    read (`read` 0 full, 1 sliding, 2 chunked: as `Kind.read_from`), the first block read
    whole, the blocks written whole, `first` capped at the table's length, and where the
    ids before `f` start (past the leading nulls a window left: they are a prefix)."""
    if not read:
        lo = 0
    elif read == 1:
        lo = tokens - window if tokens > window else 0
    else:
        lo = (tokens - 1) // window * window if tokens > 1 else 0
    first, full = -(-lo // bs), tokens // bs
    size = len(table)
    f = first if first < size else size
    if f < size and not table[f]:  # nulls into the read range (the prefix's end)
        z = leading_nulls(table)
    else:  # the ids before the read range (not freed yet), back to the nulls
        z = f
        while z and table[z - 1]:
            z -= 1
    return lo, first, full, f, z


def _plain_counts(reqs: list[tuple[list[list[int]], int, int]], read: int, window: int, bs: int,
                  g: int) -> list[int]:
    """One attention kind's counts over the requests (`held_figures`' per kind, for a kind
    none of whose groups has shared ids), each request's table of group g counted: ids read
    whole, non-null ids, tokens of window-edge ids, tokens in partly written last blocks,
    slots of the last blocks past their tokens, slots still to be written. Apart from the
    loop with shared ids, with local sums, and full attention's read range (from token 0)
    taken on its own: what most figures' calls count."""
    n_whole = n_held = n_edges = tail = unwritten = to_write = 0
    if not read:
        for tables, tokens, final in reqs:
            table = tables[g]
            size = len(table)
            full = tokens // bs
            z = leading_nulls(table) if size and not table[0] else 0
            n_held += size - z
            top = full if full < size else size
            if top > z:
                n_whole += top - z
            tail += tokens - full * bs
            slots = size * bs
            unwritten += slots - tokens
            if final > tokens and slots > tokens:
                to_write += (final if final < slots else slots) - tokens
        return [n_whole, n_held, n_edges, tail, unwritten, to_write]
    for tables, tokens, final in reqs:
        table = tables[g]
        size = len(table)
        lo, first, full, _f, z = _span(table, tokens, read, window, bs)
        n_held += size - z
        top = full if full < size else size
        if top > first and top > z:
            n_whole += top - (first if first > z else z)
        if lo % bs:
            edge = lo // bs
            if edge < full and table[edge]:  # the window's edge falls inside a block
                n_edges += (tokens if tokens < (edge + 1) * bs else (edge + 1) * bs) - lo
        if tokens % bs:
            tail += tokens - (full * bs if full * bs > lo else lo)
        slots = size * bs
        unwritten += slots - tokens
        if final > tokens and slots > tokens:
            to_write += (final if final < slots else slots) - tokens
    return [n_whole, n_held, n_edges, tail, unwritten, to_write]
