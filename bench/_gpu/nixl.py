"""The GPU benchmark's NIXL rows: NIXL 1.5.x, UCX backend, VRAM <-> VRAM, two processes, WRITE and READ.

As nixlbench does and as `hmc.bench._nixl` does on host memory: an initiator
agent on the source device and a target agent on the destination device (both
cuda:0 on one GPU) in two spawned processes, metadata exchanged over a pipe (no
etcd), torch tensors registered (VRAM: a source and a destination on each side),
one request per workload and op prepared once and reposted every iteration, no
progress thread (the initiator polls its request, the idle target drives
progress with `get_new_notifs`). WRITE checks the target's destination there;
READ pulls the target's pattern into the initiator's poisoned destination and
checks it here.

Systems (`_gpu.harness.NIXL_GPU_SYSTEMS`, each in its own pair of processes, its environment
set before NIXL and UCX load):

    nixl                 UCX defaults (on NVIDIA: cuda_ipc between the processes)
    nixl-tcp-cuda-copy   UCX_TLS=tcp,cuda_copy: what NIXL does between GPUs of two vendors
                         without RDMA (no vendor IPC): device memory through host copies and TCP,
                         the anchor of HMC's cross-vendor (staged) rows

NIXL's wheel is `nixl-cu13` (with the `nixl` meta package), installed without
dependencies. Every wait is bounded.

Concurrency: each child runs on its main thread; they talk over their own pipe.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from _gpu.harness import OPS, apply_env, gpu_row, measure_row, poison, serve_destination, sizes_of, source_and_destination, synchronize, verify
from hmc.bench._child import RUN_TIMEOUT_S, receive, send_error
from hmc.bench._nixl import finish_initiator, new_agent, reposter
from hmc.bench._nixl import nixl_available as host_nixl_available
from hmc.bench._timing import Row, Timing
from hmc.bench._workloads import Workload, make_ranges

__all__ = ["nixl_available", "nixl_initiator", "nixl_target"]

STARTUP_TIMEOUT_S = 180.0
INSTALL_HINT = "pip install --no-deps nixl-cu13==1.5.1 nixl==1.5.1"


def nixl_available() -> tuple[bool, str]:
    """Whether NIXL imports here, with the GPU wheel's install hint."""
    return host_nixl_available(INSTALL_HINT)


def _mem_type(tensor: Any) -> tuple[str, int]:
    return ("VRAM", tensor.get_device()) if tensor.is_cuda else ("DRAM", 0)


def _descs(base: int, offsets: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    """Nx3 uint64 (address, length, device id)."""
    out = np.empty((len(offsets), 3), dtype=np.uint64)
    out[:, 0] = offsets.astype(np.uint64) + np.uint64(base)
    out[:, 1] = lengths.astype(np.uint64)
    out[:, 2] = device
    return out


def _path(env: Mapping[str, str]) -> str:
    return " ".join(["UCX", *(f"{k}={v}" for k, v in sorted(env.items()))])


def nixl_target(conn: Connection, size: int, device: str = "cuda:1", env: Mapping[str, str] | None = None) -> None:
    """Child: the passive agent with a pattern source (READ's, and what WRITE must leave) and a poisoned destination;
    drives UCX progress while idle."""
    try:
        apply_env(dict(env or {}))
        src, dst = source_and_destination(size, device)
        agent = new_agent("hmc-gpu-bench-target")
        regs = agent.register_memory([src, dst])
        mem, index = _mem_type(dst)
        conn.send(("md", agent.get_agent_metadata(), src.data_ptr(), dst.data_ptr(), index, mem))

        def progress(c: Connection) -> None:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while not c.poll(0) and time.monotonic() < deadline:
                agent.get_new_notifs()

        serve_destination(conn, dst, src, idle=progress)
        agent.deregister_memory(regs)
    except BaseException:
        send_error(conn)


def nixl_initiator(conn: Connection, out: Connection, system: str, workloads: Sequence[Workload], timing: Timing,
                   device: str = "cuda:0", env: Mapping[str, str] | None = None) -> None:
    """Child: the active agent on `device`; per op and workload one prepared request, reposted per iteration."""
    try:
        apply_env(dict(env or {}))
        src, dst = source_and_destination(sizes_of(workloads), device)
        agent = new_agent("hmc-gpu-bench-initiator")
        regs = agent.register_memory([src, dst])
        _, metadata, remote_src, remote_dst, remote_index, remote_mem = receive(conn, "md", STARTUP_TIMEOUT_S)
        peer = agent.add_remote_agent(metadata)
        mem, index = _mem_type(src)
        local = (src, dst, index, mem)
        remote = (remote_src, remote_dst, remote_index, remote_mem)
        for op in OPS:
            for w in workloads:
                out.send(("row", _one(agent, peer, conn, system, _path(env or {}), op, w, timing, local, remote)))
        finish_initiator(agent, peer, regs, conn, out)
    except BaseException:
        send_error(out, conn)


def _one(agent: Any, peer: Any, conn: Connection, system: str, path: str, op: str, w: Workload, timing: Timing,
         local: tuple[Any, Any, int, str], remote: tuple[int, int, int, str]) -> Row:
    src, dst, index, mem = local
    remote_src, remote_dst, remote_index, remote_mem = remote
    so, do, ln = make_ranges(w)
    conn.send(("prep", w))
    if op == "READ":
        poison(dst, w.total_size)
        synchronize(dst)
    receive(conn, "ready")
    if op == "WRITE":
        mine, theirs = _descs(src.data_ptr(), so, ln, index), _descs(remote_dst, do, ln, remote_index)
    else:
        mine, theirs = _descs(dst.data_ptr(), do, ln, index), _descs(remote_src, so, ln, remote_index)
    handle = agent.initialize_xfer(op, agent.get_xfer_descs(mine, mem), agent.get_xfer_descs(theirs, remote_mem), peer)
    try:
        times = measure_row(reposter(agent, handle, f"{system} {op} {w.name}"), timing, w)
    finally:
        agent.release_xfer_handle(handle)
    if op == "WRITE":
        conn.send(("verify", w))
        ok = receive(conn, "verified")[1]
    else:
        synchronize(dst)
        ok = verify(dst, src, w, so, do)  # the target's source is the same pattern as ours
    detail = f"two processes, NIXL {path}, {op} of remote {remote_mem} from local {mem}, one prepared request reposted, no progress thread"
    return gpu_row(system, path, w, times, ok, detail, op=op)
