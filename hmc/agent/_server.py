"""The agent's peer listener: the owner side of every path that crosses processes.

Peers connect over TCP and say in their hello which channel they open:

- control: OpenBuffer (grants one-sided ipc access after the access-key check;
  the grant carries pid and address, for device memory the CUDA IPC handle too,
  and says when the memory is read-only: initiators refuse to write it),
  Notify (deduplicated, queued for `Agent.notifications()`), and the replies to
  the Withdrawn frames this agent sends when a granted buffer is unregistered;
- data: DataWrite and DataRead of the staged path. Every range is bounds-checked
  against the registered size, and the access key verified, before one byte is
  received into the buffer; a refused DataWrite's payload is drained and
  discarded and a typed error sent back. Malformed frames get a ProtocolError
  reply and that connection (only) is closed; so does a write whose inline
  payload (`hmc.transport._wire`) does not match its ranges, before any byte
  lands. Host memory is answered by the thread that read the frame, right after
  the bytes landed (and after the device copies queued before it), which then
  polls briefly for the next frame before sleeping. Device memory goes through a
  shared ring slot the frame names (same host, `_staged_shm`) or, when the bytes
  travel with the frame (between hosts), a pinned bounce slot of the connection
  (`_staged_tcp_ring`); either way its copies are queued on the GPU and replied
  to in frame order.

Admission. A connection must say hello and prove the access key of one of this
agent's buffers within `_HANDSHAKE_S`, and until it has, its frames are bounded
by HELLO_FRAME: nothing is reserved for a peer without a key. Every later request
proves its buffer's key on that connection (`key_proof`, never the key). At most
`max_connections` connections are served at once (bounded further by the file
descriptors this process may open); at the bound the oldest connection that has
not authenticated yet is dropped for the newcomer, or the newcomer is refused.
Running out of file descriptors (EMFILE) never stops the accept loop: it sheds
the connection it cannot serve and goes on.

Deadlines. A data frame names its transfer and what was left of its deadline; the
owner drops a frame that arrives after its transfer's deadline (as first seen
here) and stops receiving a payload at that deadline, breaking the connection.
An idle connection is probed by keepalive. `cut(buffer_id)` aborts the
connections still writing into a buffer (`Agent.unregister` uses it).

Concurrency: one accept thread ("hmc-peer-accept") and one thread per
connection ("hmc-peer-<addr>"), all daemon threads joined (bounded) on close.
`_lock` guards the connection sets and the record of who opened which buffer;
`_freed` (on `_lock`) wakes the accept loop when a connection ends.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import logging
import os
import resource
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

from hmc.agent._buffers import BufferTable, ConnBuffer
from hmc.agent._transfer import Notification, NotificationInbox
from hmc.errors import AccessDeniedError, HMCError, OutOfRangeError, ProtocolError, TimeoutError, UnsupportedError
from hmc.memory import MemoryKind
from hmc.transport._channel import Channel
from hmc.transport._ranges import RangeList
from hmc.transport._pinned import PinnedMapping
from hmc.transport._staged_owner import OwnerSegments
from hmc.transport._staged_tcp_ring import BOUNCE_WAIT_S, BounceSlots
from hmc.transport._wire import HELLO_FRAME, FrameStream, accept_handshake, error_reply, tune_socket
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["PeerServer"]

_log = logging.getLogger(__name__)
_HANDSHAKE_S = 5.0
"""A new connection must have said hello and proved a key within this."""
_JOIN_S = 2.0
_SHED_WAIT_S = 0.5
"""Out of file descriptors: how long the accept loop waits for a connection to end before it sheds the next one."""
_FDS_PER_CONNECTION = 4
"""File descriptors one served connection may hold (its socket, the dup for the receiving thread, a lending pipe)."""
_FDS_KEPT = 64
"""File descriptors left to the rest of the process (its own outgoing connections, files) when bounding connections."""
_NEXT_FRAME_SPIN_S = 50e-6
"""A data connection polls this long for its next frame before sleeping: a caller moving small messages back to
back sends it within microseconds of the reply, and a sleeping thread takes tens of microseconds to wake."""
_EXPECTED_MAX = 4096
"""Transfers a data connection remembers the deadline of; older entries past their deadline are forgotten."""


class PeerServer:
    """Listens for peer agents and serves their control and data connections."""

    def __init__(
        self,
        host: str,
        *,
        info: Callable[[], common_pb2.AgentInfo],
        buffers: BufferTable,
        inbox: NotificationInbox,
        buffer_bytes: int,
        max_connections: int = 1024,
        keepalive_s: float = 5.0,
        timeout_s: float = 30.0,
    ) -> None:
        self._info = info
        self._buffers = buffers
        self._inbox = inbox
        self._keepalive_s = keepalive_s
        self._timeout_s = timeout_s
        soft_fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_connections = max(8, min(max_connections, (soft_fds - _FDS_KEPT) // _FDS_PER_CONNECTION)) if soft_fds > 0 else max_connections
        """Connections served at once: the configured bound, or fewer where file descriptors would run out first."""
        self._lock = threading.Lock()  # guards _streams, _pending_auth, _threads, _opened, _closed
        self._freed = threading.Condition(self._lock)  # a connection ended
        self._streams: set[FrameStream] = set()
        self._pending_auth: collections.OrderedDict[FrameStream, None] = collections.OrderedDict()
        """Connections that have not proved a key yet, oldest first (the first to go at the bound)."""
        self._threads: list[threading.Thread] = []
        self._opened: dict[str, set[Channel]] = {}
        self._closed = False
        self._spare: int | None = _open_spare()
        """A descriptor held in reserve: out of descriptors, it is given up to accept and shed one connection."""
        self._listener = socket.create_server((host, 0), backlog=128)
        if buffer_bytes:  # accepted sockets inherit these (and the window scale they imply)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        self.port: int = self._listener.getsockname()[1]
        self._accepter = threading.Thread(target=self._accept_loop, name="hmc-peer-accept", daemon=True)
        self._accepter.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except OSError as exc:
                if self._closed or exc.errno not in _OUT_OF_RESOURCES:
                    return  # listener closed
                self._shed(exc)
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                tune_socket(sock, self._keepalive_s, self._timeout_s)
                stream = FrameStream(sock, peer=f"{address[0]}:{address[1]}", max_frame=HELLO_FRAME)
            except OSError as exc:  # EMFILE on the dup: this one is shed, like one accept could not take
                sock.close()
                if exc.errno in _OUT_OF_RESOURCES:
                    self._shed(exc)
                else:
                    _log.warning("peer port: cannot serve %s:%s: %s", address[0], address[1], exc)
                continue
            thread = threading.Thread(target=self._serve, args=(stream,), name=f"hmc-peer-{address[1]}", daemon=True)
            with self._lock:
                if not self._admit():
                    _log.warning("peer port: %d connections already served; refusing %s:%s", len(self._streams), address[0], address[1])
                    stream.close()
                    continue
                self._streams.add(stream)
                self._pending_auth[stream] = None
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _admit(self) -> bool:
        """Room for one more connection (under `_lock`): at the bound, the oldest one without a proof is dropped."""
        if len(self._streams) < self.max_connections:
            return True
        if not self._pending_auth:
            return False
        oldest, _ = self._pending_auth.popitem(last=False)
        oldest.shutdown()  # its thread ends and forgets it
        self._streams.discard(oldest)
        return True

    def _shed(self, exc: OSError) -> None:
        """Out of descriptors: give the spare one up to accept and close a waiting connection (so its peer is told at
        once rather than left hanging), then wait a little for a served connection to end."""
        _log.warning("peer port: %s; shedding a connection", exc)
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
            if select.select([self._listener], [], [], 0)[0]:  # the connection it could not take (never block here)
                with contextlib.suppress(OSError):
                    self._listener.accept()[0].close()
            self._spare = _open_spare()
        with self._lock:
            if not self._closed:
                self._freed.wait(_SHED_WAIT_S)

    def _authenticate(self, stream: FrameStream, auth: peer_pb2.Auth) -> None:
        """The initiator's proof of one buffer's key (any error refuses the connection)."""
        self._buffers.get(auth.buffer_id, prove=stream.proof, proof=auth.key_proof)
        with self._lock:
            self._pending_auth.pop(stream, None)

    def _serve(self, stream: FrameStream) -> None:
        try:
            hello = accept_handshake(stream, self._info(), time.monotonic() + _HANDSHAKE_S, self._authenticate)
            if hello.channel == peer_pb2.PeerHello.CHANNEL_CONTROL:
                self._serve_control(stream, hello.agent)
            elif hello.channel == peer_pb2.PeerHello.CHANNEL_DATA:
                self._serve_data(stream)
            else:
                raise ProtocolError(f"unknown channel {hello.channel} in hello")
        except (ProtocolError, AccessDeniedError) as exc:
            with contextlib.suppress(HMCError):
                stream.send(peer_pb2.PeerFrame(reply=error_reply(exc)), deadline=time.monotonic() + 1.0)
        except HMCError as exc:
            _log.debug("peer connection %s ended: %s", stream.peer, exc)
        finally:
            stream.close()
            with self._lock:
                self._streams.discard(stream)
                self._pending_auth.pop(stream, None)
                self._freed.notify_all()

    # -- control ----------------------------------------------------------------

    def _serve_control(self, stream: FrameStream, peer: common_pb2.AgentInfo) -> None:
        channel: Channel | None = None

        def handler(frame: peer_pb2.PeerFrame) -> peer_pb2.PeerReply:
            kind = frame.WhichOneof("kind")
            if kind == "open":
                assert channel is not None
                return self._open(frame.open, channel)
            if kind == "notify":
                return self._notify(frame.notify, peer.id, stream)
            raise ProtocolError(f"{kind or 'empty frame'} is not a control request")

        channel = Channel(stream, handler, name=threading.current_thread().name, on_close=self._forget_channel)
        channel.run()

    def _open(self, request: peer_pb2.OpenBuffer, channel: Channel) -> peer_pb2.PeerReply:
        buffer = self._buffers.get(request.buffer_id, prove=channel.stream.proof, proof=request.key_proof)
        if request.path != "ipc":
            raise UnsupportedError(f"buffer {buffer.id} cannot be opened for path {request.path!r}")
        handles = _grant_handles(buffer)
        with self._lock:
            self._opened.setdefault(buffer.id, set()).add(channel)
        grant = peer_pb2.BufferGrant(buffer_id=buffer.id, size=buffer.size, handles=handles, read_only=buffer.region.readonly)
        return peer_pb2.PeerReply(grant=grant)

    def _notify(self, request: peer_pb2.Notify, sender: str, stream: FrameStream) -> peer_pb2.PeerReply:
        self._buffers.get(request.buffer_id, prove=stream.proof, proof=request.key_proof)
        self._inbox.deliver(Notification(request.buffer_id, request.transfer_id, request.payload, sender))
        return peer_pb2.PeerReply()

    def _forget_channel(self, channel: Channel) -> None:
        with self._lock:
            for holders in self._opened.values():
                holders.discard(channel)

    def withdraw(self, buffer_id: str, deadline: float) -> None:
        """Tell every peer that opened `buffer_id` it is gone; wait for their acknowledgements."""
        with self._lock:
            holders = self._opened.pop(buffer_id, set())
        frame = peer_pb2.PeerFrame(withdrawn=peer_pb2.Withdrawn(buffer_id=buffer_id))
        for channel in holders:
            try:
                channel.request(frame, deadline)
            except HMCError as exc:  # cut it: a peer whose channel breaks drops every grant it holds from this agent
                _log.info("withdrawn %s not acknowledged by %s (%s): connection cut", buffer_id, channel.name, exc)
                channel.stream.abort()

    def cut(self, buffer_id: str) -> int:
        """Abort every connection whose receive still writes into `buffer_id`; how many were cut."""
        holders = [holder for holder in self._buffers.holders(buffer_id) if isinstance(holder, FrameStream)]
        for stream in holders:
            stream.abort()
        return len(holders)

    # -- data -------------------------------------------------------------------

    def _serve_data(self, stream: FrameStream) -> None:
        segments = OwnerSegments(stream)  # device memory's copies: shared ring slots (same host), bounce slots (between hosts)
        bounce = BounceSlots()
        try:
            self._serve_frames(stream, segments, bounce, _Expiry(self._timeout_s))
        finally:
            segments.close()
            bounce.close()

    def _serve_frames(self, stream: FrameStream, segments: OwnerSegments, bounce: BounceSlots, expiry: _Expiry) -> None:
        queued = False  # copies (or replies) handed to `segments` since it last drained: a reply sent here waits for them
        while True:
            frame = stream.recv(spin_s=_NEXT_FRAME_SPIN_S)
            kind = frame.WhichOneof("kind")
            if kind == "write":
                request: peer_pb2.DataWrite | peer_pb2.DataRead = frame.write
            elif kind == "read":
                request = frame.read
            else:
                raise ProtocolError(f"{kind or 'empty frame'} is not a data request")
            if stream.inline_bytes and (kind != "write" or request.HasField("shm")):
                raise ProtocolError(f"a {kind} request with {stream.inline_bytes} bytes of payload inline")
            deadline = expiry.deadline(request.transfer_id, request.expires_ms)
            if deadline < time.monotonic():  # its transfer has ended: nothing of it is written or read any more
                late = TimeoutError(f"transfer {request.transfer_id} is past its deadline; frame dropped")
                if kind == "write" and not request.HasField("shm"):
                    stream.discard(_Side(request.ranges, "dst_offsets").total, time.monotonic() + self._timeout_s)
                segments.drain()
                queued = False
                stream.send(peer_pb2.PeerFrame(request_id=frame.request_id, reply=error_reply(late)))
                continue
            if request.HasField("shm"):
                self._shm_copy(stream, frame.request_id, request, "dst_offsets" if kind == "write" else "src_offsets", segments, write=kind == "write")
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

    def _shm_copy(self, stream: FrameStream, request_id: int, request: peer_pb2.DataWrite | peer_pb2.DataRead, field: str, segments: OwnerSegments, *, write: bool) -> None:
        """A staged chunk through a shared ring slot: queue the copy of the slot into the buffer (write) or the
        buffer into it; `segments` replies once it finished, in frame order, and releases the buffer then."""
        side = _Side(request.ranges, field)
        slot = segments.slot(request.shm, side.total)  # a malformed slot is a ProtocolError: the connection ends
        try:
            buffer = self._buffers.acquire(request.buffer_id, prove=stream.proof, proof=request.key_proof, holder=stream)
        except HMCError as exc:
            segments.reply(request_id, error_reply(exc))
            return
        try:
            if write and buffer.region.readonly:
                raise AccessDeniedError(f"buffer {buffer.id} is read-only")
            side.check(buffer.size)
        except HMCError as exc:
            self._buffers.release(buffer.id, stream)
            segments.reply(request_id, error_reply(exc))
            return
        offsets, lengths = side.arrays()
        release = functools.partial(self._buffers.release, buffer.id, stream)
        segments.start(request_id, buffer.region, offsets, lengths, slot, request.shm.offset, total=side.total, to_slot=not write, release=release)

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
                    stream.send_serialized(_OK_FRAME)
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
        segments.start(request_id, buffer.region, offsets, lengths, slot, 0, total=side.total, to_slot=False, release=release)
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
                frame.request_id, buffer.region, offsets, lengths, slot, 0, total=side.total, to_slot=True, release=release, payload=slot.view(0, side.total)
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

    def close(self) -> None:
        """Stop accepting, break every connection, join the threads (bounded); idempotent."""
        with self._lock:
            self._closed = True
            self._freed.notify_all()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        with self._lock:
            streams, threads = list(self._streams), list(self._threads)
        for stream in streams:
            stream.shutdown()
        for thread in (self._accepter, *threads):
            thread.join(_JOIN_S)


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


def _open_spare() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return None


_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class _Expiry:
    """A data connection's record of its transfers' deadlines, as first seen here (see the module's "Deadlines")."""

    __slots__ = ("_default_s", "_deadlines")

    def __init__(self, default_s: float) -> None:
        self._default_s = default_s
        self._deadlines: dict[str, float] = {}

    def deadline(self, transfer_id: str, expires_ms: int) -> float:
        """The monotonic deadline of `transfer_id`'s frames (a frame without one gets the agent's default budget)."""
        now = time.monotonic()
        budget = expires_ms / 1000 if expires_ms else self._default_s
        if not transfer_id:
            return now + budget
        known = self._deadlines.get(transfer_id)
        if known is None:
            if len(self._deadlines) >= _EXPECTED_MAX:
                self._deadlines = {tid: when for tid, when in self._deadlines.items() if when >= now}
            known = self._deadlines[transfer_id] = now + budget
        return known


def _grant_handles(buffer: ConnBuffer) -> common_pb2.TransportHandles:
    """What an ipc initiator needs to reach `buffer`: pid and address (cross-memory attach, or direct
    use by an agent of this very process), and for device memory the CUDA IPC handle."""
    handles = common_pb2.TransportHandles(cma=common_pb2.CmaHandle(pid=os.getpid(), address=buffer.region.address))
    if buffer.region.kind is MemoryKind.DEVICE:
        exported = buffer.descriptor.handles
        if not exported.HasField("cuda_ipc"):
            raise UnsupportedError(f"buffer {buffer.id} is {buffer.region.device.name} memory with no IPC handle this agent could export")
        handles.cuda_ipc.CopyFrom(exported.cuda_ipc)
    return handles


_BOUNCED = frozenset({MemoryKind.DEVICE})
"""Memory a DataWrite or DataRead without a shared slot moves through a pinned bounce slot (host memory goes straight to the socket)."""
_MAX_RANGE = 1 << 40
"""Longest single range accepted on the wire (keeps the payload size computable without overflow)."""
_FEW = 8
"""Up to this many ranges a request is decoded with struct and checked on Python ints (numpy costs more)."""
_INT64S = [struct.Struct(f"<{count}q") for count in range(_FEW + 1)]
"""Decoders of up to `_FEW` little-endian int64s, built once."""
_OK = peer_pb2.PeerReply()
_OK_FRAME = peer_pb2.PeerFrame(reply=_OK).SerializeToString()
"""The reply to almost every data request, serialized once (a request id of 0 is not on the wire)."""
_SENT = peer_pb2.PeerReply(payload_bytes=1)
"""What `_receive_write` and `_send_read` return once they sent the reply themselves: nothing is left to send."""


class _Side:
    """One side (this owner's) of a request's ranges: offsets, lengths, total (ProtocolError when malformed).

    Lengths must be sane to know how much payload follows. Up to `_FEW` ranges are
    decoded with struct and checked on Python ints; longer lists with numpy.
    """

    __slots__ = ("lengths", "offsets", "ranges", "total")

    def __init__(self, message: common_pb2.RangeList, field: str) -> None:
        raw_offsets, raw_lengths = getattr(message, field), message.lengths
        count = len(raw_lengths) >> 3
        self.ranges: RangeList | None = None
        if count > _FEW or len(raw_lengths) & 7 or len(raw_offsets) not in (0, len(raw_lengths)):
            ranges = _wire_ranges(message)
            self.ranges = ranges if field == "dst_offsets" else ranges.swapped()
            self.offsets, self.lengths, self.total = self.ranges.dst, self.ranges.lengths, self.ranges.total
            return
        unpack = _INT64S[count].unpack
        self.lengths = list(unpack(raw_lengths))
        self.offsets = list(unpack(raw_offsets)) if raw_offsets else [0] * count
        if self.lengths and not 0 <= min(self.lengths) <= max(self.lengths) <= _MAX_RANGE:
            raise ProtocolError("range lengths in a data request are negative or absurd")
        self.total = sum(self.lengths)

    def check(self, size: int) -> None:
        """OutOfRangeError unless every range lies inside a buffer of `size` bytes."""
        if self.ranges is not None:
            self.ranges.check_dst(size)
            return
        for index, (offset, length) in enumerate(zip(self.offsets, self.lengths)):
            if offset < 0 or offset + length > size:
                raise OutOfRangeError(f"range #{index} [{offset}, {offset + length}) is outside the buffer of {size} bytes")

    def lists(self) -> tuple[list[int], list[int]]:
        """Offsets and lengths as lists of ints."""
        if self.ranges is None:
            return self.offsets, self.lengths
        return self.ranges.dst.tolist(), self.ranges.lengths.tolist()

    def arrays(self) -> tuple[Sequence[int], Sequence[int]]:
        """Offsets and lengths for a batched copy: int64 arrays (lists of ints for a few ranges)."""
        if self.ranges is None:
            return self.offsets, self.lengths
        return self.ranges.dst, self.ranges.lengths

    def views(self, view: memoryview) -> list[memoryview]:
        offsets, lengths = self.lists()
        return [view[o : o + n] for o, n in zip(offsets, lengths)]


def _wire_ranges(message: common_pb2.RangeList) -> RangeList:
    """Decode a request's ranges; lengths must be sane to know how much payload follows."""
    ranges = RangeList.from_proto(message)
    if len(ranges) and not 0 <= int(ranges.lengths.min()) <= int(ranges.lengths.max()) <= _MAX_RANGE:
        raise ProtocolError("range lengths in a data request are negative or absurd")
    return ranges
