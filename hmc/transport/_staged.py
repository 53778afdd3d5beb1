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
most `_FRAME_RANGES` ranges, so batches of any size go through.

Concurrency: `post()` runs on the caller's thread (it may open connections
within the request's deadline) and only enqueues, except for small transfers,
which run right there. A round-trip connection is used by one caller at a
time (taken from and given back to its pipe under the transport's `_lock`).
Each stream's queue and in-flight deque are shared by its threads and callers,
guarded by the stream's lock; its `_order` lock keeps "record as sent" and
"send" together.
"""

from __future__ import annotations

import collections
import queue
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from hmc.errors import BrokenResourceError, HMCError, ProtocolError, TimeoutError
from hmc.memory import DeviceKind, MemoryKind
from hmc.transport._base import Capabilities, InlineCopy, PathName, TransferOp, TransferRequest, Transport
from hmc.transport._ranges import RangeList
from hmc.transport._staged_shm import ShmStaging, same_host
from hmc.transport._staged_tcp_ring import TcpRingStaging
from hmc.transport._wire import FrameStream, expires_ms, raise_for_reply
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["StagedTransport"]

_TICK_S = 0.25
_ROUND_TRIP_BYTES = 1 << 20
"""A transfer up to this size is one round trip on the caller's thread (see the module's "Small transfers")."""
_ROUND_TRIP_CONNECTIONS = 4
"""Round-trip connections per peer: callers that find them all busy use the streams."""
_STREAM_CHUNK_MAX = 64 << 20
"""Cap on the one-chunk-per-stream cut of large transfers: progress (and a failure's loss) moves in
steps of at most this much, at no cost in speed (64 MiB chunks moved 256 MiB as fast as 256 MiB ones)."""
_FRAME_RANGES = 1 << 18
"""Most ranges in one chunk's frame (4 MiB of offsets and lengths, well inside MAX_FRAME): a frame of tiny ranges
costs both ends a little per range, and each frame must be answered within the stall bound."""
_REPLY_SPIN_S = 200e-6
"""A round trip polls this long for the owner's reply before sleeping: it is microseconds away, and a sleeping
thread takes tens of microseconds to wake (4 KiB WRITE p50 on the 2-core VM: see docs/decisions.md)."""
_FRAMES_KEPT = 256
"""Remote buffers a round-trip connection keeps request frames for (then it starts over)."""
_JOIN_S = 2.0
_LANDING_S = 2.0
"""How long an abort waits for a read payload's receive to let go of user memory (it is woken at once)."""
_I64 = struct.Struct("<q")
_HOST_KINDS = (common_pb2.DEVICE_KIND_UNSPECIFIED, common_pb2.DEVICE_KIND_HOST)

Connect = Callable[[common_pb2.BufferDescriptor, float], FrameStream]
"""Opens an authenticated data connection to the owner of a buffer (proving that buffer's key)."""


class _Transfer:
    """Counts one request's chunks down to completion; aborts the streams carrying them when it ends early."""

    __slots__ = ("aborted", "left", "lock", "request", "streams")

    def __init__(self, request: TransferRequest, chunks: int) -> None:
        self.request = request
        self.left = chunks
        self.lock = threading.Lock()  # guards `left`
        self.aborted = False
        """Set once the transfer ended early: its chunks are not sent any more (read under each stream's lock)."""
        self.streams: list[_Stream] = []
        """The streams its chunks were dealt to."""

    def abort(self) -> None:
        """The handle's cancel hook: no chunk of this transfer is sent or lands after this returns."""
        self.aborted = True
        for stream in list(self.streams):
            stream.abort_if_carrying(self)

    def chunk_done(self, nbytes: int) -> None:
        completion = self.request.completion
        completion.add_bytes(nbytes)
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            completion.finish()


class _Chunk:
    __slots__ = ("ranges", "sent_at", "transfer")

    def __init__(self, transfer: _Transfer, ranges: RangeList) -> None:
        self.transfer = transfer
        self.ranges = ranges
        self.sent_at = 0.0

    def local_views(self, local_offsets: Any) -> list[memoryview]:
        return _views(self.transfer.request, local_offsets, self.ranges.lengths)

    def frame(self, stream: FrameStream) -> peer_pb2.PeerFrame:
        return _frame(self.transfer.request, self.ranges, stream)

    def payload(self) -> list[memoryview]:
        """A WRITE's payload: views of its source ranges (copied into the socket), none for a READ."""
        request = self.transfer.request
        if request.op is not TransferOp.WRITE:
            return []
        return _views(request, self.ranges.src, self.ranges.lengths)


def _views(request: TransferRequest, local_offsets: Any, lengths: Any) -> list[memoryview]:
    view = request.local.view
    return [view[o : o + n] for o, n in zip(local_offsets.tolist(), lengths.tolist())]


def _frame(request: TransferRequest, ranges: RangeList, stream: FrameStream) -> peer_pb2.PeerFrame:
    """The DataWrite or DataRead asking for `ranges` of the request on `stream` (a write's payload goes after it)."""
    lengths = ranges.lengths.tobytes()
    remote = request.remote
    proof, tid, expires = stream.proof(remote.access_key), request.transfer_id, expires_ms(request.deadline)
    if request.op is TransferOp.WRITE:
        wire = common_pb2.RangeList(dst_offsets=ranges.dst.tobytes(), lengths=lengths)
        return peer_pb2.PeerFrame(write=peer_pb2.DataWrite(buffer_id=remote.id, key_proof=proof, ranges=wire, transfer_id=tid, expires_ms=expires))
    wire = common_pb2.RangeList(src_offsets=ranges.src.tobytes(), lengths=lengths)
    return peer_pb2.PeerFrame(read=peer_pb2.DataRead(buffer_id=remote.id, key_proof=proof, ranges=wire, transfer_id=tid, expires_ms=expires))


def _round_trip(stream: FrameStream, request: TransferRequest) -> peer_pb2.PeerReply:
    """Send the whole request, read the owner's reply (and a read's payload); stream failures raise."""
    ranges = request.ranges
    write = request.op is TransferOp.WRITE
    payload = _views(request, ranges.src, ranges.lengths) if write else []
    into = None if write else _views(request, ranges.dst, ranges.lengths)
    return _exchange(stream, _frame(request, ranges, stream).SerializeToString(), payload, into, ranges.total, request.deadline)


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


def _stream_error(exc: HMCError) -> HMCError:
    """What a caller sees of a failed data connection (the connection is dropped)."""
    return exc if isinstance(exc, (TimeoutError, BrokenResourceError)) else BrokenResourceError(f"data connection failed: {exc}")


class _Stream:
    """One data connection with its sender and receiver threads."""

    def __init__(self, stream: FrameStream, name: str, on_broken: Callable[[_Stream], None], stall_s: float) -> None:
        self._stream = stream
        self._stall_s = stall_s
        self._on_broken = on_broken
        self._lock = threading.Lock()  # guards _alive, _running, and _queue/_sent against failure draining
        self._order = threading.Lock()  # held across "record as sent" + send, so replies match _sent's order
        self._alive = True
        self._landing = threading.Lock()  # held while a read payload is received into user memory (an abort waits for it)
        self._receiving: _Chunk | None = None  # the chunk whose read payload is being received (under _lock)
        self._running = 2  # threads still using the socket; the last one out closes it
        self._queue: queue.SimpleQueue[_Chunk | None] = queue.SimpleQueue()
        self._sent: collections.deque[_Chunk] = collections.deque()
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"hmc-staged-tx-{name}", daemon=True),
            threading.Thread(target=self._receive_loop, name=f"hmc-staged-rx-{name}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def alive(self) -> bool:
        return self._alive

    def put(self, chunk: _Chunk) -> bool:
        """Queue a chunk (its transfer learns the stream, to abort it); False when the stream died meanwhile (the
        caller picks another)."""
        with self._lock:
            if self._alive:
                self._queue.put(chunk)
                if self not in chunk.transfer.streams:
                    chunk.transfer.streams.append(self)
            return self._alive

    def _exit(self) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            self._stream.close()

    def _send_loop(self) -> None:
        try:
            self._send_chunks()
        finally:
            self._exit()

    def _send_chunks(self) -> None:
        while True:
            chunk = self._queue.get()
            if chunk is None:
                return
            request = chunk.transfer.request
            if request.completion.cancelled:
                continue
            error = self._send(chunk)
            if error is not None:
                self._fail(error)
                return

    def _send(self, chunk: _Chunk) -> HMCError | None:
        frame = chunk.frame(self._stream)
        with self._order:
            chunk.sent_at = time.monotonic()
            with self._lock:
                if chunk.transfer.aborted:  # ended meanwhile: never sent (an abort checks _sent under this lock)
                    return None
                self._sent.append(chunk)
            try:
                self._stream.send(frame, chunk.payload(), deadline=chunk.sent_at + self._stall_s)
            except HMCError as exc:
                return exc
        return None

    def _receive_loop(self) -> None:
        try:
            while True:
                try:
                    frame = self._stream.recv(time.monotonic() + _TICK_S, idle_ok=True)
                except TimeoutError:
                    self._check_overdue()
                    continue
                self._on_reply(frame)
        except HMCError as exc:
            self._fail(exc)
        finally:
            self._exit()

    def _check_overdue(self) -> None:
        with self._lock:
            oldest = self._sent[0] if self._sent else None
        if oldest is not None and time.monotonic() > oldest.sent_at + self._stall_s:
            raise TimeoutError(f"the peer acknowledged nothing for {self._stall_s:g}s")

    def _on_reply(self, frame: peer_pb2.PeerFrame) -> None:
        if frame.WhichOneof("kind") != "reply":
            raise ProtocolError(f"expected a reply on a data stream, got {frame.WhichOneof('kind')}")
        with self._lock:
            if not self._sent:
                raise ProtocolError("reply without a request on a data stream")
            chunk = self._sent.popleft()
        request = chunk.transfer.request
        try:
            raise_for_reply(frame.reply)
        except HMCError as exc:
            request.completion.finish(exc)
            return
        if request.op is TransferOp.READ:
            if frame.reply.payload_bytes != chunk.ranges.total:
                raise ProtocolError(f"peer announced {frame.reply.payload_bytes} bytes for a {chunk.ranges.total}-byte read")
            deadline = min(request.deadline, time.monotonic() + self._stall_s)
            with self._landing:
                with self._lock:
                    landing = not chunk.transfer.aborted and not request.completion.cancelled
                    self._receiving = chunk if landing else None
                try:
                    if landing:
                        self._stream.recv_into(chunk.local_views(chunk.ranges.dst), deadline)
                    else:
                        self._stream.discard(chunk.ranges.total, deadline)
                        return
                finally:
                    self._receiving = None
        chunk.transfer.chunk_done(chunk.ranges.total)

    def abort_if_carrying(self, transfer: _Transfer) -> None:
        """Abort this stream if a chunk of `transfer` is in flight on it (sent and not answered, or its read payload
        being received); returns once no byte of it can land."""
        with self._lock:
            carrying = any(chunk.transfer is transfer for chunk in self._sent) or (
                self._receiving is not None and self._receiving.transfer is transfer
            )
        if carrying:
            self._fail(BrokenResourceError(f"data stream aborted: transfer {transfer.request.transfer_id} ended with chunks in flight"))

    def _fail(self, exc: HMCError) -> None:
        self._stream.abort()  # first: nothing the kernel still holds is sent, no payload lands, before anyone hears of it
        if self._landing.acquire(timeout=_LANDING_S):  # a read payload's receive was woken: wait until it let go
            self._landing.release()
        with self._lock:
            first = self._alive
            self._alive = False
            doomed = list(self._sent)
            self._sent.clear()
            while True:
                try:
                    chunk = self._queue.get_nowait()
                except queue.Empty:
                    break
                if chunk is not None:
                    doomed.append(chunk)
            self._queue.put(None)  # wake the sender so it exits
        error = exc if isinstance(exc, (TimeoutError, BrokenResourceError)) else BrokenResourceError(f"data stream failed: {exc}")
        for chunk in doomed:
            if not chunk.transfer.aborted:  # an aborted transfer's handle reports its own end (timeout, cancel)
                chunk.transfer.request.completion.finish(error)
        if first:
            self._on_broken(self)

    def close(self) -> None:
        self._fail(BrokenResourceError("the staged path was closed"))
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(_JOIN_S)


class _RoundTrip:
    """A round-trip connection and the single-range request frames it reuses (see `inline()`): used by one caller
    at a time, so a frame is filled in and sent without building messages."""

    __slots__ = ("frames", "stream")

    def __init__(self, stream: FrameStream) -> None:
        self.stream = stream
        self.frames: dict[tuple[str, bool], tuple[peer_pb2.PeerFrame, Any, common_pb2.RangeList]] = {}
        """Per (remote buffer id, write): the frame, its request and its range list, proving the key on this connection."""

    def single(self, remote: common_pb2.BufferDescriptor, write: bool, offset: int, length: int, deadline: float) -> bytes:
        """The serialized request for one range at `offset` of `remote` (written or read), expiring at `deadline`."""
        cached = self.frames.get((remote.id, write))
        if cached is None:
            if len(self.frames) >= _FRAMES_KEPT:
                self.frames.clear()
            frame = peer_pb2.PeerFrame()
            request = frame.write if write else frame.read
            request.buffer_id, request.key_proof = remote.id, self.stream.proof(remote.access_key)
            cached = self.frames[(remote.id, write)] = (frame, request, request.ranges)
        frame, request, ranges = cached
        if write:
            ranges.dst_offsets = _I64.pack(offset)
        else:
            ranges.src_offsets = _I64.pack(offset)
        ranges.lengths = _I64.pack(length)
        request.expires_ms = expires_ms(deadline)
        return frame.SerializeToString()


class _Pipe:
    """The streams to one peer agent, dealt chunks round-robin, and its round-trip connections."""

    def __init__(self) -> None:
        self.streams: list[_Stream] = []
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
        chunks = request.ranges.chunks(max(self._chunk_bytes, min(-(-total // len(streams)), _STREAM_CHUNK_MAX)), _FRAME_RANGES)
        request.completion.set_running()
        transfer = _Transfer(request, len(chunks))
        request.completion.on_cancel = transfer.abort
        for index, ranges in enumerate(chunks):
            chunk = _Chunk(transfer, ranges)
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
            request.completion.finish(_stream_error(exc))
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
                raise _stream_error(exc) from exc
            self._give_back(owner, pipe, connection, broken=False)
            raise_for_reply(reply)

        def write(local_offset: int, remote_offset: int, length: int) -> None:
            run(True, local_offset, remote_offset, length)

        def read(local_offset: int, remote_offset: int, length: int) -> None:
            run(False, local_offset, remote_offset, length)

        return InlineCopy(write=write, read=read, local_size=local.size, remote_size=remote.size, max_bytes=self._round_trip_bytes, waits=True)

    def _streams_for(self, remote: common_pb2.BufferDescriptor, deadline: float) -> tuple[list[_Stream], int]:
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

    def _open(self, remote: common_pb2.BufferDescriptor, deadline: float, pipe: _Pipe) -> _Stream:
        stream = self._connect(remote, deadline)
        name = f"{remote.owner.id[:8]}-{len(pipe.streams)}"

        def broken(dead: _Stream) -> None:
            with self._lock:
                if dead in pipe.streams:
                    pipe.streams.remove(dead)

        return _Stream(stream, name, broken, self._stall_s)

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
