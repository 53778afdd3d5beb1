"""Which physical host this process runs on (below both the transports, a shared ring needs the same host,
and the control plane, hmcd announces it), where its PCI devices sit, and which RDMA NICs it has."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

__all__ = ["HOST_ID_ENV", "clock_id", "host_id", "pci_numa_node", "rdma_nics"]

HOST_ID_ENV = "HMC_HOST_ID"
"""Overrides the host id: agents that share a kernel but not /dev/shm or a PID namespace (containers) are told
apart with it, so they use the paths of two hosts; the GPU tests run the cross-host staged path on one host so."""


def host_id(boot_id_path: str = "/proc/sys/kernel/random/boot_id") -> str:
    """$HMC_HOST_ID, else the kernel boot id: equal on two agents means the same physical host."""
    if override := os.environ.get(HOST_ID_ENV):
        return override
    return _boot_id(boot_id_path)


@functools.cache
def _boot_id(path: str) -> str:
    """The kernel boot id (the host name where it cannot be read), read once: a read of /proc costs ~30 us, and the
    staged path asks on every transfer."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return socket.gethostname()


@functools.cache
def clock_id() -> str:
    """The kernel boot id and this process's time namespace: equal on two processes means one CLOCK_MONOTONIC.
    $HMC_HOST_ID does not change it: it names hosts, this a clock. Fixed for a process's life (a time namespace
    entered later applies to its children only), so read once."""
    try:
        namespace = os.stat("/proc/self/ns/time").st_ino
    except OSError:  # a kernel without time namespaces: one clock
        namespace = 0
    return f"{_boot_id('/proc/sys/kernel/random/boot_id')}/{namespace}"


def pci_numa_node(bus_id: str) -> int:
    """The NUMA node sysfs reports for a PCI device ("0000:18:00.0"), -1 when unknown."""
    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus_id}/numa_node").read_text())
    except (OSError, ValueError):
        return -1
    return max(node, -1)


def rdma_nics(root: str = "/sys/class/infiniband") -> list[tuple[str, list[str]]]:
    """The RDMA NICs the kernel lists, each with its ports: e.g. [("mlx5_0", ["1"])]; none, none here."""
    base = Path(root)
    if not base.is_dir():
        return []
    out = []
    for entry in sorted(base.iterdir()):
        ports = entry / "ports"
        out.append((entry.name, sorted(p.name for p in ports.iterdir()) if ports.is_dir() else []))
    return out
