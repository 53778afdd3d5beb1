"""Transfer handles, their states, and the notifications an owner receives.

A `TransferHandle` is what `Agent.write()`/`read()` return and what transports
complete (it implements `hmc.transport._base.Completion`). It is deliberately
cheap: slots, and a pre-acquired `_thread` lock as its completion latch
(released once, on finish) instead of a `threading.Event`; handles of transfers
that finished inline carry no latch at all.

A transport that can tell completion by looking at the device (a CUDA event)
hands the handle a `drive` callable (`drive_with`): `wait()` and `done()` then
poll it on the caller's thread, so the transfer completes there without a
hand-off to another thread; the transport keeps a slow backstop for handles
nobody waits on.

Deadlines: `wait()` with no timeout waits until the transfer's deadline; when it
passes, the transfer is failed with TimeoutError and its `on_cancel` hook runs
so the transport drops it. `wait(timeout)` shorter than the deadline raises
TimeoutError and leaves the transfer running.

Concurrency: any thread may finish, cancel, poll or wait; every state change
happens under the module's `_TRANSITION` lock, so a handle finishes exactly once.
"""

from __future__ import annotations

import _thread
import collections
import dataclasses
import enum
import functools
import itertools
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable

from hmc.errors import BusyResourceError, CancelledError, HMCError, TimeoutError
from hmc.transport._ranges import check_timeout
from hmc.v1 import common_pb2

__all__ = ["FINAL_STATES", "Notification", "NotificationInbox", "NotifyStep", "TransferHandle", "TransferState"]


class TransferState(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def to_proto(self) -> int:
        return _STATE_TO_PROTO[self]


_STATE_TO_PROTO = {
    TransferState.PENDING: common_pb2.TRANSFER_STATE_PENDING,
    TransferState.RUNNING: common_pb2.TRANSFER_STATE_RUNNING,
    TransferState.DONE: common_pb2.TRANSFER_STATE_DONE,
    TransferState.FAILED: common_pb2.TRANSFER_STATE_FAILED,
    TransferState.CANCELLED: common_pb2.TRANSFER_STATE_CANCELLED,
}
FINAL_STATES = frozenset({TransferState.DONE, TransferState.FAILED, TransferState.CANCELLED})
_DONE = TransferState.DONE
_TRANSITION = threading.Lock()  # guards every handle's state, error and bytes_done (tiny critical sections)
_SEQUENCE = itertools.count(1)
_new = object.__new__


@functools.cache
def _process_token() -> str:
    """Random per-process prefix making transfer ids unique across agents."""
    return secrets.token_hex(6)


os.register_at_fork(after_in_child=_process_token.cache_clear)  # a forked child must not reuse its parent's ids


@dataclasses.dataclass(frozen=True, slots=True)
class Notification:
    """Bytes a peer attached to a transfer, delivered to the owner after the data, exactly once."""

    buffer_id: str
    transfer_id: str
    payload: bytes
    sender_agent: str


class NotificationInbox:
    """The owner's queue of notifications, deduplicated by transfer id (exactly once), holding at most `max_bytes`
    of payload and `remember` notifications undrained: beyond that a notification is refused (BusyResourceError, its
    sender's transfer fails with it) rather than held, so an owner that stops draining cannot run out of memory."""

    def __init__(self, max_bytes: int, remember: int = 1 << 16) -> None:
        self._queue: queue.SimpleQueue[Notification] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _seen and _held
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._remember = remember
        self._max_bytes = max_bytes
        self._held = 0
        self._queued = 0

    def deliver(self, notification: Notification) -> bool:
        """Queue it unless this transfer id was delivered before; True when queued. BusyResourceError when it does not
        fit (nothing is remembered of it: the same transfer id may be delivered later)."""
        size = len(notification.payload)
        with self._lock:
            if notification.transfer_id in self._seen:
                return False
            if self._held + size > self._max_bytes or self._queued >= self._remember:
                raise BusyResourceError(
                    f"the owner holds {self._queued} notifications ({self._held} bytes) undrained: no room for {size} more bytes"
                    f" (at most {self._remember} and notify_inbox_bytes = {self._max_bytes})"
                )
            self._held += size
            self._queued += 1
            self._seen[notification.transfer_id] = None
            if len(self._seen) > self._remember:
                self._seen.popitem(last=False)
        self._queue.put(notification)
        return True

    def drain(self, timeout: float | None = 0) -> list[Notification]:
        """Everything queued; waits up to `timeout` (None: forever) for the first one."""
        out: list[Notification] = []
        try:
            out.append(self._queue.get(timeout=timeout) if timeout != 0 else self._queue.get_nowait())
            while True:
                out.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        if out:
            with self._lock:
                self._held -= sum(len(n.payload) for n in out)
                self._queued -= len(out)
        return out


class TransferHandle:
    """One transfer's progress: wait on it, poll it, or cancel it."""

    __slots__ = ("_id", "state", "path", "bytes_total", "bytes_done", "error", "deadline", "_latch", "on_cancel", "_drive")

    def __init__(self, path: str, bytes_total: int, deadline: float, transfer_id: str | None = None) -> None:
        self._id: str | int = transfer_id if transfer_id is not None else next(_SEQUENCE)
        self.state = TransferState.PENDING
        self.path = path
        self.bytes_total = bytes_total
        self.bytes_done = 0
        self.deadline = deadline
        self.error: BaseException | None = None
        self.on_cancel: Callable[[], None] | None = None
        """Run (once) when the transfer is cancelled or expires, so the transport drops it."""
        self._drive: Callable[[float], None] | None = None
        self._latch: _thread.LockType | None = _thread.allocate_lock()
        self._latch.acquire()

    @classmethod
    def finished(cls, path: str, nbytes: int) -> TransferHandle:
        """A handle for a transfer that already completed inline (the hot path's handle: three stores)."""
        handle = _new(_FinishedHandle)
        handle._id = next(_SEQUENCE)
        handle.path = path
        handle.bytes_total = nbytes
        return handle

    @property
    def id(self) -> str:
        if isinstance(self._id, int):
            self._id = f"{_process_token()}-{self._id}"
        return self._id

    def done(self) -> bool:
        """True once the transfer finished, failed or was cancelled (never blocks)."""
        if self.state in FINAL_STATES:
            return True
        drive = self._drive
        if drive is not None:
            drive(0.0)  # one look at the device; finishes the transfer if it is done
        return self.state in FINAL_STATES

    def wait(self, timeout: float | None = None) -> None:
        """Block until finished; raise the transfer's typed error, or TimeoutError (see module doc).

        `timeout` is None or seconds as `hmc.transport._ranges.check_timeout` takes them
        (finite, in (0, 1e6]); anything else raises ArgumentError and the transfer runs on.
        """
        if timeout is not None:
            timeout = check_timeout(timeout)
        latch = self._latch
        if latch is not None:
            now = time.monotonic()
            until_deadline = self.deadline - now
            limit = until_deadline if timeout is None else min(timeout, until_deadline)
            drive = self._drive
            if drive is not None and self.state not in FINAL_STATES:
                drive(now + limit)  # the transport completes it on this thread (no hand-off to another one)
                limit = limit - (time.monotonic() - now)
            if latch.acquire(timeout=max(limit, 0.0)):
                latch.release()
            elif timeout is not None and timeout < until_deadline:
                raise TimeoutError(f"transfer {self.id} still running after {timeout:.3f}s")
            else:
                self._stop(TimeoutError(f"transfer {self.id} missed its deadline"), TransferState.FAILED)
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        """Stop the transfer if it is still running (no effect once finished)."""
        self._stop(CancelledError(f"transfer {self.id} was cancelled"), TransferState.CANCELLED)

    def drive_with(self, drive: Callable[[float], None]) -> None:
        """Let `wait()`/`done()` complete the transfer on the caller's thread.

        `drive(deadline)` polls the transport's completion (returning at the latest
        at `deadline`, a monotonic time; a past one means a single look) and finishes
        the transfer when it is done. Any thread may call it, more than once.
        """
        self._drive = drive

    def _stop(self, error: BaseException, state: TransferState) -> None:
        with _TRANSITION:  # take the hook once: two threads that cancel (or expire) it together run it once
            if self.state in FINAL_STATES:  # (a handle born finished has no hook to take)
                return
            hook, self.on_cancel = self.on_cancel, None
        if hook is not None:
            hook()  # the transport stops the transfer (nothing of it lands afterwards) before its end is visible
        self._settle(error, state)

    # -- Completion protocol (called by transports) --------------------------------

    @property
    def cancelled(self) -> bool:
        """True once the transfer reached a final state; transports stop working on it."""
        return self.state in FINAL_STATES

    def set_running(self) -> None:
        with _TRANSITION:
            if self.state is TransferState.PENDING:
                self.state = TransferState.RUNNING

    def add_bytes(self, nbytes: int) -> None:
        with _TRANSITION:
            self.bytes_done += nbytes

    def finish(self, error: BaseException | None = None) -> None:
        """Complete the transfer (first call wins; later calls are ignored)."""
        if error is None:
            with _TRANSITION:
                if self.state not in FINAL_STATES:
                    self.bytes_done = self.bytes_total
            settled = self._settle(None, _DONE)
        else:
            settled = self._settle(error, TransferState.FAILED)
        if settled:
            self.on_cancel = None
            self._drive = None

    def _settle(self, error: BaseException | None, state: TransferState) -> bool:
        with _TRANSITION:
            if self.state in FINAL_STATES:
                return False
            self.state = state
            self.error = error
        if self._latch is not None:
            self._latch.release()
        return True

    def __repr__(self) -> str:
        return f"<TransferHandle {self.id} {self.path} {self.state.value} {self.bytes_done}/{self.bytes_total}>"


class _FinishedHandle(TransferHandle):
    """A handle born finished: the fields that never change are class attributes, not per-handle stores."""

    __slots__ = ()
    state = _DONE  # type: ignore[assignment]
    error = None  # type: ignore[assignment]
    deadline = 0.0  # type: ignore[assignment]
    on_cancel = None  # type: ignore[assignment]
    _latch = None  # type: ignore[assignment]
    _drive = None  # type: ignore[assignment]

    @property  # type: ignore[override]
    def bytes_done(self) -> int:
        return self.bytes_total


class NotifyStep:
    """A Completion that delivers the notification after the data landed, then finishes the handle."""

    __slots__ = ("handle", "send")

    def __init__(self, handle: TransferHandle, send: Callable[[TransferHandle], None]) -> None:
        self.handle, self.send = handle, send

    @property
    def cancelled(self) -> bool:
        return self.handle.cancelled

    def set_running(self) -> None:
        self.handle.set_running()

    def add_bytes(self, nbytes: int) -> None:
        self.handle.add_bytes(nbytes)

    def drive_with(self, drive: Callable[[float], None]) -> None:
        self.handle.drive_with(drive)

    @property
    def on_cancel(self) -> Callable[[], None] | None:
        return self.handle.on_cancel

    @on_cancel.setter
    def on_cancel(self, hook: Callable[[], None] | None) -> None:
        self.handle.on_cancel = hook

    def finish(self, error: BaseException | None = None) -> None:
        if error is not None or self.handle.cancelled:
            self.handle.finish(error)
            return
        try:
            self.send(self.handle)
        except HMCError as exc:
            self.handle.finish(exc)
