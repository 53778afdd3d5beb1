"""The GPU benchmark's NIXL rows: NIXL 1.5.x, UCX backend with default settings, VRAM -> VRAM, two processes.

As nixlbench does and as `hmc.bench._nixl` does on host memory: an initiator
agent on GPU0 and a target agent on GPU1 in two spawned processes, metadata
exchanged over a pipe (no etcd), torch tensors registered (VRAM), one WRITE
request per workload prepared once and reposted every iteration, no progress
thread (the initiator polls its request, the idle target drives progress with
`get_new_notifs`). NIXL's wheel is `nixl-cu13` (with the `nixl` meta package),
installed without dependencies. Every wait is bounded.

Concurrency: each child runs on its main thread; they talk over their own pipe.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from hmc.bench._child import RUN_TIMEOUT_S, receive, send_error
from hmc.bench._gpu_common import apply_env, gpu_row, pattern, poison, sizes_of
from hmc.bench._nixl import finish_initiator, new_agent, reposter
from hmc.bench._nixl import nixl_available as host_nixl_available
from hmc.bench._timing import Timing, measure
from hmc.bench._workloads import SEED, Workload, make_ranges

__all__ = ["nixl_available", "nixl_initiator", "nixl_target"]

STARTUP_TIMEOUT_S = 180.0
INSTALL_HINT = "pip install --no-deps nixl-cu13==1.5.1 nixl==1.5.1"


def nixl_available() -> tuple[bool, str]:
    """Whether NIXL imports here, with the GPU wheel's install hint."""
    return host_nixl_available(INSTALL_HINT)


def _agent(name: str, tensors: Sequence[Any]) -> tuple[Any, Any]:
    agent = new_agent(name)
    return agent, agent.register_memory(list(tensors))


def _mem_type(tensor: Any) -> tuple[str, int]:
    return ("VRAM", tensor.get_device()) if tensor.is_cuda else ("DRAM", 0)


def _descs(base: int, offsets: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    """Nx3 uint64 (address, length, device id)."""
    out = np.empty((len(offsets), 3), dtype=np.uint64)
    out[:, 0] = offsets.astype(np.uint64) + np.uint64(base)
    out[:, 1] = lengths.astype(np.uint64)
    out[:, 2] = device
    return out


def nixl_target(conn: Connection, size: int, device: str = "cuda:1") -> None:
    """Child: the passive agent with a poisoned destination; drives UCX progress while idle."""
    try:
        apply_env()
        import torch

        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dst = torch.empty(size, dtype=torch.uint8, device=dev)
        poison(dst, size)
        expected = pattern(size, SEED, dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        agent, regs = _agent("hmc-gpu-bench-target", [dst])
        mem, index = _mem_type(dst)
        conn.send(("md", agent.get_agent_metadata(), dst.data_ptr(), index, mem))

        def progress(c: Connection) -> None:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while not c.poll(0) and time.monotonic() < deadline:
                agent.get_new_notifs()

        from hmc.bench._gpu_baselines import _serve_destination

        _serve_destination(conn, dst, expected, idle=progress)
        agent.deregister_memory(regs)
    except BaseException:
        send_error(conn)


def nixl_initiator(conn: Connection, out: Connection, workloads: Sequence[Workload], timing: Timing, device: str = "cuda:0") -> None:
    """Child: the active agent on `device`; one prepared WRITE per workload, reposted per iteration."""
    try:
        apply_env()
        import torch

        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        src = pattern(sizes_of(workloads), SEED, dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        agent, regs = _agent("hmc-gpu-bench-initiator", [src])
        _, metadata, remote_base, remote_index, remote_mem = receive(conn, "md", STARTUP_TIMEOUT_S)
        peer = agent.add_remote_agent(metadata)
        mem, index = _mem_type(src)
        for w in workloads:
            out.send(("row", _one(agent, peer, conn, w, timing, (src.data_ptr(), index, mem), (remote_base, remote_index, remote_mem))))
        finish_initiator(agent, peer, regs, conn, out)
    except BaseException:
        send_error(out, conn)


def _one(agent: Any, peer: Any, conn: Connection, w: Workload, timing: Timing, local: tuple[int, int, str], remote: tuple[int, int, str]) -> Any:
    so, do, ln = make_ranges(w)
    conn.send(("prep", w))
    receive(conn, "ready")
    handle = agent.initialize_xfer(
        "WRITE",
        agent.get_xfer_descs(_descs(local[0], so, ln, local[1]), local[2]),
        agent.get_xfer_descs(_descs(remote[0], do, ln, remote[1]), remote[2]),
        peer,
    )
    step = reposter(agent, handle, f"nixl WRITE {w.name}")

    try:
        times = measure(step, timing)
    finally:
        agent.release_xfer_handle(handle)
    conn.send(("verify", w))
    ok = receive(conn, "verified")[1]
    detail = f"two processes, NIXL UCX backend (default settings), {local[2]}->{remote[2]}, one prepared request reposted, no progress thread"
    return gpu_row("nixl", "UCX", w, times, ok, detail)
