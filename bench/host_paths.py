"""How do HMC's host paths compare with a socket, memcpy and NIXL on this machine?

Runs the full `hmc bench` (local, ipc and staged, WRITE and READ, bulk 4 KiB to
256 MiB and both KV patterns, with every baseline: memcpy, socket, NIXL with UCX
defaults and NIXL over TCP), prints the table and the issue's ratio checks, and
writes bench/results/host-paths-<machine>-<date>.json (a second run on the same
day gets -2, -3, ...). Extra arguments go to `hmc bench` (e.g. --iterations-time 1).

    python bench/host_paths.py
"""

from __future__ import annotations

import datetime
import os
import re
import sys
from pathlib import Path

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


def result_path(today: datetime.date | None = None) -> Path:
    stem = f"host-paths-{machine_name()}-{(today or datetime.date.today()).isoformat()}"
    path, n = RESULTS / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = RESULTS / f"{stem}-{n}.json"
    return path


def main(argv: list[str]) -> int:
    out = result_path()
    return hmc_main(["bench", "--out", str(out), *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
