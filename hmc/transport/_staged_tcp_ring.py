"""The `staged` path for device memory between hosts: device -> pinned ring -> TCP -> pinned slot -> device.

Initiator (`TcpRingStaging`): the shared ring's pipeline (`ShmStaging`) with another
wire. Its ring (8 x 16 MiB) is private pinned memory; a write's hand-off is a
DataWrite followed by the slot's bytes (its pages lent to TCP, `hmc.transport._splice`,
above `SMALL_BYTES`; copied into the socket below),
a read's answer is the owner's reply followed by the chunk's bytes, received into the slot. The rest is the shared ring's: the
device-to-host copies of every free slot queued at once, the oldest finished one sent,
replies collected in order as they come, reads asked `slots` chunks ahead, every wait
bounded by the request's deadline, a failed transfer drops its connection and unpins
and unmaps its ring (after waiting, within the deadline, for the copies queued into it).

Owner (`BounceSlots`, one per data connection, used by `_staged_serve`): a DataWrite
into device memory is bounds- and key-checked, received into a free pinned slot, and its
host-to-device copy queued on the GPU's stream (`OwnerSegments`); the reply goes out once
the copy finished, then the slot is free again. A DataRead from device memory queues the
device-to-host copy into a slot; the reply, followed by the slot's bytes, goes out once
it finished. So while the owner's GPU copies chunk k in, the wire carries chunk k+1 and
the initiator's GPU copies chunk k+2 out. A chunk for device memory holds at most one
slot (`SLOT_BYTES`, what the initiator cuts); a larger one is refused with its payload
drained. Slots are made on first use (up to `_OWNER_SLOTS`) and freed when the
connection ends.

Concurrency: `BounceSlots._cond` guards the free list; the connection's thread takes
slots, its OwnerSegments completion thread gives them back (or the connection's thread,
when it answered the chunk itself: a small one, or a transfer's last, with nothing queued before it).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from hmc.errors import ProtocolError, TimeoutError
from hmc.transport._pinned import PinnedMapping
from hmc.transport._staged_shm import _POLL_S, SLOT_BYTES, SMALL_BYTES, ShmStaging, _Link, frame_of, reply_of
from hmc.transport._wire import FrameStream
from hmc.v1 import peer_pb2

__all__ = ["BOUNCE_WAIT_S", "BounceSlots", "TcpRingStaging"]

_OWNER_SLOTS = 8
"""Pinned slots one owner connection keeps: as many as the initiator has chunks in flight."""
BOUNCE_WAIT_S = 30.0
"""Bound on the owner's wait for a free slot, and for a chunk's bytes to arrive."""


class TcpRingStaging(ShmStaging):
    """Initiator side between hosts: device memory through a private pinned ring, the bytes over TCP."""

    _WORKER = "hmc-staged-tcp-ring"
    _PAIRED = False
    _MAILBOX = False
    _INLINE_BYTES = SMALL_BYTES  # a slot's bytes cross the network: the pipeline's overlap is worth its hand-offs

    def _reply_spin(self, nbytes: int) -> float:
        """A reply that waits on the network polls only for a small chunk (a larger one's bytes take milliseconds)."""
        return _POLL_S if 0 < nbytes <= SMALL_BYTES else 0.0

    def _new_ring(self, size: int) -> tuple[PinnedMapping, str]:
        return PinnedMapping(None, size, create=True), ""

    def _hand_off(self, link: _Link, stream: FrameStream, message: peer_pb2.DataWrite | peer_pb2.DataRead, at: int, nbytes: int, deadline: float) -> None:
        """Send a chunk's request; a write's bytes follow it from the slot, its pages lent to the socket (the slot
        is filled again only once the owner replied, after it received them)."""
        assert link.ring is not None
        if not isinstance(message, peer_pb2.DataWrite):
            stream.send(frame_of(message), deadline=deadline)
            return
        if nbytes <= SMALL_BYTES:  # lending pages costs more than copying a few
            stream.send(frame_of(message), [link.ring.view(at, nbytes)], deadline)
            return
        pages = np.array([[link.ring.address + at, nbytes]], np.uint64)
        stream.send(frame_of(message), deadline=deadline, lend=pages)

    def _answer(self, link: _Link, stream: FrameStream, at: int, nbytes: int, deadline: float) -> None:
        """Take the owner's reply to the oldest read asked for and receive its `nbytes` into the slot."""
        assert link.ring is not None
        reply = reply_of(stream, deadline, self._reply_spin(nbytes))
        if reply.payload_bytes != nbytes:
            raise ProtocolError(f"peer announced {reply.payload_bytes} bytes for a {nbytes}-byte read")
        stream.recv_into([link.ring.view(at, nbytes)], deadline)


class BounceSlots:
    """Owner side of one data connection: pinned slots of `slot_bytes` that device-memory chunks pass through."""

    def __init__(self, count: int = _OWNER_SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        self.slot_bytes = slot_bytes
        self._count = count
        self._cond = threading.Condition()  # guards _free, _made, _closed
        self._free: list[PinnedMapping] = []
        self._made = 0
        self._closed = False

    def take(self, deadline: float) -> PinnedMapping:
        """A free slot, made when fewer than `count` exist; TimeoutError when none is given back before `deadline`."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free or self._made < self._count, max(deadline - time.monotonic(), 0.0)):
                raise TimeoutError("no staging slot of the owner came free before the deadline")
            if self._free:
                return self._free.pop()
            self._made += 1
        try:
            return PinnedMapping(None, self.slot_bytes, create=True)
        except BaseException:
            with self._cond:
                self._made -= 1
                self._cond.notify()
            raise

    def give(self, slot: PinnedMapping) -> None:
        """Return a slot taken before (freed at once once the connection ended)."""
        with self._cond:
            keep = not self._closed
            if keep:
                self._free.append(slot)
            else:
                self._made -= 1
            self._cond.notify()
        if not keep:
            slot.close()

    def close(self) -> None:
        """Free the slots given back; those still taken are freed when given back."""
        with self._cond:
            self._closed = True
            free, self._free = self._free, []
            self._made -= len(free)
        for slot in free:
            slot.close()
