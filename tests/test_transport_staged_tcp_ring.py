"""The staged path's TCP pinned-ring pipeline (device memory between hosts), exercised with host memory.

Without a GPU the rings are plain memory and the copies are memmoves; the initiator is made to treat every
request as device memory and its peer as another host, and (in-process owner) the owner to bounce host memory
through its pinned slots, so the pipeline (payload from and into slots, replies in order, owner checks) runs end
to end. The peer process variant is another host through HMC_HOST_ID. tests/gpu/test_cuda_staged_tcp.py runs it
with CUDA memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hmc.transport._staged as staged
import hmc.transport._staged_serve as staged_serve
from hmc.agent import Agent
from hmc.config import Config, PathPolicy
from hmc.errors import AccessDeniedError, OutOfRangeError, TimeoutError
from hmc.memory import MemoryKind
from hmc.memory._machine import HOST_ID_ENV, host_id
from hmc.testing import PeerProcess
from hmc.transport._pinned import PinnedMapping
from hmc.transport._staged_owner import OwnerSegments
from hmc.transport._staged_shm import SMALL_BYTES
from hmc.transport._staged_tcp_ring import BounceSlots
from hmc.v1 import peer_pb2
from hmc.v1.common_pb2 import BufferDescriptor
from staged_support import POISON, grown, scattered_read_every_byte, write_read_every_byte

STAGED = PathPolicy(allow=("staged",))


@pytest.fixture
def tcp_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request takes the ring, and every peer counts as another host."""
    monkeypatch.setattr(staged, "_HOST_KINDS", ())
    monkeypatch.setattr(staged, "same_host", lambda agent: False)


@pytest.fixture
def other_host(config: Config) -> Iterator[PeerProcess]:
    """A peer process with its own host id: agents here see it as another host."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(HOST_ID_ENV, "another-host")
        peer = PeerProcess(config.replace(policy=STAGED))
    with peer:
        yield peer


def test_host_id_env_overrides_the_boot_id(monkeypatch: pytest.MonkeyPatch) -> None:
    boot = host_id()
    monkeypatch.setenv(HOST_ID_ENV, "node-b")
    assert host_id() == "node-b" != boot


@pytest.mark.usefixtures("tcp_ring")
def test_tcp_ring_to_another_host_every_byte(config: Config, other_host: PeerProcess, rng: np.random.Generator) -> None:
    size = (40 << 20) + 3  # three 16 MiB slots
    remote = other_host.register(size, fill=POISON)
    with Agent(config.replace(policy=STAGED), daemon=False) as a:
        src, _, expected = write_read_every_byte(a, remote, size, rng)
        assert other_host.contents(remote.id) == expected.tobytes()
        with pytest.raises(OutOfRangeError):
            a.write(src, grown(remote), 0, size, 16).wait()
        a.write(src, remote, 0, 0, 16).wait()  # the ring still works after a refusal
        assert other_host.contents(remote.id)[:16] == src.numpy()[:16].tobytes()


@pytest.mark.usefixtures("tcp_ring")
def test_tcp_ring_owner_bounces_through_pinned_slots(config: Config, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    """The owner's side (bounce slots, queued copies, read payloads sent from slots) with an owner in this process; the
    owner hears which chunk of a transfer is its last (and may answer it from the connection's thread)."""
    monkeypatch.setattr(staged_serve, "_BOUNCED", frozenset({MemoryKind.DEVICE, MemoryKind.HOST}))
    lasts: list[bool] = []
    start = OwnerSegments.start

    def recorded(self: Any, *args: Any, last: bool = False, **kwargs: Any) -> None:
        lasts.append(last)
        start(self, *args, last=last, **kwargs)

    monkeypatch.setattr(OwnerSegments, "start", recorded)
    size = (50 << 20) + 7  # four slots, the last one short
    with Agent(config.replace(policy=STAGED), daemon=False) as owner, Agent(config.replace(policy=STAGED), daemon=False) as a:
        theirs = owner.register(np.full(size, POISON, np.uint8))
        _, out, expected = write_read_every_byte(a, theirs.descriptor, size, rng)
        assert np.array_equal(theirs.numpy(), expected)
        assert lasts == [False, False, False, True] * 2  # the write's four chunks, then the read's
        scattered_read_every_byte(a, out, theirs.descriptor, expected, rng)
        with pytest.raises(OutOfRangeError):
            a.read(out, grown(theirs.descriptor), size, 0, 16).wait()
        wrong = BufferDescriptor()
        wrong.CopyFrom(theirs.descriptor)
        wrong.access_key = b"\x00" * len(wrong.access_key)
        with pytest.raises(AccessDeniedError):
            a.write(out, wrong, 0, 0, 16).wait()
        assert np.array_equal(theirs.numpy(), expected), "a refused write changed the buffer"
        a.write(out, theirs.descriptor, 0, 0, 16).wait()
        assert np.array_equal(theirs.numpy()[:16], out.numpy()[:16])
        assert out.inline_routes[theirs.descriptor.id].max_bytes == SMALL_BYTES  # between hosts: one slot is not one round trip


def test_bounce_slots_are_reused_bounded_and_freed() -> None:
    slots = BounceSlots(count=2, slot_bytes=4096)
    first, second = slots.take(0.0), slots.take(0.0)
    with pytest.raises(TimeoutError):
        slots.take(0.0)
    threading.Timer(0.05, slots.give, (first,)).start()
    assert slots.take(time.monotonic() + 5.0) is first  # the slot given back, not a new one
    slots.give(first)
    slots.close()
    slots.give(second)  # given back after the connection ended: freed at once
    assert slots._free == [] and slots._made == 0


class _Sent:
    """A stand-in data connection recording what the owner sends: (request id, payload_bytes, payload)."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int, bytes]] = []

    def send(self, frame: peer_pb2.PeerFrame, payload: list[memoryview] = (), deadline: float | None = None) -> None:  # type: ignore[assignment]
        self.sent.append((frame.request_id, frame.reply.payload_bytes, b"".join(bytes(p) for p in payload)))


def test_owner_sends_a_read_payload_after_its_copy_then_releases() -> None:
    stream = _Sent()
    owner = OwnerSegments(stream)  # type: ignore[arg-type]
    source = np.arange(64, dtype=np.uint8)
    slot = PinnedMapping(None, 4096, create=True)
    released: list[int] = []

    class _Region:
        kind = MemoryKind.HOST
        address = int(source.ctypes.data)

    owner.start(7, _Region(), [3, 40], [10, 6], slot, 100, total=16, to_slot=True, release=lambda: released.append(7), payload=slot.view(100, 16))
    owner.drain()
    assert stream.sent == [(7, 16, bytes(source[3:13]) + bytes(source[40:46]))]
    assert released == [7]
    owner.close()
    slot.close()
