"""Workloads: published traces or synthetic descriptions -> one validated request table.

The request table and its contract (columns, dtypes, closed-loop rules) are described in
`workloads.table`; readers in `workloads.readers`, synthetic generators in
`workloads.synthetic`, transforms in `workloads.transforms`, scenario models in
`workloads.spec`, and `build_workload` (spec -> Workload) in `workloads.build`.
Data flows workloads -> sim -> kvfrag; this package imports neither of the others.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Where each public name lives. The package imports its modules on first use (PEP 562), so
#: that `import workloads.samples` or the command line's `--help` does not load pandas.
_MODULES: dict[str, tuple[str, ...]] = {
    "build": ("apply_transforms", "build_workload"),
    "readers": ("FORMATS", "LAYOUTS", "load_trace", "resolve_path"),
    "samples": ("samples"),
    "spec": (
        "ArrivalSpec",
        "AtOnceArrivals",
        "ClosedLoopArrivals",
        "ColumnMap",
        "ConstantArrivals",
        "EmpiricalLengths",
        "ExponentialLengths",
        "FixedLengths",
        "GammaArrivals",
        "LengthSpec",
        "LognormalLengths",
        "NormalLengths",
        "PoissonArrivals",
        "ReplayArrivals",
        "SyntheticSpec",
        "TraceSpec",
        "TransformSpec",
        "UniformLengths",
        "Window",
        "WorkloadSpec",
        "ZipfLengths",
    ),
    "stats": ("LengthStats", "TraceStats", "trace_stats"),
    "synthetic": (
        "apply_arrivals",
        "correlate",
        "sample_arrivals",
        "sample_lengths",
        "sample_requests",
        "synthesize",
    ),
    "table": ("COLUMN_ORDER", "Workload", "WorkloadError", "validate_requests"),
    "transforms": (
        "first_n",
        "limit_length",
        "limit_parts",
        "sample_n",
        "scale_rate",
        "tile",
        "time_window",
        "with_beam_width",
        "with_samples_per_prompt",
    ),
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names}

def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{where}")
    value = module if where == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__all__ = sorted(_WHERE)
