#!/usr/bin/env bash
# validate/gpu_check.sh OUTDIR — the GPU validation suite in one command.
#
# On a machine with CUDA and torch, replays every shipped validation scenario
# (scenarios/validate-*.yaml) in all modes — arena and paged on real device memory, torch
# through PyTorch's CUDA caching allocator (default settings and expandable_segments:True) —
# and writes one report folder per scenario under OUTDIR (validate.csv/json/png,
# series.parquet), plus OUTDIR/summary.txt with every terminal table and exit status, and
# OUTDIR/pytest-gpu.txt with the GPU-marked tests. Sized to finish in a few minutes on one
# H200 (KV budgets of a few GiB, a few hundred requests); each run uses at most half the GPU's
# free memory (kvfrag validate's default --cap).
#
# kvfrag need not be pip-installed: the script runs `python -m kvfrag.cli` with
# PYTHONPATH=<repo root>. Python packages kvfrag needs but torch images often lack (simpy,
# sortedcontainers, ...) travel as wheels in <repo root>/.whl/ (ignored by git; fetch them
# for the GPU machine's Python with `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64 -d .whl simpy sortedcontainers`):
# they are installed offline into a private folder put on PYTHONPATH. A wheels/ folder with
# `pip install --no-index --find-links` works too. Without them a missing package is
# reported and the run fails.
#
# Environment: PYTHON (default python3), VALIDATE_ARGS (extra arguments for every run, e.g.
# "--checkpoints 50"). Exit status: 0 when every run passed, 1 otherwise.
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
OUT=$1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MPLBACKEND=Agg

# Carried wheels (.whl/): install offline into a private site folder.
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
    SITE=${TMPDIR:-/tmp}/kvfrag-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$ROOT"/.whl/*.whl && export PYTHONPATH="$PYTHONPATH:$SITE"
fi

# Missing dependencies: install from the carried wheels, offline.
for mod_pkg in simpy:simpy sortedcontainers:sortedcontainers pydantic:pydantic yaml:pyyaml \
               pyarrow:pyarrow tqdm:tqdm pandas:pandas matplotlib:matplotlib; do
    mod=${mod_pkg%%:*}
    pkg=${mod_pkg#*:}
    if ! "$PY" -c "import $mod" 2>/dev/null; then
        if [ -d "$ROOT/wheels" ]; then
            echo "installing $pkg from $ROOT/wheels (offline)"
            "$PY" -m pip install --quiet --no-index --find-links "$ROOT/wheels/" "$pkg" \
                || echo "warning: could not install $pkg from $ROOT/wheels" >&2
        else
            echo "warning: $mod is missing and there is no $ROOT/wheels to install it from" >&2
        fi
    fi
done

"$PY" - <<'EOF' | tee "$OUT/environment.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info()
    print(f"memory free {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB")
EOF

status=0
: > "$OUT/summary.txt"
for scenario in "$ROOT"/scenarios/validate-*.yaml; do
    name=$(basename "$scenario" .yaml)
    echo "== $name" | tee -a "$OUT/summary.txt"
    start=$(date +%s)
    # shellcheck disable=SC2086
    "$PY" -m kvfrag.cli validate "$scenario" --device cuda --mode all -o "$OUT/$name" \
        ${VALIDATE_ARGS:-} 2>&1 | tee -a "$OUT/summary.txt"
    rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || status=1
done

if "$PY" -c "import pytest" 2>/dev/null; then
    (cd "$ROOT" && "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/validate) \
        > "$OUT/pytest-gpu.txt" 2>&1 || status=1
    tail -n 3 "$OUT/pytest-gpu.txt" | tee -a "$OUT/summary.txt"
fi

echo "reports in $OUT (exit $status)"
exit $status
