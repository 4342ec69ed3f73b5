"""`kvfrag compare`'s terminal output: the folders, what differs in their scenarios, the
metrics table, and what was not matched (`format_comparison`, from `kvfrag.comparison`'s
document).

Layout of the terminal table: one block of columns per matched row (metric, then A, B, Δ;
with more folders, each one's value and its Δ), the blocks side by side, as many as fit the
terminal's width (at most 160 columns; `COLUMNS` sets it when the output is not a terminal),
the rest below. The metrics run down the page, so a metric reads across the blocks in one line
(every allocator's token states on one row) and a block down its column (everything about
one allocator). The alternative, a wide table with one row per run and `A -> B (Δ)` cells,
needs 20 to 25 characters a cell: its 18 metrics make 400 columns, which no terminal shows,
and cutting it into slices scatters a run across them. The blocks keep 4 allocators of a
scenario within 150 columns, and one allocator within 60.
"""

from __future__ import annotations

from typing import Any

from kvfrag.comparison import METRICS, _scalar_text

#: The table's sections (a blank line after each of these metrics): memory, requests, speed.
_SECTION_ENDS = {"kv_utilization", "frag_refusals", "mean_tpot_s"}

#: The widest the terminal table gets, and the most characters a scenario value shows.
MAX_WIDTH = 160
_VALUE_CHARS = 48


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    v = float(value)
    if fmt == "pct":
        return f"{100 * v:.1f}%".replace("-0.0%", "0.0%")
    if fmt == "int":
        return f"{round(v):,}"
    if fmt == "ms":
        return f"{1e3 * v:,.1f}"
    if fmt == "s":
        return _seconds(v)
    if fmt == "g":
        return f"{v:.4g}"
    return fmt.format(v)


def _seconds(v: float) -> str:
    """About three significant digits: 0.0523, 2.27, 26.5, 4,410."""
    size = abs(v)
    if size >= 100:
        return f"{v:,.0f}"
    if size >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}" if size >= 1 else f"{v:.3g}"


def _delta_text(a: Any, b: Any, fmt: str, diff: str) -> str:
    """Δ for the table: `+6.5pp` for fractions, `+12.3%` for the rest (absolute, `+48`,
    when the baseline is 0); `=` when the values are the same, `-` when one is missing."""
    if a is None or b is None:
        return "-"
    a, b = float(a), float(b)
    if a == b:
        return "="
    if diff == "pp":
        return _signed(100 * (b - a), "pp")
    if a == 0:
        text = _cell(b - a, fmt).lstrip("-")
        return ("+" if b > a else "-") + text.rstrip("%")
    return _signed(100 * (b - a) / abs(a), "%")


def _signed(value: float, unit: str) -> str:
    """+6.5pp; two decimals where one would read 0; `~0` below that."""
    for text in (f"{value:+,.0f}" if abs(value) >= 1000 else f"{value:+.1f}", f"{value:+.2f}"):
        if text.lstrip("+-").strip("0.,"):
            return text + unit
    return f"~0{unit}"


def format_comparison(doc: dict[str, Any], width: int = MAX_WIDTH) -> str:
    """The comparison for the terminal: the folders, what differs in their scenarios, the
    metrics table (blocks side by side within `width` columns), and what was not matched."""
    lines = _folder_lines(doc, width)
    lines += ["", *_scenario_lines(doc, width)]
    matched = [r for r in doc["rows"] if r["diff"]]
    lines.append("")
    if matched:
        lines += _metric_lines(doc, matched, width)
    else:
        lines.append(f"No row of {doc['baseline']} matches a row of another folder (rows "
                     f"match by {', '.join(doc['match_on'])}).")
    for group in doc["only_in"]:
        where = ", ".join(group["in"])
        text = f"only in {where}: " + ", ".join(group["rows"])
        lines.append(_fill(text, width, indent=4))
    for note in doc["notes"]:
        lines.append(_fill(f"note: {note}", width, indent=6))
    return "\n".join(lines).rstrip("\n")


def _fill(text: str, width: int, indent: int) -> str:
    import textwrap

    return textwrap.fill(text, width, subsequent_indent=" " * indent, break_on_hyphens=False)


def _folder_lines(doc: dict[str, Any], width: int) -> list[str]:
    folders = doc["folders"]
    wide = max(len(f["path"]) for f in folders)
    lines = []
    for f in folders:
        about = f"{f['scenario'] or 'unnamed scenario'}, {f['runs']} run(s)"
        lines.append(f"{f['name']}  {f['path'].ljust(wide)}  {about}")
    base = doc["baseline"]
    others = [f["name"] for f in folders if f["name"] != base]
    against = (f"{others[0]} - {base}" if len(others) == 1
               else f"each folder - {base} (the baseline)")
    lines.append(_fill(f"Δ: {against}; shares of the budget and other fractions in percentage "
                       "points (pp), counts and times relative (%)", width, indent=3))
    return lines


def _scenario_lines(doc: dict[str, Any], width: int) -> list[str]:
    names = [f["name"] for f in doc["folders"]]
    diff = doc["scenario_diff"]
    if not diff:
        if any("not compared" in n for n in doc["notes"]):
            return ["Scenarios: not compared (see the notes below)."]
        return ["Scenarios: the same (scenario.resolved.yaml, apart from kvfrag_version)."]

    def show(entry: dict[str, Any], name: str) -> str:
        if name in entry["absent"]:
            return "(absent)"
        if name not in entry["values"]:
            return "(not read)"
        return _setting_text(entry["key"], entry["values"][name])

    table = [["key", *names]] + [[e["key"], *(show(e, n) for n in names)] for e in diff]
    lines = ["What differs in the scenarios (scenario.resolved.yaml):"]
    lines += ["  " + line for line in _align(table, right=False)]
    return [line[:width] for line in lines]


def _setting_text(key: str, value: Any, limit: int = _VALUE_CHARS) -> str:
    """A scenario value, short: sizes in binary units (`24.0 GiB`), mappings as JSON."""
    from kvfrag.sim.units import format_size

    last = key.split(".")[-1]
    if (last == "kv_budget" or last.endswith("_bytes")) and isinstance(value, int) \
            and not isinstance(value, bool):
        return format_size(value)
    text = _scalar_text(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _align(table: list[list[str]], right: bool = True) -> list[str]:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    out = []
    for row in table:
        cells = [c.ljust(w) if i == 0 or not right else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
    return out


def _metric_lines(doc: dict[str, Any], rows: list[dict[str, Any]], width: int) -> list[str]:
    """The headline metrics, one block of columns per row, blocks side by side."""
    metrics = [m for m in doc["metrics"] if m["headline"]]
    fmts = {col: fmt for col, _, fmt, _ in METRICS}
    names = [f["name"] for f in doc["folders"]]
    base = doc["baseline"]
    several = len(names) > 2
    name_w = max(len("metric"), *(len(m["name"]) for m in metrics))
    blocks = []
    for row in rows:
        columns: list[tuple[str, list[str]]] = []
        for n in names:
            if n not in row["values"] and n != base:
                continue
            vals = row["values"].get(n)
            columns.append((n, [_cell(vals[m["key"]], fmts[m["key"]]) if vals else "-"
                                for m in metrics]))
            if n != base:
                a = row["values"][base]
                columns.append((f"Δ{n}" if several else "Δ",
                                [_delta_text(a[m["key"]], vals[m["key"]], fmts[m["key"]],
                                             m["diff"]) for m in metrics]))
        widths = [max(len(h), 6, *(len(c) for c in cells)) for h, cells in columns]
        inner = sum(widths) + 2 * (len(widths) - 1)
        title = row["name"]
        if len(title) > inner:
            extra = min(len(title), 40) - inner
            if extra > 0:
                widths[-1] += extra
                inner += extra
            if len(title) > inner:
                title = title[: inner - 1] + "…"
        blocks.append((title, columns, widths, inner))
    gap = "   "
    panels: list[list[int]] = [[]]
    used = name_w
    for i, (_, _, _, inner) in enumerate(blocks):
        if panels[-1] and used + len(gap) + inner > width:
            panels.append([])
            used = name_w
        panels[-1].append(i)
        used += len(gap) + inner
    lines: list[str] = []
    for panel in panels:
        if lines:
            lines.append("")
        head1, head2, head3 = " " * name_w, " " * name_w, "metric".ljust(name_w)
        for i in panel:
            title, columns, widths, inner = blocks[i]
            head1 += gap + title.ljust(inner)
            head2 += gap + "─" * inner
            head3 += gap + "  ".join(h.rjust(w) for (h, _), w in zip(columns, widths,
                                                                     strict=True))
        lines += [head1.rstrip(), head2, head3]
        for j, m in enumerate(metrics):
            line = m["name"].ljust(name_w)
            for i in panel:
                _, columns, widths, _ = blocks[i]
                line += gap + "  ".join(cells[j].rjust(w) for (_, cells), w in
                                        zip(columns, widths, strict=True))
            lines.append(line)
            if m["key"] in _SECTION_ENDS and j < len(metrics) - 1:
                lines.append("")
    lines.append("")
    return lines
