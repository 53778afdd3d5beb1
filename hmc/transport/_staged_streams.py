"""The `staged` path's pipelined data streams for host memory (see `hmc.transport._staged`, which deals them chunks).

A `DataStream` is one data connection with a sender thread, which writes chunks' frames (and a write's
payload) back to back without waiting for acknowledgements, and a receiver thread, which takes the owner's
replies in order (and a read's payload, straight into the destination). A `Transfer` counts its chunks
down to completion; when it ends early (deadline, cancel) it aborts the streams carrying its chunks
(`FrameStream.abort`: nothing the kernel still holds is sent, no payload lands) before its handle reports
the end. Each frame is built right before its send, so the deadline it carries is what is left then; a chunk
whose deadline passed is never sent (its transfer is aborted and fails with TimeoutError). A stream that
breaks or makes no progress for `stall_s` fails every chunk queued or in flight on it
(`BrokenResourceError`: their callers may retry) and tells its pipe to replace it.

Concurrency: a stream's queue and in-flight deque are shared by its two threads and the callers that
queue chunks, guarded by its `_lock`; its `_order` lock keeps "build the frame", "record as sent" and "send"
together, so replies match `_sent`'s order; `_landing` is held while a read payload is received into user memory.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from hmc.errors import BrokenResourceError, HMCError, ProtocolError, TimeoutError
from hmc.transport._base import TransferOp, TransferRequest
from hmc.transport._ranges import RangeList
from hmc.transport._deadlines import shares_clock, stamp
from hmc.transport._wire import FrameStream, raise_for_reply
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["Chunk", "DataStream", "Transfer", "request_frame", "request_views", "stream_error"]

_TICK_S = 0.25
"""How often an idle stream's receiver looks at its oldest unanswered chunk (the stall bound)."""
_JOIN_S = 2.0
_LANDING_S = 2.0
"""How long an abort waits for a read payload's receive to let go of user memory (it is woken at once)."""


class Transfer:
    """Counts one request's chunks down to completion; aborts the streams carrying them when it ends early."""

    __slots__ = ("aborted", "left", "lock", "request", "streams")

    def __init__(self, request: TransferRequest, chunks: int) -> None:
        self.request = request
        self.left = chunks
        self.lock = threading.Lock()  # guards `left`
        self.aborted = False
        """Set once the transfer ended early: its chunks are not sent any more (read under each stream's lock)."""
        self.streams: list[DataStream] = []
        """The streams its chunks were dealt to."""

    def abort(self) -> None:
        """The handle's cancel hook: no chunk of this transfer is sent or lands after this returns."""
        self.aborted = True
        for stream in list(self.streams):
            stream.abort_if_carrying(self)

    def expire(self) -> None:
        """Its deadline passed before a chunk of it could be sent: abort it (nothing of it lands after this), then
        fail it with TimeoutError."""
        self.abort()
        self.request.completion.finish(TimeoutError(f"transfer {self.request.transfer_id} reached its deadline before all its chunks were sent"))

    def chunk_done(self, nbytes: int) -> None:
        completion = self.request.completion
        completion.add_bytes(nbytes)
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            completion.finish()


class Chunk:
    __slots__ = ("ranges", "sent_at", "transfer")

    def __init__(self, transfer: Transfer, ranges: RangeList) -> None:
        self.transfer = transfer
        self.ranges = ranges
        self.sent_at = 0.0

    def local_views(self, local_offsets: Any) -> list[memoryview]:
        return request_views(self.transfer.request, local_offsets, self.ranges.lengths)

    def frame(self, stream: FrameStream) -> peer_pb2.PeerFrame:
        return request_frame(self.transfer.request, self.ranges, stream)

    def payload(self) -> list[memoryview]:
        """A WRITE's payload: views of its source ranges (copied into the socket), none for a READ."""
        request = self.transfer.request
        if request.op is not TransferOp.WRITE:
            return []
        return request_views(request, self.ranges.src, self.ranges.lengths)


def request_views(request: TransferRequest, local_offsets: Any, lengths: Any) -> list[memoryview]:
    view = request.local.view
    return [view[o : o + n] for o, n in zip(local_offsets.tolist(), lengths.tolist())]


def request_frame(request: TransferRequest, ranges: RangeList, stream: FrameStream) -> peer_pb2.PeerFrame:
    """The DataWrite or DataRead asking for `ranges` of the request on `stream` (a write's payload goes after it)."""
    lengths = ranges.lengths.tobytes()
    remote = request.remote
    proof, tid = stream.proof(remote.access_key, remote.registry_epoch), request.transfer_id
    if request.op is TransferOp.WRITE:
        wire = common_pb2.RangeList(dst_offsets=ranges.dst.tobytes(), lengths=lengths)
        write = peer_pb2.DataWrite(buffer_id=remote.id, key_proof=proof, ranges=wire, transfer_id=tid)
        return peer_pb2.PeerFrame(write=stamp(write, request.deadline, shares_clock(remote)))
    wire = common_pb2.RangeList(src_offsets=ranges.src.tobytes(), lengths=lengths)
    read = peer_pb2.DataRead(buffer_id=remote.id, key_proof=proof, ranges=wire, transfer_id=tid)
    return peer_pb2.PeerFrame(read=stamp(read, request.deadline, shares_clock(remote)))


def stream_error(exc: HMCError) -> HMCError:
    """What a caller sees of a failed data connection (the connection is dropped)."""
    return exc if isinstance(exc, (TimeoutError, BrokenResourceError)) else BrokenResourceError(f"data connection failed: {exc}")


class DataStream:
    """One data connection with its sender and receiver threads."""

    def __init__(self, stream: FrameStream, name: str, on_broken: Callable[[DataStream], None], stall_s: float) -> None:
        self._stream = stream
        self._stall_s = stall_s
        self._on_broken = on_broken
        self._lock = threading.Lock()  # guards _alive, _running, and _queue/_sent against failure draining
        self._order = threading.Lock()  # held across build + "record as sent" + send, so replies match _sent's order
        self._alive = True
        self._landing = threading.Lock()  # held while a read payload is received into user memory (an abort waits for it)
        self._receiving: Chunk | None = None  # the chunk whose read payload is being received (under _lock)
        self._running = 2  # threads still using the socket; the last one out closes it
        self._queue: queue.SimpleQueue[Chunk | None] = queue.SimpleQueue()
        self._sent: collections.deque[Chunk] = collections.deque()
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"hmc-staged-tx-{name}", daemon=True),
            threading.Thread(target=self._receive_loop, name=f"hmc-staged-rx-{name}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def alive(self) -> bool:
        return self._alive

    def put(self, chunk: Chunk) -> bool:
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

    def _send(self, chunk: Chunk) -> HMCError | None:
        with self._order:
            try:  # built right before its send (not under `_lock`, which the receiver takes): its deadline is what is left now
                frame: peer_pb2.PeerFrame | None = chunk.frame(self._stream)
            except TimeoutError:
                frame = None
            with self._lock:
                if chunk.transfer.aborted:  # ended meanwhile: never sent (an abort checks _sent under this lock)
                    return None
                if frame is not None:
                    chunk.sent_at = time.monotonic()
                    self._sent.append(chunk)
            if frame is not None:
                try:
                    self._stream.send(frame, chunk.payload(), deadline=chunk.sent_at + self._stall_s)
                except HMCError as exc:
                    return exc
                return None
        chunk.transfer.expire()  # outside the locks: its abort may fail this stream
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

    def abort_if_carrying(self, transfer: Transfer) -> None:
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
