"""A control channel: request/reply PeerFrames in both directions over one FrameStream.

Either end may send requests (OpenBuffer, Notify, Withdrawn); a reply carries its
request's id. One reader thread per channel hands incoming requests to a handler,
whose return value (or typed error) is sent back, and incoming replies to the
waiting caller. When the connection breaks, every pending request fails with
BrokenResourceError and `on_close` runs once; requests whose deadline passes
fail with TimeoutError (checked every `_TICK_S`).

Concurrency: `request()`, `request_async()`, `request_each()` and `reply()` may be called from any
thread. The handler and every async callback run on the reader thread: they must
be quick and must never wait on this channel; a handler with a long job returns
`DEFERRED` and answers with `reply()` when it is done.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

from hmc.errors import BrokenResourceError, HMCError, ProtocolError, TimeoutError
from hmc.transport._wire import FrameStream, error_reply, raise_for_reply
from hmc.v1 import peer_pb2

__all__ = ["DEFERRED", "Channel", "ReplyCallback", "request_each"]

_log = logging.getLogger(__name__)
_TICK_S = 0.25

ReplyCallback = Callable[[peer_pb2.PeerReply | None, BaseException | None], None]
DEFERRED = peer_pb2.PeerReply()
"""A handler's answer meaning "I reply later, with `Channel.reply`" (for requests that take a while)."""
Handler = Callable[[peer_pb2.PeerFrame], peer_pb2.PeerReply]


class Channel:
    """Multiplexed request/reply over one connection, with a named reader thread."""

    def __init__(self, stream: FrameStream, handler: Handler, *, name: str, on_close: Callable[[Channel], None] | None = None) -> None:
        self.stream = stream
        self.name = name
        self._handler = handler
        self._on_close = on_close
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # protects _pending and _closed
        self._pending: dict[int, tuple[float, ReplyCallback]] = {}
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> Channel:
        """Run the reader loop on a new daemon thread named after the channel."""
        self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self._thread.start()
        return self

    @property
    def closed(self) -> bool:
        return self._closed

    def request_async(self, frame: peer_pb2.PeerFrame, deadline: float, callback: ReplyCallback) -> None:
        """Send a request; then `callback(reply, None)` or `callback(None, error)` runs exactly once (or this raises)."""
        request_id = next(self._ids)
        frame.request_id = request_id
        with self._lock:
            if self._closed:
                raise BrokenResourceError(f"channel {self.name} is closed")
            self._pending[request_id] = (deadline, callback)
        try:
            self.stream.send(frame, deadline=deadline)
        except HMCError:
            if self._take(request_id) is None:
                return  # the reader already failed it through the callback
            raise

    def request(self, frame: peer_pb2.PeerFrame, deadline: float) -> peer_pb2.PeerReply:
        """Send a request and wait for its reply (typed error if the reply carries one)."""
        (outcome,) = request_each([(self, frame)], deadline)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _take(self, request_id: int) -> ReplyCallback | None:
        with self._lock:
            entry = self._pending.pop(request_id, None)
        return None if entry is None else entry[1]

    def run(self) -> None:
        """The reader loop (runs until the connection breaks or the channel is closed)."""
        error: BaseException = BrokenResourceError(f"channel {self.name} closed")
        try:
            while True:
                try:
                    frame = self.stream.recv(time.monotonic() + _TICK_S, idle_ok=True)
                except TimeoutError:
                    self._expire()
                    continue
                self._dispatch(frame)
        except ProtocolError as exc:
            error = exc
            self._refuse(exc)
        except HMCError as exc:
            error = exc
        finally:
            self._shutdown(error)

    def _dispatch(self, frame: peer_pb2.PeerFrame) -> None:
        if frame.WhichOneof("kind") == "reply":
            callback = self._take(frame.request_id)
            if callback is not None:
                callback(frame.reply, None)
            return
        try:
            reply = self._handler(frame)
        except HMCError as exc:
            reply = error_reply(exc)
        except Exception as exc:  # a bug in a handler must not kill the connection silently
            _log.exception("channel %s: handler failed", self.name)
            reply = error_reply(exc)
        if reply is not DEFERRED:
            self.reply(frame.request_id, reply)

    def reply(self, request_id: int, reply: peer_pb2.PeerReply) -> None:
        """Answer a request (a deferred one from any thread); a broken connection is left to the reader."""
        try:
            self.stream.send(peer_pb2.PeerFrame(request_id=request_id, reply=reply), deadline=time.monotonic() + 5.0)
        except HMCError as exc:
            _log.debug("channel %s: reply %d not sent: %s", self.name, request_id, exc)

    def _refuse(self, exc: ProtocolError) -> None:
        """Tell the peer why we hang up (best effort; the stream may be unusable)."""
        try:
            self.stream.send(peer_pb2.PeerFrame(reply=error_reply(exc)), deadline=time.monotonic() + 1.0)
        except HMCError:
            pass

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [rid for rid, (deadline, _) in self._pending.items() if deadline <= now]
            callbacks = [self._pending.pop(rid)[1] for rid in late]
        for callback in callbacks:
            callback(None, TimeoutError(f"no reply from {self.stream.peer} before the deadline"))

    def _shutdown(self, error: BaseException) -> None:
        with self._lock:
            first = not self._closed
            self._closed = True
            callbacks = [callback for _, callback in self._pending.values()]
            self._pending.clear()
        broken = error if isinstance(error, BrokenResourceError) else BrokenResourceError(f"channel {self.name}: {error}")
        for callback in callbacks:
            callback(None, broken)
        self.stream.close()
        if first and self._on_close is not None:
            self._on_close(self)

    def close(self, timeout: float = 2.0) -> None:
        """Shut the connection down and join the reader; idempotent."""
        self.stream.shutdown()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)


def request_each(requests: Sequence[tuple[Channel, peer_pb2.PeerFrame]], deadline: float) -> list[peer_pb2.PeerReply | BaseException]:
    """Send every request on its channel at once, then wait until `deadline` for all the replies: for each, in order,
    its reply or the error it met (a refusal's typed error, the channel's end, TimeoutError). Each request has the
    whole of the deadline: one peer that does not answer costs the others nothing."""
    done = threading.Condition()
    outcomes: list[peer_pb2.PeerReply | BaseException | None] = [None] * len(requests)

    def finisher(index: int) -> ReplyCallback:
        def finish(reply: peer_pb2.PeerReply | None, error: BaseException | None) -> None:
            with done:
                outcomes[index] = error if error is not None else reply
                done.notify_all()

        return finish

    for index, (channel, frame) in enumerate(requests):
        try:
            channel.request_async(frame, deadline, finisher(index))
        except HMCError as exc:
            with done:
                outcomes[index] = exc
    with done:
        done.wait_for(lambda: None not in outcomes, max(deadline - time.monotonic(), 0.0))
        late = [index for index, outcome in enumerate(outcomes) if outcome is None]
    for index in late:
        channel, frame = requests[index]
        if channel._take(frame.request_id) is not None:
            with done:
                outcomes[index] = TimeoutError(f"no reply from {channel.stream.peer} before the deadline")
    with done:  # the rest were taken by their channel (a reply, its expiry, its end) just now: their callbacks run
        done.wait_for(lambda: None not in outcomes)
    results: list[peer_pb2.PeerReply | BaseException] = []
    for outcome in outcomes:
        assert outcome is not None
        if isinstance(outcome, peer_pb2.PeerReply):
            try:
                raise_for_reply(outcome)
            except HMCError as exc:
                outcome = exc
        results.append(outcome)
    return results
