"""How every system in `hmc bench` is timed, and the row each measurement becomes.

One iteration is post + wait for completion, timed with `perf_counter_ns`
around the call and nothing else. After `warmup` untimed iterations (and more,
until `warmup_s` seconds have gone by in warming up), batches of
iterations run until about `seconds` have been timed (at least `min_iters`, at
most `max_iters`). `gbps` is 1e9 bytes/s over the mean iteration; latencies are
microseconds.

Concurrency: runs on the calling thread (in whichever process measures).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hmc.bench._workloads import Workload

__all__ = ["COLUMNS", "Row", "Timing", "best_rounds", "measure", "make_row"]

Row = dict[str, Any]

COLUMNS = (
    "system", "path", "op", "workload", "block_size", "batch_size", "total_bytes",
    "gbps", "avg_lat_us", "p50_lat_us", "p99_lat_us", "iterations", "verified",
)
"""The fields of a result row, in table order (nixlbench-like)."""


@dataclasses.dataclass(frozen=True)
class Timing:
    """How long to measure each (system, path, op, workload)."""

    seconds: float = 0.5
    """Timed seconds to aim for per workload."""
    warmup: int = 2
    """Untimed iterations first (connections, grants and routes are set up there)."""
    warmup_s: float = 0.0
    """Untimed iterations go on until this many seconds have gone by warming up: a GPU's first second or so of a new
    kind of work ran 10-15% slower on the 2x H200 hosts (`bench/gpu.py` sets it; docs/decisions.md, "Rows warm up
    for a quarter of a second")."""
    min_iters: int = 5
    max_iters: int = 20000


def measure(
    step: Callable[[], None], timing: Timing, announce: Callable[[int], None] | None = None, *, clock: Callable[[], int] = time.perf_counter_ns,
) -> np.ndarray:
    """Warm up, then time iterations of `step` in batches; the iteration times in ns (of `clock`).

    `announce(n)` is called before each batch of `n` iterations (for a passive peer
    that must know how many to expect).
    """

    def batch(n: int, out: list[int]) -> None:
        if announce is not None:
            announce(n)
        for _ in range(n):
            t0 = clock()
            step()
            out.append(clock() - t0)

    warm: list[int] = []
    batch(timing.warmup, warm)
    while timing.warmup_s and sum(warm) < timing.warmup_s * 1e9 and len(warm) < timing.max_iters:  # one first where none told its length
        batch(max(1, min(timing.max_iters - len(warm), int((timing.warmup_s * 1e9 - sum(warm)) / max(min(warm), 100)))) if warm else 1, warm)
    estimate = min(warm) if warm else 1
    budget = int(timing.seconds * 1e9)
    times: list[int] = []
    spent = 0
    while len(times) < timing.min_iters or (spent < budget * 0.9 and len(times) < timing.max_iters):
        want = int((budget - spent) / max(estimate, 100))
        batch(min(timing.max_iters - len(times), max(timing.min_iters - len(times), want, 1)), times)
        spent = sum(times)
        estimate = int(np.median(times))
    return np.asarray(times, dtype=np.int64)


def make_row(system: str, path: str, op: str, workload: Workload, times_ns: np.ndarray, verified: bool) -> Row:
    """One result row (see COLUMNS)."""
    t = times_ns.astype(np.float64)
    mean = float(t.mean())
    return {
        "system": system,
        "path": path,
        "op": op,
        "workload": workload.name,
        "block_size": workload.block_size,
        "batch_size": workload.batch_size,
        "total_bytes": workload.nbytes,
        "gbps": round(workload.nbytes / mean, 4),
        "avg_lat_us": round(mean / 1e3, 2),
        "p50_lat_us": round(float(np.percentile(t, 50)) / 1e3, 2),
        "p99_lat_us": round(float(np.percentile(t, 99)) / 1e3, 2),
        "iterations": int(t.size),
        "verified": bool(verified),
    }


def best_rounds(rows: list[Row]) -> list[Row]:
    """One row per (system, path, op, workload): its round with the highest GB/s, every round's GB/s and p50 beside it,
    verified only if every round was."""
    groups: dict[tuple[Any, ...], list[Row]] = {}
    for row in rows:
        groups.setdefault((row["system"], row["path"], row["op"], row["workload"]), []).append(row)
    out = []
    for group in groups.values():
        best = dict(max(group, key=lambda r: r["gbps"]))
        best["rounds_gbps"] = [r["gbps"] for r in group]
        best["rounds_p50_us"] = [r["p50_lat_us"] for r in group]
        best["verified"] = all(r["verified"] for r in group)
        out.append(best)
    return out
