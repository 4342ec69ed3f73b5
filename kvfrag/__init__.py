"""kvfrag: the one import name of the project.

Its parts: `kvfrag.workloads` (traces and generators -> one request table), `kvfrag.sim`
(allocators, accounting, engine -> records), and the edges here: scenario files, the command
line, result writers and plots, and `kvfrag.validate`. Data flows workloads -> sim -> edges;
`kvfrag.sim` and `kvfrag.workloads` import nothing from the edges.

In the repository those parts keep their own top-level folders (sim/, workloads/, validate/,
scenarios/); an install maps them under `kvfrag` (pyproject.toml's package-dir). Run from a
source checkout without installing, the package finds them beside itself.
"""

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    __version__ = version("kvfrag")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+src"

_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "sim" / "__init__.py").is_file() and str(_checkout) not in __path__:
    __path__.append(str(_checkout))  # a source checkout: kvfrag.sim is ../sim
