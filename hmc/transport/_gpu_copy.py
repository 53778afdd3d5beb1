"""Batched device copies on one GPU, CUDA or HIP: a batch of ranges costs one launch, not one call per range.

A `Lane` is one GPU's stream plus what it needs to move batches of (source
pointer, destination pointer, length) triples on it, through its backend's
runtime calls (`hmc.memory._gpu.Runtime`: the CUDA driver, or the HIP runtime):

- up to `FEW` ranges: one memcpyAsync each (the copy engines; a peer copy over
  NVLink or XGMI when the two pointers live on two GPUs);
- more: ranges longer than `PIECE_BYTES` are cut into pieces, the pointer and
  length arrays are written (base added on the way) into a page-locked range
  table, which the kernel reads in place through its device mapping (no upload
  to queue first), and a launch of `hmc_copy_ranges` moves the pieces, one
  thread block per piece (a long batch in a few parts, rows and launch each,
  so the GPU starts on the first part while the CPU writes the next: `_parts`): 16-byte
  loads and stores where source and destination are equally aligned modulo 16
  (else 8, 4, 2 or 1 bytes), unrolled so each thread keeps four loads in
  flight, and a byte tail.

With the compiled helper (`hmc.transport._gpu_batch`: the CUDA driver, or the HIP runtime library the HIP runtime
names), a single copy and its first polls (`copy_now`) are one C call, and so are the staged ring's slot batches, a
gather or scatter and its copy-engine copy on two lanes (`fused`): same steps, same tables and events. A lane's own batches stay in Python: one C call
for their table writes and launch was measured no faster (2x H200, 16384 ranges: 82 against 85 us; the table
writes are bound by memory, not by Python).

Pointers may be memory of this GPU, of a peer GPU (peer access enabled, or an
IPC mapping), or page-locked host memory mapped for the device.

The kernel is compiled from one source at run time: NVRTC (else CuPy) for CUDA
GPUs, hiprtc for HIP ones (`Runtime.load_kernel`); where that fails, every range
is one memcpyAsync (correct, slow; logged once per lane).

Waiting never blocks without a deadline: `wait_idle()` and `event_done()` poll
(`spin_until()`: tight at first, then yielding, then sleeping briefly).

Concurrency: any thread may use a lane. `_lock` guards the range tables and the
kernel: a table is rewritten only after the launches that last read it ended. `_events` (under `_event_lock`)
keeps finished events for reuse, so a batch costs no cuEventCreate. `_bounce_lock`
hands the bounce buffer to one transfer at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from hmc.errors import HMCError, TimeoutError
from hmc.memory._base import Device, MemoryRegion
from hmc.transport import _gpu_batch

if TYPE_CHECKING:
    from hmc.memory._gpu import GpuBackend, Kernel, Runtime

__all__ = ["FEW", "KERNEL_SOURCE", "PIECE_BYTES", "Bounce", "Lane", "pieces", "spin_until"]

_log = logging.getLogger(__name__)

FEW = 4
"""Up to this many ranges, each is one memcpyAsync (cheaper than a table and a launch)."""
PIECE_BYTES = 256 << 10
"""Ranges longer than this are cut, so one long range still spreads over many thread blocks."""
_FIRST_ROWS = 4096
_FIRST_PART = 1024
"""A batch's first launch covers this many rows; later ones four times as many as the one before (`_parts`)."""
_TABLES = 8
"""Range tables per lane, used in turn: a batch is queued while the previous ones' tables are still on their way
(the staged ring queues a launch per slot, several slots ahead of the GPU)."""
_BLOCK_SMALL, _BLOCK_LARGE = 256, 512
_SMALL_PIECE = 32 << 10
"""Batches whose longest piece is at most this get 256-thread blocks (one unrolled pass moves 16 KiB), others 512."""
_KERNEL = "hmc_copy_ranges"
_YIELD_S = 0.02
"""How long the ipc path's waits poll with sched_yield before they nap between polls (`spin_until`)."""

KERNEL_SOURCE = r"""
typedef unsigned long long u64;

template <typename T, int UNROLL>
__device__ __forceinline__ void copy_words(const unsigned char* src, unsigned char* dst, u64 n) {
    const u64 width = sizeof(T);
    u64 head = (width - (reinterpret_cast<u64>(src) & (width - 1))) & (width - 1);
    if (head > n) head = n;
    for (u64 i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
    const T* s = reinterpret_cast<const T*>(src + head);
    T* d = reinterpret_cast<T*>(dst + head);
    const u64 words = (n - head) / width;
    const u64 stride = blockDim.x;
    u64 i = threadIdx.x;
    for (; i + (UNROLL - 1) * stride < words; i += UNROLL * stride) {
        T r[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) r[k] = s[i + k * stride];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) d[i + k * stride] = r[k];
    }
    for (; i < words; i += stride) d[i] = s[i];
    for (u64 j = head + words * width + threadIdx.x; j < n; j += stride) dst[j] = src[j];
}

// One thread block per range: sources, destinations and lengths are three arrays of gridDim.x entries.
extern "C" __global__ void __launch_bounds__(512)
hmc_copy_ranges(const u64* __restrict__ sources, const u64* __restrict__ destinations, const u64* __restrict__ lengths) {
    const unsigned char* src = reinterpret_cast<const unsigned char*>(sources[blockIdx.x]);
    unsigned char* dst = reinterpret_cast<unsigned char*>(destinations[blockIdx.x]);
    const u64 n = lengths[blockIdx.x];
    const u64 skew = reinterpret_cast<u64>(src) ^ reinterpret_cast<u64>(dst);
    if ((skew & 15) == 0) copy_words<uint4, 4>(src, dst, n);
    else if ((skew & 7) == 0) copy_words<unsigned long long, 4>(src, dst, n);
    else if ((skew & 3) == 0) copy_words<unsigned int, 4>(src, dst, n);
    else if ((skew & 1) == 0) copy_words<unsigned short, 4>(src, dst, n);
    else copy_words<unsigned char, 4>(src, dst, n);
}
"""


# -- ranges and waiting --------------------------------------------------------------


def pieces(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, piece: int = PIECE_BYTES) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ranges with every one longer than `piece` cut into `piece`-sized parts (relative alignment kept)."""
    if not lengths.size or int(lengths.max()) <= piece:
        return src, dst, lengths
    counts = (lengths + (piece - 1)) // piece
    index = np.repeat(np.arange(lengths.size), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    shift = (np.arange(index.size) - first) * piece
    return src[index] + shift, dst[index] + shift, np.minimum(lengths[index] - shift, piece)


def spin_until(query: Callable[[], Any], deadline: float, runtime: Runtime, *, yield_s: float = 0.0) -> bool:
    """Poll a status-returning query until it is not `runtime.not_ready` (True) or `deadline` passed (False).

    Tight for the first polls (microsecond copies); then, for `yield_s` seconds,
    yielding the CPU and the GIL between polls (`os.sched_yield`); then
    `time.sleep(0)` between polls for 20 ms, then 0.2 ms. `time.sleep(0)` is a
    timed sleep of about 55 us on the project's VMs (timer slack; measured on
    2x H200): the ipc path, whose caller waits for each batch or large copy,
    yields instead (2x H200: KV 64 KiB 283 -> 315 GB/s, 1 GiB 0.956x -> 0.988x
    peer copy). The staged ring's pipeline keeps napping, as before: its threads
    share the GIL, and with yields it was no faster (1 GiB 0.82x pinned D2H, with
    naps 0.84x on the same kind of host); its single ranges on the caller's thread
    yield for about their copy's time (`_staged_shm._copy_spin`).
    """
    not_ready = runtime.not_ready
    polls = 0
    started = 0.0
    while True:
        status = query()
        if status != not_ready:
            runtime.check((status,))
            return True
        now = time.monotonic()
        if now > deadline:
            return False
        polls += 1
        if polls < 64:
            continue
        if not started:
            started = now
        elapsed = now - started
        if elapsed < yield_s:
            os.sched_yield()
        else:
            time.sleep(0 if elapsed < yield_s + 0.02 else 0.0002)


# -- lanes ---------------------------------------------------------------------------


class _Table:
    """One range table: page-locked host rows written here, which the kernel reads in place through their device
    mapping."""

    def __init__(self, runtime: Runtime) -> None:
        self.rows = 0
        self.host: MemoryRegion | None = None
        self.host_pointer = 0
        """Where the GPU reads the host rows in place."""
        self.array: np.ndarray = np.empty(0, np.int64)
        self.read = runtime.event_create()
        """Recorded after a batch's last launch: the rows may be rewritten once it completed."""

    def free(self) -> None:
        if self.host is not None:
            self.host.free()
        self.host = None
        self.array = np.empty(0, np.int64)
        self.rows = 0


class Bounce:
    """A lane's page-locked bounce buffer: host `region`, and `pointer`, the address its GPU uses."""

    def __init__(self, region: MemoryRegion, pointer: int) -> None:
        self.region = region
        self.pointer = pointer
        self.size = region.size


class Lane:
    """One GPU's copy stream, its copy kernel and its range tables."""

    def __init__(self, backend: GpuBackend, device: Device) -> None:
        self.device = device
        self.ordinal = device.index
        self._backend = backend
        self._rt = backend.runtime
        self.stream = backend.stream(device)
        self.handle = self.stream.handle
        self._native = self.stream.native
        self._lock = threading.Lock()  # guards _kernel, _tables and _turn
        self._kernel: Kernel | None = None
        self._kernel_loaded = False
        with self._rt.use(self.ordinal):
            self._tables = [_Table(self._rt) for _ in range(_TABLES)]
        self._turn = 0
        self._event_lock = threading.Lock()
        self._events: list[Any] = []
        """Events given back (release_event), reused by record()."""
        self._bounce_lock = threading.Lock()  # one transfer at a time uses the bounce buffer
        self._bounce: Bounce | None = None
        self.copy_now = self._copier()
        """copy_now(dst, src, length, deadline): one copy, waited for on this thread; True once done, False when `deadline` passed first."""

    @property
    def kernel_kind(self) -> str:
        """How batches are moved here: "nvrtc", "cupy", "hiprtc", "memcpy" (no kernel) or "unloaded" (no batch yet)."""
        if not self._kernel_loaded:
            return "unloaded"
        return "memcpy" if self._kernel is None else self._kernel.kind

    def enqueue(
        self, src: np.ndarray, src_base: int, dst: np.ndarray, dst_base: int, lengths: np.ndarray, deadline: float,
        *, per_range: bool = False, record: bool = False,
    ) -> Any:
        """Queue copies of ranges (int64 offsets from each side's base address) on the stream.

        With `record`, return an event marking their end (release it with release_event).
        """
        with self._rt.use(self.ordinal):
            if per_range or lengths.size <= FEW:
                self._copies(src + src_base, dst + dst_base, lengths)
            else:
                with self._lock:
                    kernel = self._kernel_here()
                    if kernel is None:
                        self._copies(src + src_base, dst + dst_base, lengths)
                    else:
                        self._launch(kernel, src, src_base, dst, dst_base, lengths, deadline)
            if not record:
                return None
            return self._recorded()

    def fused(
        self, copy: Lane, *, gather: bool, src: np.ndarray, src_base: int, dst: np.ndarray, dst_base: int, lengths: np.ndarray,
        copy_dst: int, copy_src: int, whole: int, wait: Any, deadline: float,
    ) -> tuple[Any, Any] | None:
        """A staging slot's batch in one C call (`_gpu_batch`), its kernel on this lane and its copy of `whole` bytes
        (copy_src -> copy_dst) on `copy`'s stream: gather (the kernel, then the copy) or scatter (the copy, then the
        kernel). The kernel reads its range table in place; `wait` (an event, or None) is waited for by the stream
        that goes first. Returns (end, freed): two events recorded on the stream that goes last (release both), or
        None where there is no fused path (CuPy's kernel, the helper not built, the runtime's library not loaded):
        queue the steps instead."""
        fused = _gpu_batch.helper_for(self._rt)
        if fused is None:
            return None
        with self._lock:  # the C call makes the GPU current itself (for that call only)
            kernel = self._kernel_here()
            if kernel is None or not kernel.handle:  # CuPy's kernel
                return None
            src, dst, lengths, block = _cut(src, dst, lengths)
            table = self._next_table(int(lengths.size), deadline)
            join, end, freed = self._event(), copy._event(), copy._event()
            try:
                while not fused.run(
                    self._rt.c_target(self.ordinal), kernel.handle, block, gather=gather,
                    kernel_stream=self.handle, copy_stream=copy.handle,
                    events=(int(wait) if wait is not None else 0, int(join), int(table.read), int(end), int(freed)),
                    table=table.array, table_device=table.host_pointer,
                    src=np.ascontiguousarray(src, np.int64), src_base=src_base, dst=np.ascontiguousarray(dst, np.int64), dst_base=dst_base,
                    lengths=np.ascontiguousarray(lengths, np.int64), copy_dst=copy_dst, copy_src=copy_src, whole=whole,
                ):
                    with self._rt.use(self.ordinal):  # its last launch still reads it: nothing was queued yet
                        self._table_read(table, deadline)
            except BaseException:
                for event in (end, freed):
                    copy.release_event(event)
                raise
            finally:
                self.release_event(join)
        return end, freed

    def _copier(self) -> Callable[[int, int, int, float], bool]:
        """`copy_now`: one closure with the driver functions and handles bound (the single-range fast path, a 4 KiB write).

        The copy (memcpyAsync; cuMemcpyDtoDAsync was slower through a CUDA IPC
        mapping on 2x H200: 4 KiB write p50 11.9 us against 7.0 for a plain
        cudaMemcpyAsync) and the stream polls run with the lane's GPU made current
        unless the caller's thread has it current already (PyTorch on this GPU).
        With the helper (CUDA, or HIP where its runtime library loads), the copy and its first 256 polls are one C
        call (2x H200, 4 KiB into the other GPU: p50 8.7 us against 9.2 from Python).
        """
        rt = self._rt
        stream, ok, not_ready, ordinal = self._native, rt.ok, rt.not_ready, self.ordinal
        memcpy, query, current, use, check = rt.memcpy_async, rt.stream_query, rt.is_current, rt.use, rt.check
        helper = _gpu_batch.helper_for(rt)

        if helper is not None:  # the copy and its first polls in one C call, without the GIL
            c_copy, context, handle = helper.copy_now, rt.c_target(ordinal), self.handle

            def copy_in_c(dst: int, src: int, length: int, deadline: float) -> bool:
                if c_copy(context, dst, src, length, handle, 256):
                    return True
                with use(ordinal):
                    return spin_until(lambda: query(stream)[0], deadline, rt, yield_s=_YIELD_S)

            return copy_in_c

        def copied(dst: int, src: int, length: int, deadline: float) -> bool:
            status = memcpy(dst, src, length, stream)[0]
            if status != ok:
                check((status,))
            for _ in range(256):  # a small copy lands within these polls
                status = query(stream)[0]
                if status == ok:
                    return True
                if status != not_ready:
                    check((status,))
            return spin_until(lambda: query(stream)[0], deadline, rt, yield_s=_YIELD_S)

        def copy(dst: int, src: int, length: int, deadline: float) -> bool:
            if current(ordinal):
                return copied(dst, src, length, deadline)
            with use(ordinal):
                return copied(dst, src, length, deadline)

        return copy

    def current(self) -> contextlib.AbstractContextManager[Any]:
        """A block with the lane's GPU current on the calling thread (the caller's restored after)."""
        return self._rt.use(self.ordinal)

    def record(self) -> Any:
        """An event marking everything queued so far (release it with release_event)."""
        with self._rt.use(self.ordinal):
            return self._recorded()

    def _recorded(self) -> Any:
        """A pooled (else new) event recorded on the stream; the lane's GPU is current."""
        event = self._event()
        self._rt.event_record(event, self._native)
        return event

    def _event(self) -> Any:
        """A pooled event, else a new one (made with the lane's GPU current)."""
        with self._event_lock:
            if self._events:
                return self._events.pop()
        with self._rt.use(self.ordinal):
            return self._rt.event_create()

    def wait_for(self, event: Any) -> None:
        """Make work queued on this stream from now on wait for `event` (recorded on another of this GPU's lanes)."""
        with self._rt.use(self.ordinal):
            self._rt.stream_wait_event(self._native, event)

    def wait_idle(self, deadline: float) -> bool:
        """Poll until everything queued on the stream finished (True) or `deadline` passed (False)."""
        rt, stream = self._rt, self._native
        with rt.use(self.ordinal):
            return spin_until(lambda: rt.stream_query(stream)[0], deadline, rt, yield_s=_YIELD_S)

    def event_done(self, event: Any) -> bool:
        """True once the work before `event` finished (DeviceError if it failed)."""
        with self._rt.use(self.ordinal):
            status = self._rt.event_query(event)[0]
        if status == self._rt.not_ready:
            return False
        self._rt.check((status,))
        return True

    def event_wait(self, event: Any, deadline: float, *, yield_s: float = _YIELD_S) -> bool:
        """Poll until the work before `event` finished (True) or `deadline` passed (False; a past one: one look).

        `yield_s`: how long to poll with sched_yield before napping (`spin_until`); 0 for threads that share the
        GIL with busy ones (the staged ring's), which a yielding poller would starve for a switch interval."""
        rt = self._rt
        with rt.use(self.ordinal):
            return spin_until(lambda: rt.event_query(event)[0], deadline, rt, yield_s=yield_s)

    def release_event(self, event: Any) -> None:
        """Give an event back for reuse (it must not be waited for any more)."""
        with self._event_lock:
            self._events.append(event)

    @contextlib.contextmanager
    def bounce(self, size: int, deadline: float) -> Iterator[Bounce]:
        """The lane's page-locked bounce buffer (allocated on first use), held for the block."""
        if not self._bounce_lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise TimeoutError(f"the bounce buffer of {self.device.name} stayed busy past the deadline")
        try:
            if self._bounce is None:
                region = self._backend.allocate_pinned_host(size)
                with self._rt.use(self.ordinal):
                    self._bounce = Bounce(region, self._rt.mapped_pointer(region.address))
            yield self._bounce
        finally:
            self._bounce_lock.release()

    def _kernel_here(self) -> Kernel | None:
        """The copy kernel (under `_lock`), compiled and loaded on first use; None where there is none."""
        if not self._kernel_loaded:
            with self._rt.use(self.ordinal):
                self._kernel = self._rt.load_kernel(self.device, KERNEL_SOURCE, _KERNEL)
            if self._kernel is None:
                _log.warning("no copy kernel on %s: each range of a batch is one memcpyAsync", self.device.name)
            self._kernel_loaded = True
        return self._kernel

    def _copies(self, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> None:
        rt, stream = self._rt, self._native
        for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist()):
            rt.check(rt.memcpy_async(d, s, n, stream))

    def _launch(
        self, kernel: Kernel, src: np.ndarray, src_base: int, dst: np.ndarray, dst_base: int, lengths: np.ndarray, deadline: float,
    ) -> None:
        """Write the table and launch, in parts (`_parts`), so the GPU copies the first ranges while the rest are written.

        The kernel reads the rows in place, over the host link: 2x H200, ipc KV writes of 16384 x 16 KiB (4096 x 64
        KiB), alternated in one process: 923 (838) us a batch, against 955 (882) with each part's rows uploaded
        first and 981 (843) uploaded and launched in one piece."""
        src, dst, lengths, block = _cut(src, dst, lengths)
        table = self._table(int(lengths.size), deadline)
        launched = False
        try:
            for start, stop in _parts(int(lengths.size)):
                rows = stop - start
                at = 3 * start  # this part's sources, destinations and lengths: `rows` entries each, back to back
                rows_out = table.array[at : at + 3 * rows]
                np.add(src[start:stop], src_base, out=rows_out[:rows])
                np.add(dst[start:stop], dst_base, out=rows_out[rows : 2 * rows])
                rows_out[2 * rows :] = lengths[start:stop]
                kernel.launch(rows, block, _columns(table.host_pointer + 8 * at, rows), self._native)
                launched = True
        finally:  # a later part's launch may fail: the parts queued before it still read the table
            if launched:
                self._rt.event_record(table.read, self._native)

    def _table(self, rows: int, deadline: float) -> _Table:
        """The next range table (under `_lock`), holding at least `rows` rows, once the launch that last read it ended."""
        table = self._next_table(rows, deadline)
        with self._rt.use(self.ordinal):
            self._table_read(table, deadline)
        return table

    def _next_table(self, rows: int, deadline: float) -> _Table:
        """The next range table in turn (under `_lock`), holding at least `rows` rows; its last reader may still run."""
        table = self._tables[self._turn]
        self._turn = (self._turn + 1) % len(self._tables)
        self._reserve(table, rows, deadline)
        return table

    def _table_read(self, table: _Table, deadline: float) -> None:
        """Wait until the launch that last read `table` ended (the lane's GPU current); TimeoutError at `deadline`."""
        rt = self._rt
        if not spin_until(lambda: rt.event_query(table.read)[0], deadline, rt):
            raise TimeoutError(f"the range table of {self.device.name} stayed in use past the deadline")

    def _reserve(self, table: _Table, rows: int, deadline: float) -> None:
        """Make `table` hold at least `rows` rows (its old memory freed once the stream no longer reads it)."""
        if rows <= table.rows:
            return
        with self._rt.use(self.ordinal):
            self._grow(table, rows, deadline)

    def _grow(self, table: _Table, rows: int, deadline: float) -> None:
        if table.host is not None:
            if not self.wait_idle(deadline):
                raise TimeoutError(f"the range table of {self.device.name} stayed in use past the deadline")
            table.free()
        capacity = max(rows, 2 * table.rows, _FIRST_ROWS)
        table.host = self._backend.allocate_pinned_host(capacity * 24)
        table.host_pointer = self._rt.mapped_pointer(table.host.address)
        table.array = table.host.numpy().view(np.int64)
        table.rows = capacity

    def close(self, deadline: float) -> bool:
        """Wait (bounded) for queued work, then free the tables, the bounce buffer, the kernel and the stream; False
        when the work did not end (everything is left allocated: the GPU may still use it)."""
        try:
            idle = self.wait_idle(deadline)
        except HMCError:
            idle = False
        if not idle:  # the GPU may still read them: leak rather than free memory in use
            _log.warning("copies on %s still running at close; their buffers are left allocated", self.device.name)
            return False
        with self._lock, self._rt.use(self.ordinal):
            for table in self._tables:
                table.free()
                self._rt.event_destroy(table.read)
            self._tables = []
            if self._kernel is not None:
                self._kernel.close()
                self._kernel = None
            with self._event_lock:
                events, self._events = self._events, []
            for event in events:
                self._rt.event_destroy(event)
        if self._bounce is not None:
            self._bounce.region.free()
            self._bounce = None
        self.stream.close()
        return True


def _cut(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A batch's ranges cut into pieces (`pieces`), and the thread block its launch uses."""
    longest = int(lengths.max())
    if longest > PIECE_BYTES:
        src, dst, lengths = pieces(src, dst, lengths)
        longest = PIECE_BYTES
    return src, dst, lengths, _BLOCK_SMALL if longest <= _SMALL_PIECE else _BLOCK_LARGE


def _parts(rows: int) -> Iterator[tuple[int, int]]:
    """A batch's rows as (start, stop) parts for successive launches: `_FIRST_PART` rows, then four times as many each
    time. Writing a part's rows costs the CPU less than the GPU spends copying the part before it (2x H200, 16384 rows:
    ~60 us to write the table, ~740 us to copy 16 KiB a row), so the copies start after the first part's rows, not
    after all of them."""
    start, size = 0, _FIRST_PART
    while start < rows:
        stop = rows if rows - start < 2 * size else start + size
        yield start, stop
        start, size = stop, 4 * size


def _columns(table: int, rows: int) -> tuple[int, int, int]:
    """The kernel's arguments: where a table's sources, destinations and lengths start (`rows` entries each)."""
    return table, table + 8 * rows, table + 16 * rows
