"""HIP backend of the Memory API, on hip-python's runtime API (`hip`), for AMD GPUs.

Devices are `hip:N` in HIP's ordinal order (HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES apply), vendor
AMD. Device memory comes from hipMalloc on the device made current for the call (the caller's current
device is given back), so it mixes with PyTorch-on-ROCm's; pinned host memory from hipHostMalloc
(portable: every device may DMA from it). Copies use unified addressing (hipMemcpyDefault), so one call
moves host<->device, device<->device and peer<->peer bytes; peer access between two GPUs is enabled on
their first copy. Without a stream, copy() and fill() run on the null stream and return when done (HMC's
own streams are non-blocking: they do not wait for it); with a `HipStream` they are queued and return.

Where the runtime is the HIP-on-CUDA one (`HMC_HIP_ON_CUDA=1`), the same code runs on NVIDIA GPUs:
the devices are still `hip:N` of vendor AMD (what the backend is), with NVIDIA as the hardware's
vendor (`physical_vendor`).

No hip-python, no ROCm runtime, or no AMD GPU: probe() says why and the backend is absent.

Concurrency: thread-safe for distinct regions; shared state is the peer links (`Devices`, locked) and
the IPC mappings (locked). A caller must not free a region while a copy into or out of it is queued.
"""

from __future__ import annotations

import ctypes
import logging
import uuid as uuidlib
from collections.abc import Callable
from typing import Any

from hmc.errors import ArgumentError, DeviceError
from hmc.memory._base import Device, DeviceKind, MemoryKind, MemoryRegion, Stream, Vendor
from hmc.memory._gpu import GpuBackend
from hmc.memory._hip_ipc import export_handles, ipc_mappings
from hmc.memory._hip_runtime import ON_CUDA, Devices, HipEvent, HipRuntime, HipStream, check, hip, missing
from hmc.memory._host import HOST_DEVICE
from hmc.memory._machine import pci_numa_node

__all__ = ["HipBackend", "HipEvent", "HipStream"]

log = logging.getLogger(__name__)

_NAME_BYTES = 256
_BUS_ID_BYTES = 32
_UUID_BYTES = 16


class HipBackend(GpuBackend):
    """AMD GPUs through the HIP runtime."""

    kind = DeviceKind.HIP
    _stream_type = HipStream

    def __init__(self, devices: list[Device]) -> None:
        self._scopes = Devices()
        super().__init__(devices, self._scopes, ipc_mappings(self._scopes), HipRuntime(self._scopes))

    @classmethod
    def probe(cls) -> tuple[HipBackend | None, str]:
        """The backend, or None and why (no hip-python, no ROCm runtime, no AMD GPU); never raises."""
        if hip is None:
            return None, missing
        try:
            check(hip.hipInit(0))
            count = int(check(hip.hipGetDeviceCount()))
            if count <= 0:
                return None, "no AMD GPU: the HIP runtime reports none"
            return cls(_discover(count)), ""
        except RuntimeError as exc:  # hip-python could not load libamdhip64.so
            return None, f"no ROCm runtime: {exc}"
        except DeviceError as exc:  # a device the runtime counts but cannot describe, a driver failure
            return None, f"no AMD GPU usable: {exc}"

    @property
    def scopes(self) -> Devices:
        """Current-device scopes and peer links, for transports that issue HIP calls of their own."""
        return self._scopes

    def _malloc(self, ordinal: int, size: int) -> tuple[int, Callable[[], None]]:
        with self._scopes.use(ordinal):
            address = int(check(hip.hipMalloc(size)))

        def release() -> None:
            with self._scopes.use(ordinal):
                check(hip.hipFree(address))

        return address, release

    def _malloc_host(self, size: int) -> tuple[int, Callable[[], None]]:
        address = int(check(hip.hipHostMalloc(size, hip.hipHostMallocPortable)))

        def release() -> None:
            check(hip.hipHostFree(address))

        return address, release

    def copy(self, dst: MemoryRegion, src: MemoryRegion, size: int, *, stream: Stream | None = None) -> None:
        if size == 0:
            return
        hip_stream = self._own_stream(stream)
        self._link_peers(dst.device, src.device)
        kind = hip.hipMemcpyKind.hipMemcpyDefault
        if hip_stream is not None:
            with self._scopes.use(hip_stream.device.index):
                check(hip.hipMemcpyAsync(dst.address, src.address, size, kind, hip_stream.native))
            return
        with self._scopes.use(self._ordinal_for(dst, src)):
            check(hip.hipMemcpyAsync(dst.address, src.address, size, kind, None))
            check(hip.hipStreamSynchronize(None))

    def fill(self, region: MemoryRegion, value: int, *, stream: Stream | None = None) -> None:
        if region.size == 0:
            return
        hip_stream = self._own_stream(stream)
        if hip_stream is not None:
            with self._scopes.use(hip_stream.device.index):
                check(hip.hipMemsetD8Async(region.address, value, region.size, hip_stream.native))
            return
        with self._scopes.use(self._ordinal_for(region, region)):
            check(hip.hipMemsetD8Async(region.address, value, region.size, None))
            check(hip.hipStreamSynchronize(None))

    def stream(self, device: Device) -> HipStream:
        return HipStream(self._scopes, self._devices[self._ordinal(device)])

    def resolve_pointer(self, address: int) -> tuple[Device, MemoryKind]:
        """Where a HIP pointer's memory lives: (hip:N, DEVICE) or (host, HOST_PINNED)."""
        attributes = hip.hipPointerAttribute_t()
        check(hip.hipPointerGetAttributes(attributes, address))
        if int(attributes.type) == int(hip.hipMemoryType.hipMemoryTypeHost):
            return HOST_DEVICE, MemoryKind.HOST_PINNED
        if int(attributes.type) != int(hip.hipMemoryType.hipMemoryTypeDevice):
            raise ArgumentError(f"{address:#x} is not memory the HIP runtime allocated or registered")
        return self._devices[int(attributes.device)], MemoryKind.DEVICE

    def export_handles(self, region: MemoryRegion) -> dict[str, Any]:
        """HIP IPC and dma-buf handles for device memory; each left out where the runtime refuses it."""
        if region.kind is not MemoryKind.DEVICE:
            return {}
        region.check_alive()
        self._ordinal(region.device)
        return export_handles(self._scopes, region)


def _discover(count: int) -> list[Device]:
    devices = []
    for ordinal in range(count):
        peers = tuple(f"hip:{other}" for other in range(count) if other != ordinal and check(hip.hipDeviceCanAccessPeer(ordinal, other)))
        bus_id = _pci_bus_id(ordinal)
        devices.append(
            Device(
                name=f"hip:{ordinal}",
                kind=DeviceKind.HIP,
                index=ordinal,
                vendor=Vendor.AMD,
                physical_vendor=Vendor.NVIDIA if ON_CUDA else Vendor.AMD,
                uuid=_uuid(ordinal),
                pci_bus_id=bus_id,
                numa_node=pci_numa_node(bus_id),
                total_memory=int(check(hip.hipDeviceTotalMem(ordinal))),
                model=_c_string(check(hip.hipDeviceGetName(_NAME_BYTES, ordinal))),
                peer_devices=peers,
            )
        )
    return devices


def _c_string(raw: Any) -> str:
    return bytes(raw).split(b"\0", 1)[0].decode()


def _uuid(ordinal: int) -> str:
    """"GPU-<uuid>" from the device's 16 UUID bytes (read from the struct: its `bytes` stops at a zero byte)."""
    native = check(hip.hipDeviceGetUuid(ordinal))
    return f"GPU-{uuidlib.UUID(bytes=ctypes.string_at(native.as_c_void_p().value, _UUID_BYTES))}"


def _pci_bus_id(ordinal: int) -> str:
    """The bus id as sysfs spells it ("0000:c1:00.0")."""
    domain, rest = _c_string(check(hip.hipDeviceGetPCIBusId(_BUS_ID_BYTES, ordinal))).split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"
