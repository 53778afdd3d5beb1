"""The NIXL baseline of `hmc bench`: NIXL 1.5.1's Python API, UCX backend, host memory.

Two agents in two spawned processes (initiator and target), metadata exchanged
over a pipe (no etcd), WRITE and READ, one transfer request per workload and op,
reposted every iteration as nixlbench does. `env` (e.g. UCX_TLS=tcp for the
"nixl-tcp" system) is set in both children before NIXL, and with it UCX, is
imported. As in nixlbench (`--enable_pt` off) the agents run without NIXL's
progress thread (whose thread spins a core per agent): the initiator polls its
request and the idle target drives progress by calling `get_new_notifs`, which
UCX wire-up and TCP data need. Every wait is bounded.

Install on a CPU-only machine: `pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1`.
Where `nixl-cu12` pulled in a CUDA 13 torch, the `nixl` meta package refuses to
import ("detected CUDA 13 but nixl-cu13 is not installed"), so the wheel's own
module (`nixl_cu12._api`) is the fallback.

Concurrency: the caller waits on the initiator's result pipe; the two children
talk to each other over their own pipe.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

import numpy as np

from hmc.bench._child import MESSAGE_TIMEOUT_S, RUN_TIMEOUT_S, reap, receive, send_error
from hmc.bench._timing import Row, Timing, make_row, measure
from hmc.bench._workloads import POISON, SEED, Workload, make_ranges, random_bytes
from hmc.errors import TimeoutError, UnavailableError
from hmc.agent._peer_process import ranges_digest

__all__ = ["INSTALL_HINT", "NIXL_SYSTEMS", "finish_initiator", "import_nixl", "new_agent", "nixl_available", "nixl_rows", "reposter"]

INSTALL_HINT = "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1"
NIXL_SYSTEMS: dict[str, dict[str, str]] = {"nixl": {}, "nixl-tcp": {"UCX_TLS": "tcp"}}
"""System name -> environment of both NIXL processes."""
_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
_DISTRIBUTIONS = ("nixl", "nixl-cu12", "nixl-cu13")


def import_nixl() -> ModuleType:
    """NIXL's `_api` module: the meta package first, then the wheels directly."""
    errors = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("; ".join(errors))


def nixl_available(install_hint: str = INSTALL_HINT) -> tuple[bool, str]:
    """(True, 'nixl <version>') when NIXL's Python API imports here, else (False, why + how to install)."""
    try:
        import_nixl()
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return False, f"NIXL is not importable ({type(exc).__name__}: {exc}); install it with: {install_hint}"
    for dist in _DISTRIBUTIONS:
        try:
            return True, f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            pass
    return True, "nixl (unknown version)"


def new_agent(name: str, env: dict[str, str] | None = None) -> Any:
    """A UCX agent without NIXL's progress thread; `env` is applied before NIXL and UCX load here."""
    os.environ.update(env or {})
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    api = import_nixl()
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _agent(name: str, env: dict[str, str], buffers: Sequence[np.ndarray]) -> tuple[Any, Any]:
    """A new agent with `buffers` registered as host memory."""
    agent = new_agent(name, env)
    regs = np.array([(b.ctypes.data, b.nbytes, 0) for b in buffers], dtype=np.uint64)
    return agent, agent.register_memory(regs, "DRAM")


def finish_initiator(agent: Any, peer: Any, regs: Any, conn: Connection, out: Connection) -> None:
    """An initiator child's last steps: release the target, drop the peer and the registrations, report done."""
    conn.send(("quit",))
    agent.remove_remote_agent(peer)
    agent.deregister_memory(regs)
    out.send(("done",))


def reposter(agent: Any, handle: Any, label: str) -> Callable[[], None]:
    """One timed iteration: repost the prepared request and poll it to DONE (bounded)."""
    transfer, check = agent.transfer, agent.check_xfer_state

    def step() -> None:
        state = transfer(handle)
        deadline = time.perf_counter() + MESSAGE_TIMEOUT_S
        while state == "PROC":
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{label}: transfer not done within {MESSAGE_TIMEOUT_S:.0f} s")
            state = check(handle)
        if state != "DONE":
            raise RuntimeError(f"{label}: transfer state {state}")

    return step


def _descs(base: int, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Nx3 uint64 (address, length, device id)."""
    out = np.zeros((len(offsets), 3), dtype=np.uint64)
    out[:, 0] = offsets.astype(np.uint64) + np.uint64(base)
    out[:, 1] = lengths.astype(np.uint64)
    return out


def _target(conn: Connection, env: dict[str, str], size: int) -> None:
    """Child: the passive agent, with a random source (for READ) and a poisoned destination."""
    try:
        src, dst = random_bytes(size, SEED + 1), np.full(size, POISON, dtype=np.uint8)
        agent, regs = _agent("hmc-bench-target", env, [src, dst])
        conn.send(("md", agent.get_agent_metadata(), src.ctypes.data, dst.ctypes.data))
        while True:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while not conn.poll(0) and time.monotonic() < deadline:
                agent.get_new_notifs()  # drives the UCX worker's progress
            message = receive(conn, "", 1.0)
            if message[0] == "prep":
                dst[: message[1].total_size].fill(POISON)
                conn.send(("ready",))
            elif message[0] == "digest":
                so, do, ln = make_ranges(message[1])
                conn.send(("digest", ranges_digest(dst, do, ln) if message[2] == "WRITE" else ranges_digest(src, so, ln)))
            else:
                break
        agent.deregister_memory(regs)
    except BaseException:
        send_error(conn)


def _initiator(conn: Connection, out: Connection, system: str, env: dict[str, str], workloads: Sequence[Workload], ops: Sequence[str], timing: Timing) -> None:
    """Child: the active agent; one transfer request per workload and op, reposted per iteration."""
    try:
        size = max(w.total_size for w in workloads)
        src, dst = random_bytes(size, SEED), np.empty(size, dtype=np.uint8)
        agent, regs = _agent("hmc-bench-initiator", env, [src, dst])
        _, metadata, remote_src, remote_dst = receive(conn, "md", 120.0)
        peer = agent.add_remote_agent(metadata)
        path = " ".join(["UCX"] + [f"{k}={v}" for k, v in sorted(env.items())]) if env else "UCX (defaults)"
        for op in ops:
            for w in workloads:
                out.send(("row", _one(agent, peer, conn, system, path, op, w, (src, dst, remote_src, remote_dst), timing)))
        finish_initiator(agent, peer, regs, conn, out)
    except BaseException:
        send_error(out, conn)


def _one(agent: Any, peer: Any, conn: Connection, system: str, path: str, op: str, w: Workload, buffers: tuple[np.ndarray, np.ndarray, int, int], timing: Timing) -> Row:
    src, dst, remote_src, remote_dst = buffers
    so, do, ln = make_ranges(w)
    conn.send(("prep", w))
    dst[: w.total_size].fill(POISON)
    receive(conn, "ready")
    if op == "WRITE":
        local, remote = _descs(src.ctypes.data, so, ln), _descs(remote_dst, do, ln)
    else:
        local, remote = _descs(dst.ctypes.data, do, ln), _descs(remote_src, so, ln)
    handle = agent.initialize_xfer(op, agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), peer)
    step = reposter(agent, handle, f"nixl {op} {w.name}")

    times = measure(step, timing)
    agent.release_xfer_handle(handle)
    conn.send(("digest", w, op))
    mine = ranges_digest(src, so, ln) if op == "WRITE" else ranges_digest(dst, do, ln)
    return make_row(system, path, op, w, times, receive(conn, "digest")[1] == mine)


def nixl_rows(system: str, workloads: Sequence[Workload], ops: Sequence[str], timing: Timing, on_row: Callable[[Row], None]) -> list[Row]:
    """NIXL transfers between two agent processes, one row per (op, workload) as they finish.

    UnavailableError when NIXL does not import here; BrokenResourceError/TimeoutError
    when a child fails or stalls.
    """
    ok, why = nixl_available()
    if not ok:
        raise UnavailableError(why)
    env = NIXL_SYSTEMS[system]
    context = multiprocessing.get_context("spawn")
    initiator_conn, target_conn = context.Pipe()
    result_recv, result_send = context.Pipe(duplex=False)
    size = max(w.total_size for w in workloads)
    target = context.Process(target=_target, args=(target_conn, env, size), name="hmc-bench-nixl-target", daemon=True)
    initiator = context.Process(
        target=_initiator, args=(initiator_conn, result_send, system, env, list(workloads), list(ops), timing),
        name="hmc-bench-nixl-initiator", daemon=True,
    )
    target.start()
    initiator.start()
    for end in (initiator_conn, target_conn, result_send):
        end.close()
    rows: list[Row] = []
    try:
        while (message := receive(result_recv, "", RUN_TIMEOUT_S, procs=[initiator, target]))[0] == "row":
            rows.append(message[1])
            on_row(message[1])
    finally:
        result_recv.close()
        reap(initiator, target)
    return rows
