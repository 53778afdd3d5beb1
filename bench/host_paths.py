"""How do HMC's host paths compare with a socket, memcpy and NIXL on this machine?

Runs the full `hmc bench` (local, ipc and staged, WRITE and READ, bulk 4 KiB to
256 MiB and both KV patterns, with every baseline: memcpy, socket, NIXL with UCX
defaults and NIXL over TCP), prints the table and the issue's ratio checks, and
writes bench/results/host-paths-<machine>-<date>.json (a second run on the same
day gets -2, -3, ...). Extra arguments go to `hmc bench` (e.g. --iterations-time 1).

The cores of the project's machines are shared: with `--wait-quiet S` the script
first waits (at most S seconds) for a 5-second window in which other processes
use less than 15% of the machine, and says whether it found one.

    python bench/host_paths.py [--wait-quiet 600] [hmc bench options]
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import time
from pathlib import Path

from hmc.bench._report import CpuSample, interference
from hmc.cli._main import main as hmc_main

RESULTS = Path(__file__).resolve().parent / "results"


def machine_name() -> str:
    """'2cpu-amd-epyc': core count and CPU model, file-name safe."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            model = next(line.split(":", 1)[1] for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    slug = re.sub(r"\(r\)|\(tm\)|cpu|processor|@.*", "", model.lower())
    return f"{os.cpu_count()}cpu-" + (re.sub(r"[^a-z0-9]+", "-", slug).strip("-") or "unknown")


def result_path(question: str = "host-paths", today: datetime.date | None = None) -> Path:
    """results/<question>-<machine>-<date>.json, or -2, -3, ... for later runs the same day."""
    stem = f"{question}-{machine_name()}-{(today or datetime.date.today()).isoformat()}"
    path, n = RESULTS / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = RESULTS / f"{stem}-{n}.json"
    return path


def wait_quiet(limit_s: float, window_s: float = 5.0, threshold: float = 0.15) -> bool:
    """Wait until other processes use < `threshold` of the machine over `window_s`; False on timeout."""
    deadline = time.monotonic() + limit_s
    while True:
        before = CpuSample.take()
        time.sleep(window_s)
        other = interference(before, CpuSample.take())["other_cpu_fraction"]
        if other < threshold:
            print(f"machine quiet: other processes used {other:.0%} over {window_s:g} s", file=sys.stderr)
            return True
        if time.monotonic() >= deadline:
            print(f"machine still busy after {limit_s:g} s (other processes: {other:.0%}); measuring anyway", file=sys.stderr)
            return False
        print(f"waiting for a quieter machine (other processes: {other:.0%}) ...", file=sys.stderr)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--wait-quiet"]:
        wait_quiet(float(argv[1]))
        argv = argv[2:]
    out = result_path()
    return hmc_main(["bench", "--out", str(out), *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
