"""Negotiation: the chosen path and the reason for every better path refused."""

from __future__ import annotations

import pytest

from hmc.config import PathPolicy
from hmc.errors import NoPathError
from hmc.memory import DeviceKind
from hmc.transport._base import Capabilities, PathName
from hmc.transport._negotiate import Endpoint, PathChoice, negotiate
from hmc.v1 import common_pb2

HOST = frozenset({DeviceKind.HOST})
ALL = frozenset(DeviceKind)


def caps(*paths: PathName, kinds: frozenset[DeviceKind] = HOST) -> list[common_pb2.TransportCapability]:
    return [Capabilities(path=p, memory_kinds=kinds).to_proto() for p in paths]


def endpoint(agent: str, host: str, device: str = "host", vendor: int = common_pb2.VENDOR_HOST, paths: tuple[PathName, ...] = (PathName.LOCAL, PathName.IPC, PathName.STAGED), kinds: frozenset[DeviceKind] = HOST) -> Endpoint:
    kind = {"host": common_pb2.DEVICE_KIND_HOST, "cuda": common_pb2.DEVICE_KIND_CUDA, "hip": common_pb2.DEVICE_KIND_HIP}[device.split(":")[0]]
    info = common_pb2.AgentInfo(id=agent, node=f"node-{host}", host_id=host, transports=caps(*paths, kinds=kinds))
    return Endpoint(info, common_pb2.DeviceInfo(name=device, kind=kind, vendor=vendor))


def test_same_agent_is_local() -> None:
    a = endpoint("a", "h1")
    choice = negotiate(a, a)
    assert choice.path is PathName.LOCAL
    assert choice.rejected == ()


def test_same_host_is_ipc_and_says_why_local_was_refused() -> None:
    choice = negotiate(endpoint("a", "h1"), endpoint("b", "h1"))
    assert choice.path is PathName.IPC
    assert choice.rejected == ((PathName.LOCAL, "the buffers belong to different agents"),)


def test_different_hosts_fall_back_to_staged_with_reasons() -> None:
    choice = negotiate(endpoint("a", "h1"), endpoint("b", "h2"))
    assert choice.path is PathName.STAGED
    reasons = dict(choice.rejected)
    assert set(reasons) == {PathName.LOCAL, PathName.IPC, PathName.RDMA, PathName.UCX}
    assert "different hosts" in reasons[PathName.IPC]
    assert "no rdma transport" in reasons[PathName.RDMA]


def test_cross_vendor_never_uses_vendor_ipc() -> None:
    nvidia = endpoint("a", "h1", "cuda:0", common_pb2.VENDOR_NVIDIA, kinds=ALL)
    amd = endpoint("b", "h1", "cuda:1", common_pb2.VENDOR_AMD, kinds=ALL)
    choice = negotiate(nvidia, amd)
    assert choice.path is PathName.STAGED
    assert "cross-vendor" in dict(choice.rejected)[PathName.IPC]


def test_same_vendor_devices_use_ipc() -> None:
    a = endpoint("a", "h1", "cuda:0", common_pb2.VENDOR_NVIDIA, kinds=ALL)
    b = endpoint("b", "h1", "cuda:1", common_pb2.VENDOR_NVIDIA, kinds=ALL)
    assert negotiate(a, b).path is PathName.IPC


def test_memory_kind_the_transport_cannot_reach() -> None:
    a = endpoint("a", "h1", "cuda:0", common_pb2.VENDOR_NVIDIA)
    b = endpoint("b", "h1")
    with pytest.raises(NoPathError, match="cannot reach cuda memory"):
        negotiate(a, b)


def test_policy_deny_allow_prefer() -> None:
    a, b = endpoint("a", "h1"), endpoint("b", "h1")
    denied = negotiate(a, b, PathPolicy(deny=("ipc",)))
    assert denied.path is PathName.STAGED
    assert dict(denied.rejected)[PathName.IPC] == "denied by policy (paths.deny)"
    preferred = negotiate(a, b, PathPolicy(prefer=("staged",)))
    assert preferred.path is PathName.STAGED and "preferred" in preferred.reason
    with pytest.raises(NoPathError, match="not in the allowed paths"):
        negotiate(a, b, PathPolicy(allow=("rdma",)))


def test_missing_transport_on_one_end() -> None:
    a = endpoint("a", "h1", paths=(PathName.STAGED,))
    choice = negotiate(a, endpoint("b", "h1"))
    assert choice.path is PathName.STAGED
    assert "has no ipc transport" in dict(choice.rejected)[PathName.IPC]


def test_choice_round_trips_through_proto() -> None:
    choice = negotiate(endpoint("a", "h1"), endpoint("b", "h2"))
    assert PathChoice.from_proto(choice.to_proto()) == choice
