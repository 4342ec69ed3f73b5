"""`kvfrag validate SCENARIO.yaml`: replay simulated allocation logs on real memory (torch).

Exit status: 0 when every replay matches its prediction within tolerance, 1 when any fails,
2 for a usage error (no torch, no CUDA for --device cuda, a budget over the cap, ...).
torch is imported only when the command runs, so `kvfrag --help` works without it.

Progress goes to stderr (none with -q): a bar of the replays, which names the one in hand
and how far its simulation (requests) or its replay (log rows) is, and one line per replay
as it ends.

The report folder (default `results/<name>/validate/`) is written whole or not at all, under
the lock of the run folder holding it, whose manifest then names it (`kvfrag.outdir`): a new
`kvfrag run` keeps the report and can still replace the folder. Ctrl-C, SIGTERM and SIGHUP
stop it with the lock released and no temporary left.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvfrag import outdir
from kvfrag.args import add_set_argument
from kvfrag.outdir import VALIDATE_DIR
from kvfrag.run_cmd import bar_class

STEP_S = 0.2  # the bar shows how far the replay in hand is at most this often


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate",
        help="replay a scenario's allocation logs on real memory and compare with the model",
        description="Simulate each allocator with its allocation log, replay the log on a real "
        "byte arena / block pool (or through PyTorch's CUDA caching allocator) and compare "
        "measured bytes with the model's accounting. Writes validate.csv/json/png to "
        "results/<name>/validate/.",
    )
    p.add_argument("scenario", type=Path, help="scenario YAML file")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to replay")
    p.add_argument(
        "--mode",
        choices=("auto", "arena", "paged", "torch", "all"),
        default="auto",
        help="arena (contiguous, buddy), paged, torch (CUDA caching allocator), all, or auto: "
        "one mode per allocator (default)",
    )
    add_set_argument(p, "kv_budget=64MiB")
    p.add_argument(
        "--cap",
        help="most device memory to use, e.g. 8GiB (default: half the GPU's free memory; "
        "2 GiB on cpu)",
    )
    p.add_argument(
        "-o", "--output", type=Path, help="report folder (default results/<name>/validate)"
    )
    p.add_argument(
        "--checkpoints",
        type=int,
        default=200,
        metavar="N",
        help="measure at most N of the log's checkpoints, spread evenly (default 200; 0: all)",
    )
    p.add_argument(
        "--wait", action="store_true", help="wait for another kvfrag writing the same results"
    )
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch's CPU threads for the replays (default 1 with --device cpu: the replays are "
        "small copies that torch's thread pool slows down on a busy machine; unchanged on cuda)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress or table")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the comparison as JSON on stdout instead of the table (the rows of "
        "validate.json and the verdict; see docs/data-dictionary.md)",
    )
    p.set_defaults(func=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    from kvfrag.config import load_scenario
    from kvfrag.sim.units import format_size, parse_size
    from kvfrag.validate import suite
    from kvfrag.validate.outcome import FAILING
    from kvfrag.validate.report import format_table, write_report

    loaded = load_scenario(args.scenario, args.sets)
    scenario = loaded.scenario
    suite.check_device(args.device)
    suite.set_threads(args.device, args.threads)
    jobs, skipped = suite.plan(scenario, args.mode, args.device)
    cap = parse_size(args.cap) if args.cap else suite.default_cap(args.device)
    suite.check_cap(jobs, args.device, cap)
    if args.checkpoints < 0:
        raise ValueError("--checkpoints must be >= 0")
    out = args.output or Path("results") / scenario.name / VALIDATE_DIR
    outdir.check_target(out, early=True)  # before any work: only kvfrag's own folders
    # A report inside a run's folder shares that folder's lock: a run replacing the folder
    # carries the report over, and must not do so while it is being rewritten.
    lock_target = out.parent if out.name == VALIDATE_DIR else out
    with outdir.terminate_as_interrupt(), \
            outdir.locked(lock_target, f"kvfrag validate {args.scenario}", args.wait):
        outdir.clean_stale(out)
        outdir.check_target(out)
        if not args.quiet:
            print(
                f"{scenario.name}: {len(jobs)} replay(s) on {args.device}, KV budget "
                f"{format_size(scenario.budget_bytes)}, cap {format_size(cap)}",
                file=sys.stderr,
            )

        bar = bar_class()(total=suite.replays(jobs), unit="replay", disable=args.quiet,
                          file=sys.stderr)
        shown = [0.0]  # when the step in hand was last shown

        def progress(o) -> None:
            if not args.quiet:
                bar.write(f"  {o.label} [{o.mode}]: {o.status}", file=sys.stderr)
                bar.update(1)

        def step(job, what: str, done: int, total: int) -> None:
            now = time.monotonic()
            if done and done < total and now - shown[0] < STEP_S:
                return
            shown[0] = now
            share = f" {done / total:.0%}" if total else ""
            bar.set_postfix_str(f"{job.spec.label} [{job.mode}]: {what}{share}")

        try:
            outcomes = suite.run_jobs(
                jobs, loaded.base_dir, args.device, args.checkpoints or None, on_job=progress,
                on_step=None if args.quiet else step,
            )
        finally:
            bar.close()
        outcomes += skipped
        write_report(outcomes, out, loaded.resolved(), scenario.name)
        if out.name == VALIDATE_DIR:  # the run folder holding it names it: stays replaceable
            with outdir.writing(out.parent):
                outdir.register_nested(out)
    if not args.quiet and not args.json:
        print(format_table(outcomes))
    if not args.quiet:
        print(f"wrote {out}/", file=sys.stderr if args.json else sys.stdout)
    if args.json:  # stdout holds the JSON only
        from kvfrag.results import dumps_json

        print(dumps_json(report_document(scenario.name, out, outcomes)))
    return 1 if any(o.status in FAILING for o in outcomes) else 0


def report_document(scenario: str, out: Path, outcomes: list) -> dict:
    """What `validate --json` prints: the rows of validate.json (one per allocator, mode and
    sweep point) and the verdict the exit status gives (fail: some replay failed or errored)."""
    from kvfrag.results import SCHEMA_VERSION
    from kvfrag.validate.report import report_rows, tally

    ok, skipped, failed = tally(outcomes)
    return {
        "schema_version": SCHEMA_VERSION,
        "scenario": scenario,
        "report_dir": str(out),
        "verdict": "fail" if failed else "pass",
        "ok": ok,  # (as the table's last line: skipped ones are neither ok nor failed)
        "skipped": skipped,
        "failed": failed,
        "rows": report_rows(outcomes),
    }
