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

Load mode (bench/soak_load.py): M agents, one per process, in a ring: agent i targets the next T agents,
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
import contextlib
import dataclasses
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hmc import Agent, BufferDescriptor, Config, PathPolicy
from hmc.bench._report import CpuSample, interference, machine_info, provenance
from hmc.bench._soak import HANG_GRACE_S, OPS, Batch, BytePool, Recorder, Tally, Watch, await_handle, drive, process_sample, rows
from hmc.bench._timing import COLUMNS
from hmc.errors import TimeoutError as HMCTimeoutError
from hmc.testing import PeerProcess, ranges_digest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_paths import result_path  # noqa: E402  (bench/ is not a package)
from soak_load import LoadSpec, run_load  # noqa: E402

SCHEMA = "hmc-soak/1"


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
