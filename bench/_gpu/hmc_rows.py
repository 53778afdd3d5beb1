"""HMC's own rows in the GPU benchmark (`bench/gpu.py`): every path through the public API, WRITE and READ.

The benchmark calls `hmc_rows(...)` in a child process of its own (not a
daemon: it starts the targets) after the baselines, with the same workloads
and timing. An initiator Agent (embedded, no hmcd) in that process holds two
torch tensors on the source device, a pattern source and a destination (READ's).
For each peer of `PEERS`, a target process on the destination device (cuda:0
on one GPU, cuda:1 on two) holds the same pair in an Agent configured as the
peer says, and the initiator measures every workload against it:

    ipc          a plain peer: negotiation picks CUDA IPC (same vendor, same host)
    staged       the peer declares its GPU AMD (`Config(vendor_override={dev: "amd"})`, what
                 HMC_DEVICE_VENDOR_OVERRIDE=cuda:0=amd does): negotiation refuses vendor IPC and
                 picks staged through the shared pinned ring, what a real NVIDIA-AMD pair gets
    staged-tcp   the peer declares another host (HMC_HOST_ID in its environment): staged through
                 pinned rings over TCP, the path of two hosts
    staged-hip   the peer runs HMC's HIP backend through the HIP-on-CUDA runtime (HMC_HIP_ON_CUDA=1:
                 its tensors register as hip:N, vendor AMD): a CUDA <-> HIP pair over the shared
                 pinned ring, the HIP end's copies and kernels through hipMemcpyAsync and hiprtc
    ucx          a plain peer, the ucx path forced (negotiation picks ipc), where the UCX of the
                 libucx wheel is installed: CUDA memory registered with UCX, ranges moved through
                 the peer memory cuda_ipc maps here (HMC's batched copy)
    ucx-puts     the same, from a second initiator Agent that maps no peer memory
                 (`ucx_map_peers` off): one UCX put or get per range, what crosses hosts

No path is forced: the first transfer of each row checks that the handle
reports the path the peer stands for (a row whose negotiation picks another
path is forced to it and says so in `detail`). Then post + wait iterations are
timed, what a user's loop sees (system "hmc": `write()`/`read()` + `wait()`),
and single ranges up to 64 KiB a second time as one `prepare_write()`/
`prepare_read()` posted per iteration (system "hmc-prepared"), as NIXL's rows
repost one prepared request. Every moved byte is checked where the destination
lives: WRITE in the target, READ here (the target's source is the same pattern
as ours). A path that refuses device memory in this build is reported with
("skipped", system, reason) and gives no rows; the others are still measured.

Concurrency: the caller's thread drives the agent; each target child is driven over its pipe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from _gpu.harness import OPS, Devices, apply_env, gpu_row, measure_row, poison, serve_destination, sizes_of, source_and_destination, synchronize, verify
from hmc.bench._child import receive, reap, send_error
from hmc.bench._timing import Row, Timing
from hmc.bench._workloads import Workload, make_ranges
from hmc.errors import NoPathError, UnavailableError, UnsupportedError
from hmc.memory._hip_on_cuda import SWITCH
from hmc.memory._machine import HOST_ID_ENV

__all__ = ["HMC_PATHS", "HMC_SYSTEMS", "PEERS", "Peer", "hmc_rows", "unavailable_reason"]

PREPARED_MAX_BYTES = 64 << 10
"""Single ranges up to this size are measured a second time as a prepared transfer (system "hmc-prepared")."""
HMC_SYSTEMS = ("hmc", "hmc-prepared")
STARTUP_TIMEOUT_S = 180.0


@dataclasses.dataclass(frozen=True)
class Peer:
    """One target agent: how it is configured, and the path negotiation must pick for it."""

    label: str
    """The rows' `path`."""
    path: str
    """What the transfer handles must report."""
    amd: bool
    """The target declares its GPU AMD (vendor override)."""
    env: Mapping[str, str]
    """The target process's environment."""
    what: str
    """For the rows' `detail`."""
    maps: bool = True
    """The initiator maps the peer's memory where UCX can (`Config.ucx_map_peers`)."""


PEERS = (
    Peer("ipc", "ipc", False, {}, "same vendor, same host: CUDA IPC"),
    Peer("staged", "staged", True, {}, "the peer declares its GPU AMD (vendor override): the shared pinned ring"),
    Peer("staged-tcp", "staged", False, {HOST_ID_ENV: "hmc-gpu-bench-another-host"}, "the peer declares another host (HMC_HOST_ID): pinned rings over TCP"),
    Peer("staged-hip", "staged", False, {SWITCH: "1"}, "the peer runs HMC's HIP backend on the HIP-on-CUDA runtime: a CUDA <-> HIP pair, the shared pinned ring"),
    Peer("ucx", "ucx", False, {}, "a plain peer, the ucx path forced: UCX (cuda_ipc, cuda_copy), ranges through the peer memory cuda_ipc maps here"),
    Peer("ucx-puts", "ucx", False, {}, "a plain peer, the ucx path forced, an initiator that maps no peer memory: one UCX put or get per range (cuda_ipc, cuda_copy)", maps=False),
)
HMC_PATHS = tuple(p.label for p in PEERS)


def unavailable_reason() -> str | None:
    """Why HMC cannot run here (its agent does not import), or None."""
    try:
        import hmc.agent  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return f"hmc.agent does not import: {type(exc).__name__}: {exc}"
    return None


def _target(conn: Connection, size: int, device: str, peer: Peer) -> None:
    """Child on `device`: a target Agent configured as `peer` says, with a pattern source and a poisoned destination;
    poisons and checks the destination on request."""
    try:
        apply_env(dict(peer.env))
        from hmc.agent import Agent
        from hmc.config import Config

        src, dst = source_and_destination(size, device)
        override = {device: "amd"} if peer.amd and dst.is_cuda else {}
        with Agent(Config(vendor_override=override), daemon=False) as agent:
            remote_src = agent.register(src, name="gpu-bench-target-src")
            remote_dst = agent.register(dst, name="gpu-bench-target-dst")
            conn.send(("descriptors", remote_src.descriptor.SerializeToString(), remote_dst.descriptor.SerializeToString()))
            serve_destination(conn, dst, src)
    except BaseException:
        send_error(conn)


@dataclasses.dataclass(frozen=True)
class _Side:
    """One end's source and destination buffers: ConnBuffers here, BufferDescriptors of the target."""

    src: Any
    dst: Any


@contextlib.contextmanager
def _started(peer: Peer, size: int, device: str) -> Iterator[tuple[Connection, Any, _Side]]:
    """A target process for `peer`: (its pipe, the process, its descriptors); told to quit and reaped on exit."""
    from hmc.v1 import common_pb2

    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    proc = context.Process(target=_target, args=(child_conn, size, device, peer), name=f"hmc-gpu-bench-target-{peer.label}", daemon=True)
    proc.start()
    child_conn.close()
    try:
        message = receive(conn, "descriptors", STARTUP_TIMEOUT_S, procs=[proc])
        parse = common_pb2.BufferDescriptor.FromString
        yield conn, proc, _Side(parse(message[1]), parse(message[2]))
        conn.send(("quit",))
    finally:
        conn.close()
        reap(proc)


def hmc_rows(workloads: Sequence[Workload], timing: Timing, on_row: Callable[[Row], None], devices: Devices = Devices(),
             systems: Sequence[str] = HMC_SYSTEMS, paths: Sequence[str] = HMC_PATHS,
             on_skip: Callable[[str, str], None] | None = None) -> list[Row]:
    """One row per (peer of `paths`, op, workload) and system of `systems`; UnavailableError when HMC does not import.

    `on_skip(system, reason)` hears of a path that refuses these buffers (no rows for it).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise UnavailableError(reason)
    apply_env()
    from hmc.agent import Agent
    from hmc.config import Config

    size = sizes_of(workloads)
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        tensors = src, dst = source_and_destination(size, devices.src)
        initiators: dict[bool, tuple[Any, _Side]] = {}

        def initiator(maps: bool) -> tuple[Any, _Side]:
            """The initiator Agent (made once) mapping peer memory or not, with the tensors registered."""
            if maps not in initiators:
                agent = stack.enter_context(Agent(Config(ucx_map_peers=maps), daemon=False))
                suffix = "" if maps else "-puts"
                initiators[maps] = agent, _Side(agent.register(src, name=f"gpu-bench-src{suffix}"), agent.register(dst, name=f"gpu-bench-dst{suffix}"))
            return initiators[maps]

        info = initiator(True)[0].info
        offered = {t.path for t in info.transports}
        for peer in (p for p in PEERS if p.label in paths):
            if peer.path not in offered:  # e.g. ucx where its binding was not built: no rows, the reason said
                why = next((u.reason for u in info.unavailable if u.path == peer.path), "not offered by this agent")
                for system in systems if on_skip is not None else ():
                    on_skip(f"{system} {peer.label}", f"path {peer.path}: {why}")
                continue
            agent, mine = initiator(peer.maps)
            with _started(peer, size, devices.dst) as (conn, proc, theirs):
                try:
                    for op in OPS:
                        for w in workloads:
                            measured = [s for s in systems if s == "hmc" or (w.batch_size == 1 and w.nbytes <= PREPARED_MAX_BYTES)]
                            for system in measured:
                                row = _one(agent, tensors, mine, theirs, (conn, proc), peer, op, w, timing, devices, prepared=system == "hmc-prepared")
                                rows.append(row)
                                on_row(row)
                except UnsupportedError as exc:  # this path cannot move these buffers in this build: no (more) rows
                    if on_skip is not None:
                        for system in systems:
                            on_skip(f"{system} {peer.label}", f"{type(exc).__name__}: {exc}")
    return rows


def _one(agent: Any, tensors: tuple[Any, Any], mine: _Side, theirs: _Side, target: tuple[Connection, Any], peer: Peer, op: str,
         w: Workload, timing: Timing, devices: Devices, *, prepared: bool) -> Row:
    """One row: `write()`/`read()` + `wait()` per iteration, or with `prepared` one prepared transfer posted again and again."""
    src, dst = tensors
    conn, proc = target
    so, do, ln = make_ranges(w)
    args: tuple[Any, Any, Any] = (int(so[0]), int(do[0]), int(ln[0])) if w.batch_size == 1 else (so, do, ln)
    # WRITE(our source, their destination, so, do) and READ(our destination, their source, so, do): the same ranges
    local, remote = (mine.src, theirs.dst) if op == "WRITE" else (mine.dst, theirs.src)
    natural = agent.path_to(local, remote).path.value
    forced = None if natural == peer.path else peer.path
    conn.send(("prep", w))
    if op == "READ":
        poison(dst, w.total_size)
        synchronize(dst)
    receive(conn, "ready", procs=[proc])
    if prepared:
        prepare = agent.prepare_write if op == "WRITE" else agent.prepare_read
        post = prepare(local, remote, *args, path=forced).post
    else:
        start = agent.write if op == "WRITE" else agent.read

        def post() -> Any:
            return start(local, remote, *args, path=forced)

    first = post()
    first.wait()
    if first.path != peer.path:
        raise NoPathError(f"asked for path {peer.path} but the agent moved {w.name} over {first.path}")

    def step() -> None:
        post().wait()

    times = measure_row(step, timing, w)
    if op == "WRITE":
        conn.send(("verify", w))
        ok = receive(conn, "verified", procs=[proc])[1]
    else:
        synchronize(dst)
        ok = verify(dst, src, w, so, do)
    verb = op.lower()
    call = f"prepare_{verb}() once, post() + wait()" if prepared else f"{verb}() + wait()"
    how = f"path {peer.path}" + (" (forced: negotiation picked " + natural + ")" if forced else " (negotiated)")
    detail = f"HMC agent {call}, {devices.src} process <-> {devices.dst} process, {peer.what}; {how}"
    return gpu_row("hmc-prepared" if prepared else "hmc", peer.label, w, times, ok, detail, op=op)
