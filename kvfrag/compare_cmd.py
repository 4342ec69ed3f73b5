"""`kvfrag compare DIR_A DIR_B [DIR_C ...]`: what changed between results folders.

The question this answers is "what changed between these two configurations": the summary
metrics of each run side by side with their differences, and what differs in the scenarios
themselves (`scenario.resolved.yaml`), so that the numbers come with their cause. The first
folder is the baseline; every difference is against it. The parts:

- `kvfrag.comparison`: the folders read, their rows matched, the differences worked out, as
  one JSON-ready document (`compare`);
- `kvfrag.compare_table`: that document as the terminal's tables (`format_comparison`);
- `kvfrag.compare_plots`: its figures (`breakdown_figure`, `capacity_figure`);
- here: the command line, and `-o DIR`.

`--json` prints the same as one JSON document (NaN as null); `-o DIR` writes comparison.csv
(one row per compared row and metric, every numeric column of the summaries), comparison.json
(what --json prints), breakdown.png (the budget's five parts, a bar per folder side by side
for each row) and capacity.png (requests running, throughput, latency, time to first token
and per output token, and where present prefix hits, sharing and compaction stall, folder
against folder). The folder is written whole or not at all, with a manifest
(`kvfrag.outdir`): a folder that kvfrag compare did not write is refused, and so is one inside
(or holding) a compared folder. Without -o nothing is written.
"""

from __future__ import annotations

import argparse
import json
import shutil
import string
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfrag import outdir
from kvfrag.compare_plots import breakdown_figure, capacity_figure
from kvfrag.compare_table import MAX_WIDTH, format_comparison
from kvfrag.comparison import Folder, compare, read_folder

if TYPE_CHECKING:  # the command line imports pandas only when a command runs
    import pandas as pd
    from matplotlib.figure import Figure



def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="compare results folders: summary metrics side by side with their differences",
        description="Compare the results of two (or more) runs: the summary metrics of each "
        "allocator (and sweep point) side by side with their differences against the first "
        "folder, and what differs in the scenarios. Rows are matched by label and sweep "
        "values; the rest are listed. -o writes comparison.csv/json and figures.",
    )
    p.add_argument("folders", nargs="*", type=Path, metavar="DIR",
                   help="results folders written by kvfrag run; the first is the baseline")
    p.add_argument("-o", "--output", type=Path, metavar="DIR",
                   help="also write comparison.csv, comparison.json, breakdown.png and "
                   "capacity.png to this folder (default: write nothing)")
    p.add_argument("--json", action="store_true",
                   help="print the comparison as one JSON document on stdout instead of the "
                   "tables (see docs/compare.md)")
    p.add_argument("--wait", action="store_true",
                   help="with -o: wait for another kvfrag writing the same folder")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    if len(args.folders) < 2:
        raise ValueError(
            "compare needs at least two results folders (kvfrag compare DIR_A DIR_B ...), "
            f"got {len(args.folders)}"
        )
    if len(args.folders) > len(string.ascii_uppercase):
        raise ValueError(f"compare takes at most {len(string.ascii_uppercase)} folders")
    folders = [read_folder(path, name) for path, name in
               zip(args.folders, string.ascii_uppercase, strict=False)]
    if args.output is not None:
        check_output(args.output, args.folders)  # before the figures are drawn
    doc = compare(folders)
    if args.output is not None:
        write_output(args.output, doc, folders, args.wait)
    if args.json:
        from kvfrag.results import dumps_json

        print(dumps_json(doc))
    else:
        print(format_comparison(doc, _width()))
    if args.output is not None:
        if args.json:  # stdout holds the JSON only
            print(f"wrote {args.output}/", file=sys.stderr)
        else:
            print(f"\nwrote {args.output}/")
    return 0


def _width() -> int:
    return min(shutil.get_terminal_size((MAX_WIDTH, 24)).columns, MAX_WIDTH)


# ------------------------------------------------------------------------ -o DIR
def check_output(out: Path, folders: list[Path]) -> None:
    """Refuse an output folder inside a compared folder (or holding one), and any folder
    that `kvfrag compare` did not write (a run's results included: replacing them with a
    comparison would lose them)."""
    target = Path(out).resolve()
    for f in folders:
        src = Path(f).resolve()
        if target == src or src in target.parents:
            raise outdir.UnsafeOutput(
                f"{out}: inside the compared folder {f}; kvfrag compare never writes into "
                "the folders it compares: choose another output path"
            )
        if target in src.parents:
            raise outdir.UnsafeOutput(
                f"{out}: holds the compared folder {f}; choose another output path"
            )
    outdir.check_target(out, early=True)
    _check_ours(Path(out))


def _check_ours(out: Path) -> None:
    if not out.is_dir() or not any(out.iterdir()):
        return
    try:
        data = json.loads((out / outdir.MANIFEST).read_text(encoding="utf-8"))
        wrote = data.get("written_by")
    except (OSError, ValueError, AttributeError):
        wrote = None
    if wrote != "kvfrag compare":
        what = f"results of {wrote}" if wrote else "results kvfrag wrote"
        raise outdir.UnsafeOutput(
            f"{out}: holds {what}, not a comparison; kvfrag compare replaces only a folder it "
            "wrote: choose another output path"
        )


def write_output(out: Path, doc: dict[str, Any], folders: list[Folder], wait: bool) -> None:
    """comparison.csv, comparison.json and the figures, into `out`, whole or not at all."""
    from kvfrag.results import dumps_json

    out = Path(out)
    with outdir.terminate_as_interrupt(), outdir.locked(out, f"kvfrag compare -o {out}", wait):
        outdir.clean_stale(out)
        outdir.check_target(out)  # again: another kvfrag may have written it as we waited
        _check_ours(out)
        from kvfrag.csvcells import write_csv

        tmp = outdir.temp_dir(out)
        try:
            with outdir.writing(tmp):
                write_csv(comparison_frame(doc), tmp / "comparison.csv")
                (tmp / "comparison.json").write_text(dumps_json(doc) + "\n", encoding="utf-8")
                _save(breakdown_figure(doc, folders), tmp / "breakdown.png")
                _save(capacity_figure(doc), tmp / "capacity.png")
                outdir.write_manifest(tmp, "kvfrag compare")
            outdir.replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def comparison_frame(doc: dict[str, Any]) -> pd.DataFrame:
    """comparison.csv: one row per compared row and metric (every numeric summary column):
    label, the swept keys matched on, metric, headline, then each folder's value and, for
    each folder but the baseline, `delta_X` (X − baseline, in the metric's unit; fractions
    as fractions) and `rel_X` ((X − baseline) / |baseline|)."""
    import pandas as pd

    names = [f["name"] for f in doc["folders"]]
    base = doc["baseline"]
    keys = doc["match_on"][1:]
    records = []
    for row in doc["rows"]:
        for m in doc["metrics"]:
            rec: dict[str, Any] = {"label": row["label"]}
            rec.update({k: row["sweep"].get(k) for k in keys})
            rec.update({"metric": m["key"], "headline": m["headline"]})
            for n in names:
                rec[n] = row["values"].get(n, {}).get(m["key"])
            for n in names:
                if n == base:
                    continue
                d = row["diff"].get(n, {}).get(m["key"], {})
                rec[f"delta_{n}"] = d.get("abs")
                rec[f"rel_{n}"] = d.get("rel")
            records.append(rec)
    return pd.DataFrame(records)


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, format="png", dpi=150, metadata={"Software": None})
