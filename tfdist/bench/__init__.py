"""`tfdist bench`: tfdist's overhead, scaling, all-reduce, start-up and memory.

Each measurement has its module; `runner` runs them side by side,
`figures` is the table of every figure reported (method, target, section)
and `report` checks and shows the result. ``docs/benchmarks.md`` has the method
and the figures.
"""

from tfdist.bench.figures import FIGURES
from tfdist.bench.figures import Figure
from tfdist.bench.report import ReportError
from tfdist.bench.report import validate
from tfdist.bench.runner import FULL
from tfdist.bench.runner import QUICK
from tfdist.bench.runner import BenchConfig
from tfdist.bench.runner import run

__all__ = [
    "BenchConfig",
    "FIGURES",
    "FULL",
    "Figure",
    "QUICK",
    "ReportError",
    "run",
    "validate",
]
