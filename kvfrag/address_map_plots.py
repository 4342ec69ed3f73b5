"""The address map: every slab of a slab allocator (contiguous, buddy, torch's caching
allocator) in the address space over time.

`address_map_figure(requests, summary)` draws a panel per allocator and sweep point: each slab
a rectangle from admission to release (`slab_polygons`), stored tokens green, reserved orange,
internal fragmentation red, holes white. A request of several sequences holds a slab per
sequence (`sequences`, `_slabs`); a slab moved by compaction is drawn a piece per place it was
held at, where the results record the moves (`slab_pieces`). report.html draws the same
slabs in the browser from these functions' columns (`kvfrag.report`).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping

import matplotlib.ticker as mticker
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from kvfrag.captions import _new_figure
from kvfrag.figure_kit import (
    GIB,
    MAX_SLABS,
    PALETTE,
    _allocators_note,
    _first,
    _labels,
    _left_out,
    _notes_text,
    _panel_keep,
    _say,
    _with_keys,
    byte_unit,
    format_bytes,
)
from kvfrag.sim.allocators.torch_blocks import ADDRESS_BASE
from kvfrag.sweep_plots import _pick_points, point_names


def slab_polygons(
    requests: pd.DataFrame,
    bytes_per_token: float,
    end_s: float | None = None,
    scale: float = GIB,
    base: float = 0.0,
) -> dict[str, np.ndarray]:
    """Polygons (time s, address in units of `scale` bytes above `base`: GiB from 0 by
    default) of each admitted slab's stored tokens, reserved and internal parts, and its
    outline: arrays of shape (slabs, corners, 2); each row of `requests` is one slab (its
    `peak_bytes`), at `offset_bytes`. Stored tokens grow linearly from the prompt plus the
    first output token's slot (at the first token) to the final length (at the finish); the
    slab is held until `released_s` (static batching frees a batch together). A request still
    running at the end (`end_s`) is drawn as long as it was then (`tokens_at_end`). A row with
    `piece_start_s` / `piece_end_s` (see `slab_pieces`; NaN: from admission / to release) is
    the part of its slab held at `offset_bytes` in that time: its parts are those of the whole
    slab cut to that time, so that the pieces of a slab moved by compaction join up."""
    req = requests[requests["admitted_s"].notna() & requests["offset_bytes"].notna()]
    if end_s is None:
        end_s = (
            float(np.nanmax(req[["finished_s", "admitted_s"]].to_numpy(float))) if len(req) else 0.0
        )
    a = req["admitted_s"].to_numpy(float)
    fin = req["finished_s"].to_numpy(float)
    unfinished = np.isnan(fin)
    fin = np.where(unfinished, end_s, fin)
    # Static batching holds a finished request's slab until its whole batch is done.
    rel = req["released_s"].to_numpy(float) if "released_s" in req else fin
    rel = np.where(np.isnan(rel), fin, np.maximum(rel, fin))
    f1 = req["first_token_s"].to_numpy(float)
    f1 = np.clip(np.where(np.isnan(f1), fin, f1), a, fin)
    off = (req["offset_bytes"].to_numpy(float) - base) / scale
    peak = req["peak_bytes"].to_numpy(float) / scale
    b = float(bytes_per_token) / scale
    final = req["final_tokens"].to_numpy(float) * b
    # A request still running when the run stopped has no recorded slab size (peak 0): draw
    # the slab as its final length, since the reservation beyond that is unknown.
    peak = np.where(peak > 0, peak, final)
    final = np.minimum(np.where(final > 0, final, peak), peak)
    s0 = np.minimum((req["prompt_tokens"].to_numpy(float) + 1) * b, final)
    s1 = final
    if unfinished.any():  # still running when the run stopped: as long as it was then
        at_end = req["tokens_at_end"].to_numpy(float) * b
        s1 = np.where(unfinished, np.clip(at_end, s0, final), final)

    def polys(*corners: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        return np.stack([np.stack([x, y], axis=-1) for x, y in corners], axis=1)

    h0, hf, hn, h1 = s0, s0, s1, s1  # stored height at a, f1, fin and rel
    if PIECE_START in req.columns:  # pieces of slabs: the whole slab's corners, cut in time
        ps = req[PIECE_START].to_numpy(float)
        pe = req[PIECE_END].to_numpy(float)
        t0 = np.where(np.isnan(ps), a, np.clip(ps, a, rel))
        t1 = np.where(np.isnan(pe), rel, np.clip(pe, t0, rel))
        g1, g2 = f1, fin  # when the whole slab's stored part starts and stops growing
        a, f1, fin, rel = t0, np.clip(f1, t0, t1), np.clip(fin, t0, t1), t1
        h0, hf = (_stored_at(t, g1, g2, s0, s1, late=False) for t in (a, f1))
        hn, h1 = (_stored_at(t, g1, g2, s0, s1, late=True) for t in (fin, rel))
    stored = polys(
        (a, off), (a, off + h0), (f1, off + hf), (fin, off + hn), (rel, off + h1), (rel, off)
    )
    reserved = polys(
        (a, off + h0),
        (f1, off + hf),
        (fin, off + hn),
        (rel, off + h1),
        (rel, off + final),
        (a, off + final),
    )
    internal = polys((a, off + final), (rel, off + final), (rel, off + peak), (a, off + peak))
    outline = polys((a, off), (rel, off), (rel, off + peak), (a, off + peak))
    return {"token_states": stored, "reserved": reserved, "internal": internal, "outline": outline}


def _stored_at(
    t: np.ndarray, g1: np.ndarray, g2: np.ndarray, s0: np.ndarray, s1: np.ndarray, late: bool
) -> np.ndarray:
    """A slab's stored height at `t`: `s0` until `g1`, growing linearly to `s1` at `g2`, then
    `s1`; where `g1 == g2` the step is `s0` at it, or `s1` if `late`."""
    with np.errstate(invalid="ignore", divide="ignore"):
        ramp = s0 + (s1 - s0) * (t - g1) / (g2 - g1)
    if late:
        return np.where(t >= g2, s1, np.where(t <= g1, s0, ramp))
    return np.where(t <= g1, s0, np.where(t >= g2, s1, ramp))


#: Columns of requests.parquet written for allocators that compacted: where each request's
#: (first) slab was placed over time, as times and offsets: its admission, then each move.
MOVE_T = "slab_move_t_s"
MOVE_OFFSET = "slab_move_offset_bytes"
#: Columns `slab_pieces` adds: when the piece of a slab begins and ends (NaN: its admission,
#: its release).
PIECE_START = "piece_start_s"
PIECE_END = "piece_end_s"


def moves_known(requests: pd.DataFrame) -> bool:
    """Whether the results record where these requests' slabs moved (`MOVE_T`)."""
    return MOVE_T in requests.columns and bool(requests[MOVE_T].notna().any())


def slab_pieces(slabs: pd.DataFrame) -> pd.DataFrame:
    """Slabs (rows of `_slabs`) cut into one row per place each was held at, where the results
    record moves (`MOVE_T`, `MOVE_OFFSET`): `offset_bytes` the place, `PIECE_START` and
    `PIECE_END` when it was there (NaN: from admission, to release). Only a request's first
    slab's moves are recorded: its other sequences' slabs stay as they are."""
    if MOVE_T not in slabs.columns:
        return slabs
    first = ~slabs.index.duplicated()
    times = slabs[MOVE_T].to_numpy(object)
    places = slabs[MOVE_OFFSET].to_numpy(object)
    offset = slabs["offset_bytes"].to_numpy(float)
    counts, starts, ends, offsets = [], [], [], []
    nan = math.nan
    for j in range(len(slabs)):
        t, o = times[j], places[j]
        if not first[j] or not isinstance(t, list | tuple | np.ndarray) or not len(t):
            counts.append(1)
            starts.append(nan)
            ends.append(nan)
            offsets.append(offset[j])
            continue
        t = [float(x) for x in t]
        n = 0
        for k in range(len(t)):  # (a piece left at once, by a second move then, is not drawn)
            end = t[k + 1] if k + 1 < len(t) else nan
            if end == t[k]:
                continue
            starts.append(t[k] if k else nan)
            ends.append(end)
            offsets.append(float(o[k]))
            n += 1
        counts.append(n)
    out = slabs.iloc[np.repeat(np.arange(len(slabs)), counts)].drop(columns=[MOVE_T, MOVE_OFFSET])
    return out.assign(offset_bytes=np.array(offsets, dtype=float),
                      **{PIECE_START: np.array(starts, dtype=float),
                         PIECE_END: np.array(ends, dtype=float)})


#: The column of requests.parquet that lists every sequence's slab offset of a request (n
#: samples or beams; the first is `offset_bytes`), written when the workload has sample groups
#: or beams. Without it (results from before it existed) only each request's first slab can be
#: placed.
SLAB_OFFSETS = "slab_offsets_bytes"


def sequences(requests: pd.DataFrame) -> np.ndarray:
    """Sequences per request (n samples, or beam_width beams), each with its own slab on a slab
    allocator: a `sequences` column where results have one, else what a finished request's
    sequences generated together over what one generates (`generated_tokens` over
    `output_tokens`: exact, as each sequence generates `output_tokens`); 1 for the others."""
    n = len(requests)
    if "sequences" in requests.columns:
        return np.maximum(np.nan_to_num(requests["sequences"].to_numpy(float), nan=1), 1).astype(
            int
        )
    if "generated_tokens" not in requests.columns or "output_tokens" not in requests.columns:
        return np.ones(n, dtype=int)
    gen = requests["generated_tokens"].to_numpy(float)
    out = requests["output_tokens"].to_numpy(float)
    if "status" in requests.columns:
        done = (requests["status"].astype(str) == "completed").to_numpy()
    else:
        done = requests["finished_s"].notna().to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(done & (out > 0), gen / np.where(out > 0, out, 1), 1.0)
    return np.maximum(np.ceil(np.nan_to_num(ratio, nan=1.0) - 1e-9), 1).astype(int)


def _slabs(req: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """One row per slab to draw, and the most sequences a request has. A request with k
    sequences holds k slabs of `peak_bytes / k` each: every one at its own offset where the
    results list them (`SLAB_OFFSETS`), else only the first (`offset_bytes`), since where the
    others are is not recorded; drawing one slab k times as tall would cover other slabs."""
    k = sequences(req)
    most = int(k.max()) if len(k) else 1
    if most <= 1:
        return req, 1
    req = req.assign(peak_bytes=req["peak_bytes"].to_numpy(float) // k)
    if SLAB_OFFSETS in req.columns:
        req = req.explode(SLAB_OFFSETS)
        req = req.assign(offset_bytes=req[SLAB_OFFSETS].astype(float)).drop(columns=SLAB_OFFSETS)
    return req, most


#: Allocator kinds that place each request in a slab of its own (an address-map panel each).
SLAB_KINDS = ("contiguous", "buddy", "torch-caching")


def _slab_labels(requests: pd.DataFrame, summary: pd.DataFrame | None) -> list[str]:
    """Labels whose requests have slab offsets, or whose kind places slabs (one that admitted
    nothing gets a panel that says so)."""
    requests = _with_keys(requests)
    has = requests.groupby(requests["label"].astype(str))["offset_bytes"].apply(
        lambda s: s.notna().any()
    )
    kinds = {}
    if summary is not None and "kind" in summary.columns:
        kinds = dict(zip(summary["label"].astype(str), summary["kind"].astype(str), strict=True))
    order = _labels(summary) if summary is not None else _labels(requests)
    present = set(requests["label"].astype(str))
    return [lb for lb in order
            if has.get(lb, False) or (lb in present and kinds.get(lb) in SLAB_KINDS)]


def address_map_figure(
    requests: pd.DataFrame,
    summary: pd.DataFrame,
    meta: Mapping | None = None,
    point: int | None = None,
    max_slabs: int = MAX_SLABS,
    timeseries: pd.DataFrame | None = None,
) -> Figure | None:
    """Every slab of each contiguous or buddy allocator in the address space over time: stored
    tokens green, reserved orange, internal fragmentation red, holes white; a panel per
    allocator and sweep point (`point`: that one only). None when no allocator has slabs. More
    than `max_slabs` slabs in a panel: the first by admission are drawn. A panel that cannot
    be drawn as it was (slabs moved by compaction, in results that do not record the moves)
    says why; slabs whose moves are recorded are drawn a piece per place they were held at
    (`slab_pieces`). Addresses are in the unit that
    fits the budget; torch's caching allocator's are virtual (its segments' addresses are
    never reused), drawn from its first segment. At most MAX_PANELS panels, of the first
    MAX_ALLOCATORS slab allocators: the title says what is left out."""
    requests = _with_keys(requests)
    summary = _with_keys(summary)
    if "offset_bytes" not in requests.columns:
        return None
    points = sorted(int(p) for p in pd.unique(requests["point"]))
    points = _pick_points(points, point)
    every = _slab_labels(requests[requests["point"].isin(points)], summary)
    if not every:
        return None
    labels, keep = _panel_keep(every, points)
    left = _allocators_note(len(labels), len(every), "slab allocators") + _left_out(
        points[len(keep):])
    swept = summary["point"].nunique() > 1
    names = point_names(summary) if swept else {}
    panels = [(label, p) for label in labels for p in keep]
    # One allocator: a point per row, so that the panels keep the width time needs; several:
    # an allocator per row, a point per column.
    ncols = min(len(keep), 4) if len(labels) > 1 else 1 if len(keep) <= 4 else 2
    nrows = math.ceil(len(panels) / ncols)
    sums = summary.assign(label=summary["label"].astype(str)).drop_duplicates(["label", "point"])
    sums = sums.set_index(["label", "point"])
    caps = [_row_value(_row(sums, lb, p), "kv_budget_bytes", summary, "kv_budget_bytes")
            or _row_value(_row(sums, lb, p), "capacity_bytes", summary, "capacity_bytes") or 0.0
            for lb, p in panels]
    unit, scale = byte_unit(max(caps))
    width = 11.5 if ncols == 1 else min(1.6 + 5.0 * ncols, 17.5)
    fig = _new_figure(width, 0.9 + (3.2 if nrows <= 3 else 2.7) * nrows + 0.2 * len(left),
                      meta, summary)
    gs = fig.add_gridspec(nrows, ncols)
    chars = int(width / ncols * 11)  # a panel title's characters per line
    by_point: dict[int, Axes] = {}
    xmax: dict[int, float] = {}
    axes = []
    all_notes: list[str] = []
    drawn: list[bool] = []  # whether a panel has slabs (else it says why not)
    for i, ((label, pt), cap) in enumerate(zip(panels, caps, strict=True)):
        ax = fig.add_subplot(gs[divmod(i, ncols)], sharex=by_point.get(pt))
        by_point.setdefault(pt, ax)
        axes.append(ax)
        req = requests[(requests["point"] == pt) & (requests["label"].astype(str) == label)]
        row = _row(sums, label, pt)
        head = f"{label}  ·  {names[pt]}" if len(keep) > 1 and pt in names else label
        notes, right, drew = _map_panel(ax, req, row, summary, cap, scale, max_slabs, timeseries,
                                  label, pt, chars)
        xmax[pt] = max(xmax.get(pt, 0.0), right)
        all_notes += notes
        drawn.append(drew)
        title = head + (": " + "; ".join(notes) if notes else "")
        ax.set_title(textwrap.fill(title, chars), fontsize=9 if ncols > 1 else 10,
                     fontweight="bold", loc="left")
        ax.set_facecolor("white")
        for side in ("top", "right"):
            ax.spines[side].set_visible(True)
    for pt, ax in by_point.items():
        ax.set_xlim(0, xmax[pt] if xmax[pt] > 0 else 1)
    for ax, drew in zip(axes, drawn, strict=True):
        if drew:  # (as the timeline's: tick labels of one width)
            ax.yaxis.set_major_locator(mticker.MaxNLocator(nbins=6, steps=[1, 2, 5, 10]))
    for i, ax in enumerate(axes):
        if not drawn[i]:
            continue
        virtual = "virtual addresses" in ax.get_title(loc="left")
        if i % ncols == 0 or not drawn[i - 1] or virtual:
            ax.set_ylabel(f"{'virtual ' if virtual else ''}address ({unit})")
        if i + ncols >= len(axes) or not drawn[i + ncols]:
            ax.set_xlabel("time (s)")
    handles = [
        Patch(color=PALETTE["token_states"], label="token states (stored)"),
        Patch(color=PALETTE["reserved"], alpha=0.55, label="reserved (not yet written)"),
        Patch(color=PALETTE["internal"], alpha=0.55, label="internal fragmentation"),
        Patch(facecolor="white", edgecolor="#555555", label="hole (free)"),
    ]
    fig.legend(handles=handles, loc="outside right center", fontsize=9, frameon=False)
    title = (
        "Address space of the slab allocators: one rectangle per slab, "
        "from admission to release"
    )
    if any(moves_known(requests[requests["label"].astype(str) == lb]) for lb in labels):
        title += " (moved by compaction: a piece at each place it was held)"
    if swept and len(keep) == 1:
        title += f"\n({names.get(keep[0], f'point {keep[0]}')})"
    if any(note.startswith("only each request's 1st") for note in all_notes):
        title += ("\n(a request of several sequences holds a slab per sequence; the results "
                  "keep the first one's offset only, so only that one is drawn)")
    title += _notes_text(left, width)
    fig.suptitle(title, fontsize=11)
    return fig


def _row(sums: pd.DataFrame, label: str, point: int) -> pd.Series | None:
    key = (label, point)
    return sums.loc[key] if key in sums.index else None


def _map_panel(
    ax: Axes,
    req: pd.DataFrame,
    row: pd.Series | None,
    summary: pd.DataFrame,
    cap: float,
    scale: float,
    max_slabs: int,
    timeseries: pd.DataFrame | None,
    label: str,
    point: int,
    chars: int,
) -> tuple[list[str], float, bool]:
    """Draw one allocator's slabs at one sweep point (or say why they cannot be drawn); the
    notes for its title, the time its panel reaches, and whether it drew any."""
    bpt = _row_value(row, "bytes_per_token", summary, "bytes_per_token")
    kind = str(row["kind"]) if row is not None and "kind" in row.index else ""
    compactions = row.get("compactions") if row is not None else None
    end_s = None
    if timeseries is not None and len(timeseries):
        tsl = _with_keys(timeseries)
        tsl = tsl[(tsl["point"] == point) & (tsl["label"].astype(str) == label)]
        if len(tsl):
            end_s = float((tsl["t_s"] + tsl["dt_s"]).max())
    ax.set_ylim(0, cap / scale if cap else 1)
    if (compactions is not None and pd.notna(compactions) and compactions > 0
            and not moves_known(req)):  # (results from before moves were recorded)
        moved = row.get("bytes_moved")
        stall = row.get("stall_s")
        what = f"{int(compactions):,} compactions"
        if moved is not None and pd.notna(moved):
            what += f" moved {format_bytes(float(moved))}"
        if stall is not None and pd.notna(stall):
            what += f" ({float(stall):.2f} s of stall)"
        _say(ax, f"Not drawn: {what}. requests.parquet keeps only the offset each slab had "
                 "when it was freed, so where the slabs were before they moved is not known.",
             min(chars, 90))
        return [], end_s or 0.0, False
    placed = req[req["admitted_s"].notna() & req["offset_bytes"].notna()]
    if not len(placed):
        why = "no request was admitted"
        if len(req) and "reason" in req.columns:
            reasons = req["reason"].astype(str)
            counts = reasons[reasons != ""].value_counts()
            if len(counts):
                why += " (rejected: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()) + ")"
        _say(ax, f"Nothing to draw: {why}.", min(chars, 90))
        return [], end_s or 0.0, False
    placed = placed.sort_values("admitted_s", kind="stable")
    notes = []
    total = len(placed)
    right = None
    if total > max_slabs:
        right = float(placed["admitted_s"].iloc[max_slabs])
        placed = placed.iloc[:max_slabs]
        notes.append(f"first {max_slabs} of {total} slabs by admission time (up to t = "
                     f"{right:.0f} s)")
    slabs, most = _slabs(placed)
    if most > 1 and SLAB_OFFSETS not in placed.columns:
        notes.append(f"only each request's 1st of {most} slabs")
    base = 0.0
    if kind == "torch-caching":
        base = float(ADDRESS_BASE)
        notes.append("virtual addresses from the first segment (never reused: they pass the "
                     "budget)")
    slabs = slab_pieces(slabs)  # (compaction: a piece per place a slab was held at)
    polys = slab_polygons(slabs, bpt, end_s, scale=scale, base=base)
    for part in ("token_states", "reserved", "internal"):
        ax.add_collection(
            PolyCollection(
                polys[part],
                facecolors=PALETTE[part],
                edgecolors="none",
                alpha=1.0 if part == "token_states" else 0.55,
                rasterized=True,
                antialiased=False,
            )
        )
    ax.add_collection(  # thin outlines tell neighbouring slabs apart
        PolyCollection(
            polys["outline"],
            facecolors="none",
            edgecolors="#555555",
            linewidths=0.3 if len(slabs) < 300 else 0.12,
            alpha=0.8 if len(slabs) < 300 else 0.5,
            rasterized=True,
        )
    )
    top = float(np.nanmax(polys["outline"][..., 1])) if len(slabs) else 0.0
    if base or not cap:
        ax.set_ylim(0, max(cap / scale, top))
    if right is None:
        fin = placed["finished_s"].dropna()
        right = max(float(fin.max()) if len(fin) else 0.0, end_s or 0.0)
        if "released_s" in placed.columns and placed["released_s"].notna().any():
            right = max(right, float(placed["released_s"].max()))
    return notes, right, True


def _row_value(row, col: str, summary: pd.DataFrame, fallback: str):
    if row is not None and col in row.index and pd.notna(row[col]):
        return float(row[col])
    v = _first(summary, fallback)
    return float(v) if v is not None else None
