"""What every system of the GPU benchmark (`bench/gpu.py`) shares: devices, environment, workloads, data, checks, timers.

- `Devices`: where a run's source and destination live: cuda:0 -> cuda:1 on two
  GPUs, two processes both on cuda:0 on one GPU (or "cpu", for the CPU tests of
  the orchestration).
- `GPU_ENV`: set in the benchmark process and, again, in every child before
  torch, NCCL or UCX load (NVLink multicast stays off on the project's GPU hosts).
- Workloads: bulk 4 KiB to 1 GiB and the two KV patterns of issue 3, with
  `hmc.bench._workloads.make_ranges` (independent random block permutations on
  each side) inside `kv_total`-byte buffers; `measure_row` times a row with
  fewer iterations for moves of 256 MiB and more (the slowest systems take
  seconds each).
- Data: `pattern()` fills a buffer with pseudo-random bytes computed on the
  device (splitmix64 of the word index), the same bytes in every process and on
  every device, so the process that owns a destination can check it without the
  source's process: `verify()` compares the destination ranges with the
  source ranges of the pattern, on the device, with `torch.equal`.
  `serve_destination()` is the loop of every two-process system's target.
- Timers: one iteration is post + wait (host wall clock, `hmc.bench._timing.measure`,
  as every other row of `hmc bench`); `pipelined_gbps()` adds the rate of back-to-back
  posts with one wait at the end (CUDA events where the work is on one stream).

torch is imported lazily: the benchmark's parent process never touches CUDA.

Concurrency: each function runs on the calling thread of the child that owns the tensors.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from hmc.bench._child import RUN_TIMEOUT_S, receive
from hmc.bench._timing import Row, Timing, make_row, measure
from hmc.bench._workloads import POISON, SEED, Workload, fmt_size, make_ranges

__all__ = [
    "EXTRA_COLUMNS",
    "GPU_ENV",
    "OPS",
    "KiB",
    "MiB",
    "GiB",
    "NIXL_GPU_SYSTEMS",
    "Devices",
    "apply_env",
    "chunk_ranges",
    "gpu_quick_workloads",
    "gpu_workloads",
    "gpu_row",
    "measure_row",
    "pattern",
    "pipeline_count",
    "pipelined_gbps",
    "poison",
    "serve_destination",
    "sizes_of",
    "source_and_destination",
    "synchronize",
    "verify",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

GPU_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""Always set: NVLink multicast off (it can take a shared host's GPUs out of service)."""

NIXL_GPU_SYSTEMS: dict[str, dict[str, str]] = {"nixl": {}, "nixl-tcp-cuda-copy": {"UCX_TLS": "tcp,cuda_copy"}}
"""NIXL's systems (`_gpu.nixl`): name -> environment of both processes, set before NIXL and UCX load."""

EXTRA_COLUMNS = ("pipelined_gbps", "pipelined_timer", "detail")
"""Fields GPU rows add to `hmc.bench._timing.COLUMNS` (absent where not measured)."""

PIPELINE_SECONDS = 0.1
"""Aim of the back-to-back measurement after each timed loop."""
OPS = ("WRITE", "READ")
"""The one-sided operations, in run order (a system that has no READ measures WRITE only)."""
BIG_BYTES = 256 * MiB
"""Rows moving this much per iteration or more are timed with at most 1 warm-up and 3 iterations at least."""


@dataclasses.dataclass(frozen=True)
class Devices:
    """Where a run's source and destination live (torch device strings)."""

    src: str = "cuda:0"
    dst: str = "cuda:1"

    @classmethod
    def for_gpus(cls, gpus: int) -> Devices:
        """cuda:0 -> cuda:1 on two GPUs; cuda:0 -> cuda:0 (two processes on one GPU) on one."""
        return cls("cuda:0", "cuda:1" if gpus >= 2 else "cuda:0")

    @property
    def same(self) -> bool:
        """Source and destination on one device (one GPU: two processes share it)."""
        return self.src == self.dst

    def describe(self) -> str:
        """For the report: 'cuda:0 -> cuda:1', or 'cuda:0 -> cuda:0 (one GPU, ...)'."""
        return f"{self.src} -> {self.dst}" + (" (one device: both processes on it)" if self.same else "")


def apply_env(extra: dict[str, str] | None = None) -> None:
    """`GPU_ENV` (and `extra`) into os.environ; call before torch, NCCL or UCX load."""
    os.environ.update(GPU_ENV)
    if extra:
        os.environ.update(extra)


def _bulk(size: int) -> Workload:
    return Workload(f"bulk_{fmt_size(size)}", size, 1, size, False)


def _kv(block: int, batch: int, total: int) -> Workload:
    return Workload(f"kv_{batch}x{fmt_size(block)}", block, batch, total, True)


def gpu_workloads(kv_total: int = GiB) -> list[Workload]:
    """Issue 3's workloads: bulk 4 KiB..1 GiB, 4096 x 64 KiB and 16384 x 16 KiB random ranges."""
    sizes = (4 * KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB, GiB)
    return [*map(_bulk, sizes), _kv(64 * KiB, 4096, kv_total), _kv(16 * KiB, 16384, kv_total)]


def gpu_quick_workloads() -> list[Workload]:
    """Smoke-sized: bulk 4 KiB..1 MiB and the KV block sizes in 16 MiB buffers."""
    return [*map(_bulk, (4 * KiB, 64 * KiB, MiB)), _kv(64 * KiB, 256, 16 * MiB), _kv(16 * KiB, 1024, 16 * MiB)]


def measure_row(step: Callable[[], None], timing: Timing, w: Workload, announce: Callable[[int], None] | None = None) -> np.ndarray:
    """`hmc.bench._timing.measure` of one row; for BIG_BYTES and more, 1 warm-up and 3 iterations at least."""
    if w.nbytes >= BIG_BYTES:
        timing = dataclasses.replace(timing, warmup=min(timing.warmup, 1), min_iters=min(timing.min_iters, 3))
    return measure(step, timing, announce)


def chunk_ranges(so: np.ndarray, do: np.ndarray, ln: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split every range into pieces of at most `chunk` bytes (one thread block each), in order."""
    so, do, ln = (np.asarray(a, dtype=np.int64) for a in (so, do, ln))
    pieces = np.maximum((ln + chunk - 1) // chunk, 1)
    owner = np.repeat(np.arange(ln.size), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    inner = (np.arange(owner.size, dtype=np.int64) - first) * chunk
    lengths = np.minimum(ln[owner] - inner, chunk)
    return so[owner] + inner, do[owner] + inner, lengths


def pattern(nbytes: int, seed: int, device: Any) -> Any:
    """`nbytes` pseudo-random bytes on `device` (a torch uint8 tensor), identical wherever computed.

    splitmix64 of (word index + seed) in int64 torch arithmetic (wrapping), so no
    host round trip is needed for 1 GiB and every process can recompute any range.
    """
    import torch

    words = (nbytes + 7) // 8
    x = torch.arange(words, dtype=torch.int64, device=device)
    x.add_(seed).mul_(-7046029254386353131)  # 0x9E3779B97F4A7C15
    x.bitwise_xor_(x >> 30).mul_(-4658895280553007687)  # 0xBF58476D1CE4E5B9
    x.bitwise_xor_(x >> 27).mul_(-7723592293110705685)  # 0x94D049BB133111EB
    x.bitwise_xor_(x >> 31)
    return x.view(torch.uint8)[:nbytes]


def poison(tensor: Any, nbytes: int) -> None:
    """Fill the first `nbytes` with POISON."""
    tensor[:nbytes].fill_(POISON)


def source_and_destination(size: int, device: str) -> tuple[Any, Any]:
    """(the pattern, a poisoned destination) of `size` bytes on `device`, made the current CUDA device; synchronized."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    src = pattern(size, SEED, dev)
    dst = torch.empty(size, dtype=torch.uint8, device=dev)
    poison(dst, size)
    synchronize(dst)
    return src, dst


def synchronize(tensor: Any) -> None:
    """Wait for the work queued on `tensor`'s device (nothing for host tensors)."""
    if tensor.is_cuda:
        import torch

        torch.cuda.synchronize(tensor.device)


def _block_rows(tensor: Any, w: Workload, offsets: np.ndarray) -> Any:
    import torch

    index = torch.from_numpy(offsets // w.block_size).to(tensor.device)
    return tensor[: w.total_size].view(-1, w.block_size).index_select(0, index)


def verify(dst: Any, expected_src: Any, w: Workload, so: np.ndarray, do: np.ndarray) -> bool:
    """Every destination range equals its source range (`expected_src`: the source's bytes, on dst's device)."""
    if w.batch_size == 1:
        s, d, n = int(so[0]), int(do[0]), w.block_size
        return bool(dst[d : d + n].equal(expected_src[s : s + n]))
    return bool(_block_rows(dst, w, do).equal(_block_rows(expected_src, w, so)))


class WallTimer:
    """Back-to-back posts timed on the host: start, posts, `done()`."""

    name = "wall"

    def __init__(self, done: Callable[[], None]) -> None:
        self._done = done
        self._t0 = 0

    def start(self) -> None:
        self._done()
        self._t0 = time.perf_counter_ns()

    def stop(self) -> float:
        self._done()
        return (time.perf_counter_ns() - self._t0) / 1e9


class _EventTimer:
    """Back-to-back posts on one stream, timed with two CUDA events (`_start`, `_stop`) of the stream's library."""

    name = "cuda-events"
    _stream: Any
    _start: Any
    _stop: Any

    def start(self) -> None:
        self._stream.synchronize()
        self._start.record(self._stream)

    def stop(self) -> float:
        self._stop.record(self._stream)
        self._stop.synchronize()
        return self._elapsed_ms() / 1e3

    def _elapsed_ms(self) -> float:
        raise NotImplementedError


class TorchEventTimer(_EventTimer):
    """Back-to-back posts on one torch stream, timed with CUDA events."""

    def __init__(self, stream: Any) -> None:
        import torch

        self._stream = stream
        self._start = torch.cuda.Event(enable_timing=True)
        self._stop = torch.cuda.Event(enable_timing=True)

    def _elapsed_ms(self) -> float:
        return float(self._start.elapsed_time(self._stop))


class CupyEventTimer(_EventTimer):
    """Back-to-back posts on one CuPy stream, timed with CUDA events."""

    def __init__(self, stream: Any, device: int) -> None:
        import cupy

        self._cupy = cupy
        self._stream = stream
        with cupy.cuda.Device(device):  # an event must belong to its stream's device
            self._start, self._stop = cupy.cuda.Event(), cupy.cuda.Event()

    def _elapsed_ms(self) -> float:
        return float(self._cupy.cuda.get_elapsed_time(self._start, self._stop))


def pipeline_count(times_ns: np.ndarray) -> int:
    """How many back-to-back posts take about PIPELINE_SECONDS, given the timed loop's iterations (4..4096)."""
    median = float(np.median(times_ns)) if len(times_ns) else 1e6
    return int(min(4096, max(4, PIPELINE_SECONDS * 1e9 / max(median, 1.0))))


def pipelined_gbps(post: Callable[[], None], timer: Any, nbytes: int, times_ns: np.ndarray, count: int | None = None) -> float:
    """GB/s of `count` back-to-back `post()`s (default `pipeline_count(times_ns)`) with one wait at the end."""
    count = pipeline_count(times_ns) if count is None else count
    timer.start()
    for _ in range(count):
        post()
    seconds = timer.stop()
    return round(nbytes * count / max(seconds, 1e-9) / 1e9, 4)


def serve_destination(conn: Connection, dst: Any, expected: Any, idle: Callable[[Connection], None] | None = None,
                      recv: Callable[[Any], None] | None = None) -> None:
    """A two-process system's target loop: ("prep", w) poison -> ("ready",); ("iters", w, n): `recv` into dst n times
    (a two-sided baseline's receiving side); ("verify", w) -> ("verified", ok) (dst's ranges against `expected`'s,
    the pattern on dst's device); ("quit",). `idle(conn)` runs before each wait (a target that drives progress)."""
    while True:
        if idle is not None:
            idle(conn)
        message = receive(conn, "", RUN_TIMEOUT_S)
        if message[0] == "prep":
            poison(dst, message[1].total_size)
            synchronize(dst)
            conn.send(("ready",))
        elif message[0] == "iters" and recv is not None:
            view = dst[: message[1].nbytes]
            for _ in range(message[2]):
                recv(view)
        elif message[0] == "verify":
            synchronize(dst)
            w = message[1]
            so, do, _ = make_ranges(w)
            conn.send(("verified", verify(dst, expected, w, so, do)))
        else:
            synchronize(dst)
            return


def gpu_row(system: str, path: str, w: Workload, times_ns: np.ndarray, verified: bool, detail: str,
            pipelined: float | None = None, timer: str | None = None, op: str = "WRITE") -> Row:
    """A `make_row` row plus the GPU fields (EXTRA_COLUMNS)."""
    row = make_row(system, path, op, w, times_ns, verified)
    if pipelined is not None:
        row["pipelined_gbps"] = pipelined
        row["pipelined_timer"] = timer
    row["detail"] = detail
    return row


def sizes_of(workloads: Sequence[Workload]) -> int:
    """Bytes every buffer needs for these workloads."""
    return max(w.total_size for w in workloads)
