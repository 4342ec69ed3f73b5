"""Workloads: published traces or synthetic descriptions -> one validated request table.

The request table and its contract (columns, dtypes, closed-loop rules) are described in
`workloads.table`; readers in `workloads.readers`, synthetic generators in
`workloads.synthetic`, transforms in `workloads.transforms`, scenario models in
`workloads.spec`, and `build_workload` (spec -> Workload) in `workloads.build`.
Data flows workloads -> sim -> kvfrag; this package imports neither of the others.
"""

from workloads import samples
from workloads.build import apply_transforms, build_workload
from workloads.readers import FORMATS, LAYOUTS, load_trace, resolve_path
from workloads.spec import (
    ArrivalSpec,
    AtOnceArrivals,
    ClosedLoopArrivals,
    ColumnMap,
    ConstantArrivals,
    EmpiricalLengths,
    ExponentialLengths,
    FixedLengths,
    GammaArrivals,
    LengthSpec,
    LognormalLengths,
    NormalLengths,
    PoissonArrivals,
    ReplayArrivals,
    SyntheticSpec,
    TraceSpec,
    TransformSpec,
    UniformLengths,
    Window,
    WorkloadSpec,
    ZipfLengths,
)
from workloads.stats import LengthStats, TraceStats, trace_stats
from workloads.synthetic import (
    apply_arrivals,
    correlate,
    sample_arrivals,
    sample_lengths,
    sample_requests,
    synthesize,
)
from workloads.table import COLUMN_ORDER, Workload, WorkloadError, validate_requests
from workloads.transforms import (
    first_n,
    limit_length,
    limit_parts,
    sample_n,
    scale_rate,
    tile,
    time_window,
    with_beam_width,
    with_samples_per_prompt,
)

__all__ = [
    "COLUMN_ORDER",
    "FORMATS",
    "LAYOUTS",
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
    "LengthStats",
    "LognormalLengths",
    "NormalLengths",
    "PoissonArrivals",
    "ReplayArrivals",
    "SyntheticSpec",
    "TraceSpec",
    "TraceStats",
    "TransformSpec",
    "UniformLengths",
    "Window",
    "Workload",
    "WorkloadError",
    "WorkloadSpec",
    "ZipfLengths",
    "apply_arrivals",
    "apply_transforms",
    "build_workload",
    "correlate",
    "first_n",
    "limit_length",
    "limit_parts",
    "load_trace",
    "resolve_path",
    "sample_arrivals",
    "sample_lengths",
    "sample_n",
    "sample_requests",
    "samples",
    "scale_rate",
    "synthesize",
    "tile",
    "time_window",
    "trace_stats",
    "validate_requests",
    "with_beam_width",
    "with_samples_per_prompt",
]
