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

No cuda-python, no driver, or no GPU: probe() returns None and the backend is absent.

Concurrency: thread-safe for distinct regions. Shared state is the primary contexts
and peer links (`Contexts`, locked) and the IPC mappings (`IpcMappings`, locked).
A caller must not free a region while a copy into or out of it is queued.
"""

from __future__ import annotations

import logging
import uuid as uuidlib
from pathlib import Path
from typing import Any

from hmc.errors import ArgumentError, DeviceError
from hmc.memory._base import Device, DeviceKind, MemoryBackend, MemoryKind, MemoryRegion, Stream, Vendor
from hmc.memory._cuda_driver import Contexts, CudaEvent, CudaStream, check, driver, pointer_ordinal
from hmc.memory._cuda_ipc import IpcMappings, export_handles
from hmc.memory._host import HOST_DEVICE
from hmc.v1 import common_pb2

__all__ = ["CudaBackend", "CudaEvent", "CudaStream"]

log = logging.getLogger(__name__)

_NAME_BYTES = 256
_BUS_ID_BYTES = 32


class CudaBackend(MemoryBackend):
    """NVIDIA GPUs through the CUDA driver API."""

    kind = DeviceKind.CUDA

    def __init__(self, devices: list[Device]) -> None:
        self._devices = devices
        self._contexts = Contexts()
        self._ipc = IpcMappings(self._contexts)

    @classmethod
    def probe(cls) -> CudaBackend | None:
        """The backend, or None when cuda-python, the driver or every GPU is missing; never raises."""
        if driver is None:
            return None
        try:
            check(driver.cuInit(0))
            count = check(driver.cuDeviceGetCount())
            return cls(_discover(count)) if count > 0 else None
        except (DeviceError, RuntimeError, OSError) as exc:  # RuntimeError: libcuda.so.1 could not be loaded
            log.debug("CUDA backend absent: %s", exc)
            return None

    def devices(self) -> list[Device]:
        return list(self._devices)

    @property
    def contexts(self) -> Contexts:
        """The primary contexts and peer links, for transports that issue driver calls of their own."""
        return self._contexts

    def allocate(self, device: Device, size: int, *, pinned: bool = False) -> MemoryRegion:
        """Device memory on a `cuda:N` device (always DMA-able; `pinned` is moot there).

        On the host device, `pinned=True` gives cuMemHostAlloc memory (see allocate_pinned_host).
        """
        if size <= 0:
            raise ArgumentError(f"allocation size must be positive, got {size}")
        if device.kind is DeviceKind.HOST:
            if not pinned:
                raise ArgumentError("pageable host memory comes from the host backend")
            return self.allocate_pinned_host(size)
        ordinal = self._ordinal(device)
        with self._contexts.use(ordinal):
            address = int(check(driver.cuMemAlloc(size)))

        def release() -> None:
            with self._contexts.use(ordinal):
                check(driver.cuMemFree(address))

        return MemoryRegion(device=device, address=address, size=size, kind=MemoryKind.DEVICE, release=release)

    def allocate_pinned_host(self, size: int) -> MemoryRegion:
        """Page-locked host memory that every GPU can DMA from at full speed (staging rings)."""
        if size <= 0:
            raise ArgumentError(f"allocation size must be positive, got {size}")
        with self._contexts.use_any():
            address = int(check(driver.cuMemHostAlloc(size, driver.CU_MEMHOSTALLOC_PORTABLE)))

        def release() -> None:
            with self._contexts.use_any():
                check(driver.cuMemFreeHost(address))

        return MemoryRegion(device=HOST_DEVICE, address=address, size=size, kind=MemoryKind.HOST_PINNED, release=release)

    def copy(self, dst: MemoryRegion, src: MemoryRegion, size: int, *, stream: Stream | None = None) -> None:
        if size == 0:
            return
        cuda_stream = self._cuda_stream(stream)
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
        cuda_stream = self._cuda_stream(stream)
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

    def open_ipc(self, handle: common_pb2.CudaIpcHandle, device: Device, size: int) -> MemoryRegion:
        """Map `size` bytes another process exported, for use by the GPU `device`.

        Open it on the GPU whose kernels will touch it: the memory may live on another
        GPU (the driver then enables peer access for the mapping), but a mapping made
        on one GPU is not reachable from kernels on the others. Each exported allocation
        is mapped once per process and device however often it is opened; free the
        region (or close_ipc) to drop this user, and the last one unmaps it.
        """
        return self._ipc.open(handle, self._devices[self._ordinal(device)], size)

    def close_ipc(self, region: MemoryRegion) -> None:
        """Drop a region returned by open_ipc (the same as region.free()); idempotent."""
        region.free()

    def ipc_mappings(self) -> int:
        """How many exported allocations this process has mapped through open_ipc now."""
        return self._ipc.open_count()

    def _ordinal(self, device: Device) -> int:
        if device.kind is not DeviceKind.CUDA or not 0 <= device.index < len(self._devices):
            raise ArgumentError(f"{device.name} is not a CUDA device of this host")
        return device.index

    def _ordinal_for(self, dst: MemoryRegion, src: MemoryRegion) -> int:
        """The device whose context runs a stream-less copy: dst's GPU, else src's, else the first."""
        for region in (dst, src):
            if region.device.kind is DeviceKind.CUDA:
                return self._ordinal(region.device)
        return 0

    def _link_peers(self, a: Device, b: Device) -> None:
        if a.kind is DeviceKind.CUDA and b.kind is DeviceKind.CUDA and a.index != b.index and b.name in a.peer_devices:
            self._contexts.enable_peer_access(a.index, b.index)
            self._contexts.enable_peer_access(b.index, a.index)

    @staticmethod
    def _cuda_stream(stream: Stream | None) -> CudaStream | None:
        if stream is None or isinstance(stream, CudaStream):
            return stream
        raise ArgumentError(f"CUDA copies need a CudaStream, got {type(stream).__name__}")


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
                numa_node=_numa_node(bus_id),
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


def _numa_node(bus_id: str) -> int:
    """The NUMA node sysfs reports for the device, -1 when unknown."""
    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus_id}/numa_node").read_text())
    except (OSError, ValueError):
        return -1
    return max(node, -1)
