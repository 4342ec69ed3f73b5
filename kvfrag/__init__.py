"""kvfrag's edges: scenario files, the command line, result writers and plots.

Data flows `workloads` -> `sim` -> here; nothing in `sim` or `workloads` imports this package.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvfrag")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+src"
