"""The GPU benchmark's baselines, each in child processes of its own, source on `Devices.src`, destination on `.dst`.

Systems (row `system`, `path`):

    device-copy  torch      one process: `dst0.copy_(src0)` on cuda:0 (same GPU), bulk: the ceiling of
                            a copy between two processes on one GPU (CUDA IPC)
    peer-copy    torch      one process: `dst1.copy_(src0)` (cudaMemcpyPeerAsync), bulk; two GPUs only
    pinned-d2h   torch      one process: cuda:0 -> pinned host, non_blocking copy_, bulk
    pinned-h2d   torch      one process: pinned host -> cuda:0, bulk (with D2H: the staged ceiling)
    pinned-both  torch      one process: cuda:0 -> pinned host and pinned host -> cuda:0 at once, on two
                            streams, bulk; GB/s per direction: the ceiling of a staged pair whose two
                            ends share one GPU (its PCIe link carries both directions)
    pinned-across torch     the same with the H2D into cuda:1, bulk; two GPUs only: the ceiling of a staged
                            pair across two GPUs (each end's link and the host between them, both busy)
    pinned-ring  cuda       one process: through a pinned ring of staged's geometry, the hand-off between
                            slots on the GPUs (`_gpu.ring`), bulk: what any ring of that geometry can reach
    torch-gather torch      one process: index_select on the source device -> (peer copy) -> index_copy_
                            on the destination device, KV
    copy-kernel  push/pull  one process: the copy kernel (one block per range) on cuda:0 writing the
                            destination (push) or, on two GPUs, on cuda:1 reading cuda:0 (pull), bulk and KV
    cuda-ipc     memcpy/kernel  two processes: the destination's process exports a cudaMalloc'd buffer
                            (cudaIpcGetMemHandle); the source's process opens it and writes into it
                            with cudaMemcpyAsync (bulk) or the copy kernel (bulk and KV); on one GPU
                            both processes are on cuda:0
    nccl         send/recv  two processes, torch.distributed (NCCL, FileStore), bulk; two GPUs only
                            (NCCL refuses two ranks on one device)
    nccl-nop2p   send/recv  the same with NCCL_P2P_DISABLE=1 (host-staged through shared memory)

NIXL is in `_gpu.nixl`, HMC in `_gpu.hmc_rows`. Every row: random source data
(`pattern`), destination poisoned before the workload, post + wait timed per
iteration, then every moved byte checked once on the destination's device
(`torch.equal`), in the process that owns it; `pipelined_gbps` adds the rate of
back-to-back posts. NCCL iterations are timed on the sender (send + stream sync)
while the receiver has its receives posted for the whole batch.

Each child sends ("row", row) per measurement, ("done",) at the end, or
("error", traceback); the parent (`_gpu.run`) bounds every wait and kills the
children when one stalls.

Concurrency: each child runs its measurements on its main thread.
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from _gpu.harness import (
    CupyEventTimer,
    Devices,
    TorchEventTimer,
    WallTimer,
    apply_env,
    gpu_row,
    measure_row,
    pattern,
    pipeline_count,
    pipelined_gbps,
    poison,
    serve_destination,
    sizes_of,
    verify,
)
from _gpu.ring import pinned_ring
from hmc.bench._child import receive, send_error
from hmc.bench._timing import Timing
from hmc.bench._workloads import SEED, Workload, make_ranges

__all__ = ["LOCAL_SYSTEMS", "NCCL_SYSTEMS", "TWO_GPU_SYSTEMS", "ipc_initiator", "ipc_target", "local_child", "nccl_rank", "probe_child"]

LOCAL_SYSTEMS = (
    "device-copy", "peer-copy", "pinned-d2h", "pinned-h2d", "pinned-both", "pinned-across", "pinned-ring", "torch-gather", "copy-kernel",
)
"""Systems measured in one process that sees every GPU of the run."""
NCCL_SYSTEMS: dict[str, dict[str, str]] = {"nccl": {}, "nccl-nop2p": {"NCCL_P2P_DISABLE": "1"}}
"""System name -> extra environment of both ranks."""
TWO_GPU_SYSTEMS = {
    "peer-copy": "a copy between two GPUs",
    "pinned-across": "a D2H on one GPU and an H2D on another",
    "nccl": "NCCL refuses two ranks on one GPU",
    "nccl-nop2p": "NCCL refuses two ranks on one GPU",
}
"""Systems that need two GPUs, and why."""
STARTUP_TIMEOUT_S = 180.0
"""A peer's first message (torch import, CUDA and NCCL or UCX set-up)."""
CUDA_MEMCPY_DEFAULT = 4
"""cudaMemcpyDefault: direction from the pointers (unified addressing)."""


def _bulk(workloads: Sequence[Workload]) -> list[Workload]:
    return [w for w in workloads if not w.random]


def _kv(workloads: Sequence[Workload]) -> list[Workload]:
    return [w for w in workloads if w.random]


def _index(device: str) -> int:
    """'cuda:1' -> 1."""
    return int(device.rpartition(":")[2] or 0)


# -- probe ------------------------------------------------------------------------


def _run_text(argv: list[str]) -> str | None:
    import subprocess

    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{argv[0]}: {exc}"
    return done.stdout.strip() or done.stderr.strip() or None


def _dist_version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe_child(out: Connection) -> None:
    """Child: devices, peer access, driver and library versions -> ("info", dict), ("done",).

    Where torch does not import or sees no GPU, `device_count` is 0 and `why` says so.
    """
    try:
        apply_env()
        try:
            import torch
        except ImportError as exc:
            out.send(("info", {"device_count": 0, "devices": [], "why": f"torch is not importable ({exc})"}))
            out.send(("done",))
            return
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = []
        for index in range(count):
            props = torch.cuda.get_device_properties(index)
            devices.append({
                "index": index,
                "name": props.name,
                "total_memory": props.total_memory,
                "multiprocessors": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}",
                "uuid": str(getattr(props, "uuid", "")),
            })
        nccl = None
        if count:
            try:
                version = torch.cuda.nccl.version()
                nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
            except Exception as exc:  # noqa: BLE001 - informative only
                nccl = f"unknown ({type(exc).__name__})"
        info: dict[str, Any] = {
            "device_count": count,
            "devices": devices,
            "peer_access": {f"{a}->{b}": torch.cuda.can_device_access_peer(a, b) for a in range(count) for b in range(count) if a != b},
            "nvidia_smi": _run_text(["nvidia-smi", "--query-gpu=index,name,driver_version,pci.bus_id,memory.total", "--format=csv,noheader"]),
            "topology": _run_text(["nvidia-smi", "topo", "-m"]),
            "versions": {
                "torch": torch.__version__,
                "torch_cuda": torch.version.cuda,
                "nccl": nccl,
                "cupy": _dist_version("cupy-cuda13x") or _dist_version("cupy-cuda12x") or _dist_version("cupy"),
                "cuda-bindings": _dist_version("cuda-bindings"),
                "nixl": _dist_version("nixl"),
                "nixl-cu13": _dist_version("nixl-cu13"),
                "nixl-cu12": _dist_version("nixl-cu12"),
            },
            "env": {key: os.environ.get(key) for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "CUDA_VISIBLE_DEVICES")},
        }
        if not count:
            info["why"] = f"torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is {torch.cuda.is_available()})"
        else:
            try:
                import cupy

                info["driver_version"] = cupy.cuda.runtime.driverGetVersion()
                info["runtime_version"] = cupy.cuda.runtime.runtimeGetVersion()
            except Exception as exc:  # noqa: BLE001 - informative only
                info["driver_version"] = f"unknown ({type(exc).__name__}: {exc})"
        out.send(("info", info))
        out.send(("done",))
    except BaseException:
        send_error(out)


# -- one process ------------------------------------------------------------------


class _Local:
    """The tensors of the one-process systems: source and a destination on the source's GPU, a destination on the
    other GPU (the same tensor on one GPU), pinned host memory."""

    def __init__(self, size: int, devices: Devices) -> None:
        import torch

        self.torch = torch
        self.devices = devices
        self.d0, self.d1 = torch.device(devices.src), torch.device(devices.dst)
        torch.cuda.set_device(self.d0)
        self.src0 = pattern(size, SEED, self.d0)
        self.dst0 = torch.empty(size, dtype=torch.uint8, device=self.d0)
        if devices.same:
            self.dst1, self.expected1 = self.dst0, self.src0
        else:
            self.dst1 = torch.empty(size, dtype=torch.uint8, device=self.d1)
            self.expected1 = pattern(size, SEED, self.d1)
        self.host: Any = None
        self.host_out: Any = None
        self.size = size
        self.sync()

    def pinned(self) -> Any:
        if self.host is None:
            self.host = self.torch.empty(self.size, dtype=self.torch.uint8, pin_memory=True)
        return self.host

    def pinned_out(self) -> Any:
        """A second pinned buffer: what `pinned-both` copies out of the GPU while it copies `pinned()` in."""
        if self.host_out is None:
            self.host_out = self.torch.empty(self.size, dtype=self.torch.uint8, pin_memory=True)
        return self.host_out

    def stream(self, device: Any) -> Any:
        return self.torch.cuda.current_stream(device)

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.d0)
        self.torch.cuda.synchronize(self.d1)


def _timed_copy(dst: Any, src: Any, w: Workload, timing: Timing, stream: Any, done: Callable[[], None]) -> tuple[Any, float]:
    """Iterations of `dst.copy_(src, non_blocking=True)` + `done()`; the times and the pipelined rate (`stream`'s events)."""

    def post() -> None:
        dst.copy_(src, non_blocking=True)

    def step() -> None:
        post()
        done()

    times = measure_row(step, timing, w)
    return times, pipelined_gbps(post, TorchEventTimer(stream), w.nbytes, times)


def _device_copy(t: _Local, w: Workload, timing: Timing) -> Any:
    n = w.nbytes
    poison(t.dst0, w.total_size)
    t.sync()
    stream = t.stream(t.d0)
    times, pipe = _timed_copy(t.dst0[:n], t.src0[:n], w, timing, stream, stream.synchronize)
    ok = verify(t.dst0, t.src0, w, *make_ranges(w)[:2])
    return gpu_row("device-copy", "torch", w, times, ok, f"one process: dst.copy_(src, non_blocking=True), both on {t.d0}; stream sync", pipe, "cuda-events")


def _peer_copy(t: _Local, w: Workload, timing: Timing) -> Any:
    n = w.nbytes
    poison(t.dst1, w.total_size)
    t.sync()
    # the copy runs on the source GPU's stream; the destination GPU's stream waits for it
    times, pipe = _timed_copy(t.dst1[:n], t.src0[:n], w, timing, t.stream(t.d0), t.stream(t.d1).synchronize)
    ok = verify(t.dst1, t.expected1, w, *make_ranges(w)[:2])
    return gpu_row("peer-copy", "torch", w, times, ok, f"one process: dst({t.d1}).copy_(src({t.d0}), non_blocking=True); wait on {t.d1}'s stream", pipe, "cuda-events")


def _pinned(t: _Local, w: Workload, timing: Timing, to_host: bool) -> Any:
    n = w.nbytes
    host = t.pinned()
    stream = t.stream(t.d0)
    if to_host:
        host[:n].fill_(0xA5)
        dst, src = host[:n], t.src0[:n]
    else:
        host[:n].copy_(t.src0[:n])  # what the copy brings back, outside the timing
        poison(t.dst0, w.total_size)
        dst, src = t.dst0[:n], host[:n]
    t.sync()
    times, pipe = _timed_copy(dst, src, w, timing, stream, stream.synchronize)
    if to_host:
        poison(t.dst0, w.total_size)
        t.dst0[:n].copy_(host[:n])  # back to the device, where the check runs
    ok = verify(t.dst0, t.src0, w, *make_ranges(w)[:2])
    if to_host:
        return gpu_row("pinned-d2h", "torch", w, times, ok, f"{t.d0} -> pinned host (torch pin_memory), copy_(non_blocking=True), stream sync", pipe, "cuda-events")
    return gpu_row("pinned-h2d", "torch", w, times, ok, f"pinned host -> {t.d0}, copy_(non_blocking=True), stream sync", pipe, "cuda-events")


def _torch_gather(t: _Local, w: Workload, timing: Timing) -> Any:
    torch = t.torch
    so, do, _ = make_ranges(w)
    block = w.block_size
    src_blocks = t.src0[: w.total_size].view(-1, block)
    dst_blocks = t.dst1[: w.total_size].view(-1, block)
    src_index = torch.from_numpy(so // block).to(t.d0)
    dst_index = torch.from_numpy(do // block).to(t.d1)
    stage0 = torch.empty((w.batch_size, block), dtype=torch.uint8, device=t.d0)
    stage1 = stage0 if t.devices.same else torch.empty((w.batch_size, block), dtype=torch.uint8, device=t.d1)
    poison(t.dst1, w.total_size)
    t.sync()
    done = t.stream(t.d1).synchronize

    def post() -> None:
        torch.index_select(src_blocks, 0, src_index, out=stage0)
        if stage1 is not stage0:
            stage1.copy_(stage0, non_blocking=True)
        dst_blocks.index_copy_(0, dst_index, stage1)

    def step() -> None:
        post()
        done()

    times = measure_row(step, timing, w)
    ok = verify(t.dst1, t.expected1, w, so, do)
    pipe = pipelined_gbps(post, WallTimer(t.sync), w.nbytes, times)
    how = f"index_select -> index_copy_ on {t.d0}" if t.devices.same else f"index_select on {t.d0} -> copy_ to {t.d1} -> index_copy_ on {t.d1}"
    return gpu_row("torch-gather", "torch", w, times, ok, f"one process: {how}", pipe, "wall")


def _copy_kernel(t: _Local, w: Workload, timing: Timing, push: bool, streams: dict[int, Any]) -> Any:
    from _gpu.kernel import RangeCopy

    so, do, ln = make_ranges(w)
    device = _index(t.devices.src if push else t.devices.dst)
    stream = streams[device]
    kernel = RangeCopy(device, t.src0.data_ptr(), t.dst1.data_ptr(), so, do, ln, stream)
    poison(t.dst1, w.total_size)
    t.sync()

    def step() -> None:
        kernel.post()
        stream.synchronize()

    times = measure_row(step, timing, w)
    ok = verify(t.dst1, t.expected1, w, so, do)
    pipe = pipelined_gbps(kernel.post, CupyEventTimer(stream, device), w.nbytes, times)
    where = (f"on {t.d0}, source and destination both on it" if t.devices.same
             else f"on {t.d0} writing {t.d1} over NVLink" if push else f"on {t.d1} reading {t.d0} over NVLink")
    detail = f"one process: copy kernel ({kernel.blocks} blocks of 256 threads, one per range of <= 64 KiB) {where}"
    return gpu_row("copy-kernel", "push" if push else "pull", w, times, ok, detail, pipe, "cuda-events")


def _pinned_both(t: _Local, w: Workload, timing: Timing, across: bool = False) -> Any:
    """D2H (from the source GPU) and H2D of `w.nbytes` each at once, on two streams; the H2D into the source GPU,
    or with `across` into the destination GPU; every byte of both results compared."""
    torch, n = t.torch, w.nbytes
    target, expected, d_in = (t.dst1, t.expected1, t.d1) if across else (t.dst0, t.src0, t.d0)
    into, out = t.pinned(), t.pinned_out()
    into[:n].copy_(expected[:n])
    out[:n].fill_(0xA5)
    poison(target, w.total_size)
    t.sync()
    down, up = torch.cuda.Stream(t.d0), torch.cuda.Stream(d_in)

    def step() -> None:
        with torch.cuda.stream(down):
            out[:n].copy_(t.src0[:n], non_blocking=True)
        with torch.cuda.stream(up):
            target[:n].copy_(into[:n], non_blocking=True)
        down.synchronize()
        up.synchronize()

    times = measure_row(step, timing, w)
    ok = verify(target, expected, w, *make_ranges(w)[:2]) and bool(torch.equal(out[:n].to(t.d0), t.src0[:n]))
    detail = f"{t.d0} -> pinned host and pinned host -> {d_in} at once (two streams); GB/s per direction"
    return gpu_row("pinned-across" if across else "pinned-both", "torch", w, times, ok, detail)


_BULK_SYSTEMS: dict[str, Callable[[_Local, Workload, Timing], Any]] = {
    "device-copy": _device_copy,
    "peer-copy": _peer_copy,
    "pinned-d2h": functools.partial(_pinned, to_host=True),
    "pinned-h2d": functools.partial(_pinned, to_host=False),
    "pinned-both": _pinned_both,
    "pinned-across": functools.partial(_pinned_both, across=True),
    "pinned-ring": pinned_ring,
}
"""The one-process systems that run every bulk workload, in the order they run."""


def local_child(out: Connection, workloads: Sequence[Workload], timing: Timing, systems: Sequence[str], devices: Devices) -> None:
    """Child: every one-process system in `systems` (LOCAL_SYSTEMS), rows as they finish."""
    try:
        apply_env()
        t = _Local(sizes_of(workloads), devices)
        bulk, kv = _bulk(workloads), _kv(workloads)
        for name, system in _BULK_SYSTEMS.items():
            if name in systems:
                for w in bulk:
                    out.send(("row", system(t, w, timing)))
        if "torch-gather" in systems:
            for w in kv:
                out.send(("row", _torch_gather(t, w, timing)))
        if "copy-kernel" in systems:
            _copy_kernels(out, t, workloads, timing)
        out.send(("done",))
    except BaseException:
        send_error(out)


def _copy_kernels(out: Connection, t: _Local, workloads: Sequence[Workload], timing: Timing) -> None:
    """The copy-kernel rows: push (and, on two GPUs, pull) on every workload."""
    import cupy

    from _gpu.kernel import enable_peer_access

    indices = sorted({_index(t.devices.src), _index(t.devices.dst)})
    if len(indices) == 2:
        enable_peer_access(indices[0], indices[1])
        enable_peer_access(indices[1], indices[0])
    streams = {}
    for device in indices:
        with cupy.cuda.Device(device):
            streams[device] = cupy.cuda.Stream(non_blocking=True)
    for push in (True,) if t.devices.same else (True, False):
        for w in workloads:
            out.send(("row", _copy_kernel(t, w, timing, push, streams)))


# -- CUDA IPC across two processes --------------------------------------------------


def _cupy_tensor(ptr: int, size: int, device: int) -> Any:
    """A torch uint8 tensor over `size` bytes of device memory at `ptr` (not owned)."""
    import cupy
    import torch

    memory = cupy.cuda.UnownedMemory(ptr, size, None, device)
    array = cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.as_tensor(array, device=torch.device("cuda", device))


def ipc_target(conn: Connection, size: int, device: str = "cuda:1") -> None:
    """Child on `device`: a cudaMalloc'd destination, its IPC handle sent; poisons and checks on request."""
    try:
        apply_env()
        import cupy
        import torch

        index = _index(device)
        cupy.cuda.Device(index).use()
        torch.cuda.set_device(index)
        ptr = cupy.cuda.runtime.malloc(size)
        try:
            dst = _cupy_tensor(ptr, size, index)
            expected = pattern(size, SEED, torch.device("cuda", index))
            torch.cuda.synchronize()
            conn.send(("handle", cupy.cuda.runtime.ipcGetMemHandle(ptr)))
            serve_destination(conn, dst, expected)
        finally:
            torch.cuda.synchronize()
            cupy.cuda.runtime.free(ptr)
    except BaseException:
        send_error(conn)


def ipc_initiator(conn: Connection, out: Connection, workloads: Sequence[Workload], timing: Timing, devices: Devices) -> None:
    """Child on the source device: opens the destination's IPC handle, writes into it with cudaMemcpyAsync and the copy kernel."""
    try:
        apply_env()
        import cupy
        import torch

        from _gpu.kernel import RangeCopy

        index = _index(devices.src)
        cupy.cuda.Device(index).use()
        torch.cuda.set_device(index)
        size = sizes_of(workloads)
        src = pattern(size, SEED, torch.device("cuda", index))
        torch.cuda.synchronize()
        src_ptr = src.data_ptr()
        handle = receive(conn, "handle", STARTUP_TIMEOUT_S)[1]
        remote = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        stream = cupy.cuda.Stream(non_blocking=True)
        memcpy_async = cupy.cuda.runtime.memcpyAsync
        opened = f"two processes: {devices.src}'s process opens {devices.dst}'s cudaIpcMemHandle"
        link = " (one GPU: a device copy)" if devices.same else " over NVLink"
        try:
            for method in ("memcpy", "kernel"):
                for w in (_bulk(workloads) if method == "memcpy" else workloads):
                    so, do, ln = make_ranges(w)
                    conn.send(("prep", w))
                    receive(conn, "ready")
                    if method == "memcpy":
                        args = (remote + int(do[0]), src_ptr + int(so[0]), int(ln[0]), CUDA_MEMCPY_DEFAULT, stream.ptr)

                        def post(args: tuple[int, ...] = args) -> None:
                            memcpy_async(*args)

                        detail = f"{opened}, cudaMemcpyAsync into it{link}"
                    else:
                        kernel = RangeCopy(index, src_ptr, remote, so, do, ln, stream)
                        post = kernel.post
                        detail = f"{opened}; copy kernel on {devices.src} ({kernel.blocks} blocks, one per range of <= 64 KiB) writes into it{link}"

                    def step(post: Any = post) -> None:
                        post()
                        stream.synchronize()

                    times = measure_row(step, timing, w)
                    conn.send(("verify", w))
                    ok = receive(conn, "verified")[1]
                    pipe = pipelined_gbps(post, CupyEventTimer(stream, index), w.nbytes, times)
                    out.send(("row", gpu_row("cuda-ipc", method, w, times, ok, detail, pipe, "cuda-events")))
        finally:
            stream.synchronize()
            cupy.cuda.runtime.ipcCloseMemHandle(remote)
        conn.send(("quit",))
        out.send(("done",))
    except BaseException:
        send_error(out, conn)


# -- NCCL send/recv between two processes ---------------------------------------------


def nccl_rank(rank: int, conn: Connection, out: Connection | None, store_path: str, system: str,
              workloads: Sequence[Workload], timing: Timing, devices: Sequence[str] = ("cuda:0", "cuda:1"), backend: str = "nccl") -> None:
    """Child: rank 0 sends from devices[0] (timed, rows to `out`), rank 1 receives into devices[1].

    `devices`/`backend` other than CUDA/NCCL (cpu/gloo) exist to test the orchestration without a GPU.
    """
    try:
        apply_env({"TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING": "false", **NCCL_SYSTEMS.get(system, {})})
        import torch
        import torch.distributed as dist

        device = torch.device(devices[rank])
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)
        store = dist.FileStore(store_path, 2)
        dist.init_process_group(backend, store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120),
                                **({"device_id": device} if cuda else {}))
        size = sizes_of(workloads)
        sync = (lambda: torch.cuda.current_stream(device).synchronize()) if cuda else (lambda: None)
        try:
            if rank == 0:
                assert out is not None
                _nccl_sender(dist, conn, out, system, pattern(size, SEED, device), workloads, timing, sync)
            else:
                serve_destination(conn, torch.empty(size, dtype=torch.uint8, device=device), pattern(size, SEED, device), recv=lambda view: dist.recv(view, 0))
        finally:
            dist.destroy_process_group()
    except BaseException:
        send_error(*([out] if out is not None else []), conn)


def _nccl_sender(dist: Any, conn: Connection, out: Connection, system: str, src: Any, workloads: Sequence[Workload], timing: Timing, sync: Any) -> None:
    path_detail = "two processes, torch.distributed send/recv (FileStore), timed on the sender: send + stream sync"
    if NCCL_SYSTEMS.get(system):
        path_detail += "; " + " ".join(f"{k}={v}" for k, v in NCCL_SYSTEMS[system].items())
    for w in _bulk(workloads):
        view = src[: w.nbytes]
        conn.send(("prep", w))
        receive(conn, "ready")

        def post(view: Any = view) -> None:
            dist.send(view, 1)

        def step(post: Any = post) -> None:
            post()
            sync()

        times = measure_row(step, timing, w, announce=lambda n, w=w: conn.send(("iters", w, n)))
        conn.send(("verify", w))
        ok = receive(conn, "verified")[1]
        count = pipeline_count(times)
        conn.send(("iters", w, count))
        pipe = pipelined_gbps(post, WallTimer(sync), w.nbytes, times, count)
        out.send(("row", gpu_row(system, "send/recv", w, times, ok, path_detail, pipe, "wall")))
    conn.send(("quit",))
    out.send(("done",))
