"""`hmc status`, `hmc devices`, `hmc buffers`, `hmc path`: read-only views of a node."""

from __future__ import annotations

import argparse
from typing import Any

from google.protobuf.json_format import MessageToDict

from hmc.cli._output import print_json, print_table
from hmc.config import Config
from hmc.errors import UnavailableError
from hmc.v1 import common_pb2, daemon_pb2

__all__ = ["register"]


def _client(args: argparse.Namespace, config: Config) -> Any:
    from hmc.control import Client

    return Client(args.address, config=config)


def _as_dict(message: Any) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _device_row(device: common_pb2.DeviceInfo) -> dict[str, Any]:
    vendor = common_pb2.Vendor.Name(device.vendor).removeprefix("VENDOR_").lower()
    physical = common_pb2.Vendor.Name(device.physical_vendor).removeprefix("VENDOR_").lower()
    return {
        "name": device.name,
        "vendor": vendor if vendor == physical else f"{vendor} (declared; really {physical})",
        "model": device.model,
        "memory_gib": device.total_memory / 2**30,
        "pci_bus_id": device.pci_bus_id or "-",
        "numa": device.numa_node,
        "peers": ",".join(device.peer_devices) or "-",
    }


def _status(args: argparse.Namespace, config: Config) -> int:
    with _client(args, config) as client:
        info = client.node_info()
    if args.json:
        print_json(_as_dict(info))
        return 0
    print(f"hmcd {info.version} on node {info.node} (host {info.hostname}), up {info.uptime_s:.0f} s")
    print(f"  unix: {info.unix_address or '-'}   tcp: {info.tcp_address or '-'}")
    print(f"  agents: {info.agents}   buffers: {info.buffers}   devices: {', '.join(d.name for d in info.devices)}")
    print(f"  transports: {', '.join(t.path + (f' ({t.detail})' if t.detail else '') for t in info.transports) or '-'}")
    print(f"  rdma NICs: {', '.join(n.name for n in info.rdma_devices) or 'none'}")
    print(f"  registry epoch: {info.registry_epoch}")
    _directory(info.directory)
    return 0


def _directory(status: daemon_pb2.DirectoryStatus) -> None:
    """The directory's view: how this node finds the others, and what it sees of them."""
    if status.kind == "etcd":
        state = "in sync" if status.connected else f"cut off for {status.partitioned_s:.1f} s, serving its cache read-only ({status.error})"
        print(f"  directory: etcd {','.join(status.endpoints)} prefix {status.prefix}: {state}")
        lease = f"{status.lease_id:x}, ttl {status.lease_ttl_s} s, renewed {status.lease_renewed_s:.1f} s ago" if status.lease_id else "none (not joined)"
        print(f"  lease: {lease}")
    else:
        print(f"  directory: static ({len(status.endpoints)} peer(s) configured)")
    rows = [
        {
            "node": n.node or "?",
            "address": n.tcp_address or "-",
            "epoch": n.epoch or "-",
            "state": "up" if n.up else f"down ({n.error})" if n.error else "down",
            "buffers": n.buffers if status.kind == "etcd" else "-",
            "age_s": f"{n.age_s:.1f}",
        }
        for n in status.nodes
    ]
    if rows:
        print_table(rows)


def _local_devices(config: Config) -> tuple[list[common_pb2.DeviceInfo], list[daemon_pb2.AbsentBackend]]:
    from hmc.control._inventory import Inventory

    inventory = Inventory.collect(config)
    return list(inventory.devices), list(inventory.absent_backends)


def _devices(args: argparse.Namespace, config: Config) -> int:
    source = "hmcd"
    if args.local:
        devices, absent, source = *_local_devices(config), "local discovery"
    else:
        try:
            with _client(args, config) as client:
                info = client.node_info()
            devices, absent = list(info.devices), list(info.absent_backends)
        except UnavailableError:
            devices, absent, source = *_local_devices(config), "local discovery (hmcd not running)"
    if args.json:
        print_json({"source": source, "devices": [_as_dict(d) for d in devices], "absent": [_as_dict(a) for a in absent]})
        return 0
    print_table([_device_row(d) for d in devices])
    for backend in absent:
        print(f"no {backend.kind} devices: {backend.reason}")
    print(f"({source})")
    return 0


def _buffers(args: argparse.Namespace, config: Config) -> int:
    with _client(args, config) as client:
        listing = client.listing(local_only=args.local_only)
        node = client.node_info().node
    buffers = listing.buffers
    if args.json:
        print_json({"directory_age_s": listing.directory_age_s, "buffers": [{**_as_dict(b), "access_key": "<redacted>"} for b in buffers]})
        return 0
    age = listing.directory_age_s
    rows = [
        {
            "id": b.id,
            "name": b.name or "-",
            "node": b.owner.node,
            "epoch": b.registry_epoch,
            "agent": b.owner.id,
            "device": b.device.name,
            "size": b.size,
            "age_s": "live" if b.owner.node == node or not age else f"{age:.1f} (cached)",
        }
        for b in buffers
    ]
    print_table(rows)
    if age:
        print(f"(the other nodes' buffers are this node's cached view, {age:.1f} s old: the directory is cut off from etcd)")
    return 0


def _path(args: argparse.Namespace, config: Config) -> int:
    with _client(args, config) as client:
        choice = client.path(args.src, args.dst)
    if args.json:
        print_json(
            {
                "src": args.src,
                "dst": args.dst,
                "path": choice.path.value,
                "reason": choice.reason,
                "preferred_op": choice.preferred_op,
                "measured": None if choice.measured is None else _as_dict(choice.measured),
                "rejected": [{"path": p.value, "reason": r} for p, r in choice.rejected],
            }
        )
        return 0
    print(f"{args.src} -> {args.dst}: {choice.path.value} ({choice.reason})")
    rows = [{"path": p.value, "verdict": "rejected", "reason": r} for p, r in choice.rejected]
    rows.append({"path": choice.path.value, "verdict": "chosen", "reason": choice.reason})
    print_table(rows)
    return 0


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    status = commands.add_parser("status", help="hmcd's health, inventory, agents and peers")
    status.set_defaults(run=_status)
    devices = commands.add_parser("devices", help="memory domains of this node (host, cuda:N, hip:N)")
    devices.add_argument("--local", action="store_true", help="discover in this process instead of asking hmcd")
    devices.set_defaults(run=_devices)
    buffers = commands.add_parser("buffers", help="registered ConnBuffers (this node and its peers)")
    buffers.add_argument("--local-only", action="store_true", help="only this node's buffers")
    buffers.set_defaults(run=_buffers)
    path = commands.add_parser("path", help="the path negotiated between two ConnBuffers, with reasons")
    path.add_argument("src", help="source ConnBuffer: name or id")
    path.add_argument("dst", help="destination ConnBuffer: name or id")
    path.set_defaults(run=_path)
