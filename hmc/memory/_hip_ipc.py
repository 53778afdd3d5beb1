"""HIP IPC and dma-buf: exporting AMD device memory for other processes, opening what they exported.

As for CUDA (`_cuda_ipc`): handles name whole allocations (the hipMemGetAddressRange base) plus an
offset, opened handles are counted per allocation (`_ipc_mappings.IpcMappings`), and a dma-buf
export is checked and recorded for the rdma path where ROCm offers one.

Concurrency: both functions are stateless; the mappings they make are thread-safe.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

from hmc.errors import DeviceError
from hmc.memory._base import Device, MemoryRegion
from hmc.memory._hip_runtime import Devices, check, hip
from hmc.memory._ipc_mappings import IPC_HANDLE_BYTES, IpcMappings
from hmc.v1 import common_pb2

__all__ = ["export_handles", "ipc_mappings"]

log = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE")


def export_handles(devices: Devices, region: MemoryRegion) -> dict[str, Any]:
    """{"hip_ipc": HipIpcHandle, "dmabuf": DmabufHandle}, each only where the runtime can export it."""
    handles: dict[str, Any] = {}
    with devices.use(region.device.index):
        for name, export in (("hip_ipc", _ipc_handle), ("dmabuf", _dmabuf_handle)):
            try:
                handles[name] = export(region)
            except DeviceError as exc:
                log.debug("no %s export of %s memory at %#x: %s", name, region.device.name, region.address, exc)
    return handles


def _ipc_handle(region: MemoryRegion) -> common_pb2.HipIpcHandle:
    base, _ = check(hip.hipMemGetAddressRange(region.address))
    handle = check(hip.hipIpcGetMemHandle(base))
    raw = ctypes.string_at(handle.as_c_void_p().value, IPC_HANDLE_BYTES)
    return common_pb2.HipIpcHandle(handle=raw, offset=region.address - int(base), pid=os.getpid())


def _dmabuf_handle(region: MemoryRegion) -> common_pb2.DmabufHandle:
    """Check the region's allocation exports as a dma-buf; the fd is closed, re-made when the RDMA path asks."""
    base, length = check(hip.hipMemGetAddressRange(region.address))
    start = int(base) - int(base) % _PAGE
    end = -(-(int(base) + int(length)) // _PAGE) * _PAGE
    fd = ctypes.c_int(-1)
    check(hip.hipMemGetHandleForAddressRange(fd, start, end - start, hip.hipMemRangeHandleType.hipMemRangeHandleTypeDmaBufFd, 0))
    os.close(fd.value)
    return common_pb2.DmabufHandle(pid=os.getpid(), address=start, length=end - start)


def ipc_mappings(devices: Devices) -> IpcMappings:
    """The process's opened HIP IPC handles, mapped with the device asked for current."""

    def map_handle(raw: bytes, device: Device) -> tuple[int, int]:
        handle = hip.hipIpcMemHandle_t.fromObj(bytearray(raw))
        with devices.use(device.index):
            address = int(check(hip.hipIpcOpenMemHandle(handle, hip.hipIpcMemLazyEnablePeerAccess)))
            _, length = check(hip.hipMemGetAddressRange(address))
        return address, int(length)

    def unmap(device: Device, address: int) -> None:
        with devices.use(device.index):
            check(hip.hipIpcCloseMemHandle(address))

    return IpcMappings(map_handle, unmap, "HIP IPC")
