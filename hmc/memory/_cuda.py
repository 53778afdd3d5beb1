"""CUDA backend of the Memory API, on cuda-python's driver API (`cuda.bindings.driver`).

Devices are `cuda:N` in CUDA's ordinal order (CUDA_VISIBLE_DEVICES applies). Device
memory comes from cuMemAlloc in the device's primary context, the one PyTorch and
CuPy use, so their tensors and HMC regions mix freely; pinned host memory comes
from cuMemHostAlloc (portable: every context may DMA from it). Copies use unified
addressing, so one call moves host<->device, device<->device and peer<->peer bytes;
peer access between two GPUs is enabled on their first copy.

Without a stream, copy() and fill() run on the calling thread's per-thread default
stream and return when done; that stream waits for work already queued on the
legacy default stream (PyTorch's default). With a `CudaStream` they are queued and
return at once: synchronize the stream, or record a `CudaEvent`, before reading.

No cuda-python, no driver, or no GPU: probe() says why and the backend is absent.

Concurrency: thread-safe for distinct regions. Shared state is the primary contexts
and peer links (`Contexts`, locked) and the IPC mappings (`IpcMappings`, locked).
A caller must not free a region while a copy into or out of it is queued.
"""

from __future__ import annotations

import logging
import uuid as uuidlib
from collections.abc import Callable
from typing import Any

from hmc.errors import DeviceError
from hmc.memory._base import Device, DeviceKind, MemoryKind, MemoryRegion, Stream, Vendor
from hmc.memory._gpu import GpuBackend
from hmc.memory._cuda_driver import Contexts, CudaEvent, CudaRuntime, CudaStream, check, driver, pointer_ordinal
from hmc.memory._cuda_ipc import export_handles, ipc_mappings
from hmc.memory._host import HOST_DEVICE
from hmc.memory._machine import pci_numa_node

__all__ = ["CudaBackend", "CudaEvent", "CudaStream"]

log = logging.getLogger(__name__)

_NAME_BYTES = 256
_BUS_ID_BYTES = 32


class CudaBackend(GpuBackend):
    """NVIDIA GPUs through the CUDA driver API."""

    kind = DeviceKind.CUDA
    _stream_type = CudaStream

    def __init__(self, devices: list[Device]) -> None:
        self._contexts = Contexts()
        super().__init__(devices, self._contexts, ipc_mappings(self._contexts), CudaRuntime(self._contexts))

    @classmethod
    def probe(cls) -> tuple[CudaBackend | None, str]:
        """The backend, or None and why (no cuda-python, no driver, no GPU); never raises."""
        if driver is None:
            return None, "cuda-python is not installed"
        try:
            check(driver.cuInit(0))
            count = check(driver.cuDeviceGetCount())
            if count <= 0:
                return None, "no NVIDIA GPU: the CUDA driver reports none"
            return cls(_discover(count)), ""
        except (DeviceError, RuntimeError, OSError) as exc:  # RuntimeError: libcuda.so.1 could not be loaded
            log.debug("CUDA backend absent: %s", exc)
            return None, f"no usable CUDA driver or GPU: {exc}"

    @property
    def contexts(self) -> Contexts:
        """The primary contexts and peer links, for transports that issue driver calls of their own."""
        return self._contexts

    def _malloc(self, ordinal: int, size: int) -> tuple[int, Callable[[], None]]:
        with self._contexts.use(ordinal):
            address = int(check(driver.cuMemAlloc(size)))

        def release() -> None:
            with self._contexts.use(ordinal):
                check(driver.cuMemFree(address))

        return address, release

    def _malloc_host(self, size: int) -> tuple[int, Callable[[], None]]:
        with self._contexts.use_any():
            address = int(check(driver.cuMemHostAlloc(size, driver.CU_MEMHOSTALLOC_PORTABLE)))

        def release() -> None:
            with self._contexts.use_any():
                check(driver.cuMemFreeHost(address))

        return address, release

    def copy(self, dst: MemoryRegion, src: MemoryRegion, size: int, *, stream: Stream | None = None) -> None:
        if size == 0:
            return
        cuda_stream = self._own_stream(stream)
        self._link_peers(dst.device, src.device)
        if cuda_stream is not None:
            with self._contexts.use(cuda_stream.device.index):
                check(driver.cuMemcpyAsync(dst.address, src.address, size, cuda_stream.handle))
            return
        with self._contexts.use(self._ordinal_for(dst, src)):
            check(driver.cuMemcpyAsync(dst.address, src.address, size, driver.CU_STREAM_PER_THREAD))
            check(driver.cuStreamSynchronize(driver.CU_STREAM_PER_THREAD))

    def fill(self, region: MemoryRegion, value: int, *, stream: Stream | None = None) -> None:
        if region.size == 0:
            return
        cuda_stream = self._own_stream(stream)
        if cuda_stream is not None:
            with self._contexts.use(cuda_stream.device.index):
                check(driver.cuMemsetD8Async(region.address, value, region.size, cuda_stream.handle))
            return
        with self._contexts.use(self._ordinal_for(region, region)):
            check(driver.cuMemsetD8Async(region.address, value, region.size, driver.CU_STREAM_PER_THREAD))
            check(driver.cuStreamSynchronize(driver.CU_STREAM_PER_THREAD))

    def stream(self, device: Device) -> CudaStream:
        return CudaStream(self._contexts, self._devices[self._ordinal(device)])

    def resolve_pointer(self, address: int) -> tuple[Device, MemoryKind]:
        """Where a CUDA pointer's memory lives: (cuda:N, DEVICE) or (host, HOST_PINNED)."""
        attribute = driver.CUpointer_attribute
        with self._contexts.use_any():
            memory_type = int(check(driver.cuPointerGetAttribute(attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address)))
            if memory_type == int(driver.CUmemorytype.CU_MEMORYTYPE_HOST):
                return HOST_DEVICE, MemoryKind.HOST_PINNED
            ordinal = pointer_ordinal(address)
        return self._devices[ordinal], MemoryKind.DEVICE

    def export_handles(self, region: MemoryRegion) -> dict[str, Any]:
        """CUDA IPC and dma-buf handles for device memory; each left out where the driver refuses it."""
        if region.kind is not MemoryKind.DEVICE:
            return {}
        region.check_alive()
        self._ordinal(region.device)
        return export_handles(self._contexts, region)


def _discover(count: int) -> list[Device]:
    handles = [check(driver.cuDeviceGet(ordinal)) for ordinal in range(count)]
    devices = []
    for ordinal, handle in enumerate(handles):
        peers = tuple(f"cuda:{other}" for other, peer in enumerate(handles) if other != ordinal and check(driver.cuDeviceCanAccessPeer(handle, peer)))
        bus_id = _pci_bus_id(handle)
        devices.append(
            Device(
                name=f"cuda:{ordinal}",
                kind=DeviceKind.CUDA,
                index=ordinal,
                vendor=Vendor.NVIDIA,
                physical_vendor=Vendor.NVIDIA,
                uuid=f"GPU-{uuidlib.UUID(bytes=check(driver.cuDeviceGetUuid(handle)).bytes)}",
                pci_bus_id=bus_id,
                numa_node=pci_numa_node(bus_id),
                total_memory=int(check(driver.cuDeviceTotalMem(handle))),
                model=_c_string(check(driver.cuDeviceGetName(_NAME_BYTES, handle))),
                peer_devices=peers,
            )
        )
    return devices


def _c_string(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode()


def _pci_bus_id(handle: Any) -> str:
    """The bus id as sysfs spells it ("0000:18:00.0"); CUDA pads the domain to 8 digits."""
    domain, rest = _c_string(check(driver.cuDeviceGetPCIBusId(_BUS_ID_BYTES, handle))).split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"
