"""The owner side of the staged ring paths: one data connection's slot hand-offs, copied and answered in order.

A slot's copy is queued on the GPU's stream as soon as its frame arrives, behind the copies of earlier
frames, so the GPU never waits for a reply to go out or the next frame to be read; a completion
thread per connection waits for the copies in frame order and sends the replies (the initiator
matches replies by order). A small chunk (up to `SMALL_BYTES`) or a transfer's last chunk (nothing of
it follows: a single-range request from the mailbox, a frame marked `last`) with nothing queued before
it is answered by the thread that read its frame: one thread hand-off less, which a transfer of one
chunk otherwise pays on top of its two copies. Every copy is bounded by `_OWNER_COPY_S`.
The connection's frames are read, checked and handed here by `_staged_serve`.

A copy that misses its bound (`StuckCopy`: a hung GPU) may still run: its chunk is answered with the error, but
the buffer it touches stays held (the owner's `unregister` then says its memory must be kept) and the rings stay
pinned (never unpinned or unmapped here), as the initiator abandons its ring; the copies queued after it are looked
at once (those behind it on its stream fail the same way), and the connection takes no new copy. A drain or a close
that times out with copies still queued keeps the rings the same way, as nothing then says those copies will not run.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from hmc.errors import DeviceError, HMCError, ProtocolError, TimeoutError
from hmc.transport._pinned import PinnedMapping, SlotCopier, StuckCopy, no_wait
from hmc.transport._staged_mailbox import MAILBOX_BYTES, SUPPORTED, Mailbox, token_of
from hmc.transport._staged_rings import RING_NAME, ring_dirs
from hmc.transport._staged_shm import SMALL_BYTES
from hmc.transport._wire import OK_FRAME, FrameStream, error_reply
from hmc.v1 import peer_pb2

__all__ = ["OwnerSegments"]

_log = logging.getLogger(__name__)
_OWNER_COPY_S = 30.0
"""Bound on one slot's copy on the owner (a GPU that takes longer fails that chunk)."""
_OWNER_DEPTH = 64
"""Slot copies one owner connection keeps queued (an initiator hands off at most its ring's slot count)."""
_MAX_SEGMENTS = 4
"""Segments one owner connection keeps mapped (an initiator uses one per connection)."""
_JOIN_S = 2.0
_OK = peer_pb2.PeerReply()
_STUCK_HOLDS: list[Callable[[], None]] = []
"""The releases of copies that missed their bound and may still run, never called: the buffers they touch stay held,
their bounce slots referenced (so never unmapped or unpinned), for the life of the process."""
ReplyTo = Callable[[peer_pb2.PeerReply], None]
"""Where a request's reply goes when not on the connection: its mailbox (`_staged_mailbox.Mailbox.replier`)."""


class _Queued:
    """One slot hand-off the owner answers in frame order: a copy to wait for, or a reply ready to send.

    `payload`: what follows a successful copy's reply (a read's bytes, sent from a bounce slot); `reply_to`: where
    the reply goes instead of the connection (a request taken from the mailbox)."""

    __slots__ = ("deadline", "payload", "release", "reply", "reply_to", "request_id", "wait")

    def __init__(
        self,
        request_id: int,
        wait: Callable[[float], None],
        reply: peer_pb2.PeerReply | None,
        release: Callable[[], None],
        payload: memoryview | None = None,
        reply_to: ReplyTo | None = None,
    ) -> None:
        self.request_id = request_id
        self.wait = wait
        self.reply = reply
        self.release = release
        self.payload = payload
        self.reply_to = reply_to
        self.deadline = time.monotonic() + _OWNER_COPY_S


class OwnerSegments:
    """Owner side of one data connection: the rings its initiator named (mapped on first use) and the slot copies in flight.

    A slot's copy is queued on the GPU's stream as soon as its frame arrives, behind
    the copies of earlier frames, so the copy engine never waits for a reply to go out
    or the next frame to be read. A completion thread ("hmc-staged-shm-owner") waits
    for the copies in frame order and sends each reply (the initiator matches replies
    by order); a reply that needs no copy (a refusal, host memory copied on the spot)
    is sent by the caller when nothing is queued before it.
    """

    def __init__(self, stream: FrameStream) -> None:
        self._stream = stream
        self._mappings: collections.OrderedDict[str, PinnedMapping] = collections.OrderedDict()
        self._copier: SlotCopier | None = None
        self._cond = threading.Condition()  # guards _queue, _thread, _closed
        self._queue: collections.deque[_Queued] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stuck = False
        """A copy missed its bound: the GPU stream behind it is blocked, and what its copies touch is kept."""
        self.mailbox: Mailbox | None = None
        """The mailbox of the ring last named with one (`_staged_mailbox`): polled by the connection's thread."""
        self._mailbox_at: tuple[str, int] = ("", 0)

    def slot(self, shm: peer_pb2.ShmSlot, nbytes: int) -> PinnedMapping:
        """The ring holding `nbytes` at `shm.offset` (its mailbox attached, when it names one this machine can use);
        ProtocolError when the slot is malformed."""
        if shm.offset + nbytes > shm.segment_bytes:
            raise ProtocolError("a staging slot reaches past its ring")
        mapping = self._mappings.get(shm.segment)
        if mapping is None or mapping.size != shm.segment_bytes:
            mapping = self._map(shm)
        if shm.mailbox and SUPPORTED and self._mailbox_at != (shm.segment, shm.mailbox):
            if shm.mailbox % 64 or shm.mailbox + MAILBOX_BYTES > shm.segment_bytes:
                raise ProtocolError("a staging ring's mailbox lies outside it")
            mailbox = Mailbox(mapping.view(shm.mailbox, MAILBOX_BYTES))
            if mailbox.attach(token_of(self._stream)):  # offered to this connection: not another's ring
                self.drain()  # copies queued from the old mailbox answer there: it stays open until they did
                self._forget_mailbox()
                self.mailbox, self._mailbox_at = mailbox, (shm.segment, shm.mailbox)
            else:
                mailbox.close()
        return mapping

    def _map(self, shm: peer_pb2.ShmSlot) -> PinnedMapping:
        """Map the ring a slot names (replacing an older mapping of that name), after checking its name."""
        directory, name = os.path.split(shm.segment)
        if not RING_NAME.fullmatch(name) or directory not in ring_dirs():
            raise ProtocolError(f"{shm.segment!r} is not a staging ring")
        self._unmap(shm.segment)  # first: a new mapping would be lost (collected while pinned) were this to fail
        try:
            mapping = PinnedMapping(shm.segment, shm.segment_bytes, create=False)
        except (OSError, ValueError) as exc:  # ValueError: mmap of an empty file, or of one shrunk since its size was checked
            raise ProtocolError(f"cannot map staging ring {shm.segment}: {exc}") from exc
        self._mappings[shm.segment] = mapping
        while len(self._mappings) > _MAX_SEGMENTS:
            self._unmap(next(iter(self._mappings)))
        return mapping

    def _unmap(self, segment: str) -> None:
        """Unmap a ring and its mailbox, once no copy queued may touch them (a queued copy may answer in the mailbox);
        one a copy may still touch (stuck, or still queued at the drain's deadline) is kept for good instead."""
        old = self._mappings.get(segment)
        if old is not None or self._mailbox_at[0] == segment:
            try:
                self.drain()
            except TimeoutError:
                if old is not None:
                    self._stuck = True  # the copies still queued may run on: nothing of this connection is let go of
                    self._let_go_of(self._mappings.pop(segment))
                raise
        if self._mailbox_at[0] == segment:
            self._forget_mailbox()
        if old is not None:
            self._let_go_of(self._mappings.pop(segment))

    def _let_go_of(self, ring: PinnedMapping) -> None:
        """Unpin and unmap a ring no copy uses any more; keep it for good once a copy is stuck (it may reach it)."""
        if self._stuck:
            ring.abandon()
        else:
            ring.close()

    def mailbox_ring(self) -> tuple[PinnedMapping, int]:
        """The ring whose mailbox is attached and the bytes before its page (its slots), for a request taken there."""
        segment, page = self._mailbox_at
        return self._mappings[segment], page

    def _forget_mailbox(self) -> None:
        """Stop using the mailbox (its ring is about to be unmapped), saying so to an initiator still looking."""
        if self.mailbox is not None:
            self.mailbox.awake(False)
            self.mailbox.close()
        self.mailbox, self._mailbox_at = None, ("", 0)

    def start(
        self,
        request_id: int,
        region: Any,
        offsets: Any,
        lengths: Any,
        slot: PinnedMapping,
        at: int,
        *,
        total: int,
        to_slot: bool,
        release: Callable[[], None],
        payload: memoryview | None = None,
        reply_to: ReplyTo | None = None,
        last: bool = False,
    ) -> None:
        """Queue the copy between `slot` (from byte `at`) and the region's ranges (`total` bytes); its reply (followed by `payload`,
        the slot's bytes, when given) goes out once it finished (to `reply_to` when given), then `release()` runs.
        A small copy, or the `last` of its transfer, with nothing queued before it is waited for and answered right
        here (no hand-off to the completion thread: no frame of its transfer follows for this thread to read)."""
        if self._copier is None:
            self._copier = SlotCopier()
        try:
            if self._stuck:
                raise DeviceError("a staging copy is stuck on this connection's GPU stream: it takes no more")
            wait = self._copier.start(region, offsets, lengths, slot, at, to_slot=to_slot, deadline=time.monotonic() + _OWNER_COPY_S)
        except HMCError as exc:
            self._let_go(exc, release)
            self.reply(request_id, error_reply(exc), reply_to)
            return
        if wait is no_wait and payload is None:
            release()
            self.reply(request_id, _OK, reply_to)
            return
        if total <= SMALL_BYTES or last:
            with self._cond:
                idle = not self._queue  # only this thread queues: nothing can slip in before the reply below
            if idle:
                self._answer(_Queued(request_id, wait, None, release, payload, reply_to))
                return
        try:
            self._push(_Queued(request_id, wait, None, release, payload, reply_to))
        except HMCError:
            try:  # the copy was queued: let it end before the slot and buffer go
                self._wait(wait, time.monotonic() + _OWNER_COPY_S)
            except HMCError as exc:
                self._let_go(exc, release)
                raise
            release()
            raise

    def _wait(self, wait: Callable[[float], None], deadline: float) -> None:
        """Wait for a queued copy; once one is stuck, only look (StuckCopy at once unless it already finished: one
        queued behind the stuck copy cannot have, one queued before it on another stream may)."""
        wait(time.monotonic() if self._stuck else deadline)

    def _answer(self, item: _Queued) -> None:
        """Wait for a queued copy, send its reply, then let go of what it touched, unless the copy may still run."""
        failed: BaseException | None = None
        try:
            self._wait(item.wait, item.deadline)
            reply, payload = _payload_reply(item.payload)
        except Exception as exc:  # noqa: BLE001 - a driver failure still answers its chunk
            failed, reply, payload = exc, error_reply(exc), None
        try:
            self._send(item.request_id, reply, payload, item.reply_to)
        finally:
            self._let_go(failed, item.release)

    def _let_go(self, failed: BaseException | None, release: Callable[[], None]) -> None:
        """Release what a copy touched (its buffer, a bounce slot) once it ended, or `failed`, unless it may still run
        (StuckCopy): then the connection is stuck, and what it touched is kept for good (`_STUCK_HOLDS`)."""
        if not isinstance(failed, StuckCopy):
            release()
            return
        if not self._stuck:
            _log.warning("a staging copy is stuck on the GPU: the buffers of its connection stay held, its rings pinned")
        self._stuck = True
        _STUCK_HOLDS.append(release)

    def reply(self, request_id: int, reply: peer_pb2.PeerReply, reply_to: ReplyTo | None = None) -> None:
        """Send `reply` (to `reply_to` when given) after the replies of the copies queued before it."""
        with self._cond:
            if self._queue:
                self._push_locked(_Queued(request_id, no_wait, reply, _keep, reply_to=reply_to))
                return
        self._send(request_id, reply, reply_to=reply_to)

    def _push(self, item: _Queued) -> None:
        with self._cond:
            self._push_locked(item)

    def _push_locked(self, item: _Queued) -> None:
        if not self._cond.wait_for(lambda: len(self._queue) < _OWNER_DEPTH, max(item.deadline - time.monotonic(), 0.0)):
            raise TimeoutError("the owner's staging copies did not drain before the deadline")
        self._queue.append(item)
        if self._thread is None:
            self._thread = threading.Thread(target=self._complete, name="hmc-staged-shm-owner", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _complete(self) -> None:
        """Wait for each queued copy in order and send its reply; exits once closed and drained."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                item = self._queue[0]
            if item.reply is None:
                self._answer(item)
            else:
                self._send(item.request_id, item.reply, reply_to=item.reply_to)
            with self._cond:
                self._queue.popleft()
                self._cond.notify_all()

    def _send(self, request_id: int, reply: peer_pb2.PeerReply, payload: memoryview | None = None, reply_to: ReplyTo | None = None) -> None:
        try:
            if reply_to is not None:
                reply_to(reply)
            elif reply is _OK and not request_id:
                self._stream.send_framed(OK_FRAME)
            elif payload is None:
                self._stream.send(peer_pb2.PeerFrame(request_id=request_id, reply=reply))
            else:
                self._stream.send(peer_pb2.PeerFrame(request_id=request_id, reply=reply), [payload], deadline=time.monotonic() + _OWNER_COPY_S)
        except HMCError as exc:  # the connection broke: its receive loop (`_staged_serve`) ends it
            _log.debug("a staging reply was not sent: %s", exc)

    def drain(self) -> None:
        """Wait until every queued copy finished and its reply went out (each copy is bounded by its deadline)."""
        with self._cond:
            last = self._queue[-1].deadline if self._queue else 0.0
            if not self._cond.wait_for(lambda: not self._queue, max(last - time.monotonic(), 0.0) + _JOIN_S):
                raise TimeoutError("the owner's staging copies did not finish before their deadline")

    def close(self) -> None:
        """Let the queued copies finish (bounded), then unmap the rings."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(_OWNER_COPY_S + _JOIN_S)
            if thread.is_alive():  # still answering (a reply that does not go out): its copies may still run
                self._stuck = True
        self._forget_mailbox()
        for mapping in self._mappings.values():
            self._let_go_of(mapping)
        self._mappings.clear()
        if self._copier is not None and not (thread is not None and thread.is_alive()):
            self._copier.close()  # leaves what a stuck copy still uses allocated


def _keep() -> None:
    """The `release` of a reply that holds nothing."""


def _payload_reply(payload: memoryview | None) -> tuple[peer_pb2.PeerReply, memoryview | None]:
    """The reply to a finished copy: plain, or announcing the `payload` that follows it."""
    return (_OK, None) if payload is None else (peer_pb2.PeerReply(payload_bytes=payload.nbytes), payload)
