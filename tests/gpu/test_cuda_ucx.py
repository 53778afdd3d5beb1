"""The `ucx` path with CUDA memory between two processes, on one GPU or two.

This process's Agent owns buffers on cuda:0, a `PeerProcess` owns buffers on `peer_device` (cuda:1 where two
GPUs are visible, cuda:0 in the other process where one is); both restrict negotiation to `ucx`, so UCX's
CUDA transports (cuda_ipc, cuda_copy) carry the bytes: through the peer memory cuda_ipc maps here (HMC's
batched copy), and, with `ucx_map_peers` off (`puts_agent`), as one UCX put or get per range. Random data
into poisoned destinations, both ways, odd sizes and unaligned offsets, the KV patterns (4096 x 64 KiB and
16384 x 16 KiB random ranges), every byte compared (host copies, or BLAKE2b digests of whole buffers).
Skipped, with the reason, where the UCP binding is not built or this UCX cannot register CUDA memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hmc.agent import Agent, ConnBuffer
from hmc.config import Config, PathPolicy
from hmc.errors import BufferWithdrawnError, TimeoutError, UnsupportedError
from hmc.testing import PeerProcess, ranges_digest
from hmc.v1 import common_pb2

from ._support import ODD_CASES, POISON, gpu_buffer, kv_write_then_read, random_bytes, write_then_read

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

try:
    from hmc.transport import _ucx_engine

    _ucx_engine.load()
    WHY = ""
except UnsupportedError as exc:
    WHY = str(exc)

KV_TOTAL = 256 << 20


@pytest.fixture(scope="module")
def gpu_config(tmp_path_factory: pytest.TempPathFactory) -> Config:
    if WHY:
        pytest.skip(f"UCX binding: {WHY}")
    socket = str(Path(tmp_path_factory.mktemp("cuda-ucx")) / "no-hmcd.sock")
    return Config(socket=socket, timeout_s=60.0, policy=PathPolicy(allow=("ucx",)))


@pytest.fixture(scope="module")
def gpu_peer(gpu_config: Config) -> Iterator[PeerProcess]:
    with PeerProcess(gpu_config, timeout=120.0) as peer:
        yield peer


@pytest.fixture(scope="module")
def puts_agent(gpu_config: Config) -> Iterator[Agent]:
    """An agent that maps no peer memory: every range is a UCX put or get (as between hosts)."""
    with Agent(Config(socket=gpu_config.socket, timeout_s=60.0, policy=gpu_config.policy, ucx_map_peers=False), daemon=False) as agent:
        yield agent


def test_ucx_declares_cuda_memory(gpu_agent: Agent) -> None:
    [ucx] = [t for t in gpu_agent.info.transports if t.path == "ucx"]
    if common_pb2.DEVICE_KIND_CUDA not in ucx.memory_kinds:
        pytest.skip(f"this UCX registers no CUDA memory ({ucx.detail}): no cuda transport in the wheel's modules")
    assert common_pb2.DEVICE_KIND_HOST in ucx.memory_kinds


@pytest.mark.parametrize(("length", "remote_offset", "local_offset", "slack"), ODD_CASES)
def test_write_then_read_odd_sizes_unaligned_offsets(
    gpu_agent: Agent, gpu_peer: PeerProcess, peer_device: str, length: int, remote_offset: int, local_offset: int, slack: int
) -> None:
    write_then_read(gpu_agent, gpu_peer, "ucx", length, remote_offset, local_offset, slack, peer_device=peer_device)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "puts"])
def test_device_writes_of_any_size_take_the_fast_path_and_large_reads_the_measured_one(
    gpu_agent: Agent, puts_agent: Agent, gpu_peer: PeerProcess, peer_device: str, mapped: bool
) -> None:
    """Once a pair moved a range, its route carries device writes of any size straight to the copy (no request
    building); reads too where the peer's memory is mapped here, while with puts and gets reads past 1 MiB keep the
    slow path, which has the owner push them where pushes win: 64 MiB (and 7 bytes, unaligned) written and read
    back, every byte compared."""
    agent = gpu_agent if mapped else puts_agent
    length = (64 << 20) + 7

    def learned(local: ConnBuffer, remote: Any) -> None:
        agent.write(local, remote, 5, 3, 4096).wait()  # the pair's first transfer (the write below covers it)
        route = local.inline_routes[remote.id]
        assert route.path == "ucx" and route.max_bytes >= length
        assert route.read_max_bytes == (local.size if mapped else 1 << 20)

    write_then_read(agent, gpu_peer, "ucx", length, 3, 5, 2, peer_device=peer_device, before=learned)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "puts"])
@pytest.mark.parametrize(("count", "block"), [(4096, 64 << 10), (16384, 16 << 10)])
def test_kv_random_ranges_both_ways_every_byte(
    gpu_agent: Agent, puts_agent: Agent, gpu_peer: PeerProcess, peer_device: str, count: int, block: int, mapped: bool
) -> None:
    kv_write_then_read(gpu_agent if mapped else puts_agent, gpu_peer, "ucx", count, block, KV_TOTAL, peer_device=peer_device)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "puts"])
def test_a_withdrawn_buffer_is_refused_on_the_fast_path_and_the_slow_one(
    gpu_agent: Agent, puts_agent: Agent, gpu_peer: PeerProcess, peer_device: str, mapped: bool
) -> None:
    """Once the owner withdrew the buffer, a write on the pair's fast path (one range) and a batch both fail with
    BufferWithdrawnError, through UCX's mapping of the peer's memory as through puts."""
    agent = gpu_agent if mapped else puts_agent
    remote = gpu_peer.register(1 << 20, fill=POISON, device=peer_device)
    with gpu_buffer(agent, random_bytes(1 << 20, 7)) as local:
        agent.write(local, remote, 0, 0, 4096).wait()  # grants, maps where UCX maps, and sets up the fast path
        assert local.inline_routes[remote.id].read_max_bytes == (local.size if mapped else 1 << 20)
        gpu_peer.unregister(remote.id)
        with pytest.raises(BufferWithdrawnError):
            agent.write(local, remote, 0, 0, 4096).wait()
        with pytest.raises(BufferWithdrawnError):
            agent.read(local, remote, [0, 100, 200, 300, 400], [0, 100, 200, 300, 400], 10).wait()


def test_a_mapped_copy_past_its_deadline_has_landed_whole_or_not_at_all_when_it_fails(gpu_agent: Agent, gpu_peer: PeerProcess, peer_device: str) -> None:
    """1 GiB through the mapping with a 0.2 ms timeout (the copy takes ~0.7 ms): TimeoutError, and by then the GPU is
    done with it, so the peer's buffer is all poison or all data, and the same when looked at again."""
    size = 1 << 30
    data = random_bytes(size, 8)
    remote = gpu_peer.register(size, fill=POISON, device=peer_device)
    with gpu_buffer(gpu_agent, POISON, size=4096) as primer, gpu_buffer(gpu_agent, data) as local:
        gpu_agent.write(primer, remote, 0, 0, 4096).wait()  # the grant and the mapping, the buffer still all poison
        with pytest.raises(TimeoutError):
            gpu_agent.write(local, remote, 0, 0, size, timeout=2e-4).wait()
        seen = gpu_peer.digest(remote.id)
        assert seen in {ranges_digest(np.full(size, POISON, np.uint8)), ranges_digest(data)}, "a part of the copy landed"
        assert gpu_peer.digest(remote.id) == seen, "bytes landed after the transfer failed"
    gpu_peer.unregister(remote.id)


def test_rdma_exports_cuda_memory_as_dma_buf_up_to_where_a_verbs_device_is_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RDMA NIC exists here: with one pretended, the path checks that CUDA memory exports as a dma-buf (what a NIC
    would register), then stops where UCX needs a verbs device, and says both."""
    from hmc.transport import _ucx
    from hmc.transport._base import PathName

    if WHY:
        pytest.skip(f"UCX binding: {WHY}")
    monkeypatch.setattr(_ucx, "rdma_nics", lambda: [("mlx5_0", ["1"])])
    rdma = _ucx.UcxTransport(lambda d, t: None, lambda *a: None, path=PathName.RDMA)  # type: ignore[arg-type,return-value]
    reason = rdma.unavailable_reason() or ""
    assert "UCX has no verbs transport for mlx5_0" in reason, reason
    assert "device memory it would register by dma-buf: cuda" in reason, reason
