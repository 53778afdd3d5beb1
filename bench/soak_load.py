"""bench/soak.py's load mode: M agents (one per process) x K transfers in flight, in a ring.

See bench/soak.py's docstring for what it does and how outcomes count; `run_load`
returns the JSON-ready result that soak.py reports.

Concurrency: the caller's thread starts the workers (spawned processes) and talks to
each over a pipe; in a worker, one "load-driver" thread runs the slots while the
worker's main thread watches it.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from hmc import Agent, BufferDescriptor, Config, TransferHandle
from hmc.bench._report import CpuSample, interference
from hmc.bench._soak import HANG_GRACE_S, OPS, STUCK_AFTER_S, Batch, BytePool, Recorder, Tally, Watch, await_handle, drive, error_name, process_sample, rows
from hmc.errors import TimeoutError as HMCTimeoutError

__all__ = ["LoadSpec", "run_load"]



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
