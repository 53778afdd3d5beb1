"""hmcd's parts in-process: event fan-out, inventory, and a Daemon embedded in an asyncio loop."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
from control_fixtures import short_tempdir

from hmc.config import Config
from hmc.control import Daemon
from hmc.control._events import EventBus
from hmc.control._inventory import Inventory, apply_vendor_override, rdma_devices, transports
from hmc.memory import Device, DeviceKind, Vendor
from hmc.v1 import common_pb2, daemon_pb2


def test_events_are_sequenced_and_filtered() -> None:
    async def scenario() -> list[tuple[int, str]]:
        bus = EventBus("n1", clock=lambda: 42.0)
        local_only, with_peers = bus.subscribe(), bus.subscribe(include_peers=True)
        bus.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_AGENT_UP, agent_id="a"))
        bus.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_AGENT_UP, agent_id="b", node="n2"), relayed=True)
        bus.close()
        got_local = [(e.sequence, e.node) async for e in local_only]
        got_peers = [(e.sequence, e.node) async for e in with_peers]
        assert got_local == [(1, "n1")]
        assert bus.subscribers == 0
        return got_peers

    assert asyncio.run(scenario()) == [(1, "n1"), (2, "n2")]


def test_a_slow_watcher_is_dropped_not_buffered_forever() -> None:
    from hmc.errors import BusyResourceError

    async def scenario() -> None:
        bus = EventBus("n1", queue_size=4)
        slow = bus.subscribe()
        for _ in range(10):
            bus.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_PEER_UP))
        with pytest.raises(BusyResourceError, match="fell too far behind"):
            async for _ in slow:
                pass

    asyncio.run(scenario())


def test_rdma_devices_from_sysfs(tmp_path: Path) -> None:
    for name, ports in (("mlx5_0", ("1",)), ("mlx5_1", ("1", "2"))):
        for port in ports:
            (tmp_path / name / "ports" / port).mkdir(parents=True)
    found = rdma_devices(str(tmp_path))
    assert [(d.name, list(d.ports)) for d in found] == [("mlx5_0", ["1"]), ("mlx5_1", ["1", "2"])]
    assert rdma_devices(str(tmp_path / "absent")) == []


def test_vendor_override_and_transports() -> None:
    gpu = Device(name="cuda:1", kind=DeviceKind.CUDA, index=1, vendor=Vendor.NVIDIA, physical_vendor=Vendor.NVIDIA)
    (declared,) = apply_vendor_override([gpu], {"cuda:1": "amd"})
    assert declared.vendor is Vendor.AMD and declared.physical_vendor is Vendor.NVIDIA
    assert [c.path.value for c in transports(frozenset({DeviceKind.HOST}), ptrace_scope=0)] == ["local", "ipc", "staged"]
    assert "ipc" not in [c.path.value for c in transports(frozenset({DeviceKind.HOST}), ptrace_scope=3)]
    inventory = Inventory.collect(Config(node="n", vendor_override={"host": "host"}))
    assert inventory.devices[0].name == "host" and inventory.host_id


def test_embedded_daemon_serves_and_stops() -> None:
    directory = short_tempdir()
    socket = os.path.join(directory, "sub", "hmcd.sock")

    async def scenario() -> daemon_pb2.NodeInfo:
        daemon = Daemon(Config(node="embedded", socket=socket, listen="127.0.0.1:0", token="t", timeout_s=2.0))
        await daemon.start()
        try:
            assert daemon.tcp_address.startswith("127.0.0.1:") and not daemon.tcp_address.endswith(":0")
            assert oct(os.stat(os.path.dirname(socket)).st_mode & 0o777) == "0o700"
            return daemon.node_info()
        finally:
            await daemon.stop()
            await daemon.stop()  # idempotent

    try:
        info = asyncio.run(scenario())
        assert info.node == "embedded" and info.protocol_version == common_pb2.PROTOCOL_VERSION_1
        assert not os.path.exists(socket)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
