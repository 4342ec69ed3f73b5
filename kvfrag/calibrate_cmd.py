"""`kvfrag calibrate FILE [--json]`: fit the engine's step time to measured iteration times.

FILE is a CSV with one row per iteration of a real server: batch_size, prefill_tokens,
decode_tokens, kv_tokens_read, seconds (docs/calibrate.md). The fit itself is
`sim.calibrate.fit_step_time`; this module prints it as the `engine.step_time` block a scenario
takes (a YAML snippet to paste, with the fit's error as a comment), or as JSON. pandas is
imported only when the command runs, so `kvfrag --help` stays quick.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfrag.sim.calibrate import ErrorStats, StepTimeFit


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="fit the engine's step time to iteration times measured on a real server",
        description="Fit seconds per iteration = base_s + per_batched_token_s x (prefill_tokens"
        " + decode_tokens) + per_kv_token_s x kv_tokens_read (coefficients >= 0, least squares "
        "on relative error) and print the scenario's engine.step_time block. FILE is a CSV "
        "with one row per iteration and columns batch_size, prefill_tokens, decode_tokens, "
        "kv_tokens_read, seconds (extra columns are ignored). kv_tokens_read: every token held "
        "by the running sequences after the iteration (prompt tokens prefilled so far plus "
        "generated ones, a shared prompt once per sequence), which is what the engine counts. "
        "batch_size is reported only. See docs/calibrate.md.",
    )
    p.add_argument("file", type=Path, metavar="FILE", help="CSV of measured iterations")
    p.add_argument(
        "--json", action="store_true", help="print coefficients and error stats as JSON"
    )
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from kvfrag.sim.calibrate import fit_step_time, read_iterations

    fit = fit_step_time(read_iterations(args.file), args.file)
    print(format_json(fit, args.file) if args.json else format_yaml(fit, args.file))
    return 0


def format_yaml(fit: StepTimeFit, source: Path) -> str:
    """The block to paste into a scenario, its error and the batch sizes as comments."""
    from kvfrag.sim.calibrate import FOLDS

    comment = f"# fitted to {source}: {fit.rows} iterations; |error| {_percent(fit.error)}"
    if fit.held_out is not None:
        comment += f" ({FOLDS}-fold held out: {_percent(fit.held_out, with_max=False)})"
    low, mean, high = fit.batch_size
    lines = [
        comment,
        f"# batch size {low:g}-{high:g} (mean {mean:.1f}): reported only, the engine's form "
        "counts tokens",
        "engine:",
        "  step_time:",
        *(f"    {name}: {_yaml_float(value)}" for name, value in fit.step_time().items()),
    ]
    return "\n".join(lines)


def format_json(fit: StepTimeFit, source: Path) -> str:
    """Full-precision coefficients; errors as fractions of the measured seconds; with the
    `schema_version` every `--json` output carries, so a reader can tell layouts apart."""
    from kvfrag.results import SCHEMA_VERSION
    from kvfrag.sim.calibrate import FOLDS

    def stats(s: ErrorStats | None) -> dict[str, float] | None:
        return None if s is None else {"median": s.median, "p90": s.p90, "max": s.max}

    low, mean, high = fit.batch_size
    return json.dumps(
        {
            "schema_version": SCHEMA_VERSION,
            "file": str(source),
            "iterations": fit.rows,
            "step_time": fit.step_time(),
            "relative_error": stats(fit.error),
            "held_out_relative_error": stats(fit.held_out),
            "held_out_folds": FOLDS if fit.held_out is not None else None,
            "batch_size": {"min": low, "mean": mean, "max": high},
        },
        indent=2,
    )


def _percent(s: ErrorStats, with_max: bool = True) -> str:
    text = f"median {100 * s.median:.1f} %, p90 {100 * s.p90:.1f} %"
    return text + (f", max {100 * s.max:.1f} %" if with_max else "")


def _yaml_float(value: float) -> str:
    """4 significant digits, always with a dot: YAML 1.1 (PyYAML) reads `5e-08` as a string."""
    text = f"{value:.4g}"
    mantissa, e, exponent = text.partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    return mantissa + e + exponent
