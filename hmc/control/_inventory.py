"""What a node has: memory devices, RDMA NICs and the transports that can run.

Devices come from `hmc.memory.devices()` with `Config.vendor_override` applied
(a device declared as another vendor keeps its `physical_vendor`). RDMA NICs are
read from /sys/class/infiniband (absent: none). Transports are declared by
capability; `ipc` is listed only where cross-memory attach is allowed.

Concurrency: `collect()` runs once when hmcd starts; the result is immutable.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from hmc.config import Config
from hmc.memory import Device, DeviceKind, Vendor, absent_backends, devices
from hmc.memory._machine import host_id, rdma_nics
from hmc.transport._base import Capabilities, PathName, kind_to_proto
from hmc.v1 import common_pb2, daemon_pb2

__all__ = ["Inventory", "apply_vendor_override", "device_to_proto", "rdma_devices", "transports"]

_VENDOR = {Vendor.HOST: common_pb2.VENDOR_HOST, Vendor.NVIDIA: common_pb2.VENDOR_NVIDIA, Vendor.AMD: common_pb2.VENDOR_AMD}


def device_to_proto(device: Device) -> common_pb2.DeviceInfo:
    return common_pb2.DeviceInfo(
        name=device.name,
        kind=kind_to_proto(device.kind),
        index=device.index,
        vendor=_VENDOR[device.vendor],
        physical_vendor=_VENDOR[device.physical_vendor],
        uuid=device.uuid,
        pci_bus_id=device.pci_bus_id,
        numa_node=device.numa_node,
        total_memory=device.total_memory,
        model=device.model,
        peer_devices=list(device.peer_devices),
    )


def apply_vendor_override(found: list[Device], override: Mapping[str, str]) -> list[Device]:
    """`found` with the configured vendor declarations applied (unknown device names are ignored)."""
    return [device.with_vendor(Vendor.parse(override[device.name])) if device.name in override else device for device in found]


def rdma_devices(root: str = "/sys/class/infiniband") -> list[daemon_pb2.RdmaDevice]:
    """RDMA NICs and their ports, e.g. mlx5_0 with ports ["1"]."""
    return [daemon_pb2.RdmaDevice(name=name, ports=ports) for name, ports in rdma_nics(root)]


def _ptrace_scope(path: str = "/proc/sys/kernel/yama/ptrace_scope") -> int:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return 0


def transports(device_kinds: frozenset[DeviceKind], ptrace_scope: int | None = None) -> list[Capabilities]:
    """The paths agents on this node can offer: ipc reaches host memory where cross-memory attach is allowed, and CUDA memory where a CUDA device is."""
    scope = _ptrace_scope() if ptrace_scope is None else ptrace_scope
    found = [Capabilities(PathName.LOCAL, device_kinds, one_sided=True, same_agent_only=True, detail="memcpy")]
    ipc_kinds = {DeviceKind.HOST} if scope < 2 else set()  # 2 = admin-only attach, 3 = no attach at all: cross-memory attach is refused
    ipc_kinds |= device_kinds & {DeviceKind.CUDA}  # CUDA IPC needs no ptrace permission
    if ipc_kinds:
        detail = ", ".join(name for kind, name in ((DeviceKind.HOST, "cma"), (DeviceKind.CUDA, "cuda ipc")) if kind in ipc_kinds)
        found.append(Capabilities(PathName.IPC, frozenset(ipc_kinds), one_sided=True, same_host_only=True, same_vendor_only=DeviceKind.CUDA in ipc_kinds, detail=detail))
    found.append(Capabilities(PathName.STAGED, device_kinds, detail="tcp"))
    return found


@dataclasses.dataclass(frozen=True)
class Inventory:
    """The node as hmcd reports it in NodeInfo."""

    node: str
    host_id: str
    hostname: str
    devices: tuple[common_pb2.DeviceInfo, ...]
    rdma_devices: tuple[daemon_pb2.RdmaDevice, ...]
    transports: tuple[common_pb2.TransportCapability, ...]
    absent_backends: tuple[daemon_pb2.AbsentBackend, ...] = ()
    """Device families with no backend here, and why."""

    @classmethod
    def collect(cls, config: Config) -> Inventory:
        found = apply_vendor_override(devices(), config.vendor_override)
        kinds = frozenset(device.kind for device in found)
        return cls(
            node=config.node,
            host_id=host_id(),
            hostname=os.uname().nodename,
            devices=tuple(device_to_proto(device) for device in found),
            rdma_devices=tuple(rdma_devices()),
            transports=tuple(cap.to_proto() for cap in transports(kinds)),
            absent_backends=tuple(daemon_pb2.AbsentBackend(kind=kind, reason=why) for kind, why in absent_backends().items()),
        )
