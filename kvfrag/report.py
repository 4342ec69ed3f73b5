"""`report.html`: one self-contained page per results folder (issue 17).

`write_report(results_dir)` reads what a run wrote (`scenario.resolved.yaml`, `summary.csv`,
`requests.parquet`, `timeseries.parquet`, `plots/*.png`) and writes `results_dir/report.html`
atomically: the scenario, the summary table (a readable subset with units, and every column
in a collapsed `<details>`), every all-points figure of plots/ as an inline PNG in 256 colours
(the address map as a link to its file where the page has interactive maps), and an
interactive address map per slab allocator and sweep point (plotly: zoom and pan with the
mouse, hover a slab for its request id, tokens, slab size, reserved and internal bytes, and
times).

The page needs no network and stays under about 3 MB: plotly.js (4.8 MB) and the maps' data
are embedded gzipped, only when there is an address map to draw, and unpacked by the page
(`maps_script`). The map reuses the static address map's data preparation
(`kvfrag.address_map_plots.slab_polygons`, `_slabs`, `_slab_labels`), sent as a few
whole-number columns per slab (`compact`) that the page turns back into polygons: each part
(stored tokens, reserved, internal) is one filled scatter trace of all slabs, separated by
gaps, not one shape per slab, so thousands of slabs stay fast. The maps share REPORT_SLABS
slabs (the first by admission in each; at most `MAX_SLABS` per map), at most `MAX_PANELS`
maps and `MAX_ALLOCATORS` allocators, as the PNG; each is drawn when it scrolls into view.

The page says what it leaves out, and why: a missing Parquet file or figure (which one, and
what is not shown for it: `write_report` tells these on stderr too), and the allocators and
sweep points past the figures' caps (`kvfrag.plots.left_out`).
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import pandas as pd

REPORT = "report.html"
#: Hover points per slab: one every 1/_HOVER_STEPS of the run's time span along each slab's
#: middle (at least one), so that hovering anywhere along a long slab finds it.
_HOVER_STEPS = 80

#: Slabs the page's interactive maps hold in all, shared out evenly between them (each at most
#: `kvfrag.figure_kit.MAX_SLABS`, at least MIN_SLABS, the first by admission; a slab compaction
#: moved counts once per place): what keeps the page under 3 MB and quick to open. The
#: address map figure (plots/address_map.png) draws up to MAX_SLABS each.
REPORT_SLABS = 8_000
MIN_SLABS = 500

#: The summary table's readable subset: column, heading, how to show it.
_TABLE = (
    ("label", "allocator", "text"),
    ("kind", "kind", "text"),
    ("token_states_frac", "token states", "pct"),
    ("reserved_frac", "reserved", "pct"),
    ("internal_frac", "internal frag.", "pct"),
    ("external_frac", "external frag.", "pct"),
    ("usable_free_frac", "free", "pct"),
    ("kv_utilization", "KV utilization", "pct"),
    ("mean_running", "mean running", "f1"),
    ("max_running", "max running", "int"),
    ("completed", "completed", "int"),
    ("rejected", "rejected", "int"),
    ("preemptions", "preemptions", "int"),
    ("throughput_tok_s", "throughput (tok/s)", "f0"),
    ("p50_latency_s", "p50 latency (s)", "f2"),
    ("p99_latency_s", "p99 latency (s)", "f2"),
    ("p50_ttft_s", "p50 TTFT (s)", "f3"),
)


def _fmt(value: Any, how: str) -> str:
    import pandas as pd

    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return ""
    try:
        if how == "pct":
            return f"{100 * float(value):.1f} %"
        if how == "int":
            return f"{int(value):,}"
        if how.startswith("f"):
            return f"{float(value):,.{int(how[1:])}f}"
    except (TypeError, ValueError):
        pass
    return str(value)


def summary_html(summary: pd.DataFrame) -> str:
    """The readable table (sweep keys after `point` when there is a sweep) and every column
    in a collapsed `<details>`, each in a box of its own that scrolls sideways when the
    window is narrower than the table (a sweep over two keys adds two columns), so the
    page itself never does."""
    from kvfrag.sweep_plots import sweep_columns

    cols = [c for c in _TABLE if c[0] in summary.columns]
    sweeps = sweep_columns(summary)
    if sweeps:  # (a swept key by its last part, `max_num_seqs`: the whole name on hover)
        cols[2:2] = [("point", "point", "int")] + [(c, c.split(".")[-1], "text")
                                                    for c in sweeps]
    head = "".join(f"<th title='{html.escape(col)}'>{html.escape(name)}</th>"
                   for col, name, _ in cols)
    rows = []
    for rec in summary.to_dict("records"):
        cells = "".join(
            f"<td class='{'t' if how == 'text' else 'n'}'>{html.escape(_fmt(rec.get(col), how))}"
            "</td>"
            for col, _, how in cols
        )
        rows.append(f"<tr>{cells}</tr>")
    full = summary.to_html(index=False, escape=True, classes="full", border=0, na_rep="")
    return (
        "<p>Token states, reserved, internal and external fragmentation and free: shares of "
        "the KV budget, time-averaged (summary.csv; every column in "
        "docs/data-dictionary.md).</p>"
        f"<div class='wide'><table class='summary'><thead><tr>{head}</tr></thead><tbody>"
        f"{''.join(rows)}</tbody></table></div>"
        f"<details><summary>every column of summary.csv</summary><div class='wide'>{full}"
        "</div></details>"
    )


def figures_html(folder: Path, linked: Collection[str] = ()) -> str:
    """Every all-points PNG in plots/, inline (base64; `light_png`): not the one-point figures
    `kvfrag plot --point N` draws beside them. The figures named in `linked` (the address
    map, where the page's interactive maps show the same slabs) are a link to their file
    instead: the page stays light, and the file is beside it in the results folder."""
    from kvfrag.plots import is_point_figure

    pngs = [p for p in sorted((folder / "plots").glob("*.png")) if not is_point_figure(p)]
    if not pngs:
        return ("<p>No figures (the run was written with --no-plots? <code>kvfrag plot</code> "
                "draws them).</p>")
    parts = []
    for png in pngs:
        name = html.escape(png.stem)
        if png.stem in linked:
            parts.append(
                f"<figure><p class='note'>The address map figure is not in this page (the "
                f"maps above show its slabs): <a href='plots/{html.escape(png.name)}'>"
                f"plots/{html.escape(png.name)}</a>, in the results folder.</p></figure>"
            )
            continue
        data = base64.b64encode(light_png(png.read_bytes())).decode("ascii")
        parts.append(
            f"<figure><img alt='{name}' src='data:image/png;base64,{data}'>"
            f"<figcaption>plots/{html.escape(png.name)}</figcaption></figure>"
        )
    return "".join(parts)


def light_png(data: bytes) -> bytes:
    """A figure's PNG in at most 256 colours, for the page: a chart's flat colours and their
    anti-aliased edges look the same in 256, in about 40 % of the bytes (the full PNG stays
    in plots/). The PNG itself when that is not smaller or cannot be read."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            small = img.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT)
            out = io.BytesIO()
            small.save(out, "PNG", optimize=True)
    except (OSError, ValueError):
        return data
    return out.getvalue() if out.tell() < len(data) else data


class Map(NamedTuple):
    """An interactive map: its heading, its plotly figure with every trace's style but not
    its points, and the slabs the page draws it from (`compact`)."""

    title: str
    figure: Any
    slabs: dict[str, Any]


def address_maps(
    requests: pd.DataFrame,
    summary: pd.DataFrame,
    timeseries: pd.DataFrame | None = None,
    max_slabs: int | None = None,
) -> tuple[list[Map], list[str]]:
    """The interactive maps, one per slab allocator and sweep point, and notes on what is not
    shown (panels left out, panels that cannot be drawn)."""
    import pandas as pd

    from kvfrag.address_map_plots import _row, _slab_labels
    from kvfrag.figure_kit import MAX_PANELS, MAX_SLABS, _panel_keep, _with_keys
    from kvfrag.sweep_plots import point_names

    requests = _with_keys(requests)
    summary = _with_keys(summary)
    if "offset_bytes" not in requests.columns:
        return [], ["No allocator of this run places slabs (paged only): no address map."]
    points = sorted(int(p) for p in pd.unique(requests["point"]))
    labels = _slab_labels(requests, summary)
    if not labels:
        return [], ["No allocator of this run places slabs (paged only): no address map."]
    every = labels
    labels, keep = _panel_keep(every, points)
    if max_slabs is None:  # the page's slabs shared out between its maps
        max_slabs = min(MAX_SLABS, max(REPORT_SLABS // (len(labels) * len(keep)), MIN_SLABS))
    notes = []
    if len(labels) < len(every):
        notes.append(f"Maps of the first {len(labels)} of {len(every):,} slab allocators only "
                     "(in the scenario's order).")
    if len(keep) < len(points):
        notes.append(f"Maps of sweep points {keep[0]}..{keep[-1]} only ({len(points)} points; "
                     f"at most {MAX_PANELS} maps): `kvfrag plot --point N` draws another.")
    swept = summary["point"].nunique() > 1
    names = point_names(summary) if swept else {}
    sums = summary.assign(label=summary["label"].astype(str)).drop_duplicates(["label", "point"])
    sums = sums.set_index(["label", "point"])
    maps = []
    for label in labels:
        for pt in keep:
            title = f"{label} · {names[pt]}" if swept and pt in names else label
            req = requests[(requests["point"] == pt) & (requests["label"].astype(str) == label)]
            fig, data, why = _map(req, _row(sums, label, pt), summary, timeseries, label,
                                  pt, max_slabs, title)
            if fig is None:
                notes.append(f"{title}: {why}")
            else:
                maps.append(Map(title, fig, data))
    return maps, notes


def _map(
    req: pd.DataFrame,
    row: pd.Series | None,
    summary: pd.DataFrame,
    timeseries: pd.DataFrame | None,
    label: str,
    point: int,
    max_slabs: int,
    title: str,
) -> tuple[Any, dict[str, Any], str]:
    import numpy as np
    import pandas as pd
    import plotly.graph_objects as go

    from kvfrag.address_map_plots import (
        SLAB_OFFSETS,
        _row_value,
        _slabs,
        moves_known,
        slab_pieces,
        slab_polygons,
    )
    from kvfrag.figure_kit import PALETTE, _with_keys, byte_unit
    from kvfrag.sim.allocators.torch_blocks import ADDRESS_BASE

    bpt = _row_value(row, "bytes_per_token", summary, "bytes_per_token") or 0.0
    kind = str(row["kind"]) if row is not None and "kind" in row.index else ""
    compactions = row.get("compactions") if row is not None else None
    if (compactions is not None and pd.notna(compactions) and compactions > 0
            and not moves_known(req)):  # (results from before moves were recorded)
        return None, {}, (f"not drawn: {int(compactions):,} compactions moved slabs, and "
                      "requests.parquet keeps only the offset each slab had when it was freed.")
    placed = req[req["admitted_s"].notna() & req["offset_bytes"].notna()]
    if not len(placed):
        return None, {}, "nothing to draw: no request was admitted."
    cap = (_row_value(row, "kv_budget_bytes", summary, "kv_budget_bytes")
           or _row_value(row, "capacity_bytes", summary, "capacity_bytes") or 0.0)
    unit, scale = byte_unit(cap or float(placed["peak_bytes"].max() or 1))
    end_s = None
    if timeseries is not None and len(timeseries):
        tsl = _with_keys(timeseries)
        tsl = tsl[(tsl["point"] == point) & (tsl["label"].astype(str) == label)]
        if len(tsl):
            end_s = float((tsl["t_s"] + tsl["dt_s"]).max())
    placed = placed.sort_values("admitted_s", kind="stable")
    notes = []
    total = len(placed)
    keep = _rectangles_keep(placed, max_slabs)
    if keep < total:
        right = float(placed["admitted_s"].iloc[keep])
        placed = placed.iloc[:keep]
        notes.append(f"first {keep:,} of {total:,} slabs by admission time "
                     f"(up to t = {right:.0f} s)")
    slabs, most = _slabs(placed)
    if most > 1 and SLAB_OFFSETS not in placed.columns:
        notes.append(f"only each request's 1st of {most} slabs")
    base = 0.0
    if kind == "torch-caching":
        base = float(ADDRESS_BASE)
        notes.append("virtual addresses from the first segment")
    slabs = slab_pieces(slabs)  # (compaction: a piece per place a slab was held at)
    slabs = slabs[slabs["admitted_s"].notna() & slabs["offset_bytes"].notna()]
    polys = slab_polygons(slabs, bpt, end_s, scale=scale, base=base)
    fig = go.Figure()
    for part, name, alpha in (
        ("token_states", "token states (stored)", 1.0),
        ("reserved", "reserved (not yet written)", 0.55),
        ("internal", "internal fragmentation", 0.55),
    ):
        fig.add_trace(go.Scatter(
            mode="lines", fill="toself", name=name, hoverinfo="skip",
            line={"width": 0}, fillcolor=_rgba(PALETTE[part], alpha),
        ))
    fig.add_trace(go.Scatter(
        mode="lines", name="slab outline", hoverinfo="skip", showlegend=False,
        line={"width": 0.5 if len(slabs) < 300 else 0.25, "color": "rgba(85,85,85,0.8)"},
    ))
    out = polys["outline"]
    t1 = out[:, 1, 0]
    mib = 2.0**20
    peak = slabs["peak_bytes"].to_numpy(float)
    final = slabs["final_tokens"].to_numpy(float)
    stored = np.minimum(final * bpt, peak)
    prompt = slabs["prompt_tokens"].to_numpy(float)
    reserved = stored - np.minimum((prompt + 1) * bpt, stored)  # written as it generates
    hover = [
        (slabs["request_id"].to_numpy(float), 0),
        (final, 0),
        (prompt, 0),
        (peak / mib, 2),
        (stored / mib, 2),
        (reserved / mib, 2),
        ((peak - stored) / mib, 2),
        (slabs["admitted_s"].to_numpy(float), 3),
        (t1, 3),
        ((slabs["offset_bytes"].to_numpy(float) - base) / mib, 1),
    ]
    lab = html.escape(label).replace("%", "%%")
    # Hover: points along each slab's middle, each carrying its slab's facts (made on the page
    # from `hover`: see _JS).
    fig.add_trace(go.Scatter(
        mode="markers", name="slabs", showlegend=False,
        marker={"size": 6, "opacity": 0, "color": "#000"},
        hovertemplate=(
            f"<b>request %{{customdata[0]:d}}</b> ({lab})<br>"
            "tokens: %{customdata[1]:,d} (prompt %{customdata[2]:,d})<br>"
            "slab: %{customdata[3]:,.2f} MiB at %{customdata[9]:,.1f} MiB<br>"
            "stored at the end: %{customdata[4]:,.2f} MiB<br>"
            "reserved at admission (not yet written): %{customdata[5]:,.2f} MiB<br>"
            "internal: %{customdata[6]:,.2f} MiB<br>"
            "admitted %{customdata[7]:,.2f} s, held here until %{customdata[8]:,.2f} s"
            "<extra></extra>"
        ),
    ))
    ytitle = f"{'virtual ' if base else ''}address ({unit})"
    top = float(np.nanmax(out[..., 1])) if len(out) else 0.0
    heading = title + (" — " + "; ".join(notes) if notes else "")
    fig.update_layout(
        title={"text": html.escape(heading), "font": {"size": 14}},
        xaxis={"title": {"text": "time (s)"}, "rangemode": "tozero"},
        yaxis={"title": {"text": ytitle}, "range": [0, max(cap / scale if cap else 0, top)]},
        hovermode="closest", hoverdistance=30, plot_bgcolor="white", height=520,
        margin={"l": 70, "r": 20, "t": 50, "b": 50},
        legend={"orientation": "h", "y": -0.15},
    )
    fig.update_xaxes(showline=True, linecolor="#555", mirror=True, gridcolor="#eee")
    fig.update_yaxes(showline=True, linecolor="#555", mirror=True, gridcolor="#eee")
    return fig, compact(polys, hover), ""


#: Each part's polygon corners as (x, y) indices into `compact`'s columns: X = admitted,
#: first token, finished, released; Y = offset, stored height at those four times, the end
#: of what was stored, the slab's top (`kvfrag.address_map_plots.slab_polygons`' corners, in
#: its order). The page rebuilds the polygons from this table and the columns (_JS); the
#: outline is closed (a line, not a fill).
CORNERS: dict[str, tuple[tuple[int, int], ...]] = {
    "token_states": ((0, 0), (0, 1), (1, 2), (2, 3), (3, 4), (3, 0)),
    "reserved": ((0, 1), (1, 2), (2, 3), (3, 4), (3, 5), (0, 5)),
    "internal": ((0, 5), (3, 5), (3, 6), (0, 6)),
    "outline": ((0, 0), (3, 0), (3, 6), (0, 6), (0, 0)),
}
#: Steps each axis is cut into on the page: 1/_GRID of the map's span is far below a pixel
#: at any zoom one uses, and whole numbers that small keep the page light.
_GRID = 100_000


def compact(polys: dict[str, Any], hover: list[tuple[Any, int]]) -> dict[str, Any]:
    """A map's slabs as the page holds them: 4 time and 7 address columns (`CORNERS`),
    whole numbers in steps of `sx`, `sy`, and the hover facts rounded to their decimals: about
    a tenth of the polygons' own size (the page is measured in megabytes)."""
    import numpy as np

    n = len(polys["outline"])
    cols: dict[str, list] = {}
    for axis, width in ((0, 4), (1, 7)):
        col = np.full((width, n), np.nan)
        for part, corners in CORNERS.items():
            for c, (xi, yi) in enumerate(corners[: polys[part].shape[1]]):  # (unclosed)
                col[(xi, yi)[axis]] = polys[part][:, c, axis] if n else []
        top = float(np.nanmax(np.abs(col))) if n and np.isfinite(col).any() else 1.0
        step = (top or 1.0) / _GRID
        cols["sx" if axis == 0 else "sy"] = step
        cols["X" if axis == 0 else "Y"] = [
            [None if v != v else int(v) for v in np.round(row / step).tolist()] for row in col
        ]
    cols["H"] = [[None if v != v else (int(v) if d == 0 else v)
                  for v in np.round(np.asarray(a, float), d).tolist()] for a, d in hover]
    cols["steps"] = _HOVER_STEPS
    return cols


def corners(data: dict[str, Any]) -> dict[str, Any]:
    """`compact`'s columns back into (slabs, corners, 2) polygons, as the page rebuilds them
    (a test holds the two to `kvfrag.address_map_plots.slab_polygons`)."""
    import numpy as np

    x = np.array(data["X"], float) * data["sx"]
    y = np.array(data["Y"], float) * data["sy"]
    return {part: np.stack([np.stack([x[i], y[j]], axis=-1) for i, j in cs], axis=1)
            for part, cs in CORNERS.items()}


def _packed(text: str) -> str:
    """`text` gzipped, in base64: what the page unpacks (`_JS`)."""
    import gzip

    return base64.b64encode(gzip.compress(text.encode("utf-8"), 9, mtime=0)).decode("ascii")


def maps_script(maps: list[Map]) -> str:
    """The maps' data and plotly.js, each gzipped (plotly.js is 4.8 MB as it is, 1.5 MB
    packed), and the script that unpacks them and draws each map when it scrolls into view:
    the page opens at once however many maps it holds, and needs no network. Maps with the
    same slabs (an allocator a sweep does not touch) share their data."""
    import json

    from plotly.offline import get_plotlyjs

    slabs: dict[str, int] = {}
    shown = []
    for m in maps:
        key = json.dumps(m.slabs, separators=(",", ":"))
        slabs.setdefault(key, len(slabs))
        shown.append({"fig": json.loads(m.figure.to_json()), "slabs": slabs[key]})
    data = {"corners": CORNERS, "maps": shown, "slabs": [json.loads(k) for k in slabs],
            "config": {"displaylogo": False, "scrollZoom": True, "responsive": True}}
    return (
        f"<script type='application/gzip' id='kvfrag-plotly'>{_packed(get_plotlyjs())}</script>"
        "<script type='application/gzip' id='kvfrag-maps'>"
        f"{_packed(json.dumps(data, separators=(',', ':')))}</script><script>{_JS}</script>"
    )


#: Unpacks plotly.js and the maps once the page is idle or a map comes near the window
#: (DecompressionStream: Chrome 80, Firefox 113, Safari 16.4 and later), rebuilds each map's
#: traces from its columns (`CORNERS`, `compact`: the polygons with a gap between slabs, and
#: hover points along each slab's middle, one every 1/steps of the map's time span) and draws
#: a map when it comes near the window, one at a time.
_JS = """
(async () => {
  const unpack = async (id) => {
    const text = atob(document.getElementById(id).textContent);
    const bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'));
    return new Response(stream).text();
  };
  const divs = [...document.querySelectorAll('div.map')];
  let page = null, loading = null;
  // plotly.js is unpacked and run (about a second) after the page has opened: not before.
  const load = () => loading || (loading = (async () => {
    const [lib, maps] = await Promise.all([unpack('kvfrag-plotly'), unpack('kvfrag-maps')]);
    const script = document.createElement('script');
    script.textContent = lib;
    document.head.appendChild(script);
    page = JSON.parse(maps);
  })().catch((err) => {
    for (const div of divs) div.textContent = 'The interactive map needs a browser that '
      + 'unpacks gzip (DecompressionStream: Chrome 80, Firefox 113, Safari 16.4 or later): '
      + err;
    throw err;
  }));
  const traces = (m) => {
    const d = page.slabs[m.slabs], data = m.fig.data, n = d.X[0].length;
    const at = (col, step, i, s) => col[i][s] === null ? null : col[i][s] * step;
    ['token_states', 'reserved', 'internal', 'outline'].forEach((part, t) => {
      const x = [], y = [];
      for (let s = 0; s < n; s++) {
        for (const [i, j] of page.corners[part]) {
          x.push(at(d.X, d.sx, i, s)); y.push(at(d.Y, d.sy, j, s));
        }
        x.push(null); y.push(null);
      }
      data[t].x = x; data[t].y = y;
    });
    let lo = Infinity, hi = -Infinity;
    for (let s = 0; s < n; s++) {
      lo = Math.min(lo, at(d.X, d.sx, 0, s)); hi = Math.max(hi, at(d.X, d.sx, 3, s));
    }
    const step = ((hi - lo) || 1) / d.steps, hx = [], hy = [], custom = [];
    for (let s = 0; s < n; s++) {
      const t0 = at(d.X, d.sx, 0, s), t1 = at(d.X, d.sx, 3, s);
      const mid = (at(d.Y, d.sy, 0, s) + at(d.Y, d.sy, 6, s)) / 2;
      const count = Math.max(Math.ceil((t1 - t0) / step), 1);
      const facts = d.H.map((col) => col[s]);
      for (let k = 0; k < count; k++) {
        hx.push(t0 + (t1 - t0) * (k + 0.5) / count); hy.push(mid); custom.push(facts);
      }
    }
    data[4].x = hx; data[4].y = hy; data[4].customdata = custom;
    return data;
  };
  let queue = Promise.resolve();  // one map at a time: the one in view is not held up
  const draw = (div) => {
    queue = queue.then(load).then(() => {
      const m = page.maps[Number(div.id.slice(4))];
      return Plotly.newPlot(div, traces(m), m.fig.layout, page.config);
    }).then(() => { div.dataset.drawn = 'yes'; }, () => {});
  };
  const seen = new IntersectionObserver((entries) => {
    for (const e of entries) if (e.isIntersecting) { seen.unobserve(e.target); draw(e.target); }
  }, {rootMargin: '200px'});
  for (const div of divs) seen.observe(div);
  // and unpacked anyway once the page is idle, so that a map is ready when scrolled to
  const idle = window.requestIdleCallback || ((f) => setTimeout(f, 500));
  idle(() => load().catch(() => {}), {timeout: 3000});
})();
"""


def _rectangles_keep(placed: pd.DataFrame, most: int) -> int:
    """How many of `placed`'s requests (in admission order) a map draws so that it holds at
    most `most` rectangles: a slab is one, one per place it was held at where compaction
    moved it (`kvfrag.address_map_plots.slab_pieces`)."""
    import numpy as np

    from kvfrag.address_map_plots import MOVE_T

    if MOVE_T not in placed.columns:
        return min(len(placed), most)

    def places(times: Any) -> int:
        return max(len(times), 1) if isinstance(times, list | tuple | np.ndarray) else 1

    rects = np.cumsum([places(t) for t in placed[MOVE_T]])
    return int(np.searchsorted(rects, most, side="right"))


def _rgba(color: str, alpha: float) -> str:
    c = color.lstrip("#")
    r, g, b = (int(c[i : i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.5em auto;
max-width:1400px;padding:0 1em;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:.85em}
td,th{border:1px solid #ddd;padding:.25em .5em}th{background:#f4f4f4}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.wide{overflow-x:auto}pre{background:#f7f7f7;padding:.8em;overflow-x:auto;font-size:.85em}
figure{margin:1em 0}img{max-width:100%;border:1px solid #eee}
figcaption{font-size:.8em;color:#666}.note{color:#555;font-size:.9em}
.map{min-height:520px}
.left-out{background:#fff6dc;border-left:4px solid #e0a800;padding:.2em .8em}
div.left-out p{margin:.4em 0}
"""


def missing_files(
    folder: Path,
    summary: pd.DataFrame,
    timeseries: pd.DataFrame | None,
    requests: pd.DataFrame | None,
) -> list[tuple[str, str]]:
    """(file, what the page lacks for it) for each file the page is built from that is not
    there: a Parquet file (None) or one without rows, with the figures and the map drawn from
    it; and the figures plots/ should hold for the files that are there. The file is relative
    to `folder`."""
    from kvfrag.address_map_plots import _slab_labels
    from kvfrag.plots import FIGURES, drawn_from, figures_text

    there = {f for f in FIGURES if (folder / "plots" / f"{f}.png").is_file()}
    expected = {"breakdown", "capacity"}
    out: list[tuple[str, str]] = []
    for name, frame in (("timeseries.parquet", timeseries), ("requests.parquet", requests)):
        figures = drawn_from(name, summary)
        if frame is not None and len(frame):
            slabs = "offset_bytes" in frame.columns and _slab_labels(frame, summary)
            expected |= {f for f in figures if f != "address_map" or slabs}
            continue
        lacks = []
        if name == "requests.parquet" and "address_map" in figures:
            lacks.append("the interactive address map")
        gone = [f for f in figures if f not in there]
        if gone:
            lacks.append(figures_text(gone))
        kept = [f for f in figures if f in there]
        what = "is missing" if frame is None else "has no rows"
        if lacks:
            what += ": " + " and ".join(lacks) + (" are" if len(lacks) > 1 else " is")
            what += " left out" + (f" ({figures_text(kept)} below: as drawn earlier)"
                                   if kept else "")
        else:
            what += f": {figures_text(kept)} below is as drawn earlier"
        out.append((name, what))
    absent = [f for f in FIGURES if f in expected and f not in there]
    draw = "kvfrag plot draws"  # (no path: the page may be written in a staging folder)
    if not there:
        out.append(("plots/", f"holds no figures (written with --no-plots? {draw} them)"))
    elif len(absent) == 1:
        out.append((f"plots/{absent[0]}.png",
                    f"is missing: {figures_text(absent)} is left out ({draw} it)"))
    elif absent:
        out.append(("plots/", f"lacks {', '.join(f'{f}.png' for f in absent)}: "
                    f"{figures_text(absent)} are left out ({draw} them)"))
    return out


def _quiet(_: str) -> None:
    """`render`'s default `say`: nothing (`kvfrag run` has told what its figures leave out)."""


def render(folder: Path | str, say: Callable[[str], None] | None = None) -> str:
    """The page's HTML for a results folder; what it lacks for a missing file is also told to
    `say`, a line each (`kvfrag report`: on stderr)."""
    import pandas as pd

    from kvfrag.captions import caption_parts
    from kvfrag.figure_kit import MAX_PANELS, MAX_SLABS
    from kvfrag.plots import left_out, load_meta
    from kvfrag.results import check_schema, folder_schema, timeseries_names, upgrade_timeseries
    from kvfrag.results_io import read_summary

    folder = Path(folder)
    version = folder_schema(folder)[0]
    check_schema(version, folder, "report on")
    summary = read_summary(folder / "summary.csv", version)
    scenario_path = folder / "scenario.resolved.yaml"
    scenario_text = scenario_path.read_text(encoding="utf-8") if scenario_path.exists() else ""
    meta = load_meta(folder)
    name = str(meta.get("scenario") or folder.name)  # (written in staging: not its folder)
    requests = timeseries = None
    if (folder / "requests.parquet").exists():
        requests = pd.read_parquet(folder / "requests.parquet")
    if (folder / "timeseries.parquet").exists():
        columns = timeseries_names(["label", "point", "t_s", "dt_s"], version)
        timeseries = upgrade_timeseries(
            pd.read_parquet(folder / "timeseries.parquet", columns=columns), version
        )
    missing = missing_files(folder, summary, timeseries, requests)
    for rel, what in missing:
        (say or _quiet)(f"{folder / rel}{'/' if rel.endswith('/') else ''} {what}")
    maps: list = []
    notes: list[str] = []
    if requests is not None and len(requests):
        maps, notes = address_maps(requests, summary, timeseries)
    else:
        notes = [f"requests.parquet {'is missing' if requests is None else 'has no rows'}: "
                 "no address map."]
    map_html = [f'<h3>{html.escape(m.title)}</h3><div class="map" id="map-{i}"></div>'
                for i, m in enumerate(maps)]
    if maps:
        map_html.append(maps_script(maps))
    caption = " · ".join(caption_parts(meta, summary))
    intro = ("<p class='note'>One rectangle per slab, from admission to release, at its "
             "address: stored tokens green, reserved (not yet written) orange, internal "
             "fragmentation red, holes white. Drag to zoom (double-click resets), scroll to "
             f"zoom, hover a slab for its request. At most {MAX_PANELS} maps, with "
             f"{REPORT_SLABS:,} slabs in all shared between them (up to {MAX_SLABS:,} "
             "each, the first by admission: a map's title says when it holds fewer than its "
             "run placed; plots/address_map.png in the results folder draws up to "
             f"{MAX_SLABS:,} each). A map is drawn when it scrolls into view.</p>"
             ) if maps else ""
    note_html = "".join(f"<p class='note'>{html.escape(n)}</p>" for n in notes)
    missing_html = "".join(
        f"<p><b>Left out:</b> <code>{html.escape(rel)}</code> {html.escape(what)}</p>"
        for rel, what in missing
    )
    if missing_html:
        missing_html = f"<div class='left-out'>{missing_html}</div>"
    figure_notes = "".join(
        f"<p class='note left-out'>{html.escape(n[:1].upper() + n[1:])}.</p>"
        for n in left_out(summary, requests if requests is not None and len(requests) else None)
    )
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>kvfrag report: {html.escape(name)}</title><style>{_CSS}</style></head><body>"
        f"<h1>kvfrag report: {html.escape(name)}</h1>"
        f"<p>{html.escape(caption)}</p>{missing_html}"
        f"<h2>Summary</h2>{summary_html(summary)}"
        f"<h2>Address map</h2>{intro}{note_html}{''.join(map_html)}"
        f"<h2>Figures</h2>{figure_notes}{figures_html(folder, {'address_map'} if maps else ())}"
        f"<h2>Scenario</h2><p class='note'>scenario.resolved.yaml</p>"
        f"<pre>{html.escape(scenario_text)}</pre>"
        "</body></html>\n"
    )


def write_report(folder: Path | str, say: Callable[[str], None] | None = None) -> Path:
    """Write `folder/report.html` atomically (through a temporary folder beside it that
    `kvfrag.outdir` marks as its own: a killed writer's is not taken for the user's); what the
    page lacks for a missing file is told to `say` too (see `render`)."""
    from kvfrag.outdir import write_text_atomic

    folder = Path(folder)
    page = render(folder, say)
    path = folder / REPORT
    write_text_atomic(path, page)
    return path
