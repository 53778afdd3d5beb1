"""Negotiation: the chosen path and the reason for every better path refused."""

from __future__ import annotations

import pytest

from hmc.config import PathPolicy
from hmc.control._inventory import apply_vendor_override, device_to_proto
from hmc.errors import NoPathError
from hmc.memory import Device, DeviceKind, Vendor
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
    assert set(reasons) == {PathName.LOCAL, PathName.IPC, PathName.RDMA}  # ucx ranks below staged between hosts
    assert "different hosts" in reasons[PathName.IPC]
    assert "no rdma transport" in reasons[PathName.RDMA]


def test_cross_vendor_never_uses_vendor_ipc() -> None:
    nvidia = endpoint("a", "h1", "cuda:0", common_pb2.VENDOR_NVIDIA, kinds=ALL)
    amd = endpoint("b", "h1", "cuda:1", common_pb2.VENDOR_AMD, kinds=ALL)
    choice = negotiate(nvidia, amd)
    assert choice.path is PathName.STAGED
    assert "cross-vendor" in dict(choice.rejected)[PathName.IPC]


def test_staged_says_what_it_does_for_the_pair() -> None:
    """Host memory: the TCP streams; device memory: the pinned ring shared on one host, or pinned rings and TCP."""
    host_pair = negotiate(endpoint("a", "h1"), endpoint("b", "h2"))
    assert host_pair.reason.startswith("works between any two agents: pipelined TCP streams (ranked above ucx")
    nvidia = endpoint("a", "h1", "cuda:0", common_pb2.VENDOR_NVIDIA, kinds=ALL)
    one_host = negotiate(nvidia, endpoint("b", "h1", "cuda:1", common_pb2.VENDOR_AMD, kinds=ALL))
    assert one_host.path is PathName.STAGED and one_host.reason == "works between any two agents: device memory through a pinned ring shared on this host"
    two_hosts = negotiate(endpoint("b", "h2"), nvidia)
    assert two_hosts.path is PathName.STAGED and two_hosts.reason.startswith("works between any two agents: device memory through pinned rings on both hosts")
    forced = negotiate(nvidia, endpoint("c", "h1", "cuda:0", common_pb2.VENDOR_NVIDIA, kinds=ALL), PathPolicy(prefer=("staged",)))
    assert forced.reason == "works between any two agents: device memory through a pinned ring shared on this host (preferred by policy)"


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


# -- cross-vendor pairs made by a vendor override (HMC_DEVICE_VENDOR_OVERRIDE), from hand-built descriptors


def _gpu(index: int) -> Device:
    return Device(f"cuda:{index}", DeviceKind.CUDA, index, Vendor.NVIDIA, Vendor.NVIDIA, uuid=f"GPU-{index}")


def _gpu_endpoint(agent: str, index: int, override: dict[str, str] | None = None) -> Endpoint:
    """An agent on host h1 with ipc (host + cuda) and staged, owning cuda:`index` as its config declares it."""
    [device] = apply_vendor_override([_gpu(index)], override or {})
    info = common_pb2.AgentInfo(id=agent, node="node-h1", host_id="h1", transports=caps(PathName.LOCAL, PathName.IPC, PathName.STAGED, kinds=GPU_AGENT))
    return Endpoint(info, device_to_proto(device))


GPU_AGENT = frozenset({DeviceKind.HOST, DeviceKind.CUDA})


def test_mock_vendor_override_refuses_vendor_ipc_and_picks_staged() -> None:
    choice = negotiate(_gpu_endpoint("a", 0), _gpu_endpoint("b", 1, {"cuda:1": "amd"}))
    assert choice.path is PathName.STAGED
    reasons = dict(choice.rejected)
    assert reasons[PathName.IPC] == "cross-vendor pair (amd vs nvidia): vendor IPC cannot map the other vendor's memory"
    assert set(reasons) == {PathName.LOCAL, PathName.IPC, PathName.RDMA, PathName.UCX}


def test_mock_vendor_override_either_direction_and_reversed_roles() -> None:
    amd0 = _gpu_endpoint("a", 0, {"cuda:0": "amd"})
    nvidia1 = _gpu_endpoint("b", 1)
    for src, dst in ((amd0, nvidia1), (nvidia1, amd0)):
        choice = negotiate(src, dst)
        assert choice.path is PathName.STAGED
        assert "cross-vendor" in dict(choice.rejected)[PathName.IPC]


def test_mock_vendor_override_the_same_pair_without_override_uses_ipc() -> None:
    assert negotiate(_gpu_endpoint("a", 0), _gpu_endpoint("b", 1)).path is PathName.IPC
    assert negotiate(_gpu_endpoint("a", 0, {"cuda:7": "amd"}), _gpu_endpoint("b", 1)).path is PathName.IPC  # names no device of a


def test_mock_vendor_override_is_declared_not_physical() -> None:
    endpoint = _gpu_endpoint("b", 1, {"cuda:1": "amd"})
    assert endpoint.device.vendor == common_pb2.VENDOR_AMD
    assert endpoint.device.physical_vendor == common_pb2.VENDOR_NVIDIA
    assert endpoint.device.kind == common_pb2.DEVICE_KIND_CUDA


def test_mock_vendor_override_host_memory_cannot_map_the_declared_vendor() -> None:
    """Host memory of one agent and an AMD-declared GPU of another: a real pair needs HIP IPC, which neither declares."""
    host = endpoint("a", "h1", kinds=GPU_AGENT)
    choice = negotiate(host, _gpu_endpoint("b", 1, {"cuda:1": "amd"}))
    assert choice.path is PathName.STAGED
    assert dict(choice.rejected)[PathName.IPC] == "ipc on agent a cannot map hip memory (cuda:1 of agent b)"


def test_mock_vendor_override_both_devices_declared_amd_still_needs_hip_ipc() -> None:
    choice = negotiate(_gpu_endpoint("a", 0, {"cuda:0": "amd"}), _gpu_endpoint("b", 1, {"cuda:1": "amd"}))
    assert choice.path is PathName.STAGED
    assert "cannot map hip memory" in dict(choice.rejected)[PathName.IPC]


# -- ipc is one-sided: each agent must be able to map the other's memory


def test_ipc_needs_the_initiator_to_map_the_peers_device_memory() -> None:
    host_only = endpoint("a", "h1")  # no CUDA backend: its ipc reaches host memory only
    gpu = _gpu_endpoint("b", 0)
    for src, dst in ((host_only, gpu), (gpu, host_only)):
        choice = negotiate(src, dst, PathPolicy(allow=("ipc", "staged")))
        assert choice.path is PathName.STAGED
        assert dict(choice.rejected)[PathName.IPC] == "ipc on agent a cannot map cuda memory (cuda:0 of agent b)"


def test_ipc_between_host_memory_and_a_gpu_when_both_agents_map_both() -> None:
    assert negotiate(endpoint("a", "h1", kinds=GPU_AGENT), _gpu_endpoint("b", 0)).path is PathName.IPC


def _nic_agent(agent: str, host: str, device: str = "host", vendor: int = common_pb2.VENDOR_HOST, *, nic: bool) -> Endpoint:
    """An agent whose node does or does not report an RDMA NIC: the rdma path declared, or its reason given."""
    paths = (PathName.LOCAL, PathName.IPC, PathName.UCX, PathName.STAGED) + ((PathName.RDMA,) if nic else ())
    found = endpoint(agent, host, device, vendor, paths=paths, kinds=ALL)
    if not nic:
        found.agent.unavailable.add(path="rdma", reason="no RDMA device on this host (/sys/class/infiniband is empty)")
    return found


def test_rdma_between_nodes_whose_inventories_report_a_nic() -> None:
    for device, vendor in (("host", common_pb2.VENDOR_HOST), ("cuda:0", common_pb2.VENDOR_NVIDIA)):
        choice = negotiate(_nic_agent("a", "h1", device, vendor, nic=True), _nic_agent("b", "h2", device, vendor, nic=True))
        assert choice.path is PathName.RDMA and "RDMA NIC" in choice.reason


def test_rdma_refused_with_the_reason_where_one_node_has_no_nic() -> None:
    choice = negotiate(_nic_agent("a", "h1", nic=True), _nic_agent("b", "h2", nic=False))
    assert choice.path is PathName.STAGED  # host memory over the network: UCX would have tcp only
    assert dict(choice.rejected)[PathName.RDMA] == "agent b on node-h2 has no rdma transport: no RDMA device on this host (/sys/class/infiniband is empty)"


def test_rdma_refused_for_device_memory_its_nic_cannot_reach() -> None:
    host_only = _nic_agent("b", "h2", "cuda:0", common_pb2.VENDOR_NVIDIA, nic=True)
    [rdma] = [t for t in host_only.agent.transports if t.path == "rdma"]
    rdma.CopyFrom(Capabilities(PathName.RDMA, HOST).to_proto())  # a NIC, but no GPUDirect and no dmabuf
    gpu = _nic_agent("a", "h1", "cuda:0", common_pb2.VENDOR_NVIDIA, nic=True)
    choice = negotiate(gpu, host_only)
    assert choice.path is PathName.STAGED
    assert "rdma on agent b cannot reach cuda memory" in dict(choice.rejected)[PathName.RDMA]
    asked = negotiate(gpu, host_only, PathPolicy(prefer=("ucx",)))  # ucx ranks below staged between hosts: asked for, it refuses
    assert asked.path is PathName.STAGED and "device memory on two hosts" in dict(asked.rejected)[PathName.UCX]


def test_ucx_leaves_two_hosts_without_rdma_and_cross_vendor_pairs_to_staged() -> None:
    """Between hosts without the rdma path UCX has only tcp, which staged's pipelined streams beat: staged ranks
    above ucx there (ucx when asked for); on one host (ipc refused) host memory goes over ucx."""
    a, b = (_nic_agent(n, h, nic=False) for n, h in (("a", "h1"), ("b", "h2")))
    choice = negotiate(a, b)
    assert choice.path is PathName.STAGED and "ranked above ucx between hosts" in choice.reason
    assert PathName.UCX not in dict(choice.rejected)  # not refused: it ranks below
    assert negotiate(a, b, PathPolicy(prefer=("ucx",))).path is PathName.UCX
    assert negotiate(a, b, PathPolicy(allow=("ucx",))).path is PathName.UCX
    assert negotiate(a, b, PathPolicy(deny=("staged",))).path is PathName.UCX
    assert negotiate(a, _nic_agent("b", "h1", nic=False), PathPolicy(deny=("ipc",))).path is PathName.UCX
    nvidia = _nic_agent("a", "h1", "cuda:0", common_pb2.VENDOR_NVIDIA, nic=True)
    amd = _nic_agent("b", "h2", "cuda:1", common_pb2.VENDOR_AMD, nic=True)
    choice = negotiate(nvidia, amd, PathPolicy(prefer=("ucx",)))
    assert choice.path is PathName.STAGED
    reasons = dict(choice.rejected)
    assert reasons[PathName.RDMA].startswith("cross-vendor pair (amd vs nvidia)") and reasons[PathName.UCX].startswith("cross-vendor pair")


def test_ucx_refuses_a_device_declared_another_vendor_its_ucx_cannot_reach() -> None:
    host_here = endpoint("a", "h1", paths=(PathName.LOCAL, PathName.IPC, PathName.UCX, PathName.STAGED), kinds=GPU_AGENT)
    declared_amd = _gpu_endpoint("b", 0, {"cuda:0": "amd"})
    declared_amd.agent.transports.append(Capabilities(PathName.UCX, GPU_AGENT).to_proto())  # its UCX has cuda transports, no rocm
    choice = negotiate(host_here, declared_amd)
    assert choice.path is PathName.STAGED
    assert dict(choice.rejected)[PathName.UCX] == "ucx on agent b cannot reach hip memory (cuda:0, declared amd)"
