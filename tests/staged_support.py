"""Helpers shared by the staged path's tests (streams, shared ring, TCP ring): a whole-buffer round trip, a grown
descriptor, and a raw data connection to a peer agent (what a hostile initiator opens)."""

from __future__ import annotations

import time

import numpy as np

from hmc.agent import Agent, ConnBuffer
from hmc.testing import PeerProcess
from hmc.transport._handshake import connect, handshake
from hmc.transport._wire import FrameStream
from hmc.v1 import common_pb2, peer_pb2
from hmc.v1.common_pb2 import BufferDescriptor

POISON = 0xA5
HOST_POISON = 0x3C


def write_read_every_byte(a: Agent, remote: BufferDescriptor, size: int, rng: np.random.Generator) -> tuple[ConnBuffer, ConnBuffer, np.ndarray]:
    """Random bytes written into the poisoned `remote` (one unaligned range ending at its last byte) on staged, and the
    whole buffer read back into poisoned memory, every byte compared; returns (source, destination, what remote holds)."""
    data = rng.integers(0, 256, size, dtype=np.uint8)
    src = a.register(data)
    handle = a.write(src, remote, 1, 0, size - 1)
    handle.wait()
    assert handle.path == "staged" and handle.bytes_done == size - 1
    expected = np.full(size, POISON, np.uint8)
    expected[: size - 1] = data[1:]
    out = a.register(np.full(size, HOST_POISON, np.uint8))
    a.read(out, remote, 0, 0, size).wait()
    assert np.array_equal(out.numpy(), expected)
    return src, out, expected


def grown(descriptor: BufferDescriptor) -> BufferDescriptor:
    """The descriptor claiming more bytes than the owner registered (the owner's own check refuses)."""
    bigger = BufferDescriptor()
    bigger.CopyFrom(descriptor)
    bigger.size = descriptor.size + 64
    return bigger


def scattered_read_every_byte(a: Agent, out: ConnBuffer, remote: BufferDescriptor, holds: np.ndarray, rng: np.random.Generator) -> None:
    """3001 ranges of `remote` (which `holds` these bytes) read in random order into poisoned `out`, every byte compared."""
    size = holds.size
    count = 3001
    slot = size // count
    lengths = rng.integers(1, slot + 1, count)
    offsets = np.arange(count) * slot
    order = rng.permutation(count)
    out.numpy()[:] = HOST_POISON
    a.read(out, remote, offsets[order], offsets[order], lengths[order]).wait()
    mine = np.full(size, HOST_POISON, np.uint8)
    for o, n in zip(offsets.tolist(), lengths.tolist()):
        mine[o : o + n] = holds[o : o + n]
    assert np.array_equal(out.numpy(), mine)


def data_connection(peer: PeerProcess, proves: BufferDescriptor) -> FrameStream:
    """A raw data connection to the peer agent, authenticated with `proves`' key (what a staged initiator opens)."""
    stream = FrameStream(connect(peer.info.endpoint, time.monotonic() + 5), "owner")
    handshake(stream, common_pb2.AgentInfo(id="raw-initiator"), peer_pb2.PeerHello.CHANNEL_DATA, time.monotonic() + 5, proves)
    return stream
