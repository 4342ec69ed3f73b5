#!/usr/bin/env bash
# Install vLLM 0.33.0's pure-Python scheduler / KV-cache manager into the active venv, for the
# oracle tests in tests/oracle (they drive vLLM's real v1 Scheduler on CPU; no GPU, no vllm._C).
#
# Run with the project's venv active, after `pip install -e '.[test,validate,ray]'` (and the
# CPU torch). Idempotent and quiet; prints nothing on success.
#
# - vLLM goes in with --no-deps: its requirements would pull a CUDA torch 2.14, triton, ...
#   (torch 2.13 CPU runs the scheduler code fine).
# - Plus the packages its import chain needs, at vLLM's own version bounds.
# - Nothing kvfrag uses may change: every distribution in kvfrag[test,validate,ray]'s
#   installed dependency closure (numpy, pandas, pyarrow, pydantic, torch, simpy,
#   matplotlib, pyyaml, ray, requests, ...) is pinned at its installed version through a
#   constraints file, so pip fails rather than up- or downgrade one of them.
set -euo pipefail

PY=${PYTHON:-python}
PIP=("$PY" -m pip install --quiet --disable-pip-version-check)

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT

"$PY" - "$constraints" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, distribution

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip always vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

pins, todo = {}, [Requirement("kvfrag[test,validate,ray]")]
# If kvfrag is not installed, pin at least what it imports.
fallback = "numpy pandas pyarrow pydantic pydantic-core torch simpy matplotlib pyyaml".split()
while todo:
    req = todo.pop()
    name = canonicalize_name(req.name)
    if name in pins:
        continue
    try:
        dist = distribution(req.name)
    except PackageNotFoundError:
        continue
    pins[name] = dist.version
    for sub in dist.requires or ():
        sub = Requirement(sub)
        envs = [{"extra": e} for e in req.extras] or [{"extra": ""}]
        if sub.marker is None or any(sub.marker.evaluate(env) for env in envs):
            todo.append(sub)
if len(pins) <= 1:
    for n in fallback:
        try:
            pins[n] = distribution(n).version
        except PackageNotFoundError:
            pass
pins.pop("kvfrag", None)
with open(sys.argv[1], "w") as f:
    f.writelines(f"{n}=={v}\n" for n, v in sorted(pins.items()))
EOF

# What `import vllm.v1.core.sched.scheduler`, vllm.config and vllm.v1.request import
# (bounds from vllm 0.33.0's metadata where it states one).
"${PIP[@]}" -c "$constraints" --no-warn-conflicts \
    packaging psutil 'pyzmq>=25.0.0' urllib3 regex numpy msgspec 'pydantic>=2.12.0' cbor2 \
    'transformers>=5.16.1,<5.21.0' 'aiohttp>=3.14.4' 'requests>=2.33.0' openai-harmony \
    'openai>=2.25.0' 'pillow>=13.0.0' pybase64 cachetools cloudpickle uvloop py-cpuinfo \
    'prometheus_client>=0.18.0' 'fastapi>=0.133.0,<0.137.0' partial-json-parser \
    'llguidance>=1.7.0,<1.8.0' einops

# Without their requirements: xgrammar's would pull triton (~1 GB) and a CUDA torch; vLLM's
# own list is GPU-only. --no-warn-conflicts: pip would list every missing GPU package.
"${PIP[@]}" -c "$constraints" --no-deps --no-warn-conflicts \
    'xgrammar==0.2.8' 'apache-tvm-ffi==0.1.11' 'vllm==0.33.0'

if ! "$PY" -c 'import vllm.v1.core.sched.scheduler' 2>/dev/null; then
    "$PY" -c 'import vllm.v1.core.sched.scheduler'
    echo "install-oracle: vllm.v1.core.sched.scheduler does not import" >&2
    exit 1
fi
