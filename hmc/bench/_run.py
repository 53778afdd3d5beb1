"""One `hmc bench` run: HMC's paths and the chosen baselines on the same workloads.

`run(spec, config, progress)` measures each system in turn (HMC, memcpy, socket,
NIXL, NIXL over TCP), records a system that cannot run here as skipped (with
the reason) and one that fails as failed (with the error), evaluates the
ratio checks on the rows of this run, and returns the JSON-ready report.

With `rounds` above one, the whole sequence runs that many times, one round
after the other (every system in each), and each row reports its round with the
highest GB/s, every round's figures beside it (`rounds_gbps`, `rounds_p50_us`):
on a small shared machine the same loopback TCP transfer runs at twice the
rate in one minute as in the next (NIXL over tcp, 256 MiB, 2-core VM: 2.2 and
4.2 GB/s), so one round set beside another compares machine states, not
systems; interleaved rounds give every system the same chances.

Concurrency: the caller's thread; systems run one after another, each with its
own child processes, so they never share the cores.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from hmc.bench._baselines import memcpy_rows, socket_rows
from hmc.bench._nixl import NIXL_SYSTEMS, nixl_available, nixl_rows
from hmc.bench._paths import PATHS, hmc_rows
from hmc.bench._report import CpuSample, checks_for, evaluate, interference, machine_info, provenance
from hmc.bench._timing import COLUMNS, Row, Timing, best_rounds
from hmc.bench._workloads import Workload
from hmc.config import Config

__all__ = ["BASELINES", "OPS", "BenchSpec", "Progress", "run"]

BASELINES = ("memcpy", "socket", "nixl", "nixl-tcp")
OPS = ("WRITE", "READ")
SCHEMA = "hmc-bench/1"

Progress = Callable[[int, str], None]
"""progress(units_done_now, note): called as rows arrive."""


@dataclasses.dataclass(frozen=True)
class BenchSpec:
    """What to measure."""

    workloads: tuple[Workload, ...]
    paths: tuple[str, ...] = PATHS
    ops: tuple[str, ...] = OPS
    baselines: tuple[str, ...] = BASELINES
    timing: Timing = Timing()
    rounds: int = 1

    def units(self) -> dict[str, int]:
        """Rows expected per system (memcpy and socket are WRITE only)."""
        n = len(self.workloads)
        out = {"hmc": len(self.paths) * len(self.ops) * n} if self.paths else {}
        for name in self.baselines:
            out[name] = n * (len(self.ops) if name in NIXL_SYSTEMS else int("WRITE" in self.ops))
        return {k: v for k, v in out.items() if v}


def _measure_system(name: str, spec: BenchSpec, config: Config, on_row: Callable[[Row], None]) -> list[Row]:
    wls = spec.workloads
    if name == "hmc":
        return hmc_rows(wls, spec.paths, spec.ops, config, spec.timing, on_row)
    if name == "memcpy":
        return memcpy_rows(wls, spec.timing, on_row)
    if name == "socket":
        return socket_rows(wls, spec.timing, on_row)
    return nixl_rows(name, wls, spec.ops, spec.timing, on_row)


def _note(row: Row) -> str:
    return f"{row['system']} {row['path']} {row['op']} {row['workload']}: {row['gbps']:.2f} GB/s"


def run(spec: BenchSpec, config: Config, progress: Progress | None = None, command: Sequence[str] = ()) -> dict[str, Any]:
    """Measure everything in `spec`; the report (see hmc.bench._report for the checks)."""
    advance = progress or (lambda units, note: None)
    started = time.monotonic()
    machine = machine_info()
    rows: list[Row] = []
    skipped: list[dict[str, str]] = []
    failed: list[dict[str, str]] = []
    nixl_ok, nixl_why = nixl_available()
    load: dict[str, dict[str, float]] = {}
    for round_ in range(spec.rounds):
        for name, units in spec.units().items():
            if name in NIXL_SYSTEMS and not nixl_ok:
                if round_ == 0:
                    skipped.append({"system": name, "reason": nixl_why})
                advance(units, f"{name}: skipped")
                continue
            got: list[Row] = []

            def on_row(row: Row) -> None:
                got.append(row)
                advance(1, _note(row))

            before = CpuSample.take()
            try:
                _measure_system(name, spec, config, on_row)
            except Exception as exc:  # noqa: BLE001 - one system's failure is reported, the others still run
                failed.append({"system": name, "round": round_, "error": f"{type(exc).__name__}: {exc}"})
                advance(units - len(got), f"{name}: FAILED")
            load[name if spec.rounds == 1 else f"{name} round {round_}"] = interference(before, CpuSample.take())
            rows.extend(got)
    rows = best_rounds(rows) if spec.rounds > 1 else rows
    machine["loadavg_end"] = machine_info()["loadavg"]
    machine["interference"] = load
    return {
        "schema": SCHEMA,
        "command": " ".join(command) or None,
        **provenance(),
        "machine": machine,
        "settings": {
            "paths": list(spec.paths),
            "ops": list(spec.ops),
            "baselines": list(spec.baselines),
            "workloads": [w.to_dict() for w in spec.workloads],
            "timing": dataclasses.asdict(spec.timing),
            "rounds": spec.rounds,
            "config": {
                "timeout_s": config.timeout_s,
                "ipc_threads": config.ipc_threads,
                "staged_streams": config.staged_streams,
                "staged_chunk_bytes": config.staged_chunk_bytes,
                "socket_buffer_bytes": config.socket_buffer_bytes,
            },
            "nixl": nixl_why if nixl_ok else None,
            "python_executable": sys.executable,
        },
        "columns": list(COLUMNS),
        "rows": rows,
        "ratios": evaluate(checks_for(spec.workloads), rows),
        "skipped": skipped,
        "failed": failed,
        "duration_s": round(time.monotonic() - started, 1),
    }
