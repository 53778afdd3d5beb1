"""Pinned host memory for the staged path: mappings of ring files (or private memory), and slot copies.

Both ends of a staged transfer copy between a region's ranges and a contiguous slot of pinned host
memory: host regions with memmove on the spot, GPU (CUDA or HIP) regions as one batch per slot (copy-engine copies
for a few ranges, one kernel launch for many), waited for with an event within a deadline. The
shared-memory ring (`_staged_shm`), its owner side (`_staged_owner`) and the TCP ring
(`_staged_tcp_ring`) all use these.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import stat
import threading
import time
from typing import Any

import numpy as np

from hmc.errors import HMCError, ProtocolError, TimeoutError
from hmc.memory import DeviceKind, MemoryKind
from hmc.transport._ranges import end_to_end

__all__ = ["Pending", "PinnedMapping", "SlotCopier", "StuckCopy", "gpu_backends", "no_wait"]

_log = logging.getLogger(__name__)
_CLOSE_S = 5.0
"""How long closing a copier waits for copies still queued on its lanes."""
_ZERO = np.zeros(1, np.int64)
_SCRATCH_SLOTS = 2
"""Device scratch slots per GPU, used in turn: batch k+1 is gathered while batch k is copied."""
_SCRATCH_MIN = 4 << 20
"""The smallest device scratch slot made (grown to the largest gathered chunk, at most a ring slot)."""
_NOW_BYTES = 256 << 10
"""A single range up to this size is copied and waited for on the spot (`Lane.copy_now`: no event, no hand-off)."""


def gpu_backends() -> list[Any]:
    """The GPU backends present in this process (CUDA, HIP), each with its `runtime`."""
    from hmc.memory import backend_for

    found = []
    for kind in (DeviceKind.CUDA, DeviceKind.HIP):
        try:
            found.append(backend_for(kind))
        except HMCError:
            continue
    return found


def _check_theirs(fd: int, path: str, size: int) -> None:
    """Refuse a ring file another process made unless it is a regular file of this user, of at least `size` bytes.

    Another user could otherwise hand over a file it may shrink once it is mapped here (a copy through the mapping
    then touches pages past its end: SIGBUS, the whole process), a FIFO or a device. A process of this user can
    shrink the file too, but it can also signal this process (docs/decisions.md, "The peer port")."""
    info = os.fstat(fd)
    name = os.path.basename(path)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        raise ProtocolError(f"shared ring {name} is not a regular file of this user")
    if info.st_size < size:
        raise ProtocolError(f"shared ring {name} is smaller than announced")


_ABANDONED: list[PinnedMapping] = []
"""Mappings a stuck GPU copy may still touch (`PinnedMapping.abandon`): never unmapped, never unpinned."""


class PinnedMapping:
    """A /dev/shm file (`path`), or private memory (`path` None), mapped here and pinned for the GPUs present."""

    def __init__(self, path: str | None, size: int, *, create: bool) -> None:
        if path is None:
            self._mmap = mmap.mmap(-1, size)
        else:
            flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else os.O_NOFOLLOW | os.O_NONBLOCK)
            fd = os.open(path, flags, 0o600)
            try:
                if create:
                    os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS on first touch
                else:
                    _check_theirs(fd, path, size)
                self._mmap = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        self.size = size
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = int(self._array.ctypes.data)
        self._pointers: dict[int, int] = {}
        """Where each runtime's GPUs reach the mapping (by id of the runtime; usually the host address itself)."""
        self._pinned_by: list[Any] = []
        """The runtimes this mapping is page-locked and mapped with (every GPU backend present)."""
        try:
            for backend in gpu_backends():
                self._pointers[id(backend.runtime)] = backend.runtime.register_host(self.address, size)
                self._pinned_by.append(backend.runtime)
        except BaseException:
            self.close()
            raise

    def device_address(self, runtime: Any) -> int:
        """Where the GPUs of `runtime` (a backend's) reach the mapping."""
        return self._pointers.get(id(runtime), self.address)

    def abandon(self) -> None:
        """Keep the mapping, and its pinning, for the life of the process: a GPU copy that missed its deadline
        (`StuckCopy`) may still touch it. Not closing is not enough: once collected, the mapping's addresses go
        back to the process while the runtime still holds them registered, and the next ring mapped there fails
        to register."""
        _ABANDONED.append(self)

    def close(self) -> None:
        runtimes, self._pinned_by = self._pinned_by, []
        for runtime in runtimes:
            try:
                runtime.unregister_host(self.address)
            except HMCError as exc:
                _log.debug("unpinning a shared ring failed: %s", exc)
        self._array = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view still referenced (a traceback's) keeps it mapped until collected
            self._mmap.close()

    def view(self, offset: int, nbytes: int) -> memoryview:
        """`nbytes` of the mapping from `offset`, for sockets to send from or receive into."""
        return memoryview(self._mmap)[offset : offset + nbytes]


class StuckCopy(TimeoutError):
    """A GPU copy did not finish by its deadline: it may still run, so the memory it touches must not be freed
    or reused (its pinned ring is abandoned, not unmapped)."""


class Pending:
    """A queued copy's wait: calling it waits until the copy finished (StuckCopy when `deadline` passes first) and
    lets go of its event; `done()` looks once without waiting (for a caller with something else to wait for)."""

    __slots__ = ("_event", "_lane")

    def __init__(self, lane: Any, event: Any) -> None:
        self._lane = lane
        self._event = event

    def done(self) -> bool:
        """True once the copy finished (DeviceError if it failed); no event is let go of."""
        return self._event is None or bool(self._lane.event_done(self._event))

    def __call__(self, deadline: float, yield_s: float = 0.0) -> None:
        """Wait for the copy, polling with yields for `yield_s` before napping (0 where other threads of the ring
        wait for the GIL: the owner's reader, the initiator's pipeline)."""
        event, self._event = self._event, None
        if event is None:
            return
        try:
            if not self._lane.event_wait(event, deadline, yield_s=yield_s):
                raise StuckCopy("a staging copy did not finish before the deadline")
        finally:
            self._lane.release_event(event)


no_wait = Pending(None, None)
"""The wait of a copy that already finished (host memory, copied on the spot)."""


class _GpuSide:
    """One GPU's copy lane, kernel lane, small-copy lane and device scratch slots: a gathered batch's bytes on
    their way to the pinned slot (or a slot's bytes on their way to be scattered).

    A batch of many ranges is a kernel launch on `kernels` and one copy-engine copy on `lane`, joined by
    events; the scratch slots are used in turn, so batch k+1's kernel runs while batch k's copy does.
    `batch` keeps each pair's queueing together; `freed[i]` marks the end of the last work queued on scratch i
    (also when its queueing failed halfway: the next user waits for both lanes then). Small single copies go
    on `small`, whose stream `copy_now` polls: they never wait behind another transfer's slot copies.
    """

    def __init__(self, backend: Any, device: Any) -> None:
        from hmc.transport._gpu_copy import FEW, Lane

        self.few = FEW
        """Up to this many ranges go straight between device memory and the slot (copy engines)."""
        self.backend = backend
        self.device = device
        self.lane = Lane(backend, device)
        self.kernels = Lane(backend, device)
        self.small = Lane(backend, device)
        self.scratch: list[Any] = [None] * _SCRATCH_SLOTS
        self.freed: list[Any] = [None] * _SCRATCH_SLOTS
        self.turn = 0
        self.batch = threading.Lock()
        """Held while a batch and its copy are queued, and while closing (guards scratch, freed, turn)."""

    def queue(
        self, offsets: np.ndarray, base: int, positions: np.ndarray, lengths: np.ndarray, pointer: int, deadline: float, *, to_slot: bool
    ) -> tuple[Any, Any]:
        """Queue a slot's batch: to the slot, the ranges' gather into scratch, then its copy to `pointer` (pinned); from
        it, the copy of `pointer` into scratch, then its scatter to the ranges. Returns (lane, event of the end)."""
        whole = int(positions[-1] + lengths[-1])
        first, last = (self.kernels, self.lane) if to_slot else (self.lane, self.kernels)
        with self.batch:
            index, scratch, wait = self._next(whole, deadline)
            ranges = (offsets, base, positions, scratch) if to_slot else (positions, scratch, offsets, base)  # the kernel's
            copy_dst, copy_src = (pointer, scratch) if to_slot else (scratch, pointer)
            try:
                fused = self.kernels.fused(
                    self.lane, gather=to_slot, src=ranges[0], src_base=ranges[1], dst=ranges[2], dst_base=ranges[3], lengths=lengths,
                    copy_dst=copy_dst, copy_src=copy_src, whole=whole, wait=wait, deadline=deadline,
                )
                if fused is not None:
                    event, self.freed[index] = fused
                    return last, event
                if wait is not None:
                    first.wait_for(wait)
                steps = [
                    lambda record: self.kernels.enqueue(*ranges, lengths, deadline, record=record),
                    lambda record: self.lane.enqueue(_ZERO, copy_src, _ZERO, copy_dst, np.array([whole], np.int64), deadline, record=record),
                ]
                if not to_slot:
                    steps.reverse()
                steps[0](False)
                self._join(first, last)
                event = steps[1](True)
            except BaseException:
                self._fence(index)
                raise
            finally:
                if wait is not None:
                    self.lane.release_event(wait)
            self.freed[index] = last.record()
        return last, event

    def _next(self, nbytes: int, deadline: float) -> tuple[int, int, Any]:
        """The next scratch slot (grown to `nbytes`) and the event that marks the end of its last use (None if none):
        the lane that touches it first must wait for that event (then release it)."""
        index, self.turn = self.turn, (self.turn + 1) % len(self.scratch)
        scratch = self.scratch[index]
        if scratch is None or scratch.size < nbytes:
            if scratch is not None:
                if not (self.lane.wait_idle(deadline) and self.kernels.wait_idle(deadline)):
                    raise TimeoutError(f"the staging scratch of {self.device.name} stayed in use past the deadline")
                scratch.free()
                self.scratch[index] = None
            scratch = self.scratch[index] = self.backend.allocate(self.device, max(nbytes, _SCRATCH_MIN))
        wait, self.freed[index] = self.freed[index], None
        return index, scratch.address, wait

    def _fence(self, index: int) -> None:
        """After a batch's queueing failed halfway: mark scratch `index` in use until both lanes' work so far ended."""
        self._join(self.kernels, self.lane)
        self.freed[index] = self.lane.record()

    @staticmethod
    def _join(before: Any, after: Any) -> None:
        """Make `after`'s stream wait for what is queued on `before` so far."""
        event = before.record()
        after.wait_for(event)
        before.release_event(event)

    def close(self) -> None:
        """Free the lanes and the scratch slots, once the work queued on them ended (else they are left allocated)."""
        with self.batch:
            for index, event in enumerate(self.freed):
                if event is not None:
                    self.lane.release_event(event)
                    self.freed[index] = None
            idle = self.kernels.close(time.monotonic() + _CLOSE_S)
            idle = self.small.close(time.monotonic() + _CLOSE_S) and idle
            if self.lane.close(time.monotonic() + _CLOSE_S) and idle:
                for index, scratch in enumerate(self.scratch):
                    if scratch is not None:
                        scratch.free()
                        self.scratch[index] = None


class SlotCopier:
    """Copies between a region's ranges and a contiguous slot of a pinned mapping, waiting within a deadline.

    Host memory: memmove per range, on the spot. Device memory: a small single range is copied and
    polled on the spot (`Lane.copy_now`, the small-transfer path); up to `FEW` ranges are copy-engine
    copies straight to or from the slot; more are gathered by one launch of the batched copy kernel into
    the GPU's scratch slot and copied to the pinned slot by the copy engine in one piece (or the reverse,
    scattered). Not the kernel straight into pinned memory: on one H100 with the opposite direction busy
    (the other end of a staged pair on the same GPU), a kernel reached 28 GB/s over PCIe, copy engines 44.
    The kernel reads its range table in place (as every lane's: no upload, which would queue behind the other
    direction's copies on the copy engines).
    GPU sides (`_GpuSide`: a copy lane, a kernel lane and a small-copy lane, with their range tables and
    pooled events, and scratch slots used in turn, so one batch is gathered while the previous one is
    copied) are made once per GPU and kept until `close()`.
    """

    def __init__(self) -> None:
        self._gpus: dict[str, _GpuSide] = {}
        self._lock = threading.Lock()  # guards _gpus

    def _gpu(self, device: Any) -> _GpuSide:
        side = self._gpus.get(device.name)  # a plain read first: sides are never replaced
        if side is not None:
            return side
        from hmc.memory import backend_for

        with self._lock:
            side = self._gpus.get(device.name)
            if side is None:
                side = self._gpus[device.name] = _GpuSide(backend_for(device), device)
            return side

    def copy(self, region: Any, offsets: Any, lengths: Any, slot: PinnedMapping, at: int, *, to_slot: bool, deadline: float, yield_s: float = 0.0) -> None:
        """`start` and wait (see `Pending`: `yield_s`)."""
        self.start(region, offsets, lengths, slot, at, to_slot=to_slot, deadline=deadline)(deadline, yield_s)

    def start(
        self, region: Any, offsets: Any, lengths: Any, slot: PinnedMapping, at: int, *, to_slot: bool, deadline: float
    ) -> Pending:
        """Queue the copy between the region's ranges and `slot` from byte `at`, the ranges end to end (device memory:
        on this GPU's stream, behind the ones queued before); returns the wait for it. `deadline` bounds the queueing."""
        base = region.address
        if region.kind is not MemoryKind.DEVICE:
            position = slot.address + at
            for offset, length in zip(np.asarray(offsets).tolist(), np.asarray(lengths).tolist()):
                if to_slot:
                    ctypes.memmove(position, base + offset, length)
                else:
                    ctypes.memmove(base + offset, position, length)
                position += length
            return no_wait
        gpu = self._gpu(region.device)
        lane = gpu.lane
        pointer = slot.device_address(gpu.backend.runtime) + at
        if len(lengths) == 1 and lengths[0] <= _NOW_BYTES:  # a small single range: copied and polled right here
            source, target = (base + int(offsets[0]), pointer) if to_slot else (pointer, base + int(offsets[0]))
            if not gpu.small.copy_now(target, source, int(lengths[0]), deadline):
                raise StuckCopy("a staging copy did not finish before the deadline")
            return no_wait
        offsets, lengths = np.asarray(offsets, np.int64), np.asarray(lengths, np.int64)
        positions = end_to_end(lengths)
        if lengths.size <= gpu.few:  # copy engines, straight between the ranges and the slot
            if to_slot:
                event = lane.enqueue(offsets, base, positions, pointer, lengths, deadline, record=True)
            else:
                event = lane.enqueue(positions, pointer, offsets, base, lengths, deadline, record=True)
        else:  # one kernel gathers into scratch and one copy-engine copy moves it out (or the reverse)
            lane, event = gpu.queue(offsets, base, positions, lengths, pointer, deadline, to_slot=to_slot)
        return Pending(lane, event)

    def close(self) -> None:
        """Free the GPU sides (each waits, bounded, for the copies still queued on it)."""
        with self._lock:
            gpus, self._gpus = list(self._gpus.values()), {}
        for gpu in gpus:
            gpu.close()
