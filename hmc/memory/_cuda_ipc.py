"""CUDA IPC and dma-buf: exporting device memory for other processes, opening what they exported.

Handles name whole allocations (the cuMemGetAddressRange base) plus an offset, so a
region carved out of a larger allocation (a PyTorch caching-allocator block, say)
exports correctly. A process maps each exported allocation once however many
regions it opens from it on one device: `IpcMappings` keeps one mapping per (pid,
handle, device) with a reference count, and unmaps it when the last region made
from it is freed. The device is the GPU whose context opens the handle: kernels
on that GPU reach the memory (over NVLink when it lives on another GPU: the
driver enables peer access for the mapping), kernels on other GPUs do not.

Concurrency: `IpcMappings` is thread-safe; `export_handles` is stateless.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from typing import Any

from hmc.errors import ArgumentError, DeviceError, OutOfRangeError
from hmc.memory._base import Device, MemoryKind, MemoryRegion
from hmc.memory._cuda_driver import Contexts, check, driver
from hmc.v1 import common_pb2

__all__ = ["IpcMappings", "export_handles"]

log = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE")
_IPC_HANDLE_BYTES = 64


def export_handles(contexts: Contexts, region: MemoryRegion) -> dict[str, Any]:
    """{"cuda_ipc": CudaIpcHandle, "dmabuf": DmabufHandle}, each only where the driver can export it."""
    handles: dict[str, Any] = {}
    with contexts.use(region.device.index):
        for name, export in (("cuda_ipc", _ipc_handle), ("dmabuf", _dmabuf_handle)):
            try:
                handles[name] = export(region)
            except DeviceError as exc:  # e.g. cuMemCreate (VMM) memory has no legacy IPC handle; no dma-buf support
                log.debug("no %s export of %s memory at %#x: %s", name, region.device.name, region.address, exc)
    return handles


def _ipc_handle(region: MemoryRegion) -> common_pb2.CudaIpcHandle:
    base, _ = check(driver.cuMemGetAddressRange(region.address))
    handle = check(driver.cuIpcGetMemHandle(base))
    return common_pb2.CudaIpcHandle(handle=bytes(handle.reserved), offset=region.address - int(base), pid=os.getpid())


def _dmabuf_handle(region: MemoryRegion) -> common_pb2.DmabufHandle:
    """Check the region's allocation exports as a dma-buf; the fd is closed, re-made when the RDMA path asks.

    The recorded span is the whole allocation, page-aligned as the driver requires;
    the region sits at (region.address - address) inside it.
    """
    base, length = check(driver.cuMemGetAddressRange(region.address))
    start = int(base) - int(base) % _PAGE
    end = -(-(int(base) + int(length)) // _PAGE) * _PAGE
    handle_type = driver.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    fd = int(check(driver.cuMemGetHandleForAddressRange(start, end - start, handle_type, 0)))
    os.close(fd)
    return common_pb2.DmabufHandle(pid=os.getpid(), address=start, length=end - start)


@dataclasses.dataclass
class _Mapping:
    """One exported allocation mapped into this process."""

    device: Device
    address: int
    size: int
    users: int = 0


class IpcMappings:
    """CUDA IPC handles opened in this process, one mapping per exported allocation."""

    def __init__(self, contexts: Contexts) -> None:
        self._contexts = contexts
        # _lock guards _mappings: mapping a handle, counting its users and unmapping it are
        # one step, so two threads opening one handle map it once and a close never races an open.
        self._lock = threading.Lock()
        self._mappings: dict[tuple[int, bytes, int], _Mapping] = {}

    def open(self, handle: common_pb2.CudaIpcHandle, device: Device, size: int) -> MemoryRegion:
        """The `size` bytes at handle.offset in the exported allocation, mapped on `device`."""
        if handle.pid == os.getpid():
            raise ArgumentError("a CUDA IPC handle cannot be opened by the process that exported it")
        if len(handle.handle) != _IPC_HANDLE_BYTES:
            raise ArgumentError(f"a CUDA IPC handle has {_IPC_HANDLE_BYTES} bytes, got {len(handle.handle)}")
        if size <= 0:
            raise ArgumentError(f"size must be positive, got {size}")
        key = (handle.pid, bytes(handle.handle), device.index)
        with self._lock:
            mapping = self._mappings.get(key) or self._map(handle, device)
            if handle.offset + size > mapping.size:
                if mapping.users == 0:
                    self._unmap(mapping)
                raise OutOfRangeError(f"[{handle.offset}, {handle.offset + size}) outside the exported allocation of {mapping.size} bytes")
            mapping.users += 1
            self._mappings[key] = mapping
        address = mapping.address + handle.offset
        release = functools.partial(self._release, key)
        return MemoryRegion(device=device, address=address, size=size, kind=MemoryKind.DEVICE, owner=mapping, release=release)

    def _map(self, handle: common_pb2.CudaIpcHandle, device: Device) -> _Mapping:
        native = driver.CUipcMemHandle()
        native.reserved = bytes(handle.handle)
        flags = int(driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        with self._contexts.use(device.index):
            address = int(check(driver.cuIpcOpenMemHandle(native, flags)))
            _, length = check(driver.cuMemGetAddressRange(address))
        return _Mapping(device=device, address=address, size=int(length))

    def _unmap(self, mapping: _Mapping) -> None:
        with self._contexts.use(mapping.device.index):
            check(driver.cuIpcCloseMemHandle(mapping.address))

    def _release(self, key: tuple[int, bytes, int]) -> None:
        with self._lock:
            mapping = self._mappings[key]
            mapping.users -= 1
            if mapping.users == 0:
                del self._mappings[key]
                self._unmap(mapping)

    def open_count(self) -> int:
        """How many exported allocations are mapped now."""
        with self._lock:
            return len(self._mappings)
