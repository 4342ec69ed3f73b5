"""The caption line under every figure: the scenario, model, KV budget, max_model_len and
workload the figure shows (`caption_parts`, `caption`), wrapped to the figure's width, and
`_new_figure`, the empty figure every figure is drawn on, which keeps room for it.

The facts come from `meta` (what the caller knows: `kvfrag.plots.load_meta` reads the folder's
scenario.resolved.yaml) and from the summary; a value a sweep changed is shown as the range it
took (`KV budget: swept (4–8 GiB)`), never as one figure for all points.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd
from matplotlib.figure import Figure

from kvfrag.figure_kit import _DPI, _first, format_bytes
from kvfrag.sweep_plots import _SETTING_COLUMNS, key_span, sweep_columns

_LINE_IN = 0.17  # inches per caption line kept at the bottom of every figure


def caption_parts(meta: Mapping | None = None, summary: pd.DataFrame | None = None) -> list[str]:
    """The facts of the caption line: scenario, model, KV budget, max_model_len, workload.
    `meta` (what the caller knows) wins over the summary, except for values a sweep changed."""
    meta = dict(meta or {})
    parts = []
    scenario = meta.get("scenario") or meta.get("name") or _first(summary, "scenario")
    if scenario:
        parts.append(f"scenario: {scenario}")
    models = [] if summary is None or "model" not in summary.columns else [
        str(m) for m in pd.unique(summary["model"].dropna())]
    model = meta.get("model") or _first(summary, "model")
    if isinstance(model, Mapping):
        model = model.get("name")
    if len(models) > 1:  # (a sweep over the model)
        parts.append(f"model: swept ({', '.join(models)})")
    elif model:
        parts.append(f"model: {model}")
    # The budget the runs used (summary.csv) rather than how the scenario gave it: a number,
    # a size string or a GPU's terms (a mapping) all read `12 GiB`, as the axes do.
    budget = meta.get("kv_budget")
    derived = isinstance(budget, Mapping)
    col = "kv_budget_bytes" if _first(summary, "kv_budget_bytes") is not None else "capacity_bytes"
    keys = _swept_keys(summary)
    swept = "kv_budget" in keys or col in keys
    spread_ = _range(summary, col, format_bytes)
    if spread_:
        # A budget swept itself, or one derived per point (a sweep over max_num_seqs changes
        # the activation reserve, so the budget left for KV): never one figure for all.
        budget = f"swept ({spread_})" if swept else f"{spread_} per point"
    elif _first(summary, col) is not None:
        budget = format_bytes(float(_first(summary, col)))
    elif isinstance(budget, int | float) and not isinstance(budget, bool):
        budget = format_bytes(float(budget))
    elif derived:
        budget = _describe(budget)
    if budget is not None:
        parts.append(f"KV budget: {budget}" + (" (derived)" if derived and not swept else ""))
    mml_range = _range(summary, "max_model_len", lambda v: f"{v:.0f}")
    if mml_range:
        mml = f"swept ({mml_range})" if "max_model_len" in keys else f"{mml_range} per point"
    else:
        mml = meta.get("max_model_len") or _first(summary, "max_model_len")
    if mml is not None:
        parts.append(f"max_model_len: {mml if isinstance(mml, str) else int(mml)}")
    bpt_range = _range(summary, "bytes_per_token", format_bytes)
    bpt = _first(summary, "bytes_per_token")
    if bpt_range:
        parts.append(f"{bpt_range} per token per point")
    elif bpt is not None:
        parts.append(f"{format_bytes(float(bpt))} per token")
    workload = meta.get("workload")
    if workload:
        parts.append(f"workload: {_describe(workload)}")
    return parts


def _range(summary: pd.DataFrame | None, col: str, fmt) -> str | None:
    """`lo–hi` (`54.7–55.7 GiB`: the unit once) when `col` differs between the summary's
    rows, else None."""
    if summary is None or col not in summary.columns:
        return None
    vals = pd.to_numeric(summary[col], errors="coerce").dropna()
    if vals.nunique() <= 1:
        return None
    lo, hi = fmt(float(vals.min())), fmt(float(vals.max()))
    unit = lo.rpartition(" ")[2]
    if " " in lo and hi.endswith(" " + unit):
        lo = lo.rpartition(" ")[0]
    return f"{lo}–{hi}"


def _swept_keys(summary: pd.DataFrame | None) -> list[str]:
    """The sweep's own keys (`kv_budget`, `engine.max_num_seqs`), without the run settings
    that changed only because of them (a derived `kv_budget_bytes`)."""
    if summary is None or "point" not in summary.columns:
        return []
    return [c for c in sweep_columns(summary) if c not in _SETTING_COLUMNS
            or c not in _fallback_settings(summary)]


def _fallback_settings(summary: pd.DataFrame) -> set[str]:
    """The setting columns `sweep_columns` names only for want of sweep-key columns."""
    between = key_span(list(summary.columns))
    return set(_SETTING_COLUMNS) - set(between or ())


def caption(meta: Mapping | None = None, summary: pd.DataFrame | None = None) -> str:
    """The caption line: scenario, model, KV budget, max_model_len, workload."""
    return _SEP.join(caption_parts(meta, summary))


_SEP = "  ·  "


def _wrap(parts: list[str], width_in: float, fontsize: float) -> list[str]:
    """Join caption parts into lines that fit `width_in` inches (breaking between parts)."""
    limit = max(int(width_in * 72 / (fontsize * 0.56)), 20)
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + len(_SEP) + len(part) <= limit:
            lines[-1] += _SEP + part
        else:
            lines.append(part if len(part) <= limit else part[: limit - 1] + "…")
    return lines


def _describe(value, limit: int = 100) -> str:
    """A short one-line description of a scalar or a mapping (the resolved workload spec):
    `trace PATH` or the synthetic settings, then the other settings that are set, by their
    last key (None, False and "auto" left out)."""
    if not isinstance(value, Mapping):
        text = str(value)
    else:
        value = dict(value)
        head = []
        trace = value.pop("trace", None)
        if isinstance(trace, Mapping) and trace.get("path"):
            head.append(f"trace {trace['path']}")
            trace = {k: v for k, v in trace.items() if k != "path"}
        synthetic = value.pop("synthetic", None)
        if synthetic:
            head.append("synthetic")
        items = []
        for part in (synthetic, trace, value):
            items += _leaves(part)
        text = ", ".join(head + items)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _leaves(v, key: str = "") -> list[str]:
    if isinstance(v, Mapping):
        if key and set(v) <= {"kind", "value"} and "value" in v:  # {kind: fixed, value: 256}
            return [f"{key}={v['value']}"]
        out = []
        for k, sub in v.items():
            out += _leaves(sub, str(k))
        return out
    if v is None or v is False or v == "auto" or v == [] or not key:
        return []
    return [f"{key}={v}"]


def _new_figure(width: float, height: float, meta, summary) -> Figure:
    """A figure with constrained layout that keeps room for the caption line at the bottom."""
    lines = _wrap(caption_parts(meta, summary), width, 8)
    height += _LINE_IN * len(lines)
    fig = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    if lines:
        fig.text(
            0.5,
            0.06 / height,
            "\n".join(lines),
            ha="center",
            va="bottom",
            fontsize=8,
            color="#444444",
            linespacing=1.4,
        )
        bottom = (0.1 + _LINE_IN * len(lines)) / height
        fig.get_layout_engine().set(rect=(0, bottom, 1, 1 - bottom))
    return fig
