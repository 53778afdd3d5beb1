"""The benchmark engine behind `hmc bench` and `bench/*.py`.

    _workloads   what is moved: bulk sizes and the KV patterns, range lists, data
    _timing      how an iteration is timed, and the row it becomes
    _paths       HMC: an agent here, a target agent in a child process, every host path
    _baselines   single-process memcpy and a plain Python TCP socket
    _nixl        NIXL 1.5.1 (UCX backend) in two child processes
    _report      the issue's ratio checks, machine and provenance
    _run         one run over all of them
    _soak        bench/soak.py's random batches, outcomes, records and bounded waits

Every module is private; the CLI (`hmc.cli._bench`) and the scripts in `bench/`
use `BenchSpec`, `run` and the workload lists from here. The GPU benchmark
(`bench/gpu.py`, its engine in `bench/_gpu/`) is benchmark-only code outside the
package; it uses `_child`, `_timing`, `_workloads`, `_report` and `_nixl` from here.
"""

from hmc.bench._run import BASELINES, OPS, BenchSpec, run
from hmc.bench._timing import COLUMNS, Timing
from hmc.bench._workloads import Workload, default_workloads, fmt_size, quick_workloads

__all__ = ["BASELINES", "COLUMNS", "OPS", "BenchSpec", "Timing", "Workload", "default_workloads", "fmt_size", "quick_workloads", "run"]
