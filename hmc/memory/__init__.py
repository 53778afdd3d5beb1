"""The Memory API: one device-agnostic call set for host, CUDA and HIP memory.

    devices()                      every memory domain on this host
    get_device("cuda:0")           one of them
    allocate(size, "host")         new memory (pinned=True for page-locked host memory)
    register(obj)                  borrow existing memory (numpy, torch, CuPy, bytes-like)
    copy(dst, src, size)           any device to any device
    fill(region, value)            set every byte
    view(region, offset, size)     a sub-region
    free(region)                   release what allocate() returned

Backends whose runtime or devices are absent contribute no devices; that is not
an error. Hardware discovery runs once per process, on first use.
"""

from __future__ import annotations

import functools
from typing import Any

from hmc.errors import ArgumentError, DeviceError, OutOfRangeError, UnsupportedError
from hmc.memory._base import Device, DeviceKind, MemoryBackend, MemoryKind, MemoryRegion, Stream, Vendor
from hmc.memory._host import HOST_DEVICE, HostBackend
from hmc.memory._interop import as_region

__all__ = [
    "Device",
    "DeviceKind",
    "MemoryBackend",
    "MemoryKind",
    "MemoryRegion",
    "Stream",
    "Vendor",
    "absent_backends",
    "allocate",
    "backend_for",
    "copy",
    "devices",
    "dmabuf_kinds",
    "fill",
    "free",
    "get_device",
    "register",
    "view",
]


@functools.cache
def _discovery() -> tuple[dict[DeviceKind, MemoryBackend], dict[DeviceKind, str]]:
    """Discover device families once: those present, and why each absent one is."""
    found: dict[DeviceKind, MemoryBackend] = {DeviceKind.HOST: HostBackend()}
    absent: dict[DeviceKind, str] = {}
    for kind, loader in ((DeviceKind.CUDA, _load_cuda), (DeviceKind.HIP, _load_hip)):
        try:
            backend, reason = loader()
        except Exception as exc:  # noqa: BLE001 - a runtime failing in a way its probe did not foresee: absent, not fatal
            backend, reason = None, f"its runtime failed during discovery: {type(exc).__name__}: {exc}"
        if backend is not None and backend.devices():
            found[kind] = backend
        else:
            absent[kind] = reason or f"no {kind.value} devices"
    return found, absent


def _backends() -> dict[DeviceKind, MemoryBackend]:
    return _discovery()[0]


def _load_cuda() -> tuple[MemoryBackend | None, str]:
    from hmc.memory._hip_on_cuda import SWITCH, enabled

    if enabled():
        return None, f"this process runs its NVIDIA GPUs as HIP devices ({SWITCH}=1, the HIP-on-CUDA runtime)"
    try:
        from hmc.memory._cuda import CudaBackend
    except ImportError as exc:
        return None, f"cuda-python is not installed ({exc})"
    return CudaBackend.probe()


def _load_hip() -> tuple[MemoryBackend | None, str]:
    from hmc.memory._hip import HipBackend

    return HipBackend.probe()


def absent_backends() -> dict[str, str]:
    """The device families with no backend here ("cuda", "hip"), each with why (no runtime, no device)."""
    return {kind.value: reason for kind, reason in _discovery()[1].items()}


def backend_for(device: Device | DeviceKind) -> MemoryBackend:
    """The backend serving a device (or device family)."""
    kind = device if isinstance(device, DeviceKind) else device.kind
    try:
        return _backends()[kind]
    except KeyError:
        raise UnsupportedError(f"no {kind.value} devices on this host") from None


def dmabuf_kinds() -> frozenset[DeviceKind]:
    """The GPU families here whose memory exports as a dma-buf (what an RDMA NIC registers; checked on a small
    allocation of each family's first device)."""
    kinds = set()
    for kind in (DeviceKind.CUDA, DeviceKind.HIP):
        try:
            backend = backend_for(kind)
            found = backend.devices()
        except UnsupportedError:
            continue
        if not found:
            continue
        region = allocate(2 << 20, found[0])
        try:
            if "dmabuf" in backend.export_handles(region):
                kinds.add(kind)
        finally:
            free(region)
    return frozenset(kinds)


def devices() -> list[Device]:
    """Every memory domain on this host: `host` first, then accelerators."""
    return [device for backend in _backends().values() for device in backend.devices()]


def get_device(name: str | Device) -> Device:
    """Look a device up by name ("host", "cuda:0", "hip:1")."""
    if isinstance(name, Device):
        return name
    for device in devices():
        if device.name == name:
            return device
    raise ArgumentError(f"no device {name!r}; present: {', '.join(d.name for d in devices())}")


def allocate(size: int, device: str | Device = "host", *, pinned: bool = False) -> MemoryRegion:
    """New memory of `size` bytes on `device`; free it with `free()` or a `with` block."""
    target = get_device(device)
    return backend_for(target).allocate(target, size, pinned=pinned)


def free(region: MemoryRegion) -> None:
    """Release memory returned by allocate(); idempotent."""
    region.free()


def _resolve_pointer(address: int) -> tuple[Device, MemoryKind]:
    """The device a GPU pointer belongs to: asked of each GPU backend in turn (on a node with NVIDIA and AMD GPUs,
    a torch-on-ROCm tensor's pointer is unknown to CUDA)."""
    refused: list[str] = []
    for kind in (DeviceKind.CUDA, DeviceKind.HIP):
        backend = _backends().get(kind)
        if backend is not None and hasattr(backend, "resolve_pointer"):
            try:
                return backend.resolve_pointer(address)
            except (DeviceError, ArgumentError) as exc:
                refused.append(f"{kind.value}: {exc}")
    if refused:
        raise ArgumentError(f"no GPU backend knows the pointer {address:#x} ({'; '.join(refused)})")
    raise UnsupportedError("device pointer given but no CUDA or HIP backend is available")


def register(obj: Any) -> MemoryRegion:
    """Borrow existing memory (buffer protocol, DLPack, __cuda_array_interface__) as a region."""
    return as_region(obj, _resolve_pointer)


def view(region: MemoryRegion, offset: int, size: int | None = None) -> MemoryRegion:
    """A sub-region of `region`."""
    return region.view(offset, size)


def copy(dst: Any, src: Any, size: int | None = None, *, dst_offset: int = 0, src_offset: int = 0, stream: Stream | None = None) -> None:
    """Copy bytes between any two regions (or registrable objects), host or device."""
    dst_region, src_region = register(dst), register(src)
    dst_region.check_alive()
    src_region.check_alive()
    if size is None:
        size = min(dst_region.size - dst_offset, src_region.size - src_offset)
    if dst_region.readonly:
        raise ArgumentError("destination is read-only")
    for name, region, offset in (("source", src_region, src_offset), ("destination", dst_region, dst_offset)):
        if offset < 0 or size < 0 or offset + size > region.size:
            raise OutOfRangeError(f"{name} range [{offset}, {offset + size}) outside {region.size} bytes")
    device_side = dst_region if dst_region.kind is MemoryKind.DEVICE else src_region
    backend_for(device_side.device).copy(dst_region.view(dst_offset, size), src_region.view(src_offset, size), size, stream=stream)


def fill(region: Any, value: int, *, stream: Stream | None = None) -> None:
    """Set every byte of `region` to `value` (0-255)."""
    target = register(region)
    target.check_alive()
    if not 0 <= value <= 255:
        raise ArgumentError(f"fill value must be a byte, got {value}")
    backend_for(target.device).fill(target, value, stream=stream)
