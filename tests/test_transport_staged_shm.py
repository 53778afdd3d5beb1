"""The staged path's shared pinned ring (device memory between processes of one host), exercised with host memory.

Without a GPU the ring is plain shared memory and the copies are memmoves; the initiator here is made to treat
every request as device memory so the ring protocol (slot hand-offs, reuse, owner checks) runs end to end
against a real owner process. tests/gpu/test_cuda_staged.py runs it with CUDA memory.
"""

from __future__ import annotations

import glob
import threading
from typing import Any

import numpy as np
import pytest

import hmc.transport._staged as staged
from hmc.agent import Agent
from hmc.config import Config, PathPolicy
from hmc.errors import AccessDeniedError, OutOfRangeError
from hmc.testing import PeerProcess
from hmc.transport._pinned import SlotCopier
from hmc.transport._staged_owner import OwnerSegments
from hmc.transport._wire import error_reply
from hmc.v1 import peer_pb2
from staged_support import POISON, grown, scattered_read_every_byte, write_read_every_byte

STAGED = PathPolicy(allow=("staged",))


@pytest.fixture
def ring_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staged, "_HOST_KINDS", ())


@pytest.mark.usefixtures("ring_only")
def test_ring_write_and_read_every_byte(config: Config, peer: PeerProcess, rng: np.random.Generator) -> None:
    size = (200 << 20) + 3  # 13 chunks for eight 16 MiB slots: the ring wraps
    remote = peer.register(size, fill=POISON)
    before = set(glob.glob("/dev/shm/hmc-staged-*"))
    with Agent(config.replace(policy=STAGED), daemon=False) as a:
        src, out, expected = write_read_every_byte(a, remote, size, rng)
        assert peer.contents(remote.id) == expected.tobytes()
        scattered_read_every_byte(a, out, remote, expected, rng)
        with pytest.raises(OutOfRangeError):
            a.write(src, grown(remote), 0, size, 16).wait()
        a.write(src, remote, 0, 0, 16).wait()  # the ring still works after a refusal
    assert set(glob.glob("/dev/shm/hmc-staged-*")) <= before, "the ring outlived the agent"


class _Replies:
    """A stand-in data connection recording the owner's replies: (request id, error code)."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []

    def send(self, frame: peer_pb2.PeerFrame, deadline: float | None = None) -> None:
        self.sent.append((frame.request_id, frame.reply.error.code))

    def send_serialized(self, body: bytes) -> None:
        self.send(peer_pb2.PeerFrame.FromString(body))


def test_owner_queues_copies_and_replies_in_frame_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot copy still running holds back the replies behind it; the buffer is released once its copy finished."""
    gates = [threading.Event(), threading.Event()]

    def start(self: Any, region: Any, offsets: list[int], lengths: list[int], slot: int, *, to_slot: bool) -> Any:
        gate = gates[slot]
        return lambda deadline: gate.wait(5.0)

    monkeypatch.setattr(SlotCopier, "start", start)
    stream = _Replies()
    owner = OwnerSegments(stream)  # type: ignore[arg-type]
    released: list[int] = []
    owner.start(1, None, [0], [8], 0, to_slot=False, release=lambda: released.append(1))
    owner.start(2, None, [0], [8], 1, to_slot=False, release=lambda: released.append(2))
    owner.reply(3, error_reply(AccessDeniedError("refused")))
    assert stream.sent == [] and released == []
    gates[1].set()  # the second copy finishing first changes nothing: replies keep frame order
    gates[0].set()
    owner.drain()
    assert [request_id for request_id, _ in stream.sent] == [1, 2, 3]
    assert stream.sent[0][1] == 0 and stream.sent[2][1] != 0
    assert released == [1, 2]
    owner.reply(4, error_reply(AccessDeniedError("refused")))  # nothing queued: sent at once
    assert stream.sent[-1][0] == 4
    owner.close()
