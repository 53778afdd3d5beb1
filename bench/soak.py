"""Does HMC stay correct and bounded over many random transfers, and under load?

Soak mode: an agent in this process and one peer agent per path in other processes
(`hmc.testing.PeerProcess`, its negotiation restricted to that path, so a transfer the
peer initiates takes it too), each peer owning one ConnBuffer. Every transfer draws,
from a generator seeded with (seed, transfer index) so any one can be replayed alone:
the path (ipc or staged, forced with `path=`), the initiator (this agent, or now and
then the peer), the op (write or read), the call form (plain ints for a single range,
which is the inline fast path; range arrays; a prepared transfer), and a batch of 1 to
`max_batch` ranges with log-uniform sizes (1 byte to `max_bytes`), random unaligned
source offsets and random non-overlapping destination offsets (sometimes packed
end to end, so ranges coalesce). Source bytes here are fresh random bytes before each
transfer; a local destination is poisoned with the complement of what must land.
Models of every buffer's expected content are kept here; after each transfer its
destination ranges are compared with the model (numpy here, a BLAKE2b digest of the
ranges computed by the peer there), and every `full_check_every` transfers and at the
end whole buffers are (stray writes). RSS, threads and open descriptors of this
process and of each peer are sampled after a warm-up (connections, grants and caches
then exist), every tenth of the run, and at the end: growth = end / after warm-up.

Load mode: M agents, one per process, in a ring: agent i targets the next T agents,
and owns T x K destination lanes (one per writer and in-flight slot) plus K source and
K read-back lanes. Each agent keeps K transfers in flight for `load_seconds`: each slot
writes fresh random bytes (random path, batch, target) into its lane of a target, then
reads them back and compares. Handles are waited in submission order, each with
its deadline + 1 s.

Outcomes, in both modes:
  mismatch  a byte that differs from the model after a transfer reported success
  error     a transfer that raised (by type); none is expected, nothing injects faults
  hung      a handle still unfinished 1 s after its deadline (a wait that overran)
  lost      a handle that never finished (its driver was stuck when the run ended)
A run fails (exit status 1) on any of these, or on RSS growth over `--rss-limit`.

The JSON (default bench/results/soak-<machine>-<date>[-N].json) has the machine, date,
git commit and versions (hmc.bench._report), rows in `hmc bench`'s columns per path
and op, both modes' outcomes, resource samples and the checks; stdout gets a summary.

    python bench/soak.py [--transfers 100000] [--load-agents 64 --in-flight 100] [--quick]

Concurrency: each mode's driver runs on a thread of its own ("soak-driver",
"load-driver") while the main thread watches it, so a wait that never returns is
reported (with the transfer's seed and index) instead of hanging the run. Soak mode
has one transfer in flight; load workers each run one driver thread.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from hmc import Agent, BufferDescriptor, Config, PathPolicy, TransferHandle
from hmc.bench._report import CpuSample, interference, machine_info, provenance
from hmc.bench._timing import COLUMNS, Row
from hmc.errors import TimeoutError as HMCTimeoutError
from hmc.testing import PeerProcess, ranges_digest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_paths import result_path  # noqa: E402  (bench/ is not a package)

SCHEMA = "hmc-soak/1"
OPS = ("WRITE", "READ")
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


# -- Soak mode ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SoakSpec:
    """What the soak does."""

    transfers: int = 100_000
    """Measured transfers, after the warm-up."""
    seed: int = 0
    paths: tuple[str, ...] = ("ipc", "staged")
    max_batch: int = 16
    """Ranges per transfer: 1 to this many."""
    max_bytes: int = 1 << 20
    """Largest range; sizes are log-uniform from 1 byte."""
    deadline_s: float = 30.0
    """Every transfer's deadline (its `timeout=`, or the agent's default, the same value)."""
    warmup: int = 1000
    """Transfers before the resource baseline (verified and counted like the others)."""
    full_check_every: int = 1000
    """Compare whole buffers with their models this often (stray writes outside the ranges)."""
    peer_initiated: float = 0.05
    """Share of transfers the peer initiates (into or out of this process's buffer)."""
    rss_limit: float = 0.10
    """Largest allowed RSS growth, end over after warm-up, for every process."""

    @property
    def buffer_bytes(self) -> int:
        """Every buffer's size: a full batch fills at most half of it, leaving room to place ranges."""
        return max(2 * self.max_batch * self.max_bytes, 1 << 20)


@dataclasses.dataclass
class Remote:
    """A peer process, its buffer, and the model of that buffer's content."""

    peer: PeerProcess
    descriptor: BufferDescriptor
    model: np.ndarray


class Soak:
    """The soak's state: models of every buffer, outcomes, samples; `step(i)` runs transfer i (one thread at a time)."""

    def __init__(self, spec: SoakSpec, agent: Agent, remotes: dict[str, Remote], progress: Callable[[str], None] = lambda s: None) -> None:
        self.spec = spec
        self.progress = progress
        self.agent = agent
        self.remotes = remotes
        self.watch = Watch()
        self.tally = Tally()
        self.recorder = Recorder(spec.warmup + spec.transfers)
        self.samples: list[dict[str, Any]] = []
        self.full_checks = 0
        self.done = 0
        size = spec.buffer_bytes
        self.pool = BytePool(np.random.default_rng([spec.seed, 1 << 40]), max(2 * spec.max_bytes, 1 << 20))
        self.local = self.pool.tile(size)  # every page touched now, so RSS does not grow as transfers reach them
        self.model = self.local.copy()
        self.buffer = agent.register(self.local)

    # one transfer

    def step(self, index: int) -> None:
        spec = self.spec
        rng = np.random.default_rng([spec.seed, index])
        path_index = int(rng.integers(len(spec.paths)))
        remote = self.remotes[spec.paths[path_index]]
        by_peer = bool(rng.random() < spec.peer_initiated)
        op = int(rng.integers(2))  # 0 write, 1 read
        batch = Batch.draw(rng, spec.max_batch, spec.max_bytes, spec.buffer_bytes, spec.buffer_bytes)
        local_is_src = (op == 0) != by_peer
        as_ints = batch.lengths.size == 1 and bool(rng.random() < 0.5)
        prepared = not by_peer and not as_ints and bool(rng.random() < 0.1)
        timeout = spec.deadline_s if rng.random() < 0.5 else None
        what = {"seed": spec.seed, "index": index, "path": spec.paths[path_index], "op": OPS[op],
                "initiator": "peer" if by_peer else "here", "form": "prepared" if prepared else "ints" if as_ints else "arrays",
                "timeout": timeout, **batch.describe()}

        src_model = self.model if local_is_src else remote.model
        if local_is_src:  # fresh random source bytes
            for s, _, n in batch.spans():
                self.pool.fill(rng, self.local[s : s + n])
            for s, _, n in batch.spans():
                self.model[s : s + n] = self.local[s : s + n]
        expected = [src_model[s : s + n].copy() for s, _, n in batch.spans()]
        if not local_is_src:  # poison: every byte that does not move shows
            for (_, d, n), e in zip(batch.spans(), expected):
                np.invert(e, out=self.local[d : d + n])

        deadline = time.monotonic() + spec.deadline_s
        started = time.perf_counter_ns()
        if by_peer:
            error, hung = self._peer_transfer(remote, op, batch, as_ints, timeout, deadline, what)
        else:
            error, hung = self._transfer(remote, op, batch, as_ints, prepared, timeout, deadline, what)
        elapsed = time.perf_counter_ns() - started

        self.tally.transfers += 1
        bad = error is not None or hung
        if hung:
            self.tally.hung += 1
            self.tally.note("hung", what)
        if error is not None:
            self.tally.error(error, what)
            self._resync(remote, local_is_src)
        else:
            self.tally.bytes += batch.nbytes
            bad = self._verify(remote, batch, expected, local_is_src, what) or bad
        self.recorder.add(path_index, op, by_peer, batch, elapsed, bad)
        self.done += 1
        if self.done % spec.full_check_every == 0:
            self.full_check()

    def _transfer(self, remote: Remote, op: int, batch: Batch, as_ints: bool, prepared: bool, timeout: float | None,
                  deadline: float, what: dict[str, Any]) -> tuple[BaseException | None, bool]:
        path = what["path"]
        try:
            if prepared:
                prepare = self.agent.prepare_write if op == 0 else self.agent.prepare_read
                handle = prepare(self.buffer, remote.descriptor, *batch.args(False), timeout=timeout, path=path).post()
            else:
                run = self.agent.write if op == 0 else self.agent.read
                handle = run(self.buffer, remote.descriptor, *batch.args(as_ints), timeout=timeout, path=path)
        except Exception as exc:  # noqa: BLE001 - counted by type
            return exc, False
        return await_handle(handle, deadline, self.watch, what)

    def _peer_transfer(self, remote: Remote, op: int, batch: Batch, as_ints: bool, timeout: float | None,
                       deadline: float, what: dict[str, Any]) -> tuple[BaseException | None, bool]:
        """The peer runs write (its buffer into ours) or read (ours into its buffer) and waits."""
        self.watch.waiting(deadline, what)
        try:
            remote.peer.transfer("write" if op == 0 else "read", remote.descriptor.id, self.buffer.descriptor,
                                 *batch.args(as_ints), timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - counted by type
            return exc, isinstance(exc, HMCTimeoutError) and time.monotonic() > deadline + HANG_GRACE_S
        finally:
            self.watch.idle()
        return None, False

    # verification

    def _verify(self, remote: Remote, batch: Batch, expected: list[np.ndarray], local_is_src: bool, what: dict[str, Any]) -> bool:
        """Update the destination's model; count the bytes that differ from it. True on a mismatch."""
        dst_model = remote.model if local_is_src else self.model
        for (_, d, n), e in zip(batch.spans(), expected):
            dst_model[d : d + n] = e
        if local_is_src:
            if remote.peer.digest(remote.descriptor.id, batch.dst, batch.lengths) == ranges_digest(remote.model, batch.dst, batch.lengths):
                return False
            actual = np.frombuffer(remote.peer.contents(remote.descriptor.id), np.uint8)
        else:
            actual = self.local
        wrong = sum(int(np.count_nonzero(actual[d : d + n] != dst_model[d : d + n])) for _, d, n in batch.spans())
        if not wrong:
            return False
        self.tally.mismatches += 1
        self.tally.mismatched_bytes += wrong
        self.tally.note("mismatch", {**what, "wrong_bytes": wrong})
        self._resync(remote, local_is_src)
        return True

    def _resync(self, remote: Remote, local_is_src: bool) -> None:
        """After an error or a mismatch the destination's content is what it is: the model follows it."""
        if local_is_src:
            remote.model[:] = np.frombuffer(remote.peer.contents(remote.descriptor.id), np.uint8)
        else:
            self.model[:] = self.local

    def full_check(self) -> None:
        """Compare whole buffers with their models (catches writes outside any range)."""
        self.full_checks += 1
        wrong = int(np.count_nonzero(self.local != self.model))
        if wrong:
            self.tally.note("stray", {"seed": self.spec.seed, "after_index": self.done - 1, "buffer": "local", "wrong_bytes": wrong})
            self.model[:] = self.local
        for path, remote in self.remotes.items():
            if remote.peer.digest(remote.descriptor.id) == ranges_digest(remote.model):
                continue
            actual = np.frombuffer(remote.peer.contents(remote.descriptor.id), np.uint8)
            n = int(np.count_nonzero(actual != remote.model))
            self.tally.note("stray", {"seed": self.spec.seed, "after_index": self.done - 1, "buffer": path, "wrong_bytes": n})
            remote.model[:] = actual
            wrong += n
        if wrong:
            self.tally.mismatches += 1
            self.tally.mismatched_bytes += wrong

    # resources

    def sample(self, label: str, started: float) -> None:
        """Resources of every process now; a progress line for the operator."""
        self.samples.append({
            "label": label, "transfers": self.done, "t_s": round(time.monotonic() - started, 2),
            "self": {**process_sample(), "py_threads": threading.active_count()},
            **{f"peer_{path}": process_sample(remote.peer.pid) for path, remote in self.remotes.items()},
        })
        now = self.samples[-1]
        self.progress(f"soak {label}: {self.done} transfers in {now['t_s']} s, {self.tally.mismatches} mismatches, "
                      f"{sum(self.tally.errors.values())} errors, {self.tally.hung} hung; RSS here {now['self']['rss_kib'] / 1024:.1f} MiB")

    def run(self, started: float) -> None:
        """Warm-up, baseline sample, the measured transfers with a sample every tenth, last full check."""
        spec = self.spec
        for i in range(spec.warmup):
            self.step(i)
        self.sample("after-warmup", started)
        tenth = max(spec.transfers // 10, 1)
        for i in range(spec.warmup, spec.warmup + spec.transfers):
            self.step(i)
            if (i - spec.warmup + 1) % tenth == 0 and i + 1 < spec.warmup + spec.transfers:
                self.sample("middle" if (i - spec.warmup + 1) == 5 * tenth else "progress", started)
        if self.done % spec.full_check_every:
            self.full_check()
        self.sample("end", started)


def rss_growth(samples: Sequence[dict[str, Any]]) -> dict[str, float]:
    """End over after-warm-up RSS, minus one, per process."""
    first, last = samples[0], samples[-1]
    return {k: round(last[k]["rss_kib"] / first[k]["rss_kib"] - 1.0, 4) for k in first if isinstance(first[k], dict)}


@contextlib.contextmanager
def open_soak(spec: SoakSpec, config: Config, progress: Callable[[str], None] = lambda s: None) -> Iterator[Soak]:
    """An agent here, one peer process per path with a buffer of random bytes, and the Soak over them."""
    config = config.replace(timeout_s=spec.deadline_s)
    with contextlib.ExitStack() as stack:
        agent = stack.enter_context(Agent(config, daemon=False))
        remotes: dict[str, Remote] = {}
        for path in spec.paths:
            peer = stack.enter_context(PeerProcess(config.replace(policy=PathPolicy(allow=(path,))), timeout=spec.deadline_s + 5.0))
            content = BytePool(np.random.default_rng([spec.seed, 1 << 41, len(remotes)]), spec.buffer_bytes).tile(spec.buffer_bytes)
            descriptor = peer.register(spec.buffer_bytes)
            peer.fill(descriptor.id, content.tobytes())
            remotes[path] = Remote(peer, descriptor, content)
        yield Soak(spec, agent, remotes, progress)


def run_soak(spec: SoakSpec, config: Config, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The soak: N random verified transfers (see the module docstring); the JSON-ready result."""
    started = time.monotonic()
    cpu = CpuSample.take()
    with open_soak(spec, config, progress) as soak:
        progress(f"soak: {spec.warmup} warm-up + {spec.transfers} transfers over {', '.join(spec.paths)}, seed {spec.seed}")
        stuck = drive(lambda: soak.run(started), soak.watch, "soak-driver")
        if stuck is not None:
            soak.tally.hung += 1
            soak.tally.note("hung", {**stuck, "driver": "stuck: the wait never returned; run ended here"})
            soak.sample("end", started)
            for remote in soak.remotes.values():
                remote.peer.kill()
        duration = time.monotonic() - started
    tally, samples = soak.tally, soak.samples
    growth = rss_growth(samples) if len(samples) >= 2 else {}
    return {
        "spec": dataclasses.asdict(spec),
        "buffer_bytes": spec.buffer_bytes,
        "warmup": spec.warmup,
        "completed": soak.done,
        "stuck": stuck,
        **tally.to_dict(),
        "full_checks": soak.full_checks,
        "rows": rows([soak.recorder.trimmed()], spec.paths, "soak-random"),
        "resources": samples,
        "rss_growth": growth,
        "threads_growth": {k: samples[-1][k]["threads"] - samples[0][k]["threads"] for k in growth},
        "duration_s": round(duration, 1),
        "transfers_per_s": round(soak.done / duration, 1),
        "machine_during": interference(cpu, CpuSample.take()),  # the peers are reaped: their CPU counts as ours
        "ok": tally.ok and stuck is None and all(g < spec.rss_limit for g in growth.values()),
    }


# -- Load mode ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """What the load run does."""

    agents: int = 64
    """Agents, one per process."""
    in_flight: int = 100
    """Transfers each agent keeps in flight."""
    targets: int = 4
    """Each agent writes to and reads from the next `targets` agents of the ring (round-robin per slot)."""
    seconds: float = 30.0
    """How long slots keep starting new cycles; then every handle is drained."""
    lane_bytes: int = 64 << 10
    """Each (writer, slot) owns a lane of this size in each target; a batch stays inside it."""
    max_batch: int = 4
    seed: int = 0
    paths: tuple[str, ...] = ("ipc", "staged")
    deadline_s: float = 30.0
    start_timeout_s: float = 600.0
    """How long all the processes may take to start (64 interpreters on 2 cores take a while)."""

    @property
    def ring(self) -> int:
        return min(self.targets, self.agents - 1)

    @property
    def buffer_bytes(self) -> int:
        return (self.ring + 2) * self.in_flight * self.lane_bytes

    @property
    def max_bytes(self) -> int:
        """Largest range: a full batch fills at most half a lane."""
        return max(self.lane_bytes // (2 * self.max_batch), 1)


class _LoadDriver:
    """One worker's slots: write fresh bytes into a lane of a target, read them back, compare, repeat."""

    def __init__(self, spec: LoadSpec, index: int, agent: Agent, buffer: Any, memory: np.ndarray, targets: list[BufferDescriptor]) -> None:
        self.spec, self.index, self.agent, self.buffer, self.memory, self.targets = spec, index, agent, buffer, memory, targets
        self.watch = Watch()
        self.tally = Tally()
        self.recorder = Recorder(1 << 14)
        self.pool = BytePool(np.random.default_rng([spec.seed, index, 1 << 40]), 1 << 20)
        self.inflight: collections.deque[tuple[Any, ...]] = collections.deque()
        self.cycles = [0] * spec.in_flight
        lane, k = spec.lane_bytes, spec.in_flight
        self.src_base = spec.ring * k * lane
        self.back_base = (spec.ring + 1) * k * lane

    def lane_in(self, target: int, slot: int) -> int:
        """Offset of this writer's lane `slot` in target `target` (its `target`-th successor): it is that agent's writer number `target`."""
        return (target * self.spec.in_flight + slot) * self.spec.lane_bytes

    def warm_up(self) -> None:
        """One write and read per target and path, so connections and grants exist before the clock starts."""
        for t, target in enumerate(self.targets):
            for path in self.spec.paths:
                self.agent.write(self.buffer, target, self.src_base, self.lane_in(t, 0), 1, path=path).wait()
                self.agent.read(self.buffer, target, self.lane_in(t, 0), self.back_base, 1, path=path).wait()

    def _start(self, slot: int, stop_at: float) -> None:
        if time.monotonic() >= stop_at:
            return
        spec = self.spec
        cycle = self.cycles[slot]
        self.cycles[slot] += 1
        rng = np.random.default_rng([spec.seed, self.index, slot, cycle])
        rel = Batch.draw(rng, spec.max_batch, spec.max_bytes, spec.lane_bytes, spec.lane_bytes)
        target = (slot + cycle) % len(self.targets)
        path_index = int(rng.integers(len(spec.paths)))
        src = self.src_base + slot * spec.lane_bytes
        for _, d, n in rel.spans():  # the lane's bytes at the destination's relative offsets
            self.pool.fill(rng, self.memory[src + d : src + d + n])
        job = {"seed": spec.seed, "agent": self.index, "slot": slot, "cycle": cycle, "target": target,
               "path": spec.paths[path_index], "as_ints": rel.lengths.size == 1 and bool(rng.random() < 0.5), **rel.describe()}
        self._submit(0, job, Batch(src + rel.dst, self.lane_in(target, slot) + rel.dst, rel.lengths), path_index, rel)

    def _submit(self, op: int, job: dict[str, Any], batch: Batch, path_index: int, rel: Batch) -> None:
        run = self.agent.write if op == 0 else self.agent.read
        deadline = time.monotonic() + self.spec.deadline_s
        try:
            handle: TransferHandle | BaseException = run(self.buffer, self.targets[job["target"]], *batch.args(job["as_ints"]),
                                                         timeout=self.spec.deadline_s, path=job["path"])
        except Exception as exc:  # noqa: BLE001 - counted by type when its turn comes
            handle = exc
        self.inflight.append((op, job, batch, path_index, rel, handle, deadline, time.perf_counter_ns()))

    def run(self, stop_at: float) -> None:
        """Start every slot, then wait handles in submission order until none is left."""
        spec = self.spec
        for slot in range(spec.in_flight):
            self._start(slot, stop_at)
        while self.inflight:
            op, job, batch, path_index, rel, handle, deadline, started = self.inflight[0]
            what = {**job, "op": OPS[op]}
            if isinstance(handle, BaseException):
                error, hung = handle, False
            else:
                error, hung = await_handle(handle, deadline, self.watch, what)
            self.inflight.popleft()
            elapsed = time.perf_counter_ns() - started
            self.tally.transfers += 1
            if hung:
                self.tally.hung += 1
                self.tally.note("hung", what)
            bad = hung or error is not None
            if error is not None:
                self.tally.error(error, what)
            else:
                self.tally.bytes += batch.nbytes
            if error is None and op == 0:  # written: read it back into the slot's read-back lane, poisoned first
                back = self.back_base + job["slot"] * spec.lane_bytes
                src = self.src_base + job["slot"] * spec.lane_bytes
                for _, d, n in rel.spans():
                    np.invert(self.memory[src + d : src + d + n], out=self.memory[back + d : back + d + n])
                self._submit(1, job, Batch(batch.dst, back + rel.dst, rel.lengths), path_index, rel)
            elif error is None:
                bad = self._compare(job, rel) or bad
                self._start(job["slot"], stop_at)
            else:
                self._start(job["slot"], stop_at)
            self.recorder.add(path_index, op, False, batch, elapsed, bad)

    def _compare(self, job: dict[str, Any], rel: Batch) -> bool:
        lane = self.spec.lane_bytes
        src, back = self.src_base + job["slot"] * lane, self.back_base + job["slot"] * lane
        wrong = sum(int(np.count_nonzero(self.memory[back + d : back + d + n] != self.memory[src + d : src + d + n])) for _, d, n in rel.spans())
        if wrong:
            self.tally.mismatches += 1
            self.tally.mismatched_bytes += wrong
            self.tally.note("mismatch", {**job, "wrong_bytes": wrong})
        return bool(wrong)

    def abandon(self) -> None:
        """The driver is stuck: the handle it waits on is hung, any other unfinished one is lost."""
        pending = list(self.inflight)
        self.tally.hung += 1
        self.tally.note("hung", {**dict(self.watch.what), "driver": "stuck: the wait never returned"})
        for entry in pending[1:]:
            handle = entry[5]
            if isinstance(handle, TransferHandle) and not handle.done():
                self.tally.lost += 1
                self.tally.note("lost", {**entry[1], "op": OPS[entry[0]]})


def _load_worker(conn: Connection, index: int, spec: LoadSpec, config: Config) -> None:
    """One load agent's process: register, learn the targets, warm up, run, report, wait for the others."""
    try:
        with Agent(config, daemon=False) as agent:
            memory = BytePool(np.random.default_rng([spec.seed, index]), 1 << 20).tile(spec.buffer_bytes)
            buffer = agent.register(memory)
            conn.send(("ready", buffer.descriptor.SerializeToString()))
            targets = [BufferDescriptor.FromString(raw) for raw in conn.recv()]
            driver = _LoadDriver(spec, index, agent, buffer, memory, targets)
            driver.warm_up()
            conn.send(("warm", process_sample()))
            stop_at = conn.recv()
            stuck = drive(lambda: driver.run(stop_at), driver.watch, "load-driver")
            if stuck is not None:
                driver.abandon()
            conn.send(("done", {"tally": driver.tally, "records": driver.recorder.trimmed(), "finished": time.monotonic(),
                                "stuck": stuck, "sample": process_sample()}))
            conn.recv()  # "close": every agent finished, nobody writes into this buffer any more
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
        conn.send(("failed", f"{error_name(exc)}: {exc}"))


def _expect(conn: Connection, kind: str, deadline: float) -> Any:
    """The next message of a worker, which must be `kind`, before `deadline` (monotonic)."""
    if not conn.poll(max(deadline - time.monotonic(), 0.0)):
        raise HMCTimeoutError(f"no {kind!r} from a load worker in time")
    got, value = conn.recv()
    if got != kind:
        raise RuntimeError(f"load worker: expected {kind!r}, got {got!r}: {value}")
    return value


def run_load(spec: LoadSpec, config: Config, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """M agents x K in flight (see the module docstring); the JSON-ready result."""
    if spec.agents < 2:
        raise ValueError("the load run needs at least 2 agents")
    config = config.replace(timeout_s=spec.deadline_s)
    context = multiprocessing.get_context("spawn")
    workers: list[tuple[Any, Connection]] = []
    tally = Tally()
    cpu = CpuSample.take()
    try:
        began = time.monotonic()
        for i in range(spec.agents):
            mine, theirs = context.Pipe()
            process = context.Process(target=_load_worker, args=(theirs, i, spec, config), name=f"hmc-load-{i}", daemon=True)
            process.start()
            theirs.close()
            workers.append((process, mine))
        start_by = began + spec.start_timeout_s
        descriptors = [_expect(conn, "ready", start_by) for _, conn in workers]
        started_s = time.monotonic() - began
        progress(f"load: {spec.agents} agents started in {started_s:.1f} s; warming up")
        for i, (_, conn) in enumerate(workers):
            conn.send([descriptors[(i + 1 + t) % spec.agents] for t in range(spec.ring)])
        warm = [_expect(conn, "warm", start_by) for _, conn in workers]
        go = time.monotonic()
        for _, conn in workers:
            conn.send(go + spec.seconds)
        progress(f"load: {spec.agents} x {spec.in_flight} in flight for {spec.seconds:g} s")
        results: list[dict[str, Any]] = []
        unresponsive = 0
        finish_by = go + spec.seconds + spec.deadline_s + HANG_GRACE_S + STUCK_AFTER_S + 60.0
        for i, (_, conn) in enumerate(workers):
            try:
                results.append(_expect(conn, "done", finish_by))
            except HMCTimeoutError:
                unresponsive += 1
                tally.lost += spec.in_flight  # what it had in flight can no longer be accounted for
                tally.note("lost", {"agent": i, "why": "the worker never reported"})
        elapsed = max((r["finished"] for r in results), default=time.monotonic()) - go
        for _, conn in workers:
            conn.send("close")
    finally:
        for process, conn in workers:
            process.join(10.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)
            conn.close()
    machine_during = interference(cpu, CpuSample.take())  # start to end: the workers are reaped, their CPU counts as ours
    for r in results:
        tally.merge(r["tally"])
    stuck = [r["stuck"] for r in results if r["stuck"] is not None]
    end = [r["sample"] for r in results]

    def spread(samples: Sequence[dict[str, int]], key: str) -> dict[str, float]:
        values = np.array([s[key] for s in samples], np.float64)
        return {"min": float(values.min()), "median": float(np.median(values)), "max": float(values.max()), "sum": float(values.sum())}

    return {
        "spec": dataclasses.asdict(spec),
        "buffer_bytes": spec.buffer_bytes,
        "max_range_bytes": spec.max_bytes,
        "start_s": round(started_s, 1),
        "seconds": round(elapsed, 2),
        **tally.to_dict(),
        "unresponsive_workers": unresponsive,
        "stuck": stuck,
        "gbps": round(tally.bytes / elapsed / 1e9, 4) if elapsed > 0 else None,
        "transfers_per_s": round(tally.transfers / elapsed, 1) if elapsed > 0 else None,
        "rows": rows([r["records"] for r in results], spec.paths, f"load-{spec.agents}x{spec.in_flight}", elapsed),
        "latency_note": "submit to completion as seen by a waiter taking handles in submission order",
        "per_agent": {
            "rss_kib_after_warmup": spread(warm, "rss_kib"), "rss_kib_end": spread(end, "rss_kib"),
            "threads_after_warmup": spread(warm, "threads"), "threads_end": spread(end, "threads"),
            "fds_after_warmup": spread(warm, "fds"), "fds_end": spread(end, "fds"),
        } if end else None,
        "machine_during": machine_during,
        "ok": tally.ok and not stuck and not unresponsive,
    }


# -- Report and CLI -------------------------------------------------------------------


def checks(soak: dict[str, Any] | None, load: dict[str, Any] | None) -> list[dict[str, Any]]:
    """What the run must show, each with its value, target and pass/fail."""
    out: list[dict[str, Any]] = []

    def check(name: str, value: float, target: str, ok: bool) -> None:
        out.append({"check": name, "value": value, "target": target, "ok": bool(ok)})

    if soak is not None:
        check("soak mismatches", soak["mismatches"], "== 0", soak["mismatches"] == 0)
        check("soak errors", sum(soak["errors"].values()), "== 0", not soak["errors"])
        check("soak hung", soak["hung"], "== 0", soak["hung"] == 0)
        check("soak completed", soak["completed"], f"== {soak['warmup'] + soak['spec']['transfers']}",
              soak["completed"] == soak["warmup"] + soak["spec"]["transfers"])
        for proc, growth in soak["rss_growth"].items():
            limit = soak["spec"]["rss_limit"]
            check(f"soak RSS growth {proc}", growth, f"< {limit}", growth < limit)
    if load is not None:
        for key in ("mismatches", "lost", "hung", "unresponsive_workers"):
            check(f"load {key}", load[key], "== 0", load[key] == 0)
        check("load errors", sum(load["errors"].values()), "== 0", not load["errors"])
    return out


def report(soak: dict[str, Any] | None, load: dict[str, Any] | None, command: Sequence[str], started: float,
           machine: dict[str, Any], origin: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: provenance (`origin`, taken when the run started), machine, rows of both modes, outcomes, checks."""
    results = checks(soak, load)
    return {
        "schema": SCHEMA,
        "question": "Random verified transfers over ipc and staged: mismatches, errors, hung and lost handles, RSS and threads over the run; and M agents x K in flight",
        "command": " ".join(command) or None,
        **origin,
        "machine": {**machine, "loadavg_end": machine_info()["loadavg"]},
        "columns": list(COLUMNS),
        "rows": (soak["rows"] if soak else []) + (load["rows"] if load else []),
        "soak": soak,
        "load": load,
        "checks": results,
        "ok": all(c["ok"] for c in results),
        "duration_s": round(time.monotonic() - started, 1),
    }


def summary(doc: dict[str, Any]) -> str:
    """The human summary: rows, outcomes, resources and checks."""
    lines = [f"{'path':7} {'op':5} {'workload':30} {'n':>8} {'avg B':>9} {'ranges':>6} {'GB/s':>7} {'p50 us':>9} {'p99 us':>9} ok"]
    for r in doc["rows"]:
        lines.append(f"{r['path']:7} {r['op']:5} {r['workload']:30} {r['iterations']:8d} {r['block_size']:9d} {r['batch_size']:6.1f} "
                     f"{r['gbps']:7.3f} {r['p50_lat_us']:9.1f} {r['p99_lat_us']:9.1f} {'yes' if r['verified'] else 'NO'}")
    soak, load = doc["soak"], doc["load"]
    if soak:
        lines.append(f"soak: {soak['completed']} transfers ({soak['warmup']} warm-up) in {soak['duration_s']} s, "
                     f"{soak['bytes'] / 1e9:.1f} GB, {soak['mismatches']} mismatches, errors {soak['errors'] or 0}, "
                     f"{soak['hung']} hung, {soak['full_checks']} whole-buffer checks")
        first, last = soak["resources"][0], soak["resources"][-1]
        for proc in soak["rss_growth"]:
            lines.append(f"  {proc:12} RSS {first[proc]['rss_kib'] / 1024:.1f} -> {last[proc]['rss_kib'] / 1024:.1f} MiB "
                         f"({soak['rss_growth'][proc]:+.2%}), threads {first[proc]['threads']} -> {last[proc]['threads']}, "
                         f"fds {first[proc]['fds']} -> {last[proc]['fds']}")
    if load:
        spec = load["spec"]
        lines.append(f"load: {spec['agents']} agents x {spec['in_flight']} in flight, {load['transfers']} transfers in {load['seconds']} s "
                     f"({load['transfers_per_s']}/s, {load['gbps']} GB/s), {load['mismatches']} mismatches, errors {load['errors'] or 0}, "
                     f"{load['lost']} lost, {load['hung']} hung; started in {load['start_s']} s")
        if load["per_agent"]:
            rss, threads = load["per_agent"]["rss_kib_end"], load["per_agent"]["threads_end"]
            lines.append(f"  per agent at the end: RSS median {rss['median'] / 1024:.0f} MiB (all {rss['sum'] / 1024 ** 2:.2f} GiB), "
                         f"threads median {threads['median']:.0f} max {threads['max']:.0f}")
    for c in doc["checks"]:
        lines.append(f"  [{'ok' if c['ok'] else 'FAIL'}] {c['check']}: {c['value']} (target {c['target']})")
    lines.append("PASS" if doc["ok"] else "FAIL")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    soak, load = SoakSpec(), LoadSpec()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transfers", type=int, default=soak.transfers, help="soak transfers after the warm-up, 0: no soak (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=soak.warmup, help="soak transfers before the resource baseline (default: %(default)s)")
    p.add_argument("--seed", type=int, default=soak.seed, help="(default: %(default)s)")
    p.add_argument("--paths", default=",".join(soak.paths), help="comma-separated paths (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=soak.max_batch, help="soak: most ranges per transfer (default: %(default)s)")
    p.add_argument("--max-bytes", type=int, default=soak.max_bytes, help="soak: largest range in bytes (default: %(default)s)")
    p.add_argument("--peer-initiated", type=float, default=soak.peer_initiated, help="soak: share of transfers the peer starts (default: %(default)s)")
    p.add_argument("--rss-limit", type=float, default=soak.rss_limit, help="soak: largest RSS growth allowed (default: %(default)s)")
    p.add_argument("--load-agents", type=int, default=load.agents, help="load: agents (processes), 0: no load run (default: %(default)s)")
    p.add_argument("--in-flight", type=int, default=load.in_flight, help="load: transfers in flight per agent (default: %(default)s)")
    p.add_argument("--load-targets", type=int, default=load.targets, help="load: ring neighbours each agent targets (default: %(default)s)")
    p.add_argument("--load-seconds", type=float, default=load.seconds, help="load: how long new transfers start (default: %(default)s)")
    p.add_argument("--load-lane-bytes", type=int, default=load.lane_bytes, help="load: lane per writer and slot (default: %(default)s)")
    p.add_argument("--load-max-batch", type=int, default=load.max_batch, help="load: most ranges per transfer (default: %(default)s)")
    p.add_argument("--deadline-s", type=float, default=soak.deadline_s, help="every transfer's deadline (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="what CI runs: 500 warm-up + 2,000 transfers of ranges up to 256 KiB, 4 agents x 8 in flight for 5 s")
    p.add_argument("--out", type=Path, help="JSON result (default: bench/results/soak-<machine>-<date>[-N].json)")
    return p


def specs(args: argparse.Namespace) -> tuple[SoakSpec | None, LoadSpec | None]:
    """The two modes' specs from the command line (--quick overrides the sizes)."""
    paths = tuple(p for p in args.paths.split(",") if p)
    soak = SoakSpec(transfers=args.transfers, seed=args.seed, paths=paths, max_batch=args.max_batch, max_bytes=args.max_bytes,
                    deadline_s=args.deadline_s, warmup=args.warmup, peer_initiated=args.peer_initiated, rss_limit=args.rss_limit)
    load = LoadSpec(agents=args.load_agents, in_flight=args.in_flight, targets=args.load_targets, seconds=args.load_seconds,
                    lane_bytes=args.load_lane_bytes, max_batch=args.load_max_batch, seed=args.seed, paths=paths, deadline_s=args.deadline_s)
    if args.quick:
        soak = dataclasses.replace(soak, transfers=2000, warmup=500, max_bytes=256 << 10, full_check_every=500)
        load = dataclasses.replace(load, agents=4, in_flight=8, seconds=5.0)
    return (soak if soak.transfers > 0 else None), (load if load.agents > 0 else None)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    soak_spec, load_spec = specs(args)
    out = args.out or result_path("soak")
    started, machine, origin = time.monotonic(), machine_info(), provenance()  # the code that runs is the tree now

    def progress(note: str) -> None:
        print(note, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="hmc-soak-") as tmp:
        config = Config(socket=str(Path(tmp) / "no-hmcd.sock"))  # embedded agents: no hmcd listens there
        soak = run_soak(soak_spec, config, progress) if soak_spec else None
        load = run_load(load_spec, config, progress) if load_spec else None
    doc = report(soak, load, ["python", "bench/soak.py", *(argv if argv is not None else sys.argv[1:])], started, machine, origin)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(summary(doc))
    print(f"wrote {out}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
