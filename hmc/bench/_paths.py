"""HMC's own rows in `hmc bench`: every host path, WRITE and READ, on every workload.

An initiator `Agent` runs embedded in this process (no hmcd) with two 256 MiB
ConnBuffers: a random source and a destination. A target agent runs in a child
process (`hmc.agent._peer_process.PeerProcess`) holding one ConnBuffer of the same size.

- `local`: between the initiator's two buffers (WRITE source -> destination,
  READ pulls the source into the destination).
- `ipc`, `ucx`, `staged`: between the initiator and the target process (`ucx`
  with the transports UCX chooses, as NIXL's default row).
- `ucx-tcp`: the `ucx` path with both agents' UCX restricted to tcp
  (`ucx_transports = "tcp"`), against NIXL's UCX_TLS=tcp row; its own pair of
  agents, measured after the others.

A path the agent would negotiate for the pair anyway (local, ipc) is requested
without `path=`, so the agent's hot path counts as a user would see it; any
other path (staged) is forced with `path=...`. The first transfer of every
workload checks that the handle reports the intended path.

Each workload: ranges built once as int64 arrays (a single range as plain ints,
as a caller moving one block would pass it); the destination poisoned; timed
iterations of `write(...)/read(...)` + `wait()`; then every moved byte checked:
a digest of the destination ranges (computed where they live) against the
source ranges' digest. WRITE runs before READ; for READ the target buffer is
filled with random bytes once.

Concurrency: the caller's thread drives the agent and the child (over its pipe).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hmc.agent import Agent
from hmc.bench._timing import Row, Timing, make_row, measure
from hmc.bench._workloads import POISON, SEED, Workload, make_ranges, random_bytes
from hmc.config import Config
from hmc.errors import HMCError, NoPathError
from hmc.agent._peer_process import PeerProcess, ranges_digest

__all__ = ["PATHS", "hmc_rows"]

PATHS = ("local", "ipc", "ucx", "ucx-tcp", "staged")
_VARIANTS = {"ucx-tcp": ("ucx", {"ucx_transports": "tcp"})}
"""Bench path -> (the HMC path it takes, the config changes of its own pair of agents)."""
_FILL_CHUNK = 32 << 20
"""Bytes per command when the target's buffer is filled over the pipe."""


class _Bench:
    """The agents and buffers of one `hmc_rows` run."""

    def __init__(self, stack: contextlib.ExitStack, config: Config, size: int, remote_paths: bool) -> None:
        self.agent = stack.enter_context(Agent(config, daemon=False))
        self.src_array = random_bytes(size, SEED)
        self.dst_array = np.full(size, POISON, dtype=np.uint8)
        self.src = self.agent.register(self.src_array, name="bench-src")
        self.dst = self.agent.register(self.dst_array, name="bench-dst")
        self.peer: PeerProcess | None = None
        self.remote: Any = None
        self.remote_random = False
        if remote_paths:
            self.peer = stack.enter_context(PeerProcess(config, daemon=False, timeout=max(config.timeout_s, 60.0)))
            self.remote = self.peer.register(size, name="bench-target", fill=POISON)

    def fill_remote_random(self) -> None:
        """Random bytes in the target's buffer (READ's source), once."""
        if self.remote_random or self.peer is None:
            return
        data = random_bytes(self.remote.size, SEED + 1)
        for offset in range(0, data.size, _FILL_CHUNK):
            self.peer.fill(self.remote.id, data[offset : offset + _FILL_CHUNK].tobytes(), offset)
        self.remote_random = True

    def endpoints(self, path: str, op: str) -> tuple[Any, Any]:
        """(local ConnBuffer, remote buffer or descriptor) of a path and op."""
        if path == "local":
            return (self.src, self.dst) if op == "WRITE" else (self.dst, self.src)
        return (self.src if op == "WRITE" else self.dst), self.remote

    def poison_destination(self, path: str, op: str, w: Workload) -> None:
        if op == "WRITE" and path != "local":
            assert self.peer is not None
            self.peer.poison(self.remote.id, POISON)
        else:
            self.dst_array[: w.total_size].fill(POISON)

    def verified(self, path: str, op: str, so: np.ndarray, do: np.ndarray, ln: np.ndarray) -> bool:
        """Digest of the destination ranges (where they live) == digest of the source ranges."""
        if path == "local":
            return ranges_digest(self.src_array, so, ln) == ranges_digest(self.dst_array, do, ln)
        assert self.peer is not None
        if op == "WRITE":
            return self.peer.digest(self.remote.id, do, ln) == ranges_digest(self.src_array, so, ln)
        return self.peer.digest(self.remote.id, so, ln) == ranges_digest(self.dst_array, do, ln)


def _one(bench: _Bench, label: str, op: str, w: Workload, timing: Timing) -> Row:
    path = _VARIANTS.get(label, (label, {}))[0]
    local, remote = bench.endpoints(path, op)
    natural = bench.agent.path_to(local, remote).path.value
    forced = None if natural == path else path
    so, do, ln = make_ranges(w)
    # write(local, remote, src, dst, n) and read(local, remote, remote, local, n) both take the
    # source side's offsets first: `so` then `do`. A single range goes as plain ints.
    args: tuple[Any, Any, Any] = (int(so[0]), int(do[0]), int(ln[0])) if w.batch_size == 1 else (so, do, ln)
    run = bench.agent.write if op == "WRITE" else bench.agent.read
    bench.poison_destination(path, op, w)
    first = run(local, remote, *args, path=forced)
    first.wait()
    if first.path != path:
        raise NoPathError(f"asked for path {path} but the agent moved {w.name} over {first.path}")

    def step() -> None:
        run(local, remote, *args, path=forced).wait()

    times = measure(step, timing)
    return make_row("hmc", label, op, w, times, bench.verified(path, op, so, do, ln))


def hmc_rows(workloads: Sequence[Workload], paths: Sequence[str], ops: Sequence[str], config: Config, timing: Timing, on_row: Callable[[Row], None]) -> list[Row]:
    """Rows for every (op, path, workload), WRITE first; HMCError when a path fails."""
    rows: list[Row] = []
    size = max(w.total_size for w in workloads)
    plain = [p for p in paths if p not in _VARIANTS]
    groups = [(config, plain)] if plain else []
    groups += [(config.replace(**_VARIANTS[p][1]), [p]) for p in paths if p in _VARIANTS]
    for group_config, group in groups:
        with contextlib.ExitStack() as stack:
            bench = _Bench(stack, group_config, size, remote_paths=any(p != "local" for p in group))
            for op in sorted(ops, key=lambda o: o != "WRITE"):
                if op == "READ":
                    bench.fill_remote_random()
                for path in group:
                    for w in workloads:
                        try:
                            rows.append(_one(bench, path, op, w, timing))
                        except HMCError as exc:
                            raise type(exc)(f"{path} {op} {w.name}: {exc}") from exc
                        on_row(rows[-1])
    return rows
