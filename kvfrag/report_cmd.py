"""`kvfrag report RESULTS_DIR`: (re)build a results folder's `report.html` (kvfrag.report).

It writes into a folder kvfrag wrote (its manifest lists everything in it), holding the
folder's lock (`kvfrag.outdir`), and records the page in the manifest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvfrag import outdir


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="(re)build a results folder's report.html",
        description="Write RESULTS/report.html: one self-contained page (no network needed) "
        "with the scenario, the summary table, every figure of plots/ and an interactive "
        "address map of each slab allocator (zoom; hover a slab for its request). kvfrag run "
        "writes it too (unless --no-plots or --no-report).",
    )
    p.add_argument("results", type=Path, help="a folder written by kvfrag run")
    p.add_argument("--wait", action="store_true", help="wait for a run writing that folder")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    """Write report.html in place, under the folder's lock; Ctrl-C, SIGTERM and SIGHUP stop it
    with the lock released and no temporary left. A file the page lacks (a Parquet file, a
    figure) is named on stderr, a line each, with what is left out for it, as the page says."""
    from kvfrag.report import write_report

    folder = args.results
    if not (folder / "summary.csv").exists():
        raise FileNotFoundError(f"{folder}: not a results folder (no summary.csv)")
    outdir.check_target(folder, replace=False)  # it writes into the folder: one kvfrag wrote
    with outdir.terminate_as_interrupt(), \
            outdir.locked(folder, f"kvfrag report {folder}", args.wait), outdir.writing(folder):
        outdir.clean_stale_inside(folder)  # a killed report's temporary
        outdir.check_target(folder, replace=False)  # again: a run may have replaced it
        path = write_report(folder, say=_note)
        outdir.add_to_manifest(folder, [path])
    print(path)
    return 0


def _note(line: str) -> None:
    """A line on what the page leaves out, on stderr (as `kvfrag plot` tells its own)."""
    print(f"kvfrag: note: {line}", file=sys.stderr, flush=True)
