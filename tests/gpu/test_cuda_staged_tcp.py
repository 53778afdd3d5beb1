"""The `staged` path for CUDA device memory between hosts (pinned rings, bytes over TCP), run on one host, one GPU or two.

The peer process gets its own host id (HMC_HOST_ID, as agents in two containers sharing a kernel would), so
both agents treat each other as other hosts: negotiation refuses ipc (different hosts) and staged moves device
memory through pinned rings over TCP, not the shared ring of one host. The peer's buffers live on `peer_device`
(cuda:1, or cuda:0 on a one-GPU machine). Random data into poisoned destinations, every byte compared, in both
directions and with either side initiating: odd sizes, unaligned offsets, ranges touching the last byte, transfers
of many ring slots, host memory on one side, and a peer killed mid-transfer failing it within its deadline.
Skipped with the reason where no GPU exists.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hmc.agent import Agent
from hmc.config import Config
from hmc.memory._machine import HOST_ID_ENV
from hmc.errors import HMCError
from hmc.testing import PeerProcess
from hmc.transport._base import PathName

from ._support import gpu_buffer, host_here_device_there, peer_initiates_both_directions, write_then_read

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

CASES = [
    (1, 0, 0, 0),
    (4095, 7, 0, 0),
    (65537, 0, 3, 0),
    ((3 << 20) + 13, 17, 4091, 5),
    ((16 << 20) + 1, 0, 1, 0),  # one byte past a slot
    ((200 << 20) + 7, 3, 1, 0),  # 13 chunks for eight 16 MiB ring slots: both rings wrap
]


@pytest.fixture(scope="module")
def gpu_config(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return Config(socket=str(Path(tmp_path_factory.mktemp("cuda-staged-tcp")) / "no-hmcd.sock"), timeout_s=60.0)


def _other_host(config: Config) -> PeerProcess:
    """A peer process on this host that declares another host id."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(HOST_ID_ENV, "another-host-same-machine")
        return PeerProcess(config, timeout=120.0)


@pytest.fixture(scope="module")
def remote_host(gpu_config: Config) -> Iterator[PeerProcess]:
    with _other_host(gpu_config) as peer:
        yield peer


@pytest.mark.parametrize(("length", "remote_offset", "local_offset", "slack"), CASES)
def test_staged_cross_host_tcp_on_one_host_write_then_read(
    gpu_agent: Agent, remote_host: PeerProcess, peer_device: str, length: int, remote_offset: int, local_offset: int, slack: int
) -> None:
    write_then_read(gpu_agent, remote_host, "staged", length, remote_offset, local_offset, slack, peer_device=peer_device, negotiated=PathName.STAGED)


def test_staged_cross_host_tcp_on_one_host_ipc_refused_as_different_hosts(gpu_agent: Agent, remote_host: PeerProcess, peer_device: str) -> None:
    remote = remote_host.register(4096, device=peer_device)
    with gpu_buffer(gpu_agent, 1, size=4096) as local:
        choice = gpu_agent.path_to(local, remote)
        assert choice.path is PathName.STAGED
        assert any(path is PathName.IPC and "different hosts" in reason for path, reason in choice.rejected)
    remote_host.unregister(remote.id)


def test_staged_cross_host_tcp_on_one_host_the_peer_initiates_both_directions(gpu_agent: Agent, remote_host: PeerProcess, peer_device: str) -> None:
    peer_initiates_both_directions(gpu_agent, remote_host, (70 << 20) + 3, "staged", peer_device=peer_device)


def test_staged_cross_host_tcp_on_one_host_host_memory_here_device_memory_there(gpu_agent: Agent, remote_host: PeerProcess, peer_device: str) -> None:
    host_here_device_there(gpu_agent, remote_host, (40 << 20) + 5, 31, "staged", peer_device=peer_device)


def test_staged_cross_host_tcp_on_one_host_a_peer_killed_mid_transfer_fails_it(gpu_agent: Agent, gpu_config: Config, peer_device: str) -> None:
    size = 1 << 30
    with _other_host(gpu_config) as peer:
        remote = peer.register(size, device=peer_device)
        with gpu_buffer(gpu_agent, 7, size=size) as local:
            gpu_agent.write(local, remote, 0, 0, 1 << 20).wait()
            handle = gpu_agent.write(local, remote, 0, 0, size, timeout=10.0)
            started = time.monotonic()
            peer.kill()
            with pytest.raises(HMCError):
                handle.wait()
            assert time.monotonic() - started < 15.0
            with pytest.raises(HMCError):  # and a transfer after it fails too, within its deadline
                gpu_agent.write(local, remote, 0, 0, 64 << 20, timeout=10.0).wait()
            assert time.monotonic() - started < 30.0
