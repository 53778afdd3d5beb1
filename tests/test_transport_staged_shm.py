"""The staged path's shared pinned ring (device memory between processes of one host), exercised with host memory.

Without a GPU the ring is plain shared memory and the copies are memmoves; the initiator here is made to treat
every request as device memory so the ring protocol (slot hand-offs, reuse, owner checks) runs end to end
against a real owner process. tests/gpu/test_cuda_staged.py runs it with CUDA memory.
"""

from __future__ import annotations

import glob

import numpy as np
import pytest

import hmc.transport._staged as staged
from hmc.agent import Agent
from hmc.config import Config, PathPolicy
from hmc.errors import OutOfRangeError
from hmc.testing import PeerProcess
from hmc.v1.common_pb2 import BufferDescriptor

POISON = 0xA5
STAGED = PathPolicy(allow=("staged",))


@pytest.fixture
def ring_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staged, "_HOST_KINDS", ())


@pytest.mark.usefixtures("ring_only")
def test_ring_write_and_read_every_byte(config: Config, peer: PeerProcess, rng: np.random.Generator) -> None:
    size = (200 << 20) + 3  # four chunks for three 64 MiB slots: the ring wraps
    remote = peer.register(size, fill=POISON)
    before = set(glob.glob("/dev/shm/hmc-staged-*"))
    with Agent(config.replace(policy=STAGED), daemon=False) as a:
        data = rng.integers(0, 256, size, dtype=np.uint8)
        src = a.register(data)
        handle = a.write(src, remote, 1, 0, size - 1)
        handle.wait()
        assert handle.path == "staged" and handle.bytes_done == size - 1
        expected = np.full(size, POISON, np.uint8)
        expected[: size - 1] = data[1:]
        assert peer.contents(remote.id) == expected.tobytes()
        out = a.register(np.full(size, 0x3C, np.uint8))
        a.read(out, remote, 0, 0, size).wait()
        assert np.array_equal(out.numpy(), expected)
        count = 3001
        slot = size // count
        lengths = rng.integers(1, slot + 1, count)
        offsets = np.arange(count) * slot
        order = rng.permutation(count)
        out.numpy()[:] = 0x3C
        a.read(out, remote, offsets[order], offsets[order], lengths[order]).wait()
        mine = np.full(size, 0x3C, np.uint8)
        for o, n in zip(offsets.tolist(), lengths.tolist()):
            mine[o : o + n] = expected[o : o + n]
        assert np.array_equal(out.numpy(), mine)
        with pytest.raises(OutOfRangeError):
            a.write(src, _grown(remote), 0, size, 16).wait()
        a.write(src, remote, 0, 0, 16).wait()  # the ring still works after a refusal
    assert set(glob.glob("/dev/shm/hmc-staged-*")) <= before, "the ring outlived the agent"


def _grown(descriptor: BufferDescriptor) -> BufferDescriptor:
    """The descriptor claiming more bytes than the owner registered (the owner's own check refuses)."""
    bigger = BufferDescriptor()
    bigger.CopyFrom(descriptor)
    bigger.size = descriptor.size + 64
    return bigger
