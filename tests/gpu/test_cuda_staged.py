"""The `staged` path for CUDA device memory between two processes of one host (shared pinned ring), on two GPUs.

The peer declares its cuda:1 as AMD (vendor override, as HMC_DEVICE_VENDOR_OVERRIDE="cuda:1=amd" would), so
negotiation refuses vendor IPC and picks staged, what a real NVIDIA-AMD pair gets. Random data into poisoned
destinations, every byte compared, in both directions and with either side initiating: odd sizes, unaligned
offsets, ranges touching the last byte, transfers of many ring slots, scattered ranges, host memory on one side,
and a killed peer failing the transfer within its deadline. Skipped with the reason where fewer than two GPUs exist.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hmc import memory
from hmc.agent import Agent, ConnBuffer
from hmc.config import Config
from hmc.errors import HMCError
from hmc.testing import PeerProcess
from hmc.transport._base import PathName

pytestmark = [pytest.mark.cuda, pytest.mark.multi_gpu(2), pytest.mark.timeout(300)]

POISON = 0xA5
HOST_POISON = 0x3C

CASES = [
    (1, 0, 0, 0),
    (4095, 7, 0, 0),
    (65537, 0, 3, 0),
    ((3 << 20) + 13, 17, 4091, 5),
    ((200 << 20) + 7, 3, 1, 0),  # four chunks for three 64 MiB ring slots: the ring wraps
]


def random_bytes(n: int, seed: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(n), np.uint8).copy()


def host_copy(buffer: ConnBuffer) -> np.ndarray:
    out = np.full(buffer.size, HOST_POISON, np.uint8)
    memory.copy(out, buffer.region)
    return out


def assert_bytes_equal(actual: np.ndarray, expected: np.ndarray, what: str = "") -> None:
    assert actual.shape == expected.shape
    differ = np.flatnonzero(actual != expected)
    assert differ.size == 0, f"{what}: {differ.size} of {actual.size} bytes differ, first at {differ[:3].tolist()}"


@pytest.fixture(scope="module")
def gpu_config(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return Config(socket=str(Path(tmp_path_factory.mktemp("cuda-staged")) / "no-hmcd.sock"), timeout_s=60.0)


@pytest.fixture(scope="module")
def gpu_agent(gpu_config: Config) -> Iterator[Agent]:
    with Agent(gpu_config, daemon=False) as agent:
        yield agent


@pytest.fixture(scope="module")
def amd(gpu_config: Config) -> Iterator[PeerProcess]:
    with PeerProcess(gpu_config.replace(vendor_override={"cuda:1": "amd"}), timeout=120.0) as peer:
        yield peer


@contextlib.contextmanager
def gpu_buffer(agent: Agent, data: np.ndarray | int, device: str = "cuda:0", size: int | None = None) -> Iterator[ConnBuffer]:
    nbytes = size if isinstance(data, int) else data.size
    region = memory.allocate(nbytes or 1, device)
    if isinstance(data, int):
        memory.fill(region, data)
    else:
        memory.copy(region, data)
    buffer = agent.register(region)
    try:
        yield buffer
    finally:
        with contextlib.suppress(Exception):
            agent.unregister(buffer)
        region.free()


@pytest.mark.parametrize(("length", "remote_offset", "local_offset", "slack"), CASES)
def test_staged_vendor_override_write_then_read(gpu_agent: Agent, amd: PeerProcess, length: int, remote_offset: int, local_offset: int, slack: int) -> None:
    remote_size = remote_offset + length + slack
    data = random_bytes(local_offset + length + 3, length)
    remote = amd.register(remote_size, fill=POISON, device="cuda:1")
    with gpu_buffer(gpu_agent, data) as local:
        assert gpu_agent.path_to(local, remote).path is PathName.STAGED
        handle = gpu_agent.write(local, remote, local_offset, remote_offset, length)
        handle.wait()
        assert handle.path == "staged"
        expected = np.full(remote_size, POISON, np.uint8)
        expected[remote_offset : remote_offset + length] = data[local_offset : local_offset + length]
        assert_bytes_equal(np.frombuffer(amd.contents(remote.id), np.uint8), expected, "write")
        memory.fill(local.region, POISON)
        gpu_agent.read(local, remote, remote_offset, local_offset, length).wait()
        mine = np.full(local.size, POISON, np.uint8)
        mine[local_offset : local_offset + length] = data[local_offset : local_offset + length]
        assert_bytes_equal(host_copy(local), mine, "read")
    amd.unregister(remote.id)


def test_staged_vendor_override_scattered_ranges_both_ways(gpu_agent: Agent, amd: PeerProcess) -> None:
    rng = np.random.default_rng(5)
    size = (80 << 20) + 13
    count = 2001
    data = random_bytes(size, 6)
    remote = amd.register(size, fill=POISON, device="cuda:1")
    with gpu_buffer(gpu_agent, data) as local:
        slot = size // count
        lengths = rng.integers(1, slot + 1, count)
        dst = np.arange(count) * slot + rng.integers(0, slot - lengths + 1)
        dst[-1], lengths[-1] = size - 999, 999  # ends at the buffer's last byte
        order = rng.permutation(count)
        dst, lengths = dst[order], lengths[order]
        src = rng.integers(0, size - lengths)
        gpu_agent.write(local, remote, src, dst, lengths).wait()
        expected = np.full(size, POISON, np.uint8)
        for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist()):
            expected[d : d + n] = data[s : s + n]
        assert_bytes_equal(np.frombuffer(amd.contents(remote.id), np.uint8), expected, "scattered write")
        memory.fill(local.region, POISON)
        local_dst = np.arange(count) * slot
        gpu_agent.read(local, remote, dst, local_dst, lengths).wait()
        mine = np.full(size, POISON, np.uint8)
        for s, d, n in zip(dst.tolist(), local_dst.tolist(), lengths.tolist()):
            mine[d : d + n] = expected[s : s + n]
        assert_bytes_equal(host_copy(local), mine, "scattered read")
    amd.unregister(remote.id)


def test_staged_vendor_override_the_peer_initiates_both_directions(gpu_agent: Agent, amd: PeerProcess) -> None:
    size = (70 << 20) + 3
    data = random_bytes(size, 11)
    theirs = amd.register(size, device="cuda:1")
    amd.fill(theirs.id, data.tobytes())
    with gpu_buffer(gpu_agent, POISON, size=size) as mine:
        assert amd.transfer("write", theirs.id, mine.descriptor, [0, 5000, size - 1], [3, 9000, size - 1], [4000, 70001, 1]) == "staged"
        expected = np.full(size, POISON, np.uint8)
        expected[3:4003], expected[9000:79001], expected[-1] = data[:4000], data[5000:75001], data[-1]
        assert_bytes_equal(host_copy(mine), expected, "peer write")
        fresh = random_bytes(size, 12)
        memory.copy(mine.region, fresh)
        assert amd.transfer("read", theirs.id, mine.descriptor, 0, 0, size) == "staged"
        assert amd.contents(theirs.id) == fresh.tobytes()
    amd.unregister(theirs.id)


def test_staged_vendor_override_host_memory_here_device_memory_there(gpu_agent: Agent, amd: PeerProcess) -> None:
    size = (40 << 20) + 5
    data = random_bytes(size, 21)
    remote = amd.register(size, fill=POISON, device="cuda:1")
    local = gpu_agent.register(data.copy())
    try:
        handle = gpu_agent.write(local, remote, 1, 0, size - 1)
        handle.wait()
        assert handle.path == "staged"
        expected = np.full(size, POISON, np.uint8)
        expected[: size - 1] = data[1:]
        assert_bytes_equal(np.frombuffer(amd.contents(remote.id), np.uint8), expected, "host -> device")
        out = np.full(size, HOST_POISON, np.uint8)
        back = gpu_agent.register(out)
        gpu_agent.read(back, remote, 0, 0, size).wait()
        assert_bytes_equal(out, expected, "device -> host")
        gpu_agent.unregister(back)
    finally:
        gpu_agent.unregister(local)
        amd.unregister(remote.id)


def test_staged_vendor_override_a_killed_peer_fails_the_transfer(gpu_agent: Agent, gpu_config: Config) -> None:
    peer = PeerProcess(gpu_config.replace(vendor_override={"cuda:1": "amd"}), timeout=120.0)
    with peer:
        remote = peer.register(64 << 20, device="cuda:1")
        with gpu_buffer(gpu_agent, 7, size=64 << 20) as local:
            gpu_agent.write(local, remote, 0, 0, 1 << 20).wait()
            peer.kill()
            started = time.monotonic()
            with pytest.raises(HMCError):
                gpu_agent.write(local, remote, 0, 0, 64 << 20, timeout=10.0).wait()
            assert time.monotonic() - started < 15.0
