"""The `staged` path: TCP data streams between any two agents, chunked and pipelined.

Per peer agent, `streams` data connections are opened lazily on first use, kept
and reused (large SO_SNDBUF/SO_RCVBUF, TCP_NODELAY, set by the connector). A
transfer's coalesced ranges are cut into chunks of `chunk_bytes`, or one per
stream when that is larger (up to 64 MiB each), and dealt round-robin over the
streams. Each stream has a sender thread that writes frames back to back without
waiting for acknowledgements, and a receiver thread that collects the owner's
replies in order: the pipeline stays full.

WRITE sends `DataWrite` + the payload straight from registered memory in one
sendmsg (copied into the socket: over loopback on the 2-core VM, lending the
pages as `hmc.transport._splice` can moved 256 MiB slower than the copy, whose
cost the other core absorbs); the owner bounds-checks the ranges and the access
key before receiving into its buffer. READ sends `DataRead`; the owner answers
with a reply announcing `payload_bytes` and the bytes follow, received straight
into the destination (`recvmsg_into`). No intermediate copy on either side,
except that payloads up to `INLINE_MAX` travel inline with their frame and land
from the receiver's read-ahead buffer (`hmc.transport._wire`).

Device memory (at either end) takes a pinned ring instead, on a data connection
of its own per peer: between processes of one host the ring is shared memory both
map (`_staged_shm`); between hosts each end has its own pinned memory and the
chunks travel over TCP (`_staged_tcp_ring`). Host memory never goes through a ring.
The owner side of every variant (frames checked and served into the owner's
buffers, replies in frame order) is `_staged_serve`, with `_staged_owner` for
its device copies.

Small transfers (up to 1 MiB) skip the streams: the caller's thread sends the
whole request on an idle round-trip connection to the owner, whose connection
thread answers, and reads the reply (and a read's payload) itself, polling for
it briefly before sleeping (`_REPLY_SPIN_S`). No thread hand-off on either
side, no chunking; the transfer is finished when post() returns. Up to 4 such
connections per peer are kept; a caller that finds them all busy uses the
streams instead. Once a pair has moved one range this way, the agent's fast
path (`inline()`) sends later single ranges without building range lists,
requests or handles: each connection keeps the request frame it sent to a
buffer and fills in the next range (it waits for a free connection instead).

Deadlines and failures. A transfer that has ended never writes another byte.
Every frame names its transfer and what was left of its deadline when sent
(the owner drops frames of transfers past their deadline and stops receiving a
payload at it). A stream is torn down when the connection breaks or makes no
progress for `stall_s`; when a transfer expires or is cancelled while chunks of
it are in flight, the streams carrying them are aborted (`FrameStream.abort`:
RST, the kernel drops what it still held to send, lent pages included; a read
payload being received is cut off) before the handle reports the end, and the
other transfers' chunks on those streams fail with BrokenResourceError (their
callers may retry: nothing of theirs is half-acknowledged). Queued chunks of an
ended transfer are skipped. A torn-down stream fails every chunk queued or in
flight on it and is replaced on the next transfer.

Deadlines hold for small transfers too: a round trip that misses its deadline
(or fails in any way but a typed refusal from the owner) aborts its connection.

Frames stay within what the owner accepts (`MAX_FRAME`): a chunk carries at
most `FRAME_RANGES` ranges, so batches of any size go through.

Concurrency: `post()` runs on the caller's thread (it may open connections
within the request's deadline) and only enqueues, except for small transfers,
which run right there. A round-trip connection is used by one caller at a
time (taken from and given back to its pipe under the transport's `_lock`).
Each stream's own state and threads are `hmc.transport._staged_streams.DataStream`'s.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from hmc.errors import HMCError, ProtocolError, TimeoutError
from hmc.memory import DeviceKind, MemoryKind
from hmc.transport._base import Capabilities, InlineCopy, PathName, TransferOp, TransferRequest, Transport
from hmc.transport._staged_rings import same_host
from hmc.transport._staged_shm import ShmStaging
from hmc.transport._staged_streams import Chunk, DataStream, Transfer, request_frame, request_views, stream_error
from hmc.transport._staged_tcp_ring import TcpRingStaging
from hmc.transport._deadlines import shares_clock, stamp
from hmc.transport._wire import FRAME_RANGES, FrameStream, raise_for_reply
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["StagedTransport"]

_ROUND_TRIP_BYTES = 1 << 20
"""A transfer up to this size is one round trip on the caller's thread (see the module's "Small transfers")."""
_ROUND_TRIP_CONNECTIONS = 4
"""Round-trip connections per peer: callers that find them all busy use the streams."""
_STREAM_CHUNK_MAX = 64 << 20
"""Cap on the one-chunk-per-stream cut of large transfers: progress (and a failure's loss) moves in
steps of at most this much, at no cost in speed (64 MiB chunks moved 256 MiB as fast as 256 MiB ones)."""
_REPLY_SPIN_S = 200e-6
"""A round trip polls this long for the owner's reply before sleeping: it is microseconds away, and a sleeping
thread takes tens of microseconds to wake (4 KiB WRITE p50 on the 2-core VM: see docs/decisions.md)."""
_FRAMES_KEPT = 256
"""Remote buffers a round-trip connection keeps request frames for (then it starts over)."""
_I64 = struct.Struct("<q")
_HOST_KINDS = (common_pb2.DEVICE_KIND_UNSPECIFIED, common_pb2.DEVICE_KIND_HOST)

Connect = Callable[[common_pb2.BufferDescriptor, float], FrameStream]
"""Opens an authenticated data connection to the owner of a buffer (proving that buffer's key)."""


def _round_trip(stream: FrameStream, request: TransferRequest) -> peer_pb2.PeerReply:
    """Send the whole request, read the owner's reply (and a read's payload); stream failures raise."""
    ranges = request.ranges
    write = request.op is TransferOp.WRITE
    payload = request_views(request, ranges.src, ranges.lengths) if write else []
    into = None if write else request_views(request, ranges.dst, ranges.lengths)
    return _exchange(stream, request_frame(request, ranges, stream).SerializeToString(), payload, into, ranges.total, request.deadline)


def _exchange(
    stream: FrameStream, body: bytes, payload: list[memoryview], into: list[memoryview] | None, nbytes: int, deadline: float
) -> peer_pb2.PeerReply:
    """One serialized request (a write's payload inline with it) and its reply; a read (`into` given) receives its
    `nbytes` of payload there."""
    stream.send_serialized(body, payload, deadline)
    answer = stream.recv(deadline, spin_s=_REPLY_SPIN_S)
    if answer.WhichOneof("kind") != "reply":
        raise ProtocolError(f"expected a reply on a data connection, got {answer.WhichOneof('kind')}")
    reply = answer.reply
    if stream.inline_bytes and (into is None or stream.inline_bytes != reply.payload_bytes):  # bytes nobody asked for
        raise ProtocolError(f"a reply carried {stream.inline_bytes} bytes inline but announced {reply.payload_bytes}")
    if into is not None and not (reply.HasField("error") and reply.error.code):
        if reply.payload_bytes != nbytes:
            raise ProtocolError(f"peer announced {reply.payload_bytes} bytes for a {nbytes}-byte read")
        stream.recv_into(into, deadline, spin_s=_REPLY_SPIN_S)
    return reply


class _RoundTrip:
    """A round-trip connection and the single-range request frames it reuses (see `inline()`): used by one caller
    at a time, so a frame is filled in and sent without building messages."""

    __slots__ = ("frames", "stream")

    def __init__(self, stream: FrameStream) -> None:
        self.stream = stream
        self.frames: dict[tuple[str, bool], tuple[peer_pb2.PeerFrame, Any, common_pb2.RangeList, bool]] = {}
        """Per (remote buffer id, write): the frame, its request and its range list, proving the key on this connection,
        and whether the owner reads our clock (`_deadlines.stamp`)."""

    def single(self, remote: common_pb2.BufferDescriptor, write: bool, offset: int, length: int, deadline: float) -> bytes:
        """The serialized request for one range at `offset` of `remote` (written or read), expiring at `deadline`."""
        cached = self.frames.get((remote.id, write))
        if cached is None:
            if len(self.frames) >= _FRAMES_KEPT:
                self.frames.clear()
            frame = peer_pb2.PeerFrame()
            request = frame.write if write else frame.read
            request.buffer_id, request.key_proof = remote.id, self.stream.proof(remote.access_key, remote.registry_epoch)
            cached = self.frames[(remote.id, write)] = (frame, request, request.ranges, shares_clock(remote))
        frame, request, ranges, clocked = cached
        if write:
            ranges.dst_offsets = _I64.pack(offset)
        else:
            ranges.src_offsets = _I64.pack(offset)
        ranges.lengths = _I64.pack(length)
        stamp(request, deadline, clocked)
        return frame.SerializeToString()


class _Pipe:
    """The streams to one peer agent, dealt chunks round-robin, and its round-trip connections."""

    def __init__(self) -> None:
        self.streams: list[DataStream] = []
        self.next = 0
        self.opening = threading.Lock()  # one thread at a time opens this pipe's missing streams
        self.idle: list[_RoundTrip] = []
        """Round-trip connections nobody uses right now."""
        self.round_trips = 0
        """Round-trip connections open or being opened, idle or in use."""


class StagedTransport(Transport):
    """TCP streams between any two agents (initiator side; the owner side is `_staged_serve.DataConnections`)."""

    def __init__(
        self,
        connect: Connect,
        *,
        streams: int = 4,
        chunk_bytes: int = 4 << 20,
        stall_s: float = 30.0,
        memory_kinds: frozenset[DeviceKind] = frozenset({DeviceKind.HOST}),
    ) -> None:
        """`memory_kinds`: what to declare besides host memory (the device kinds this process can copy from and to),
        so that negotiation picks this path where a real pair would: a cross-vendor pair, or two hosts."""
        self._connect = connect
        self._stall_s = stall_s
        self._streams = max(1, streams)
        self._chunk_bytes = chunk_bytes
        self._round_trip_bytes = min(_ROUND_TRIP_BYTES, chunk_bytes)
        self._lock = threading.Lock()  # guards _pipes, _closed, each pipe's stream list and round-trip connections
        self._pipes: dict[str, _Pipe] = {}
        self._freed = threading.Condition(self._lock)  # a round-trip connection was given back
        self._waiting = 0
        """Callers waiting on `_freed` (under `_lock`): only then is a connection's return announced."""
        self._closed = False
        self.capabilities = Capabilities(path=PathName.STAGED, memory_kinds=memory_kinds | {DeviceKind.HOST}, detail=f"tcp x{self._streams}")
        self._shm = ShmStaging(connect)
        """Device memory between processes of one host: a shared pinned ring (see _staged_shm)."""
        self._tcp_ring = TcpRingStaging(connect)
        """Device memory between hosts: pinned rings on both ends, the bytes over TCP (see _staged_tcp_ring)."""

    def post(self, request: TransferRequest) -> None:
        # Ranges were checked against the descriptor by the agent; the owner checks them again on receipt.
        if request.local.region.kind is MemoryKind.DEVICE or request.remote.device.kind not in _HOST_KINDS:
            (self._shm if same_host(request.remote.owner) else self._tcp_ring).post(request)
            return
        total = request.ranges.total
        if not total:
            request.completion.finish()
            return
        if total <= self._round_trip_bytes and self._round_trip(request):
            return
        try:
            streams, first = self._streams_for(request.remote, request.deadline)
        except HMCError as exc:
            request.completion.finish(exc)
            return
        chunks = request.ranges.chunks(max(self._chunk_bytes, min(-(-total // len(streams)), _STREAM_CHUNK_MAX)), FRAME_RANGES)
        request.completion.set_running()
        transfer = Transfer(request, len(chunks))
        request.completion.on_cancel = transfer.abort
        for index, ranges in enumerate(chunks):
            chunk = Chunk(transfer, ranges)
            stream = streams[(first + index) % len(streams)]
            while not stream.put(chunk):
                try:  # a stream died since we listed them: list again, opening replacements
                    streams, first = self._streams_for(request.remote, request.deadline)
                except HMCError as exc:
                    request.completion.finish(exc)
                    return
                stream = streams[(first + index) % len(streams)]

    def _round_trip(self, request: TransferRequest) -> bool:
        """Run a small transfer on this thread over an idle round-trip connection; False when none is free."""
        owner = request.remote.owner
        try:
            taken = self._take_connection(request.remote, request.deadline)
        except HMCError as exc:
            request.completion.finish(exc)
            return True
        if taken is None:
            return False
        pipe, connection = taken
        request.completion.set_running()
        try:
            reply = _round_trip(connection.stream, request)
        except HMCError as exc:  # the connection is in an unknown state: drop it
            self._give_back(owner, pipe, connection, broken=True)
            request.completion.finish(stream_error(exc))
            return True
        self._give_back(owner, pipe, connection, broken=False)
        try:
            raise_for_reply(reply)
        except HMCError as exc:  # the owner refused (access, bounds): the connection is fine
            request.completion.finish(exc)
            return True
        request.completion.finish()
        return True

    def _take_connection(self, remote: common_pb2.BufferDescriptor, deadline: float, *, wait: bool = False) -> tuple[_Pipe, _RoundTrip] | None:
        """An idle round-trip connection to `remote`'s owner, a new one, or (all busy) None or, with `wait`, the first freed."""
        owner = remote.owner
        with self._lock:
            pipe = self._pipes.get(owner.id)
            if pipe is not None and pipe.idle:  # the usual case, first
                return pipe, pipe.idle.pop()
            if pipe is None:
                pipe = self._pipes[owner.id] = _Pipe()
            while not pipe.idle and pipe.round_trips >= _ROUND_TRIP_CONNECTIONS:
                if not wait:
                    return None
                self._waiting += 1
                try:
                    freed = self._freed.wait(max(deadline - time.monotonic(), 0.0))
                finally:
                    self._waiting -= 1
                if not freed:
                    raise TimeoutError(f"every data connection to agent {owner.id} stayed busy until the deadline")
                pipe = self._pipes.setdefault(owner.id, _Pipe())
            if pipe.idle:
                return pipe, pipe.idle.pop()
            pipe.round_trips += 1
        try:
            return pipe, _RoundTrip(self._connect(remote, deadline))
        except BaseException:
            with self._lock:
                pipe.round_trips -= 1
                if self._waiting:
                    self._freed.notify()
            raise

    def _give_back(self, owner: common_pb2.AgentInfo, pipe: _Pipe, connection: _RoundTrip, *, broken: bool) -> None:
        stream = connection.stream
        with self._lock:
            keep = not broken and not stream.broken and not self._closed and self._pipes.get(owner.id) is pipe
            if keep:
                pipe.idle.append(connection)
            else:
                pipe.round_trips -= 1
            if self._waiting:
                self._freed.notify()
        if not keep:
            if broken:
                stream.abort()  # a failed round trip's bytes never leave late
            stream.close()

    def inline(self, local: Any, remote: common_pb2.BufferDescriptor) -> InlineCopy | None:
        """One range as one round trip, the agent's fast path (within `stall_s`, the agent's default deadline): the
        connection's request frame for `remote` is filled in and sent with the range, inline."""
        if local.region.kind is MemoryKind.DEVICE or remote.device.kind not in _HOST_KINDS:  # device memory: its ring's
            return (self._shm if same_host(remote.owner) else self._tcp_ring).inline(local, remote, self._stall_s)
        owner, view = remote.owner, local.view

        def run(write: bool, local_offset: int, remote_offset: int, length: int) -> None:
            deadline = time.monotonic() + self._stall_s
            pipe, connection = self._take_connection(remote, deadline, wait=True)  # type: ignore[misc]
            mine = [view[local_offset : local_offset + length]]
            try:
                body = connection.single(remote, write, remote_offset, length, deadline)
                reply = _exchange(connection.stream, body, mine if write else [], None if write else mine, length, deadline)
            except HMCError as exc:
                self._give_back(owner, pipe, connection, broken=True)
                raise stream_error(exc) from exc
            self._give_back(owner, pipe, connection, broken=False)
            raise_for_reply(reply)

        def write(local_offset: int, remote_offset: int, length: int) -> None:
            run(True, local_offset, remote_offset, length)

        def read(local_offset: int, remote_offset: int, length: int) -> None:
            run(False, local_offset, remote_offset, length)

        return InlineCopy(write=write, read=read, local_size=local.size, remote_size=remote.size, max_bytes=self._round_trip_bytes, waits=True)

    def _streams_for(self, remote: common_pb2.BufferDescriptor, deadline: float) -> tuple[list[DataStream], int]:
        owner = remote.owner
        with self._lock:
            pipe = self._pipes.setdefault(owner.id, _Pipe())
        with pipe.opening:
            with self._lock:
                pipe.streams = [s for s in pipe.streams if s.alive]
            while len(pipe.streams) < self._streams:
                stream = self._open(remote, deadline, pipe)
                with self._lock:
                    pipe.streams.append(stream)
        with self._lock:
            streams = list(pipe.streams)
            first = pipe.next
            pipe.next += 1
        return streams, first

    def _open(self, remote: common_pb2.BufferDescriptor, deadline: float, pipe: _Pipe) -> DataStream:
        stream = self._connect(remote, deadline)
        name = f"{remote.owner.id[:8]}-{len(pipe.streams)}"

        def broken(dead: DataStream) -> None:
            with self._lock:
                if dead in pipe.streams:
                    pipe.streams.remove(dead)

        return DataStream(stream, name, broken, self._stall_s)

    def forget_peer(self, agent: common_pb2.AgentInfo) -> None:
        """Close the streams to an agent that went away."""
        with self._lock:
            pipe = self._pipes.pop(agent.id, None)
        if pipe is not None:
            self._close_pipe(pipe)
        self._shm.forget_peer(agent)
        self._tcp_ring.forget_peer(agent)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pipes, self._pipes = list(self._pipes.values()), {}
        for pipe in pipes:
            self._close_pipe(pipe)
        self._shm.close()
        self._tcp_ring.close()

    def _close_pipe(self, pipe: _Pipe) -> None:
        """Close a pipe that is out of `_pipes` (round-trip connections in use close when given back)."""
        with self._lock:
            idle, pipe.idle = pipe.idle, []
        for connection in idle:
            connection.stream.close()
        for stream in list(pipe.streams):
            stream.close()
