"""HMC's own rows in the GPU benchmark (`bench/gpu.py`): the plug-in point for the CUDA paths.

The benchmark calls `hmc_rows(workloads, timing, on_row)` in a child process of
its own (not a daemon: it may start more) after the baselines, with the same
workloads and timing, and records what it returns next to them; the ratio checks
of issue 3 (`_gpu_run.gpu_checks`) read rows with system "hmc" and path "ipc" or
"staged". While `hmc.transport`'s CUDA ipc mover declares no CUDA memory,
`unavailable_reason()` says so and the benchmark records HMC as skipped. A path
that refuses device memory gives no rows (staged moves it between processes
of one host through its shared pinned ring, not yet between hosts); the other
paths are still measured.

What it measures once the paths exist (GPU0 -> GPU1, WRITE): an initiator Agent
(embedded, no hmcd) in this process with a torch tensor on cuda:0 registered as
the source; in a spawned child, a poisoned tensor on cuda:1 registered with two
target Agents: one as it is, one that declares cuda:1 an AMD device (vendor
override), so negotiation refuses vendor IPC and picks `staged`, what a real
NVIDIA-AMD pair gets. For each path of `HMC_PATHS` and each workload: the first
transfer checks the path the handle reports, then post + wait iterations are
timed, then the target checks every moved byte on its device. Both paths go
without `path=`: `ipc` to the plain agent's buffer, `staged` to the overriding
agent's. Single ranges up to 64 KiB are measured twice: `write()` + `wait()` per
iteration (system "hmc"), and one `prepare_write()` posted per iteration (system
"hmc-prepared"), as NIXL's rows repost one prepared request.

Concurrency: the caller's thread drives the agent; the target child is driven over a pipe.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from hmc.bench._child import receive, reap, send_error
from hmc.bench._gpu_common import apply_env, gpu_row, pattern, poison, sizes_of
from hmc.bench._timing import Row, Timing, measure
from hmc.bench._workloads import SEED, Workload, make_ranges
from hmc.errors import NoPathError, UnavailableError, UnsupportedError

__all__ = ["HMC_PATHS", "hmc_rows", "unavailable_reason"]

_log = logging.getLogger(__name__)

PREPARED_MAX_BYTES = 64 << 10
"""Single ranges up to this size are measured a second time as a prepared write (system "hmc-prepared")."""
HMC_PATHS = ("ipc", "staged")
"""HMC's paths measured between the GPU0 and GPU1 processes (rows: system "hmc", path as named)."""
STARTUP_TIMEOUT_S = 180.0
VENDOR_OVERRIDE = {"cuda:1": "amd"}
"""The second target agent's declaration: cuda:1 is "AMD", so only staged serves the pair."""


def unavailable_reason() -> str | None:
    """Why HMC cannot move CUDA memory between processes in this build (None: it can)."""
    try:
        from hmc.memory import DeviceKind
        from hmc.transport._cuda_ipc import CudaIpcTransport
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return f"hmc.transport does not import: {type(exc).__name__}: {exc}"
    kinds = CudaIpcTransport.capabilities.memory_kinds  # a declaration: the parent never touches CUDA
    if DeviceKind.CUDA not in kinds:
        names = ", ".join(sorted(k.name for k in kinds))
        return f"CUDA paths not implemented yet (hmc.transport's CUDA ipc mover moves {names} memory only)"
    return None


def _target(conn: Connection, size: int) -> None:
    """Child on cuda:1: a target Agent holding one poisoned tensor; poisons and checks on request."""
    try:
        apply_env()
        import torch

        from hmc.agent import Agent
        from hmc.bench._gpu_baselines import _serve_destination
        from hmc.config import Config

        torch.cuda.set_device(1)
        dst = torch.empty(size, dtype=torch.uint8, device="cuda:1")
        poison(dst, size)
        expected = pattern(size, SEED, torch.device("cuda", 1))
        torch.cuda.synchronize()
        with Agent(Config(), daemon=False) as agent, Agent(Config(vendor_override=VENDOR_OVERRIDE), daemon=False) as amd:
            buffer = agent.register(dst, name="gpu-bench-target")
            declared = amd.register(dst, name="gpu-bench-target-amd")
            conn.send(("descriptor", buffer.descriptor.SerializeToString(), declared.descriptor.SerializeToString()))
            _serve_destination(conn, dst, expected)
    except BaseException:
        send_error(conn)


def hmc_rows(workloads: Sequence[Workload], timing: Timing, on_row: Callable[[Row], None]) -> list[Row]:
    """One row per (path of HMC_PATHS, workload); UnavailableError when HMC has no CUDA path yet."""
    reason = unavailable_reason()
    if reason is not None:
        raise UnavailableError(reason)
    apply_env()
    import torch

    from hmc.agent import Agent
    from hmc.config import Config
    from hmc.v1 import common_pb2

    torch.cuda.set_device(0)
    size = sizes_of(workloads)
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    proc = context.Process(target=_target, args=(child_conn, size), name="hmc-gpu-bench-target", daemon=True)
    proc.start()
    child_conn.close()
    rows: list[Row] = []
    try:
        with contextlib.ExitStack() as stack:
            agent = stack.enter_context(Agent(Config(), daemon=False))
            src = pattern(size, SEED, torch.device("cuda", 0))
            torch.cuda.synchronize()
            local = agent.register(src, name="gpu-bench-src")
            message = receive(conn, "descriptor", STARTUP_TIMEOUT_S, procs=[proc])
            remotes = {"ipc": common_pb2.BufferDescriptor.FromString(message[1]), "staged": common_pb2.BufferDescriptor.FromString(message[2])}
            for path in HMC_PATHS:
                for w in workloads:
                    try:
                        measured = [_one(agent, local, remotes[path], conn, proc, path, w, timing)]
                        if w.batch_size == 1 and w.nbytes <= PREPARED_MAX_BYTES:
                            measured.append(_one(agent, local, remotes[path], conn, proc, path, w, timing, prepared=True))
                    except UnsupportedError as exc:  # this path cannot move device memory in this build: no rows
                        _log.warning("hmc %s measures nothing: %s", path, exc)
                        break
                    for row in measured:
                        rows.append(row)
                        on_row(row)
            conn.send(("quit",))
    finally:
        conn.close()
        reap(proc)
    return rows


def _one(agent: Any, local: Any, remote: Any, conn: Connection, proc: Any, path: str, w: Workload, timing: Timing, *, prepared: bool = False) -> Row:
    """One row: write() + wait() per iteration, or with `prepared` one prepared write posted again and again
    (system "hmc-prepared": what NIXL's rows do with their prepared request)."""
    so, do, ln = make_ranges(w)
    args: tuple[Any, Any, Any] = (int(so[0]), int(do[0]), int(ln[0])) if w.batch_size == 1 else (so, do, ln)
    natural = agent.path_to(local, remote).path.value
    forced = None if natural == path else path
    conn.send(("prep", w))
    receive(conn, "ready", procs=[proc])
    if prepared:
        post = agent.prepare_write(local, remote, *args, path=forced).post
    else:
        write = agent.write

        def post() -> Any:
            return write(local, remote, *args, path=forced)

    first = post()
    first.wait()
    if first.path != path:
        raise NoPathError(f"asked for path {path} but the agent moved {w.name} over {first.path}")

    def step() -> None:
        post().wait()

    times = measure(step, timing)
    conn.send(("verify", w))
    ok = receive(conn, "verified", procs=[proc])[1]
    declared = " (negotiated: the target declares cuda:1 AMD by vendor override)" if remote.device.vendor != local.descriptor.device.vendor else " (negotiated)"
    how = "prepare_write() once, post() + wait()" if prepared else "write() + wait()"
    detail = f"HMC agent {how}, GPU0 process -> GPU1 process, path {path}" + (" (forced)" if forced else declared)
    return gpu_row("hmc-prepared" if prepared else "hmc", path, w, times, ok, detail)
