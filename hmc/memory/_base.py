"""The Memory API's one interface: devices, memory regions and the backend contract.

A `MemoryRegion` is the one normalised descriptor of any memory HMC touches
(host, pinned host, CUDA or HIP device memory), whatever object it came from.
Backends (`_host.py`, `_cuda.py`, `_hip.py`) implement `MemoryBackend`.

Concurrency: regions and devices are immutable; backends are thread-safe for
distinct regions. A region's owner keeps the memory alive while the region lives.
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import enum
from collections.abc import Callable
from typing import Any, Self

import numpy as np

from hmc.errors import ArgumentError, ClosedResourceError, OutOfRangeError, UnsupportedError

__all__ = ["Device", "DeviceKind", "MemoryBackend", "MemoryKind", "MemoryRegion", "Owned", "Stream", "Vendor"]


class DeviceKind(enum.Enum):
    HOST = "host"
    CUDA = "cuda"
    HIP = "hip"


class Vendor(enum.Enum):
    HOST = "host"
    NVIDIA = "nvidia"
    AMD = "amd"

    @classmethod
    def parse(cls, text: str) -> Vendor:
        try:
            return cls(text.lower())
        except ValueError as exc:
            raise ArgumentError(f"unknown vendor {text!r}; known: host, nvidia, amd") from exc


class MemoryKind(enum.Enum):
    HOST = "host"
    """Pageable host memory."""
    HOST_PINNED = "host_pinned"
    """Page-locked host memory a device can DMA from."""
    DEVICE = "device"
    """Memory on an accelerator."""


@dataclasses.dataclass(frozen=True)
class Device:
    """A memory domain: `host`, `cuda:N` or `hip:N`."""

    name: str
    kind: DeviceKind
    index: int = 0
    vendor: Vendor = Vendor.HOST
    """Effective vendor, after any configured override."""
    physical_vendor: Vendor = Vendor.HOST
    """What the hardware reports."""
    uuid: str = ""
    pci_bus_id: str = ""
    numa_node: int = -1
    total_memory: int = 0
    model: str = ""
    peer_devices: tuple[str, ...] = ()

    def with_vendor(self, vendor: Vendor) -> Device:
        """The same device declared as another vendor (cross-vendor testing)."""
        return dataclasses.replace(self, vendor=vendor)


class Owned(abc.ABC):
    """A runtime object (a stream, an event) destroyed once, by close() or at the end of a with block."""

    _closed = False

    @abc.abstractmethod
    def _destroy(self) -> None:
        """Give the object back to its runtime."""

    def close(self) -> None:
        """Destroy the object (a stream once its queued work finishes); idempotent."""
        if not self._closed:
            self._closed = True
            self._destroy()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Stream(abc.ABC):
    """An ordered queue of copies on one device; host streams run inline."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block until every queued operation has finished."""

    @property
    def handle(self) -> int:
        """The native stream handle (0 for the host)."""
        return 0


@dataclasses.dataclass(frozen=True, eq=False)
class MemoryRegion:
    """A contiguous span of memory on one device, normalised from any source.

    `owner` keeps the memory alive (a numpy array, a tensor, an allocation);
    `release` frees memory HMC allocated itself and is None for borrowed memory.
    """

    device: Device
    address: int
    size: int
    kind: MemoryKind
    owner: Any = None
    readonly: bool = False
    release: Callable[[], None] | None = dataclasses.field(default=None, repr=False)
    _freed: list[bool] = dataclasses.field(default_factory=lambda: [False], repr=False)

    def view(self, offset: int, size: int | None = None) -> MemoryRegion:
        """A sub-region sharing this one's memory and lifetime (never freed through the view)."""
        if size is None:
            size = self.size - offset
        if offset < 0 or size < 0 or offset + size > self.size:
            raise OutOfRangeError(f"view [{offset}, {offset + size}) outside region of {self.size} bytes")
        return dataclasses.replace(self, address=self.address + offset, size=size, owner=self, release=None, _freed=self._freed)

    @property
    def freed(self) -> bool:
        return self._freed[0]

    def check_alive(self) -> None:
        if self._freed[0]:
            raise ClosedResourceError("memory region was freed")

    def free(self) -> None:
        """Free memory HMC allocated; idempotent. Borrowed memory is left to its owner."""
        if self._freed[0]:
            return
        self._freed[0] = True
        if self.release is not None:
            self.release()

    def numpy(self) -> np.ndarray:
        """A zero-copy uint8 array over host memory."""
        if self.kind is MemoryKind.DEVICE:
            raise UnsupportedError(f"{self.device.name} memory is not addressable from the host")
        self.check_alive()
        if self.size == 0:
            return np.empty(0, dtype=np.uint8)
        raw = (ctypes.c_uint8 * self.size).from_address(self.address)
        array = np.ctypeslib.as_array(raw)
        if self.readonly:
            array.flags.writeable = False
        return array

    def __enter__(self) -> MemoryRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()


class MemoryBackend(abc.ABC):
    """What every device family implements; absent runtimes yield no devices, never errors."""

    kind: DeviceKind

    @abc.abstractmethod
    def devices(self) -> list[Device]:
        """The devices of this family present on this host (empty when none)."""

    @abc.abstractmethod
    def allocate(self, device: Device, size: int, *, pinned: bool = False) -> MemoryRegion:
        """New memory on `device`; `pinned` asks for page-locked host memory."""

    @abc.abstractmethod
    def copy(self, dst: MemoryRegion, src: MemoryRegion, size: int, *, stream: Stream | None = None) -> None:
        """Copy `size` bytes from src to dst (either may be host memory); async on a stream."""

    @abc.abstractmethod
    def fill(self, region: MemoryRegion, value: int, *, stream: Stream | None = None) -> None:
        """Set every byte of region to `value`."""

    @abc.abstractmethod
    def stream(self, device: Device) -> Stream:
        """A new stream on `device`."""

    def export_handles(self, region: MemoryRegion) -> dict[str, Any]:
        """Per-transport handles for a descriptor (e.g. {"cuda_ipc": CudaIpcHandle(...)})."""
        return {}
