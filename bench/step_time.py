"""Step-time calibration: the roofline model (sim/steptime.py) against Vidur's kernel times.

For every (gpu, model, num_tokens, tp) point of ../shared/profiles/vidur-compute, the measured
time of one layer (the sum of its token-wise operators: norms, QKV projection, rotary
embedding, output projection, MLP up, activation, MLP down, residual add) against the model's
prediction, two ways:
- fit: efficiencies fitted on all of that GPU's models (how the shipped constants were made);
- held-out: leave one model out; the model's points are predicted by a fit on the GPU's other
  models only, less any with the same layer shape (Llama-2-70B and Llama-3-70B share every
  per-layer matrix). The honest number; targets: median <= 10 %, p90 <= 20 %.
Also: errors by num_tokens band (held-out), the fitted efficiencies, the shipped constants'
drift from a fresh fit, and cross-GPU transfer (one GPU's fit with the other's data-sheet
peaks), which is what the presets without measurements (h200, l40s, mi300x) rely on.

    python bench/step_time.py [--profiles DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd
from kvfrag.sim.hardware import PRESETS as GPUS
from kvfrag.sim.steptime import (
    FIT_FIELDS,
    FITTED,
    OPERATORS,
    cross_validate,
    fit,
    layer_predictions,
    load_vidur_profiles,
)

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "profiles" / "vidur-compute"


def _pct(s: pd.Series, q: float) -> str:
    return f"{100 * s.quantile(q):5.1f}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", type=Path, default=DEFAULT, help=f"default: {DEFAULT}")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    df = load_vidur_profiles(args.profiles)
    cv = cross_validate(df)

    print("Layer time (sum of per-layer operators): |predicted / measured - 1|")
    print(f"{'gpu':<10} {'model':<14} {'points':>6}   {'fit med':>7} {'fit p90':>7}"
          f"   {'held med':>8} {'held p90':>8}")
    for (g, m), s in cv.groupby(["gpu", "model"]):
        print(f"{g:<10} {m:<14} {len(s):>6}   {_pct(s.fit_err, .5):>7} {_pct(s.fit_err, .9):>7}"
              f"   {_pct(s.heldout_err, .5):>8} {_pct(s.heldout_err, .9):>8}")
    for g, s in cv.groupby("gpu"):
        print(f"{g:<10} {'(all)':<14} {len(s):>6}   {_pct(s.fit_err, .5):>7} "
              f"{_pct(s.fit_err, .9):>7}   {_pct(s.heldout_err, .5):>8} "
              f"{_pct(s.heldout_err, .9):>8}")
    print(f"{'overall':<25} {len(cv):>6}   {_pct(cv.fit_err, .5):>7} {_pct(cv.fit_err, .9):>7}"
          f"   {_pct(cv.heldout_err, .5):>8} {_pct(cv.heldout_err, .9):>8}")
    med, p90 = cv.heldout_err.median(), cv.heldout_err.quantile(0.9)
    ok = med <= 0.10 and p90 <= 0.20
    print(f"held-out target (median <= 10 %, p90 <= 20 %): {'met' if ok else 'MISSED'}")

    print("\nHeld-out by num_tokens band: median signed error, p90 |error|")
    bands = pd.cut(cv.num_tokens, [0, 1, 16, 64, 256, 1024, 4096, 32768])
    signed = cv.heldout_pred / cv.measured - 1
    table = signed.groupby([cv.gpu, bands], observed=True).agg(
        median="median", p90=lambda s: s.abs().quantile(0.9), points="size"
    )
    for (g, band), r in table.iterrows():
        print(f"{g:<10} {band!s:<16} {100 * r['median']:+6.1f}%  {100 * r['p90']:5.1f}%"
              f"  {int(r['points']):>5}")

    print("\nFitted efficiencies (all models of the GPU) vs the shipped FITTED constants")
    for g, sub in df.groupby("gpu"):
        fresh = fit(sub, GPUS[g])
        names = [k for ks in FIT_FIELDS.values() for k in ks]
        drift = max(abs(getattr(fresh, k) / getattr(FITTED[g], k) - 1) for k in names)
        print(f"{g:<10} " + " ".join(f"{k}={getattr(fresh, k):.3g}" for k in names)
              + f"  (max drift from shipped: {100 * drift:.2f}%)")

    print("\nTransfer: one GPU's fitted efficiencies on the other GPU's points (its own peaks)")
    measured = df[list(OPERATORS)].sum(axis=1).to_numpy()
    for src in FITTED:
        for dst in FITTED:
            if src == dst:
                continue
            mask = (df.gpu == dst).to_numpy()
            pred = layer_predictions(df[mask], {dst: FITTED[src]})
            err = pd.Series(np.abs(pred / measured[mask] - 1))
            print(f"{src} fit -> {dst} points: median {_pct(err, .5)}  p90 {_pct(err, .9)}")

    print(f"\n{time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
