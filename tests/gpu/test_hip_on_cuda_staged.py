"""A CUDA agent and a HIP agent on one GPU, over `staged`: the peer process runs HMC's HIP backend through the
HIP-on-CUDA runtime (HMC_HIP_ON_CUDA=1: its GPU is `hip:0`, vendor AMD, the ring's copies and kernels its HIP
code through hipMemcpyAsync and hiprtc), this process the CUDA backend. Negotiation picks `staged` (two vendors);
random data into poisoned destinations, every byte compared: single ranges, 1 GiB and both KV patterns (4096 x
64 KiB and 16384 x 16 KiB random ranges), WRITE and READ, and the peer initiating. Not run on AMD hardware.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hmc import memory
from hmc.agent import Agent
from hmc.config import Config
from hmc.testing import PeerProcess, ranges_digest
from hmc.testing.hip_on_cuda import SWITCH
from hmc.transport._base import PathName

from ._support import POISON, assert_bytes_equal, gpu_buffer, host_copy, peer_initiates_both_directions, random_bytes, write_then_read

pytestmark = [pytest.mark.cuda, pytest.mark.hip_on_cuda, pytest.mark.timeout(600)]
HIP = "hip:0"
GIB = 1 << 30


@pytest.fixture(scope="module")
def gpu_config(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return Config(socket=str(Path(tmp_path_factory.mktemp("hip-staged")) / "no-hmcd.sock"), timeout_s=120.0)


@pytest.fixture(scope="module")
def hip_peer(gpu_config: Config) -> Iterator[PeerProcess]:
    """A peer process switched to the HIP-on-CUDA runtime."""
    with PeerProcess(gpu_config, timeout=120.0, env={SWITCH: "1"}) as peer:
        yield peer


@pytest.mark.parametrize(("length", "remote_offset", "local_offset", "slack"), [(1, 0, 0, 0), (4095, 7, 0, 0), ((3 << 20) + 13, 17, 4091, 5), ((200 << 20) + 7, 3, 1, 0)])
def test_hip_on_cuda_staged_write_then_read(gpu_agent: Agent, hip_peer: PeerProcess, length: int, remote_offset: int, local_offset: int, slack: int) -> None:
    write_then_read(gpu_agent, hip_peer, "staged", length, remote_offset, local_offset, slack, peer_device=HIP, negotiated=PathName.STAGED)


def test_hip_on_cuda_staged_the_hip_agent_initiates_both_directions(gpu_agent: Agent, hip_peer: PeerProcess) -> None:
    peer_initiates_both_directions(gpu_agent, hip_peer, (70 << 20) + 3, "staged", peer_device=HIP)


@pytest.mark.parametrize(("block", "count"), [(GIB, 1), (64 << 10, 4096), (16 << 10, 16384)])
def test_hip_on_cuda_staged_1gib_and_kv_patterns_write_and_read(gpu_agent: Agent, hip_peer: PeerProcess, block: int, count: int) -> None:
    """Random ranges (whole blocks, shuffled) of a 1 GiB CUDA buffer into a poisoned 1 GiB HIP buffer and back."""
    rng = np.random.default_rng(count)
    data = random_bytes(GIB, count)
    src = rng.permutation(GIB // block)[:count] * block
    dst = rng.permutation(GIB // block)[:count] * block
    remote = hip_peer.register(GIB, fill=POISON, device=HIP)
    with gpu_buffer(gpu_agent, data) as local:
        handle = gpu_agent.write(local, remote, src, dst, block)
        handle.wait()
        assert handle.path == "staged"
        expected = np.full(GIB, POISON, np.uint8)
        for s, d in zip(src.tolist(), dst.tolist()):
            expected[d : d + block] = data[s : s + block]
        assert hip_peer.digest(remote.id) == ranges_digest(expected), "write"
        memory.fill(local.region, POISON)
        gpu_agent.read(local, remote, dst, src, block).wait()
        mine = np.full(GIB, POISON, np.uint8)
        for s, d in zip(src.tolist(), dst.tolist()):
            mine[s : s + block] = expected[d : d + block]
        assert_bytes_equal(host_copy(local), mine, "read")
    hip_peer.unregister(remote.id)
