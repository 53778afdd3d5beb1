"""Host memory backend: pageable and page-locked host memory, copies with memmove.

Concurrency: stateless; safe from any thread (memmove releases the GIL).
"""

from __future__ import annotations

import ctypes
import mmap
import os

from hmc.errors import ArgumentError, DeviceError
from hmc.memory._base import Device, DeviceKind, MemoryBackend, MemoryKind, MemoryRegion, Stream, Vendor

__all__ = ["HOST_DEVICE", "HostBackend"]


def _host_device() -> Device:
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return Device(name="host", kind=DeviceKind.HOST, vendor=Vendor.HOST, physical_vendor=Vendor.HOST, total_memory=pages, model=os.uname().machine)


HOST_DEVICE = _host_device()

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


class _InlineStream(Stream):
    """Host copies complete before the call returns."""

    def synchronize(self) -> None:
        return None


def _address_of(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class HostBackend(MemoryBackend):
    kind = DeviceKind.HOST

    def devices(self) -> list[Device]:
        return [HOST_DEVICE]

    def allocate(self, device: Device, size: int, *, pinned: bool = False) -> MemoryRegion:
        if device.kind is not DeviceKind.HOST:
            raise ArgumentError(f"host backend cannot allocate on {device.name}")
        if size <= 0:
            raise ArgumentError(f"allocation size must be positive, got {size}")
        buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = _address_of(buffer)
        if pinned and _libc.mlock(address, size) != 0:
            err = ctypes.get_errno()
            buffer.close()
            raise DeviceError(f"mlock of {size} bytes failed: {os.strerror(err)} (raise RLIMIT_MEMLOCK)")

        def release() -> None:
            if pinned:
                _libc.munlock(address, size)
            buffer.close()

        kind = MemoryKind.HOST_PINNED if pinned else MemoryKind.HOST
        return MemoryRegion(device=device, address=address, size=size, kind=kind, owner=buffer, release=release)

    def copy(self, dst: MemoryRegion, src: MemoryRegion, size: int, *, stream: Stream | None = None) -> None:
        ctypes.memmove(dst.address, src.address, size)

    def fill(self, region: MemoryRegion, value: int, *, stream: Stream | None = None) -> None:
        ctypes.memset(region.address, value, region.size)

    def stream(self, device: Device) -> Stream:
        return _InlineStream()
