"""The `staged` path for CUDA device memory between two processes of one host (shared pinned ring), on one GPU or two.

The peer declares its GPU (`peer_device`: cuda:1, or cuda:0 on a one-GPU machine) AMD (vendor override, as
HMC_DEVICE_VENDOR_OVERRIDE="cuda:1=amd" would), so negotiation refuses vendor IPC and picks staged, what a real
NVIDIA-AMD pair gets. Random data into poisoned
destinations, every byte compared, in both directions and with either side initiating: odd sizes, unaligned
offsets, ranges touching the last byte, transfers of many ring slots, scattered ranges, host memory on one side,
and a killed peer failing the transfer within its deadline. Skipped with the reason where no GPU exists.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hmc import memory
from hmc.agent import Agent
from hmc.config import Config
from hmc.errors import HMCError
from hmc.testing import PeerProcess
from hmc.transport._base import PathName

from ._support import (
    POISON,
    assert_bytes_equal,
    gpu_buffer,
    host_copy,
    host_here_device_there,
    peer_initiates_both_directions,
    random_bytes,
    scatter,
    write_then_read,
)

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

CASES = [
    (1, 0, 0, 0),
    (4095, 7, 0, 0),
    (65537, 0, 3, 0),
    ((3 << 20) + 13, 17, 4091, 5),
    ((200 << 20) + 7, 3, 1, 0),  # 13 chunks for eight 16 MiB ring slots: the ring wraps
]


@pytest.fixture(scope="module")
def gpu_config(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return Config(socket=str(Path(tmp_path_factory.mktemp("cuda-staged")) / "no-hmcd.sock"), timeout_s=60.0)


def _amd_peer(config: Config, peer_device: str) -> PeerProcess:
    """A peer process that declares its GPU AMD."""
    return PeerProcess(config.replace(vendor_override={peer_device: "amd"}), timeout=120.0)


@pytest.fixture(scope="module")
def amd(gpu_config: Config, peer_device: str) -> Iterator[PeerProcess]:
    with _amd_peer(gpu_config, peer_device) as peer:
        yield peer


@pytest.mark.parametrize(("length", "remote_offset", "local_offset", "slack"), CASES)
def test_staged_vendor_override_write_then_read(
    gpu_agent: Agent, amd: PeerProcess, peer_device: str, length: int, remote_offset: int, local_offset: int, slack: int
) -> None:
    write_then_read(gpu_agent, amd, "staged", length, remote_offset, local_offset, slack, peer_device=peer_device, negotiated=PathName.STAGED)


def test_staged_vendor_override_scattered_ranges_both_ways(gpu_agent: Agent, amd: PeerProcess, peer_device: str) -> None:
    rng = np.random.default_rng(5)
    size = (80 << 20) + 13
    count = 2001
    data = random_bytes(size, 6)
    remote = amd.register(size, fill=POISON, device=peer_device)
    with gpu_buffer(gpu_agent, data) as local:
        slot = size // count
        lengths = rng.integers(1, slot + 1, count)
        dst = np.arange(count) * slot + rng.integers(0, slot - lengths + 1)
        dst[-1], lengths[-1] = size - 999, 999  # ends at the buffer's last byte
        order = rng.permutation(count)
        dst, lengths = dst[order], lengths[order]
        src = rng.integers(0, size - lengths)
        handle = gpu_agent.write(local, remote, src, dst, lengths)
        handle.wait()
        assert handle.path == "staged"
        expected = scatter(np.full(size, POISON, np.uint8), data, src, dst, lengths)
        assert_bytes_equal(np.frombuffer(amd.contents(remote.id), np.uint8), expected, "scattered write")
        memory.fill(local.region, POISON)
        local_dst = np.arange(count) * slot
        gpu_agent.read(local, remote, dst, local_dst, lengths).wait()
        mine = scatter(np.full(size, POISON, np.uint8), expected, dst, local_dst, lengths)
        assert_bytes_equal(host_copy(local), mine, "scattered read")
    amd.unregister(remote.id)


def test_staged_vendor_override_the_peer_initiates_both_directions(gpu_agent: Agent, amd: PeerProcess, peer_device: str) -> None:
    peer_initiates_both_directions(gpu_agent, amd, (70 << 20) + 3, "staged", peer_device=peer_device)


def test_staged_vendor_override_host_memory_here_device_memory_there(gpu_agent: Agent, amd: PeerProcess, peer_device: str) -> None:
    host_here_device_there(gpu_agent, amd, (40 << 20) + 5, 21, "staged", peer_device=peer_device)


def test_staged_vendor_override_a_killed_peer_fails_the_transfer(gpu_agent: Agent, gpu_config: Config, peer_device: str) -> None:
    with _amd_peer(gpu_config, peer_device) as peer:
        remote = peer.register(64 << 20, device=peer_device)
        with gpu_buffer(gpu_agent, 7, size=64 << 20) as local:
            gpu_agent.write(local, remote, 0, 0, 1 << 20).wait()
            peer.kill()
            started = time.monotonic()
            with pytest.raises(HMCError):
                gpu_agent.write(local, remote, 0, 0, 64 << 20, timeout=10.0).wait()
            assert time.monotonic() - started < 15.0
