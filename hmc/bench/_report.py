"""The report of one `hmc bench` run: the issue's ratio checks and the JSON document.

The checks are computed from the rows of ONE run (never across runs), on the
largest bulk workload of the run (256 MiB in a full run), the smallest one
(4 KiB) for latency, and each KV workload:

    staged bulk WRITE  >= 0.9 x socket,   >= 1.3 x NIXL over TCP          (GB/s)
    ipc bulk WRITE     >= 0.6 x memcpy,   >= 1.0 x NIXL (UCX defaults)    (GB/s)
    ipc KV WRITE       >= 0.8 x ipc bulk, >= 2.0 x NIXL same pattern      (GB/s)
    ipc smallest WRITE p50 latency <= 2.0 x NIXL's                        (us)

A check whose rows are missing (baseline skipped or failed) says so and has
`pass: null`.

Concurrency: pure functions (and /proc reads); any thread.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hmc.bench._timing import Row
from hmc.bench._workloads import KIND_BULK, KIND_KV, Workload

__all__ = ["Check", "CpuSample", "checks_for", "evaluate", "interference", "machine_info", "provenance"]


@dataclasses.dataclass(frozen=True)
class Check:
    """`numerator.metric / denominator.metric` against `target` (>= for GB/s, <= for latency)."""

    name: str
    numerator: tuple[str, str, str, str]
    """(system, path, op, workload) of the row compared."""
    denominator: tuple[str, str, str, str]
    target: float
    metric: str = "gbps"

    @property
    def at_least(self) -> bool:
        return self.metric == "gbps"


def checks_for(workloads: Sequence[Workload]) -> list[Check]:
    """The issue's checks for the workloads of a run (none when it has no bulk workload)."""
    bulk = sorted((w for w in workloads if w.kind == KIND_BULK), key=lambda w: w.nbytes)
    if not bulk:
        return []
    big, small = bulk[-1].name, bulk[0].name
    checks = [
        Check(f"staged {big} WRITE vs socket", ("hmc", "staged", "WRITE", big), ("socket", "", "WRITE", big), 0.9),
        Check(f"staged {big} WRITE vs NIXL over TCP", ("hmc", "staged", "WRITE", big), ("nixl-tcp", "", "WRITE", big), 1.3),
        Check(f"ipc {big} WRITE vs memcpy", ("hmc", "ipc", "WRITE", big), ("memcpy", "", "WRITE", big), 0.6),
        Check(f"ipc {big} WRITE vs NIXL", ("hmc", "ipc", "WRITE", big), ("nixl", "", "WRITE", big), 1.0),
    ]
    checks.append(Check(f"ucx {big} WRITE vs NIXL", ("hmc", "ucx", "WRITE", big), ("nixl", "", "WRITE", big), 1.0))
    checks.append(Check(f"ucx over tcp {big} WRITE vs NIXL over TCP", ("hmc", "ucx-tcp", "WRITE", big), ("nixl-tcp", "", "WRITE", big), 1.0))
    for kv in (w.name for w in workloads if w.kind == KIND_KV):
        checks.append(Check(f"ipc {kv} WRITE vs ipc {big}", ("hmc", "ipc", "WRITE", kv), ("hmc", "ipc", "WRITE", big), 0.8))
        checks.append(Check(f"ipc {kv} WRITE vs NIXL", ("hmc", "ipc", "WRITE", kv), ("nixl", "", "WRITE", kv), 2.0))
        checks.append(Check(f"ucx {kv} WRITE vs NIXL", ("hmc", "ucx", "WRITE", kv), ("nixl", "", "WRITE", kv), 1.0))
        checks.append(Check(f"ucx over tcp {kv} WRITE vs NIXL over TCP", ("hmc", "ucx-tcp", "WRITE", kv), ("nixl-tcp", "", "WRITE", kv), 1.0))
    checks.append(Check(f"ipc {small} WRITE p50 latency vs NIXL", ("hmc", "ipc", "WRITE", small), ("nixl", "", "WRITE", small), 2.0, "p50_lat_us"))
    return checks


def _find(rows: Sequence[Row], key: tuple[str, str, str, str]) -> Row | None:
    system, path, op, workload = key
    for row in rows:
        if row["system"] == system and row["op"] == op and row["workload"] == workload and (not path or row["path"] == path):
            return row
    return None


def _label(key: tuple[str, str, str, str]) -> str:
    return " ".join(part for part in key if part)


def evaluate(checks: Sequence[Check], rows: Sequence[Row]) -> list[dict[str, Any]]:
    """One result per check: both figures, the ratio, the target and pass/fail (None: not measured)."""
    out = []
    for check in checks:
        num, den = _find(rows, check.numerator), _find(rows, check.denominator)
        result: dict[str, Any] = {
            "check": check.name,
            "metric": check.metric,
            "numerator": _label(check.numerator),
            "denominator": _label(check.denominator),
            "target": f"{'>=' if check.at_least else '<='} {check.target}",
        }
        if num is None or den is None or not den[check.metric]:
            missing = _label(check.numerator if num is None else check.denominator)
            result.update(numerator_value=None, denominator_value=None, ratio=None, ok=None, reason=f"no row for {missing}")
        else:
            ratio = num[check.metric] / den[check.metric]
            ok = ratio >= check.target if check.at_least else ratio <= check.target
            result.update(numerator_value=num[check.metric], denominator_value=den[check.metric], ratio=round(ratio, 3), ok=ok)
        out.append(result)
    return out


def machine_info() -> dict[str, Any]:
    """Cores, CPU model, kernel, memory and load average (the cores may be shared)."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 0
    return {
        "hostname": platform.node(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu_model": cpu,
        "kernel": platform.release(),
        "platform": platform.platform(),
        "memory_bytes": memory,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


@dataclasses.dataclass(frozen=True)
class CpuSample:
    """Wall clock, CPU seconds the whole machine spent busy and stolen, and this process tree's."""

    wall: float
    busy: float
    steal: float
    own: float

    @classmethod
    def take(cls) -> CpuSample:
        ticks = os.sysconf("SC_CLK_TCK")
        try:
            with open("/proc/stat") as fh:
                fields = [int(x) for x in fh.readline().split()[1:9]]
        except (OSError, ValueError):
            fields = [0] * 8
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        own = os.times()
        return cls(time.monotonic(), (user + nice + system + irq + softirq) / ticks, steal / ticks,
                   own.user + own.system + own.children_user + own.children_system)


def interference(before: CpuSample, after: CpuSample) -> dict[str, float]:
    """What else used the machine between two samples (child processes must have been reaped).

    `other_cpu_fraction`: CPU time of processes outside this run, as a fraction of all
    cores over the interval; `steal_fraction`: time the hypervisor gave to other guests.
    """
    capacity = max(after.wall - before.wall, 1e-9) * (os.cpu_count() or 1)
    other = (after.busy - before.busy) - (after.own - before.own)
    return {
        "seconds": round(after.wall - before.wall, 1),
        "other_cpu_fraction": round(min(max(other / capacity, 0.0), 1.0), 3),
        "steal_fraction": round((after.steal - before.steal) / capacity, 3),
    }


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.rstrip("\n") if done.returncode == 0 else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def provenance() -> dict[str, Any]:
    """Date, git commit (and the tracked files modified in the working tree), versions."""
    commit = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": {
            "commit": commit,
            "modified_files": [line[3:] for line in dirty.splitlines() if line.strip()] if dirty else [],
        } if commit else None,
        "versions": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "hmc": _version("hmc"),
            "nixl": _version("nixl") or _version("nixl-cu12"),
        },
    }
