"""Opened IPC handles, one mapping per exported allocation: the bookkeeping the CUDA and HIP backends share.

Handles (CudaIpcHandle, HipIpcHandle: bytes, offset, pid) name whole allocations plus an offset, so a
region carved out of a larger allocation (a caching-allocator block) exports correctly. A process maps
each exported allocation once however many regions it opens from it on one device: `IpcMappings` keeps
one mapping per (pid, handle, device) with a reference count and unmaps it when the last region made
from it is freed. What mapping and unmapping mean is the backend's (`map_handle`, `unmap`).

Concurrency: thread-safe.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Callable
from typing import Any

from hmc.errors import ArgumentError, OutOfRangeError
from hmc.memory._base import Device, MemoryKind, MemoryRegion

__all__ = ["IPC_HANDLE_BYTES", "IpcMappings"]

IPC_HANDLE_BYTES = 64
"""cudaIpcMemHandle_t and hipIpcMemHandle_t alike."""


@dataclasses.dataclass
class _Mapping:
    """One exported allocation mapped into this process."""

    device: Device
    address: int
    size: int
    users: int = 0


class IpcMappings:
    """IPC handles opened in this process, one mapping per exported allocation.

    `map_handle(handle bytes, device)` maps an allocation and returns (address, allocation size);
    `unmap(device, address)` undoes it; `what` names the handles in errors ("CUDA IPC").
    """

    def __init__(self, map_handle: Callable[[bytes, Device], tuple[int, int]], unmap: Callable[[Device, int], None], what: str) -> None:
        self._map_handle = map_handle
        self._unmap = unmap
        self._what = what
        # _lock guards _mappings: mapping a handle, counting its users and unmapping it are
        # one step, so two threads opening one handle map it once and a close never races an open.
        self._lock = threading.Lock()
        self._mappings: dict[tuple[int, bytes, int], _Mapping] = {}

    def open(self, handle: Any, device: Device, size: int) -> MemoryRegion:
        """The `size` bytes at handle.offset in the exported allocation, mapped on `device`."""
        if handle.pid == os.getpid():
            raise ArgumentError(f"a {self._what} handle cannot be opened by the process that exported it")
        if len(handle.handle) != IPC_HANDLE_BYTES:
            raise ArgumentError(f"a {self._what} handle has {IPC_HANDLE_BYTES} bytes, got {len(handle.handle)}")
        if size <= 0:
            raise ArgumentError(f"size must be positive, got {size}")
        key = (handle.pid, bytes(handle.handle), device.index)
        with self._lock:
            mapping = self._mappings.get(key)
            if mapping is None:
                mapping = _Mapping(device, *self._map_handle(bytes(handle.handle), device))
            if handle.offset + size > mapping.size:
                if mapping.users == 0:
                    self._unmap(device, mapping.address)
                raise OutOfRangeError(f"[{handle.offset}, {handle.offset + size}) outside the exported allocation of {mapping.size} bytes")
            mapping.users += 1
            self._mappings[key] = mapping
        address = mapping.address + handle.offset
        release = functools.partial(self._release, key)
        return MemoryRegion(device=device, address=address, size=size, kind=MemoryKind.DEVICE, owner=mapping, release=release)

    def _release(self, key: tuple[int, bytes, int]) -> None:
        with self._lock:
            mapping = self._mappings[key]
            mapping.users -= 1
            if mapping.users == 0:
                del self._mappings[key]
                self._unmap(mapping.device, mapping.address)

    def open_count(self) -> int:
        """How many exported allocations are mapped now."""
        with self._lock:
            return len(self._mappings)
