"""The shared parts of bench/soak.py (the soak mode there, the load mode in bench/soak_load.py).

    random batches   log-uniform sizes, unaligned sources, disjoint destinations; a pool of random bytes
    outcomes         `Tally` (mismatches, errors by type, hung, lost, the first few details of each)
    records          `Recorder` (per transfer, preallocated) and `rows` in `hmc bench`'s columns
    waiting          `Watch`, `await_handle` (a wait bounded by the deadline + HANG_GRACE_S) and
                     `drive` (a driver thread the main thread can give up on when it is stuck)
    resources        `process_sample` (RSS, threads, open descriptors from /proc)

Benchmark code: only bench/ and hmc.bench use it, never the product.

Concurrency: `Watch` is written by one driver thread and read by the main thread
(single stores); everything else belongs to the thread that made it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from hmc.agent import TransferHandle
from hmc.bench._run import OPS
from hmc.bench._timing import Row
from hmc.errors import TimeoutError as HMCTimeoutError

__all__ = [
    "EXAMPLES", "HANG_GRACE_S", "OPS", "STUCK_AFTER_S", "Batch", "BytePool", "Recorder", "Tally", "Watch",
    "await_handle", "drive", "error_name", "log_uniform_lengths", "place", "process_sample", "rows",
]

HANG_GRACE_S = 1.0
"""A handle unfinished this long after its deadline is hung."""
STUCK_AFTER_S = 10.0
"""A wait that has not returned this long after deadline + HANG_GRACE_S: the driver is stuck, the run ends."""
EXAMPLES = 20
"""Details kept per kind of bad outcome (the counts are complete)."""


# -- Random batches -------------------------------------------------------------------


def log_uniform_lengths(rng: np.random.Generator, count: int, max_bytes: int) -> np.ndarray:
    """`count` lengths from 1 to `max_bytes`, uniform in log scale (as many 10-byte ranges as 1 MiB ones)."""
    return np.minimum(np.exp(rng.uniform(0.0, math.log(max_bytes + 1), count)).astype(np.int64), max_bytes).clip(1)


def place(rng: np.random.Generator, lengths: np.ndarray, size: int, packed: bool = False) -> np.ndarray:
    """Random non-overlapping offsets for `lengths` inside `size` bytes, in random order.

    Sorted random gaps are laid between the ranges taken in a random order;
    `packed` puts them end to end (one random start), so the agent coalesces them.
    """
    free = size - int(lengths.sum())
    if free < 0:
        raise ValueError(f"{int(lengths.sum())} bytes of ranges do not fit in {size}")
    order = rng.permutation(lengths.size)
    gaps = np.full(lengths.size, rng.integers(0, free + 1)) if packed else np.sort(rng.integers(0, free + 1, lengths.size))
    in_order = lengths[order]
    offsets = np.empty_like(lengths)
    offsets[order] = gaps + np.concatenate(([0], np.cumsum(in_order)[:-1]))
    return offsets


@dataclasses.dataclass(frozen=True)
class Batch:
    """One transfer's ranges: data moves from src[i] to dst[i], lengths[i] bytes."""

    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray

    @classmethod
    def draw(cls, rng: np.random.Generator, max_batch: int, max_bytes: int, src_size: int, dst_size: int) -> Batch:
        """1..max_batch ranges; sources anywhere (they may overlap), destinations disjoint."""
        lengths = log_uniform_lengths(rng, int(rng.integers(1, max_batch + 1)), max_bytes)
        src = rng.integers(0, src_size - lengths + 1)
        return cls(src, place(rng, lengths, dst_size, packed=bool(rng.random() < 0.125)), lengths)

    def spans(self) -> Iterator[tuple[int, int, int]]:
        yield from zip(self.src.tolist(), self.dst.tolist(), self.lengths.tolist())

    def args(self, as_ints: bool) -> tuple[Any, Any, Any]:
        """(src, dst, lengths) as range arrays, or plain ints (a single range: the inline fast path)."""
        if as_ints:
            return int(self.src[0]), int(self.dst[0]), int(self.lengths[0])
        return self.src, self.dst, self.lengths

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def describe(self, limit: int = 16) -> dict[str, Any]:
        return {"ranges": len(self.lengths), "bytes": self.nbytes, "src_dst_len": [list(s) for s in self.spans()][:limit]}


class BytePool:
    """Random bytes to copy from (much cheaper than drawing fresh random bytes per transfer)."""

    def __init__(self, rng: np.random.Generator, size: int) -> None:
        self._bytes = np.frombuffer(rng.bytes(size), np.uint8)

    def fill(self, rng: np.random.Generator, out: np.ndarray) -> None:
        """Overwrite `out` with pool bytes from a random (unaligned) offset."""
        start = int(rng.integers(0, self._bytes.size - out.size + 1))
        out[:] = self._bytes[start : start + out.size]

    def tile(self, size: int) -> np.ndarray:
        """`size` bytes of the pool repeated, as a fresh array (initial buffer content)."""
        return np.resize(self._bytes, size)


# -- Outcomes and resources -----------------------------------------------------------


def error_name(exc: BaseException) -> str:
    """`hmc.errors.TimeoutError`-style: errors outside HMC's tree show their module (they are bugs)."""
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


@dataclasses.dataclass
class Tally:
    """Counts of outcomes, with the first few details of each bad kind."""

    transfers: int = 0
    bytes: int = 0
    mismatches: int = 0
    mismatched_bytes: int = 0
    hung: int = 0
    lost: int = 0
    errors: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    examples: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)

    def note(self, kind: str, detail: dict[str, Any]) -> None:
        kept = self.examples.setdefault(kind, [])
        if len(kept) < EXAMPLES:
            kept.append(detail)

    def error(self, exc: BaseException, detail: dict[str, Any]) -> None:
        name = error_name(exc)
        self.errors[name] += 1
        self.note("error", {**detail, "error": f"{name}: {exc}"})

    def merge(self, other: Tally) -> None:
        self.transfers += other.transfers
        self.bytes += other.bytes
        self.mismatches += other.mismatches
        self.mismatched_bytes += other.mismatched_bytes
        self.hung += other.hung
        self.lost += other.lost
        self.errors.update(other.errors)
        for kind, details in other.examples.items():
            for detail in details:
                self.note(kind, detail)

    @property
    def ok(self) -> bool:
        return not (self.mismatches or self.hung or self.lost or self.errors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "transfers": self.transfers, "bytes": self.bytes, "mismatches": self.mismatches,
            "mismatched_bytes": self.mismatched_bytes, "errors": dict(self.errors), "hung": self.hung,
            "lost": self.lost, "examples": self.examples,
        }


def process_sample(pid: int | str = "self") -> dict[str, int]:
    """RSS (KiB), OS threads and open file descriptors of a process, from /proc."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "Threads"):
                fields[key] = int(value.split()[0])
    return {"rss_kib": fields.get("VmRSS", 0), "threads": fields.get("Threads", 0), "fds": len(os.listdir(f"/proc/{pid}/fd"))}


class Recorder:
    """Per-transfer path, op, size and latency, preallocated (the soak's own bookkeeping must not grow RSS)."""

    def __init__(self, capacity: int) -> None:
        self.n = 0
        self.path = np.zeros(capacity, np.int8)
        self.op = np.zeros(capacity, np.int8)
        self.peer = np.zeros(capacity, np.bool_)
        self.nbytes = np.zeros(capacity, np.int64)
        self.nranges = np.zeros(capacity, np.int32)
        self.lat_ns = np.zeros(capacity, np.int64)
        self.bad = np.zeros(capacity, np.bool_)

    def add(self, path: int, op: int, peer: bool, batch: Batch, lat_ns: int, bad: bool) -> None:
        i = self.n
        if i == self.path.size:  # a load worker's run length is open-ended
            for name in ("path", "op", "peer", "nbytes", "nranges", "lat_ns", "bad"):
                setattr(self, name, np.resize(getattr(self, name), max(2 * i, 1024)))
        self.path[i], self.op[i], self.peer[i], self.lat_ns[i], self.bad[i] = path, op, peer, lat_ns, bad
        self.nbytes[i], self.nranges[i] = batch.nbytes, batch.lengths.size
        self.n = i + 1

    def trimmed(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name)[: self.n] for name in ("path", "op", "peer", "nbytes", "nranges", "lat_ns", "bad")}


def rows(records: Sequence[dict[str, np.ndarray]], paths: Sequence[str], workload: str, wall_s: float | None = None) -> list[Row]:
    """`hmc bench` rows per (path, op, initiator).

    gbps: bytes over the time spent in these transfers (one at a time), or over
    `wall_s` when transfers overlapped (load: each row's share of the throughput).
    """
    merged = {k: np.concatenate([r[k] for r in records]) for k in records[0]} if records else {}
    out: list[Row] = []
    for p, path in enumerate(paths):
        for o, op in enumerate(OPS):
            for peer in (False, True):
                pick = (merged["path"] == p) & (merged["op"] == o) & (merged["peer"] == peer) if merged else np.zeros(0, bool)
                if not pick.any():
                    continue
                lat = merged["lat_ns"][pick].astype(np.float64)
                nbytes = merged["nbytes"][pick]
                out.append({
                    "system": "hmc", "path": path, "op": op,
                    "workload": workload + ("-peer-initiated" if peer else ""),
                    "block_size": int(nbytes.sum() // max(int(merged["nranges"][pick].sum()), 1)),
                    "batch_size": round(float(merged["nranges"][pick].mean()), 2),
                    "total_bytes": int(nbytes.sum()),
                    "gbps": round(float(nbytes.sum()) / (float(lat.sum()) if wall_s is None else wall_s * 1e9), 4),
                    "avg_lat_us": round(float(lat.mean()) / 1e3, 2),
                    "p50_lat_us": round(float(np.percentile(lat, 50)) / 1e3, 2),
                    "p99_lat_us": round(float(np.percentile(lat, 99)) / 1e3, 2),
                    "iterations": int(pick.sum()),
                    "verified": not bool(merged["bad"][pick].any()),
                })
    return out


# -- Waiting with deadlines -----------------------------------------------------------


class Watch:
    """What a driver thread is waiting for, so the main thread can tell a stuck driver from a slow one."""

    def __init__(self) -> None:
        self.until = math.inf  # monotonic time after which the current wait is overdue; set and read as one store
        self.what: dict[str, Any] = {}

    def waiting(self, deadline: float, what: dict[str, Any]) -> None:
        self.what = what
        self.until = deadline + HANG_GRACE_S

    def idle(self) -> None:
        self.until = math.inf

    def stuck(self) -> bool:
        return time.monotonic() > self.until + STUCK_AFTER_S


def await_handle(handle: TransferHandle, deadline: float, watch: Watch, what: dict[str, Any]) -> tuple[BaseException | None, bool]:
    """Wait until `deadline` + HANG_GRACE_S at most; (the transfer's error or None, hung)."""
    watch.waiting(deadline, what)
    error: BaseException | None = None
    try:
        handle.wait(max(deadline + HANG_GRACE_S - time.monotonic(), 0.0))
    except Exception as exc:  # noqa: BLE001 - any error is an outcome to count, foreign ones included
        error = exc
    finally:
        watch.idle()
    overran = isinstance(error, HMCTimeoutError) and time.monotonic() > deadline + HANG_GRACE_S
    return error, overran or not handle.done()


def drive(body: Callable[[], None], watch: Watch, name: str) -> dict[str, Any] | None:
    """Run `body` on a named daemon thread; None when it ended, or what it was stuck on.

    The main thread polls the thread with join(timeout) (never sleeps) and gives up
    on it once its current wait is STUCK_AFTER_S past deadline + grace. An exception
    from `body` is re-raised here.
    """
    failure: list[BaseException] = []

    def run() -> None:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            failure.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
        if thread.is_alive() and watch.stuck():
            return dict(watch.what)
    if failure:
        raise failure[0]
    return None
