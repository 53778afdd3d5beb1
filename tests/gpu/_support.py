"""Helpers shared by the GPU transfer tests: poison bytes, random data, byte-exact comparisons, device buffers registered
with an agent, and the transfer checks every path between two processes passes, this one's buffers on cuda:0 and the
peer's on `peer_device` (conftest.py: cuda:1, or cuda:0 on a one-GPU machine)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hmc import memory
from hmc.agent import Agent, ConnBuffer
from hmc.testing import PeerProcess, ranges_digest
from hmc.transport._base import PathName

POISON = 0xA5
"""What device destinations hold before a copy."""
HOST_POISON = 0x3C
"""What host buffers hold before a copy back, different so a missing copy shows."""

# (length, destination offset, source offset, slack after the destination range; 0 touches the last byte)
ODD_CASES = [
    (1, 0, 0, 0),
    (3, 1, 5, 2),
    (4095, 7, 0, 0),
    (4096, 4093, 1, 9),
    (65537, 0, 3, 0),
    ((3 << 20) + 13, 17, 4091, 5),
]
"""Odd sizes, unaligned offsets and ranges touching the last byte."""


def disjoint_offsets(rng: np.random.Generator, lengths: np.ndarray, size: int) -> np.ndarray:
    """Offsets for `lengths` in a `size`-byte buffer: no two overlap, in random order, the last placed one ending at
    the buffer's last byte."""
    order = rng.permutation(lengths.size)
    free = size - int(lengths.sum())
    gaps = np.diff(np.concatenate([[0], np.sort(rng.integers(0, free + 1, lengths.size - 1)), [free]]))
    ends = np.cumsum(gaps + lengths[order])
    offsets = np.empty(lengths.size, np.int64)
    offsets[order] = ends - lengths[order]
    return offsets


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


def scatter(into: np.ndarray, data: np.ndarray, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """What a batched copy of `data`'s ranges into `into` leaves there (range by range, in order): `into`, updated."""
    for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist()):
        into[d : d + n] = data[s : s + n]
    return into


@contextlib.contextmanager
def gpu_buffer(agent: Agent, data: np.ndarray | int, device: str = "cuda:0", size: int | None = None) -> Iterator[ConnBuffer]:
    """A ConnBuffer of device memory here, holding `data` (or every byte set to it)."""
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


def write_then_read(
    agent: Agent,
    peer: PeerProcess,
    path: str,
    length: int,
    remote_offset: int,
    local_offset: int,
    slack: int,
    *,
    peer_device: str,
    negotiated: PathName | None = None,
    before: Callable[[ConnBuffer, Any], None] | None = None,
) -> None:
    """One range written into the peer's buffer on `peer_device` on `path` and read back, every byte of both buffers compared.

    With `negotiated`, also asserts that path negotiation picks it before the write; `before(local, remote)` runs
    once both buffers exist, before the write.
    """
    remote_size = remote_offset + length + slack
    data = random_bytes(local_offset + length + 3, length)
    remote = peer.register(remote_size, fill=POISON, device=peer_device)
    with gpu_buffer(agent, data) as local:
        if negotiated is not None:
            assert agent.path_to(local, remote).path is negotiated
        if before is not None:
            before(local, remote)
        handle = agent.write(local, remote, local_offset, remote_offset, length)
        handle.wait()
        assert handle.path == path
        expected = np.full(remote_size, POISON, np.uint8)
        expected[remote_offset : remote_offset + length] = data[local_offset : local_offset + length]
        assert_bytes_equal(np.frombuffer(peer.contents(remote.id), np.uint8), expected, "write")
        memory.fill(local.region, POISON)
        agent.read(local, remote, remote_offset, local_offset, length).wait()
        mine = np.full(local.size, POISON, np.uint8)
        mine[local_offset : local_offset + length] = data[local_offset : local_offset + length]
        assert_bytes_equal(host_copy(local), mine, "read")
    peer.unregister(remote.id)


def peer_initiates_both_directions(agent: Agent, peer: PeerProcess, size: int, path: str, *, peer_device: str) -> None:
    """The peer writes three ranges (one the last byte) from its buffer on `peer_device` into a device buffer here, then
    reads a whole fresh one back, on `path`."""
    data = random_bytes(size, 11)
    theirs = peer.register(size, device=peer_device)
    peer.fill(theirs.id, data.tobytes())
    with gpu_buffer(agent, POISON, size=size) as mine:
        assert peer.transfer("write", theirs.id, mine.descriptor, [0, 5000, size - 1], [3, 9000, size - 1], [4000, 70001, 1]) == path
        expected = np.full(size, POISON, np.uint8)
        expected[3:4003], expected[9000:79001], expected[-1] = data[:4000], data[5000:75001], data[-1]
        assert_bytes_equal(host_copy(mine), expected, "peer write")
        fresh = random_bytes(size, 12)
        memory.copy(mine.region, fresh)
        assert peer.transfer("read", theirs.id, mine.descriptor, 0, 0, size) == path
        assert peer.contents(theirs.id) == fresh.tobytes()
    peer.unregister(theirs.id)


def host_here_device_there(agent: Agent, peer: PeerProcess, size: int, seed: int, path: str, *, peer_device: str) -> None:
    """Host memory here written into the peer's poisoned buffer on `peer_device` (unaligned, one byte short) and the
    whole buffer read back into poisoned host memory, on `path`, every byte compared."""
    data = random_bytes(size, seed)
    remote = peer.register(size, fill=POISON, device=peer_device)
    local = agent.register(data.copy())
    try:
        handle = agent.write(local, remote, 1, 0, size - 1)
        handle.wait()
        assert handle.path == path
        expected = np.full(size, POISON, np.uint8)
        expected[: size - 1] = data[1:]
        assert_bytes_equal(np.frombuffer(peer.contents(remote.id), np.uint8), expected, "host -> device")
        out = np.full(size, HOST_POISON, np.uint8)
        back = agent.register(out)
        agent.read(back, remote, 0, 0, size).wait()
        assert_bytes_equal(out, expected, "device -> host")
        agent.unregister(back)
    finally:
        agent.unregister(local)
        peer.unregister(remote.id)


def kv_write_then_read(agent: Agent, peer: PeerProcess, path: str, count: int, block: int, total: int, *, peer_device: str) -> None:
    """`count` random `block`-byte ranges of a `total`-byte device buffer written into the peer's poisoned buffer on
    `peer_device` over `path` (digest of the whole buffer compared), then read back to other random places (every
    byte of ours compared)."""
    rng = np.random.default_rng(count)
    slots = total // block
    src = rng.permutation(slots)[:count].astype(np.int64) * block
    dst = rng.permutation(slots)[:count].astype(np.int64) * block
    data = random_bytes(total, count)
    remote = peer.register(total, fill=POISON, device=peer_device)
    with gpu_buffer(agent, data) as local:
        handle = agent.write(local, remote, src, dst, block)
        handle.wait()
        assert handle.path == path
        expected = np.full(total, POISON, np.uint8)
        expected.reshape(slots, block)[dst // block] = data.reshape(slots, block)[src // block]
        assert peer.digest(remote.id) == ranges_digest(expected), "KV write: the peer's buffer differs"
        memory.fill(local.region, POISON)
        back = rng.permutation(slots)[:count].astype(np.int64) * block
        handle = agent.read(local, remote, dst, back, block)
        handle.wait()
        assert handle.path == path
        mine = np.full(total, POISON, np.uint8)
        mine.reshape(slots, block)[back // block] = expected.reshape(slots, block)[dst // block]
        assert_bytes_equal(host_copy(local), mine, "KV read")
    peer.unregister(remote.id)
