"""CUDA IPC and dma-buf: exporting device memory for other processes, opening what they exported.

Handles name whole allocations (the cuMemGetAddressRange base) plus an offset; opened handles are
counted per allocation by `hmc.memory._ipc_mappings.IpcMappings`. The device is the GPU whose context
opens the handle: kernels on that GPU reach the memory (over NVLink when it lives on another GPU: the
driver enables peer access for the mapping), kernels on other GPUs do not.

Concurrency: both functions are stateless; the mappings they make are thread-safe.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hmc.errors import DeviceError
from hmc.memory._base import Device, MemoryRegion
from hmc.memory._cuda_driver import Contexts, check, driver
from hmc.memory._ipc_mappings import IpcMappings
from hmc.v1 import common_pb2

__all__ = ["export_handles", "ipc_mappings"]

log = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE")


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


def ipc_mappings(contexts: Contexts) -> IpcMappings:
    """The process's opened CUDA IPC handles, mapped in the primary context of the device asked for."""

    def map_handle(raw: bytes, device: Device) -> tuple[int, int]:
        native = driver.CUipcMemHandle()
        native.reserved = raw
        flags = int(driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        with contexts.use(device.index):
            address = int(check(driver.cuIpcOpenMemHandle(native, flags)))
            _, length = check(driver.cuMemGetAddressRange(address))
        return address, int(length)

    def unmap(device: Device, address: int) -> None:
        with contexts.use(device.index):
            check(driver.cuIpcCloseMemHandle(address))

    return IpcMappings(map_handle, unmap, "CUDA IPC")
