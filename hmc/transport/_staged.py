"""The `staged` path: TCP data streams between any two agents, chunked and pipelined.

Per peer agent, `streams` data connections are opened lazily on first use, kept
and reused (large SO_SNDBUF/SO_RCVBUF, TCP_NODELAY, set by the connector). A
transfer's coalesced ranges are cut into chunks of about `chunk_bytes` and dealt
round-robin over the streams. Each stream has a sender thread that writes
frames back to back without waiting for acknowledgements, and a receiver thread
that collects the owner's replies in order: the pipeline stays full.

WRITE sends `DataWrite` + the payload straight from registered memory
(`sendmsg` of memoryviews); the owner bounds-checks the ranges and the access
key before receiving into its buffer. READ sends `DataRead`; the owner answers
with a reply announcing `payload_bytes` and the bytes follow, received straight
into the destination (`recvmsg_into`). No intermediate copy on either side.

Deadlines and failures: a transfer's deadline is enforced by its handle; a
stream is torn down only when the connection breaks or makes no progress for
`stall_s`, because one transfer expiring must not fail the others queued
behind it. A torn-down stream fails every chunk queued or in flight on it and
is replaced on the next transfer. Chunks of a transfer that already expired or
was cancelled are skipped, and read payloads for it are discarded, never
written into user memory.

Concurrency: `post()` runs on the caller's thread (it may open connections
within the request's deadline) and only enqueues, except that a small
single-chunk transfer is sent right there. Each stream's queue and in-flight
deque are shared by its threads and such callers, guarded by the stream's lock;
its `_order` lock keeps "record as sent" and "send" together.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from hmc.errors import BrokenResourceError, HMCError, ProtocolError, TimeoutError, UnsupportedError
from hmc.memory import DeviceKind, MemoryKind
from hmc.transport._base import Capabilities, PathName, TransferOp, TransferRequest, Transport
from hmc.transport._ranges import RangeList
from hmc.transport._wire import FrameStream, raise_for_reply
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["StagedTransport"]

_TICK_S = 0.25
_INLINE_SEND_BYTES = 256 << 10
"""A transfer of one chunk up to this size is sent by the caller's thread, not the stream's sender."""
_JOIN_S = 2.0
_HOST_KINDS = (common_pb2.DEVICE_KIND_UNSPECIFIED, common_pb2.DEVICE_KIND_HOST)

Connect = Callable[[common_pb2.AgentInfo, float], FrameStream]


class _Transfer:
    """Counts one request's chunks down to completion."""

    __slots__ = ("left", "lock", "request")

    def __init__(self, request: TransferRequest, chunks: int) -> None:
        self.request = request
        self.left = chunks
        self.lock = threading.Lock()  # guards `left`

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
        view = self.transfer.request.local.view
        return [view[o : o + n] for o, n in zip(local_offsets.tolist(), self.ranges.lengths.tolist())]

    def frame(self) -> tuple[peer_pb2.PeerFrame, list[memoryview]]:
        request, ranges = self.transfer.request, self.ranges
        lengths = ranges.lengths.tobytes()
        if request.op is TransferOp.WRITE:
            wire = common_pb2.RangeList(dst_offsets=ranges.dst.tobytes(), lengths=lengths)
            frame = peer_pb2.PeerFrame(write=peer_pb2.DataWrite(buffer_id=request.remote.id, access_key=request.remote.access_key, ranges=wire))
            return frame, self.local_views(ranges.src)
        wire = common_pb2.RangeList(src_offsets=ranges.src.tobytes(), lengths=lengths)
        return peer_pb2.PeerFrame(read=peer_pb2.DataRead(buffer_id=request.remote.id, access_key=request.remote.access_key, ranges=wire)), []


class _Stream:
    """One data connection with its sender and receiver threads."""

    def __init__(self, stream: FrameStream, name: str, on_broken: Callable[[_Stream], None], stall_s: float) -> None:
        self._stream = stream
        self._stall_s = stall_s
        self._on_broken = on_broken
        self._lock = threading.Lock()  # guards _alive, _running, and _queue/_sent against failure draining
        self._order = threading.Lock()  # held across "record as sent" + send, so replies match _sent's order
        self._alive = True
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
        """Queue a chunk; False when the stream died meanwhile (the caller picks another)."""
        with self._lock:
            if self._alive:
                self._queue.put(chunk)
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
        frame, payload = chunk.frame()
        with self._order:
            chunk.sent_at = time.monotonic()
            with self._lock:
                self._sent.append(chunk)
            try:
                self._stream.send(frame, payload, deadline=chunk.sent_at + self._stall_s)
            except HMCError as exc:
                return exc
        return None

    def send_now(self, chunk: _Chunk) -> bool:
        """Send a small chunk on the caller's thread (one thread hand-off less); False if the stream is dead."""
        if not self._alive:
            return False
        error = self._send(chunk)
        if error is not None:
            self._fail(error)  # fails the chunk with the rest of the stream
        return True

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
            if request.completion.cancelled:
                self._stream.discard(chunk.ranges.total, time.monotonic() + self._stall_s)
                return
            self._stream.recv_into(chunk.local_views(chunk.ranges.dst), time.monotonic() + self._stall_s)
        chunk.transfer.chunk_done(chunk.ranges.total)

    def _fail(self, exc: HMCError) -> None:
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
            chunk.transfer.request.completion.finish(error)
        self._stream.shutdown()
        if first:
            self._on_broken(self)

    def close(self) -> None:
        with self._lock:
            self._alive = False
            self._queue.put(None)
        self._stream.shutdown()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(_JOIN_S)


class _Pipe:
    """The streams to one peer agent, dealt chunks round-robin."""

    def __init__(self) -> None:
        self.streams: list[_Stream] = []
        self.next = 0
        self.opening = threading.Lock()  # one thread at a time opens this pipe's missing streams


class StagedTransport(Transport):
    """TCP streams between any two agents (initiator side; the owner side is the agent's server)."""

    def __init__(
        self,
        connect: Connect,
        *,
        streams: int = 4,
        chunk_bytes: int = 4 << 20,
        stall_s: float = 30.0,
        memory_kinds: frozenset[DeviceKind] = frozenset({DeviceKind.HOST}),
    ) -> None:
        """`memory_kinds`: what to declare. Device memory is declared so that negotiation picks this path where a
        real pair would (a cross-vendor pair, say), but is refused with UnsupportedError until the pinned-ring
        pipeline (device -> pinned ring -> wire -> pinned ring -> device) exists."""
        self._connect = connect
        self._stall_s = stall_s
        self._streams = max(1, streams)
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Lock()  # guards _pipes and each pipe's stream list
        self._pipes: dict[str, _Pipe] = {}
        self.capabilities = Capabilities(path=PathName.STAGED, memory_kinds=memory_kinds | {DeviceKind.HOST}, detail=f"tcp x{self._streams}")

    def post(self, request: TransferRequest) -> None:
        try:  # ranges were checked against the descriptor by the agent; the owner checks them again on receipt
            if request.local.region.kind is MemoryKind.DEVICE or request.remote.device.kind not in _HOST_KINDS:
                raise UnsupportedError(
                    "the staged path cannot move device memory yet (the pinned-ring pipeline is not built): "
                    f"{request.local.region.device.name} -> {request.remote.device.name or 'host'}"
                )
            streams, first = self._streams_for(request.remote.owner, request.deadline)
        except HMCError as exc:
            request.completion.finish(exc)
            return
        chunks = request.ranges.chunks(self._chunk_bytes) if len(request.ranges) else []
        if not chunks:
            request.completion.finish()
            return
        request.completion.set_running()
        transfer = _Transfer(request, len(chunks))
        inline = len(chunks) == 1 and chunks[0].total <= _INLINE_SEND_BYTES
        for index, ranges in enumerate(chunks):
            chunk = _Chunk(transfer, ranges)
            stream = streams[(first + index) % len(streams)]
            while not (stream.send_now(chunk) if inline else stream.put(chunk)):
                try:  # a stream died since we listed them: list again, opening replacements
                    streams, first = self._streams_for(request.remote.owner, request.deadline)
                except HMCError as exc:
                    request.completion.finish(exc)
                    return
                stream = streams[(first + index) % len(streams)]

    def _streams_for(self, owner: common_pb2.AgentInfo, deadline: float) -> tuple[list[_Stream], int]:
        with self._lock:
            pipe = self._pipes.setdefault(owner.id, _Pipe())
        with pipe.opening:
            with self._lock:
                pipe.streams = [s for s in pipe.streams if s.alive]
            while len(pipe.streams) < self._streams:
                stream = self._open(owner, deadline, pipe)
                with self._lock:
                    pipe.streams.append(stream)
        with self._lock:
            streams = list(pipe.streams)
            first = pipe.next
            pipe.next += 1
        return streams, first

    def _open(self, owner: common_pb2.AgentInfo, deadline: float, pipe: _Pipe) -> _Stream:
        stream = self._connect(owner, deadline)
        name = f"{owner.id[:8]}-{len(pipe.streams)}"

        def broken(dead: _Stream) -> None:
            with self._lock:
                if dead in pipe.streams:
                    pipe.streams.remove(dead)

        return _Stream(stream, name, broken, self._stall_s)

    def forget_peer(self, agent: common_pb2.AgentInfo) -> None:
        """Close the streams to an agent that went away."""
        with self._lock:
            pipe = self._pipes.pop(agent.id, None)
        for stream in pipe.streams if pipe else ():
            stream.close()

    def close(self) -> None:
        with self._lock:
            pipes, self._pipes = list(self._pipes.values()), {}
        for pipe in pipes:
            for stream in list(pipe.streams):
                stream.close()
