"""The owner side of the staged path: a data connection's requests, served into this agent's buffers.

The agent's peer listener (`hmc.agent._server`) accepts a connection, checks its hello and key
proof, and hands a data connection to `DataConnections.serve` on that connection's thread.

DataWrite and DataRead of the staged path. Every range is bounds-checked against the registered
size, and the access key verified, before one byte is received into the buffer; a refused
DataWrite's payload is drained and discarded and a typed error sent back. Malformed frames get a
ProtocolError reply (from the listener) and that connection (only) is closed; so does a write whose
inline payload (`hmc.transport._wire`) does not match its ranges, before any byte lands. Host memory
is answered by the thread that read the frame, right after the bytes landed (and after the device
copies queued before it), which then polls briefly for the next frame before sleeping. Device memory
goes through a shared ring slot the frame names (same host, `_staged_shm`) or, when the bytes travel
with the frame (between hosts), a pinned bounce slot of the connection (`_staged_tcp_ring`); either
way its copies are queued on the GPU (`_staged_owner.OwnerSegments`) and replied to in frame order.

Deadlines. A data frame names its transfer and its deadline (`_deadlines`); the owner drops a frame
that arrives after its transfer's deadline (as first seen here) and stops receiving a payload at that
deadline, breaking the connection.

Concurrency: `serve` runs on the connection's thread (the listener's "hmc-peer-<addr>"), which reads
every frame and receives or sends host memory's payloads; the connection's `OwnerSegments`
completion thread ("hmc-staged-shm-owner") answers device memory's copies, then gives their bounce
slots back and releases their buffers (the connection's thread does that itself for a small chunk, or a
transfer's last, with nothing queued before it). A connection's segments, bounce slots and record of deadlines
belong to its `serve` call; `DataConnections` itself holds only the buffer table (which has its own
lock) and the default budget, so one serves every connection of a listener.
"""

from __future__ import annotations

import functools
import struct
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from hmc.errors import AccessDeniedError, BrokenResourceError, HMCError, OutOfRangeError, ProtocolError, TimeoutError, UnsupportedError
from hmc.memory import MemoryKind
from hmc.transport._pinned import PinnedMapping
from hmc.transport._staged_mailbox import RECHECK_S, SmallRequest, decode_request, token_of
from hmc.transport._staged_owner import OwnerSegments, ReplyTo
from hmc.transport._deadlines import Expiry
from hmc.transport._staged_tcp_ring import BOUNCE_WAIT_S, BounceSlots
from hmc.transport._wire import FRAME_RANGES, OK_FRAME, FrameStream, error_reply
from hmc.v1 import common_pb2, peer_pb2

if TYPE_CHECKING:
    from hmc.agent._buffers import BufferTable

__all__ = ["DataConnections"]

_NEXT_FRAME_SPIN_S = 50e-6
"""A data connection polls this long for its next frame before sleeping: a caller moving small messages back to
back sends it within microseconds of the reply, and a sleeping thread takes tens of microseconds to wake."""
_MAILBOX_SPIN_S = 100e-6
"""How long a data connection polls its ring's mailbox (and socket) for the next request: a caller moving small
messages back to back posts the next within tens of microseconds (a GPU copy and the agent's bookkeeping)."""
_LOOKS = 128
"""Looks at the mailbox between two at the socket (a select, a system call) while polling: a few microseconds of
looks, so a request posted meanwhile is seen within one look, not after a select (2-4 us on the GPU hosts)."""
_UNSEEN_S = 1e-3
"""A request taken longer than this after the one before it (the connection's thread slept, or its process was
stopped meanwhile) is served only while its initiator is still connected: one that gave up (its deadline passed while
the owner was frozen) hung up, and its request must not land late."""


class DataConnections:
    """Serves staged data connections: checks each request against `buffers` and moves its bytes.

    `timeout_s` is the budget of a frame that names no deadline (and of draining a late frame's payload).
    """

    def __init__(self, buffers: BufferTable, timeout_s: float) -> None:
        self._buffers = buffers
        self._timeout_s = timeout_s

    def serve(self, stream: FrameStream) -> None:
        """Serve one data connection, whose hello was accepted, until it ends (an HMCError ends it)."""
        segments = OwnerSegments(stream)  # device memory's copies: shared ring slots (same host), bounce slots (between hosts)
        bounce = BounceSlots()
        try:
            self._serve_frames(stream, segments, bounce, Expiry(self._timeout_s))
        finally:
            segments.close()
            bounce.close()

    def _serve_frames(self, stream: FrameStream, segments: OwnerSegments, bounce: BounceSlots, expiry: Expiry) -> None:
        queued = False  # copies (or replies) handed to `segments` since it last drained: a reply sent here waits for them
        token = token_of(stream)
        taken = time.monotonic()  # when the last request was taken: a stop since then shows in the next one's wait
        while True:
            frame, reply_to = _next_request(stream, segments, token)
            now = time.monotonic()
            if now - taken > _UNSEEN_S and stream.peer_left():
                raise BrokenResourceError(f"{stream.peer} left while its request waited; not served")
            taken = now
            if isinstance(frame, SmallRequest):  # from the ring's mailbox: one range through slot 0, answered there
                self._small(stream, frame, segments, reply_to)
                queued = True
                continue
            kind = frame.WhichOneof("kind")
            if kind == "write":
                request: peer_pb2.DataWrite | peer_pb2.DataRead = frame.write
            elif kind == "read":
                request = frame.read
            else:
                raise ProtocolError(f"{kind or 'empty frame'} is not a data request")
            if stream.inline_bytes and (kind != "write" or request.HasField("shm")):
                raise ProtocolError(f"a {kind} request with {stream.inline_bytes} bytes of payload inline")
            deadline = expiry.deadline(request.transfer_id, request.expires_ms, request.deadline_monotonic_s)
            if deadline < time.monotonic():  # its transfer has ended: nothing of it is written or read any more
                late = TimeoutError(f"transfer {request.transfer_id} is past its deadline; frame dropped")
                if kind == "write" and not request.HasField("shm"):
                    stream.discard(_Side(request.ranges, "dst_offsets").total, time.monotonic() + self._timeout_s)
                segments.drain()
                queued = False
                stream.send(peer_pb2.PeerFrame(request_id=frame.request_id, reply=error_reply(late)))
                continue
            if request.HasField("shm"):
                side = _Side(request.ranges, "dst_offsets" if kind == "write" else "src_offsets")
                slot = segments.slot(request.shm, side.total)  # a malformed slot is a ProtocolError: the connection ends
                self._slot_copy(
                    stream, frame.request_id, request.buffer_id, request.key_proof, side, (slot, request.shm.offset), segments, write=kind == "write", last=request.last
                )
                queued = True
                continue
            if kind == "write":
                reply = self._receive_write(stream, frame.request_id, frame.write, segments, bounce, deadline, queued=queued)
            else:
                reply = self._send_read(stream, frame, segments, bounce, deadline, queued=queued)
            if reply is _SENT:
                queued = False
                continue
            if reply is None:
                queued = True
                continue
            if queued:  # replies go out in frame order
                segments.drain()
                queued = False
            stream.send(peer_pb2.PeerFrame(request_id=frame.request_id, reply=reply))

    def _small(self, stream: FrameStream, request: SmallRequest, segments: OwnerSegments, reply_to: ReplyTo) -> None:
        """A request from the ring's mailbox: its one range through slot 0 of the mailbox's ring, answered there."""
        ring, room = segments.mailbox_ring()
        if request.length > room:
            raise ProtocolError("a mailbox request reaches past its ring's slots")
        side = _Side.single(request.offset, request.length)
        self._slot_copy(stream, 0, request.buffer_id, request.key_proof, side, (ring, 0), segments, write=request.write, reply_to=reply_to, last=True)

    def _slot_copy(
        self, stream: FrameStream, request_id: int, buffer_id: str, key_proof: bytes, side: _Side, slot: tuple[PinnedMapping, int], segments: OwnerSegments,
        *, write: bool, reply_to: ReplyTo | None = None, last: bool = False,
    ) -> None:
        """A staged chunk through a shared ring slot (mapping, from byte): queue the copy of the slot into the buffer
        (write) or the buffer into it; `segments` replies once it finished (in frame order, or to `reply_to`: a
        request taken from the ring's mailbox), and releases the buffer then (`last`: its transfer's last chunk)."""
        try:
            buffer = self._buffers.acquire(buffer_id, prove=stream.proof, proof=key_proof, holder=stream)
        except HMCError as exc:
            segments.reply(request_id, error_reply(exc), reply_to)
            return
        try:
            if write and buffer.region.readonly:
                raise AccessDeniedError(f"buffer {buffer.id} is read-only")
            side.check(buffer.size)
        except HMCError as exc:
            self._buffers.release(buffer.id, stream)
            segments.reply(request_id, error_reply(exc), reply_to)
            return
        offsets, lengths = side.arrays()
        release = functools.partial(self._buffers.release, buffer.id, stream)
        segments.start(request_id, buffer.region, offsets, lengths, *slot, total=side.total, to_slot=not write, release=release, reply_to=reply_to, last=last)

    def _receive_write(
        self, stream: FrameStream, request_id: int, request: peer_pb2.DataWrite, segments: OwnerSegments, bounce: BounceSlots,
        deadline: float, *, queued: bool,
    ) -> peer_pb2.PeerReply | None:
        """Receive a write's payload into host memory and acknowledge it (after what `segments` has `queued`: _SENT),
        or into a bounce slot whose copy into device memory `segments` queues and answers (None); returns a refusal
        to send. The payload must have arrived by `deadline`, its transfer's: a receive cut off there breaks the
        connection, and nothing lands afterwards. An inline payload must match the ranges (ProtocolError, before any
        byte lands: the connection ends)."""
        side = _Side(request.ranges, "dst_offsets")
        if stream.inline_bytes not in (0, side.total):
            raise ProtocolError(f"a write of {side.total} bytes came with {stream.inline_bytes} bytes inline")
        buffer = None
        slot = None
        try:
            buffer = self._buffers.acquire(request.buffer_id, prove=stream.proof, proof=request.key_proof, holder=stream)
            if buffer.region.readonly:
                raise AccessDeniedError(f"buffer {buffer.id} is read-only")
            side.check(buffer.size)
            if buffer.region.kind in _BOUNCED:
                slot = _bounce_slot(bounce, side.total)
        except HMCError as exc:
            if buffer is not None:
                self._buffers.release(buffer.id, stream)
            stream.discard(side.total, deadline)
            return error_reply(exc)
        if slot is None:
            try:
                stream.recv_into(side.views(buffer.view), deadline, spin_s=_NEXT_FRAME_SPIN_S)
                if queued:
                    segments.drain()  # replies go out in frame order
                if request_id:
                    stream.send(peer_pb2.PeerFrame(request_id=request_id, reply=_OK))
                else:
                    stream.send_framed(OK_FRAME)
            finally:
                self._buffers.release(buffer.id, stream)  # after the reply: the initiator need not wait for it
            return _SENT
        release = _releaser(self._buffers, buffer.id, bounce, slot, stream)
        try:
            stream.recv_into([slot.view(0, side.total)], min(deadline, time.monotonic() + BOUNCE_WAIT_S))
        except BaseException:
            release()
            raise
        offsets, lengths = side.arrays()
        segments.start(request_id, buffer.region, offsets, lengths, slot, 0, total=side.total, to_slot=False, release=release, last=request.last)
        return None

    def _send_read(
        self, stream: FrameStream, frame: peer_pb2.PeerFrame, segments: OwnerSegments, bounce: BounceSlots, deadline: float, *, queued: bool
    ) -> peer_pb2.PeerReply | None:
        """Send a read's reply and payload straight from host memory (by `deadline`, after what `segments` has
        `queued`: _SENT), or queue device memory's copy into a bounce slot that `segments` sends once it finished
        (None); returns a refusal to send."""
        side = _Side(frame.read.ranges, "src_offsets")
        try:
            buffer = self._buffers.acquire(frame.read.buffer_id, prove=stream.proof, proof=frame.read.key_proof, holder=stream)
        except HMCError as exc:
            return error_reply(exc)
        try:
            side.check(buffer.size)
            slot = _bounce_slot(bounce, side.total) if buffer.region.kind in _BOUNCED else None
        except HMCError as exc:
            self._buffers.release(buffer.id, stream)
            return error_reply(exc)
        if slot is not None:
            offsets, lengths = side.arrays()
            release = _releaser(self._buffers, buffer.id, bounce, slot, stream)
            segments.start(
                frame.request_id, buffer.region, offsets, lengths, slot, 0, total=side.total, to_slot=True, release=release, payload=slot.view(0, side.total),
                last=frame.read.last,
            )
            return None
        try:
            if queued:
                segments.drain()  # replies go out in frame order
            reply = peer_pb2.PeerReply(payload_bytes=side.total)
            stream.send(peer_pb2.PeerFrame(request_id=frame.request_id, reply=reply), side.views(buffer.view), deadline)
        finally:
            self._buffers.release(buffer.id, stream)
        return _SENT


def _next_request(stream: FrameStream, segments: OwnerSegments, token: int) -> tuple[peer_pb2.PeerFrame, None] | tuple[SmallRequest, ReplyTo]:
    """The next request: a frame (answered on the connection) or one from the mailbox and what answers it there
    (a malformed one is a ProtocolError: the connection ends). Where the initiator's ring has a mailbox,
    it is polled along with the socket for `_MAILBOX_SPIN_S`; the owner's flag says so until then (also while
    a frame from the socket is served: the mailbox is looked at before anything else). Then the thread lowers
    the flag, looks at the mailbox again, once more after `RECHECK_S` (`_staged_mailbox`'s "Ordering"), and
    sleeps on the socket, where a Posted frame (the doorbell) sends it back to the mailbox."""
    while True:
        mailbox = segments.mailbox
        if mailbox is None:
            frame = stream.recv(spin_s=_NEXT_FRAME_SPIN_S)
            if frame.WhichOneof("kind") == "posted":
                raise ProtocolError(f"{stream.peer} rang the doorbell of a mailbox it never named")
            return frame, None
        mailbox.awake(True)
        until = time.monotonic() + _MAILBOX_SPIN_S
        posted = None
        while not stream.broken and (posted := mailbox.take(token, _LOOKS)) is None and not stream.readable():
            if time.monotonic() > until:
                mailbox.awake(False)
                if (posted := mailbox.take(token)) is None and not stream.readable(RECHECK_S):
                    posted = mailbox.take(token)
                break
        if posted is None or stream.broken:  # a connection cut meanwhile serves nothing more: its receive fails
            frame = stream.recv()
            if frame.WhichOneof("kind") != "posted":
                return frame, None
            if (posted := mailbox.take(token)) is None:  # taken while polling
                continue
        return decode_request(posted[1]), mailbox.replier(posted[0])


def _bounce_slot(bounce: BounceSlots, nbytes: int) -> PinnedMapping:
    """A free bounce slot for a chunk of device memory; UnsupportedError when the chunk exceeds a slot."""
    if nbytes > bounce.slot_bytes:
        raise UnsupportedError(f"a staged chunk of device memory holds at most {bounce.slot_bytes} bytes, not {nbytes}")
    return bounce.take(time.monotonic() + BOUNCE_WAIT_S)


def _releaser(buffers: BufferTable, buffer_id: str, bounce: BounceSlots, slot: PinnedMapping, holder: FrameStream) -> Callable[[], None]:
    """What runs once a bounced chunk is answered: the slot is given back and the buffer released."""

    def release() -> None:
        try:
            bounce.give(slot)
        finally:
            buffers.release(buffer_id, holder)

    return release


_BOUNCED = frozenset({MemoryKind.DEVICE})
"""Memory a DataWrite or DataRead without a shared slot moves through a pinned bounce slot (host memory goes straight to the socket)."""
_MAX_RANGE = 1 << 40
"""Longest single range accepted on the wire (keeps the payload size computable without overflow)."""
_FEW = 8
"""Up to this many ranges a request is decoded with struct and checked on Python ints (numpy costs more)."""
_WIRE_I64 = np.dtype("<i8")
_INT64S = [struct.Struct(f"<{count}q") for count in range(_FEW + 1)]
"""Decoders of up to `_FEW` little-endian int64s, built once."""
_OK = peer_pb2.PeerReply()
_SENT = peer_pb2.PeerReply(payload_bytes=1)
"""What `_receive_write` and `_send_read` return once they sent the reply themselves: nothing is left to send."""


class _Side:
    """One side (this owner's) of a request's ranges: offsets, lengths, total (ProtocolError when malformed).

    Only this side's offsets and the lengths are decoded (the other side's offsets are the initiator's; an
    empty offsets field means offsets of 0). Lengths must be sane to know how much payload follows. Up to
    `_FEW` ranges are decoded with struct and checked on Python ints; longer lists are numpy views of the frame's
    bytes, checked with four reductions (a staged chunk holds up to thousands of ranges, one per frame).
    """

    __slots__ = ("lengths", "many", "offsets", "total")

    def __init__(self, message: common_pb2.RangeList, field: str) -> None:
        raw_offsets, raw_lengths = getattr(message, field), message.lengths
        if len(raw_lengths) & 7 or len(raw_offsets) not in (0, len(raw_lengths)):
            raise ProtocolError("range list fields of a data request are not whole int64 arrays of one length")
        count = len(raw_lengths) >> 3
        self.many = count > _FEW
        if self.many:
            lengths = np.frombuffer(raw_lengths, _WIRE_I64)
            if int(lengths.min()) < 0 or int(lengths.max()) > _MAX_RANGE:
                raise ProtocolError("range lengths in a data request are negative or absurd")
            self.lengths: Sequence[int] = lengths
            self.offsets: Sequence[int] = np.frombuffer(raw_offsets, _WIRE_I64) if raw_offsets else np.zeros(count, _WIRE_I64)
            self.total = int(lengths.sum())
            return
        unpack = _INT64S[count].unpack
        self.lengths = list(unpack(raw_lengths))
        self.offsets = list(unpack(raw_offsets)) if raw_offsets else [0] * count
        if self.lengths and not 0 <= min(self.lengths) <= max(self.lengths) <= _MAX_RANGE:
            raise ProtocolError("range lengths in a data request are negative or absurd")
        self.total = sum(self.lengths)

    @classmethod
    def single(cls, offset: int, length: int) -> _Side:
        """One range (a mailbox request's: decoded as unsigned ints, so never negative)."""
        side = cls.__new__(cls)
        side.many, side.offsets, side.lengths, side.total = False, [offset], [length], length
        return side

    def check(self, size: int) -> None:
        """OutOfRangeError unless every range lies inside a buffer of `size` bytes."""
        if self.many:
            offsets = self.offsets
            assert isinstance(offsets, np.ndarray)
            # lengths are within [0, _MAX_RANGE]: with offsets within [0, size], no end overflows
            if int(offsets.min()) < 0 or int(offsets.max()) > size or int((offsets + self.lengths).max()) > size:
                raise OutOfRangeError(f"a range of the request lies outside the buffer of {size} bytes")
            return
        for index, (offset, length) in enumerate(zip(self.offsets, self.lengths)):
            if offset < 0 or offset + length > size:
                raise OutOfRangeError(f"range #{index} [{offset}, {offset + length}) is outside the buffer of {size} bytes")

    def lists(self) -> tuple[list[int], list[int]]:
        """Offsets and lengths as lists of ints."""
        if self.many:
            return np.asarray(self.offsets).tolist(), np.asarray(self.lengths).tolist()
        return self.offsets, self.lengths  # type: ignore[return-value]

    def arrays(self) -> tuple[Sequence[int], Sequence[int]]:
        """Offsets and lengths for a batched copy: int64 arrays (lists of ints for a few ranges)."""
        return self.offsets, self.lengths

    def views(self, view: memoryview) -> list[memoryview]:
        """One view of `view` per range (a payload received or sent on the connection); at most FRAME_RANGES of them,
        as initiators cut their frames (ProtocolError past it)."""
        if len(self.lengths) > FRAME_RANGES:
            raise ProtocolError(f"a data request of {len(self.lengths)} ranges with its payload on the connection; at most {FRAME_RANGES}")
        offsets, lengths = self.lists()
        return [view[o : o + n] for o, n in zip(offsets, lengths)]
