"""Pinned host memory for the staged path: mappings of ring files (or private memory), and slot copies.

Both ends of a staged transfer copy between a region's ranges and a contiguous slot of pinned host
memory: host regions with memmove on the spot, CUDA regions with cuMemcpyAsync on one stream per GPU,
waited for with an event within a deadline. The shared-memory ring (`_staged_shm`), its owner side
(`_staged_owner`) and the TCP ring (`_staged_tcp_ring`) all use these.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from hmc.errors import HMCError, ProtocolError, TimeoutError, UnsupportedError
from hmc.memory import DeviceKind, MemoryKind

__all__ = ["PinnedMapping", "SlotCopier", "cuda_backend", "no_wait"]

_log = logging.getLogger(__name__)


def cuda_backend() -> Any:
    """The CUDA backend, or None."""
    try:
        from hmc.memory import backend_for

        return backend_for(DeviceKind.CUDA)
    except HMCError:
        return None


def _driver() -> Any:
    from hmc.memory._cuda_driver import driver

    return driver


def _check(result: Any) -> Any:
    from hmc.memory._cuda_driver import check

    return check(result)


class PinnedMapping:
    """A /dev/shm file (`path`), or private memory (`path` None), mapped here and pinned where CUDA is present."""

    def __init__(self, path: str | None, size: int, *, create: bool) -> None:
        if path is None:
            self._mmap = mmap.mmap(-1, size)
        else:
            flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
            fd = os.open(path, flags, 0o600)
            try:
                if create:
                    os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS on first touch
                elif os.fstat(fd).st_size < size:
                    raise ProtocolError(f"shared ring {os.path.basename(path)} is smaller than announced")
                self._mmap = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        self.size = size
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = int(self._array.ctypes.data)
        self._pinned = False
        self._backend = cuda_backend()
        if self._backend is not None:
            driver = _driver()
            with self._backend.contexts.use_any():
                _check(driver.cuMemHostRegister(self.address, size, driver.CU_MEMHOSTREGISTER_PORTABLE))
            self._pinned = True

    def close(self) -> None:
        if self._pinned:
            self._pinned = False
            driver = _driver()
            try:
                with self._backend.contexts.use_any():
                    _check(driver.cuMemHostUnregister(self.address))
            except HMCError as exc:
                _log.debug("unpinning a shared ring failed: %s", exc)
        self._array = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view still referenced (a traceback's) keeps it mapped until collected
            self._mmap.close()

    def view(self, offset: int, nbytes: int) -> memoryview:
        """`nbytes` of the mapping from `offset`, for sockets to send from or receive into."""
        return memoryview(self._mmap)[offset : offset + nbytes]


def no_wait(deadline: float) -> None:
    """The wait of a copy that already finished (host memory, copied on the spot)."""


class SlotCopier:
    """Copies between a region's ranges and a contiguous slot, waiting within a deadline."""

    def __init__(self) -> None:
        self._backend: Any = None  # resolved on the first device copy (a process may never touch CUDA)
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _stream(self, device: Any) -> Any:
        with self._lock:
            stream = self._streams.get(device.index)
            if stream is None:
                stream = self._streams[device.index] = self._backend.stream(device)
            return stream

    def copy(self, region: Any, offsets: list[int], lengths: list[int], slot: int, *, to_slot: bool, deadline: float) -> None:
        self.start(region, offsets, lengths, slot, to_slot=to_slot)(deadline)

    def start(self, region: Any, offsets: list[int], lengths: list[int], slot: int, *, to_slot: bool) -> Callable[[float], None]:
        """Queue the copy (device memory: on this GPU's stream, behind the ones queued before); returns the wait for it."""
        base = region.address
        if region.kind is not MemoryKind.DEVICE:
            position = slot
            for offset, length in zip(offsets, lengths):
                if to_slot:
                    ctypes.memmove(position, base + offset, length)
                else:
                    ctypes.memmove(base + offset, position, length)
                position += length
            return no_wait
        if self._backend is None:
            self._backend = cuda_backend()
        if self._backend is None:
            raise UnsupportedError(f"{region.device.name} memory without a CUDA backend in this process")
        from hmc.transport._cuda_copy import spin_until

        driver = _driver()
        stream = self._stream(region.device)
        handle = stream.handle
        position = slot
        contexts, ordinal = self._backend.contexts, region.device.index
        with contexts.use(ordinal):
            for offset, length in zip(offsets, lengths):
                if to_slot:
                    _check(driver.cuMemcpyAsync(position, base + offset, length, handle))
                else:
                    _check(driver.cuMemcpyAsync(base + offset, position, length, handle))
                position += length
            event = _check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING))
            _check(driver.cuEventRecord(event, handle))

        def wait(deadline: float) -> None:
            try:
                if not spin_until(lambda: driver.cuEventQuery(event)[0], deadline):
                    raise TimeoutError("a staging copy did not finish before the deadline")
            finally:
                with contexts.use(ordinal):
                    _check(driver.cuEventDestroy(event))

        return wait

    def close(self) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close()
