"""Completion of the CUDA `ipc` path: requests completed by whoever waits on them, or by the backstop thread.

Requests up to `sync_bytes` are waited for on the caller's thread, polling the
stream, before post() returns (that is the transport's). Larger ones record a
CUDA event and hand the transfer handle a `drive` (`TransferHandle.drive_with`):
the thread that calls wait() or done() polls the event itself and completes the
request (no hand-off to another thread). The "hmc-cuda-ipc-wait" thread
(`_Waiter`) is only the backstop for requests nobody waits on: it looks at their
events once a millisecond. A request whose deadline passes first fails with
TimeoutError; its buffers stay counted as in use until the GPU is done.

Concurrency contract: each `_Pending` is settled exactly once. Its `_lock`
admits one thread at a time to look at the event: a waiter blocks on it, the
backstop only tries it (and leaves the event to a waiter that holds it); the
thread that sees the event done sets `settled` under the lock, then releases the
event and runs `on_done` outside it. `on_late` runs at most once, on the
backstop thread. `_Waiter._cond` guards its pending list, thread and closed
flag; items are polled outside it. `_Latch` is the Completion of a sub-request
handed to the host mover: `finish` from the mover's thread, `wait` on the
posting thread, the parent's cancellation read through and its stop hook (`on_cancel`) handed to the parent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from hmc.errors import HMCError, TimeoutError
from hmc.transport._gpu_copy import Lane

_log = logging.getLogger(__name__)

_CLOSE_S = 2.0


class _Latch:
    """The Completion of a sub-request handed to the host mover; the parent's cancellation shows through."""

    __slots__ = ("_event", "_parent", "error")

    def __init__(self, parent: Any) -> None:
        self._event = threading.Event()
        self._parent = parent
        self.error: BaseException | None = None

    @property
    def cancelled(self) -> bool:
        return bool(self._parent.cancelled)

    @property
    def on_cancel(self) -> Callable[[], None] | None:
        return self._parent.on_cancel  # type: ignore[no-any-return]

    @on_cancel.setter
    def on_cancel(self, hook: Callable[[], None] | None) -> None:
        """The host mover's stop hook becomes the parent's: cancelling the transfer stops the chunk in flight."""
        self._parent.on_cancel = hook

    def set_running(self) -> None:
        return None

    def add_bytes(self, nbytes: int) -> None:
        return None

    def finish(self, error: BaseException | None = None) -> None:
        if not self._event.is_set():
            self.error = error
            self._event.set()

    def wait(self, deadline: float) -> None:
        if not self._event.wait(max(deadline - time.monotonic(), 0.0)):
            raise TimeoutError("ipc transfer missed its deadline")
        if self.error is not None:
            raise self.error


class _Pending:
    """A request's CUDA event, completed once: by whoever waits on it (`drive`) or by the backstop thread (`poll`)."""

    __slots__ = ("_lock", "deadline", "event", "lane", "late", "on_done", "on_late", "settled")

    def __init__(self, lane: Lane, event: Any, deadline: float, on_done: Callable[[BaseException | None], None], on_late: Callable[[], None]) -> None:
        self.lane, self.event, self.deadline = lane, event, deadline
        self.on_done, self.on_late = on_done, on_late
        self.late = False
        self.settled = False
        self._lock = threading.Lock()  # one thread at a time looks at the event; the one that sees it done settles

    def drive(self, deadline: float) -> None:
        """Poll the event on the caller's thread until it is done (then complete the request) or `deadline` passed."""
        if self.settled:
            return
        with self._lock:
            if self.settled:
                return
            error: BaseException | None = None
            try:
                done = self.lane.event_wait(self.event, deadline)
            except HMCError as exc:
                done, error = True, exc
            if not done:
                return
            self.settled = True
        self._settle(error)

    def poll(self, now: float) -> bool:
        """One look (the backstop thread): True once settled, by this call or another thread."""
        if self.settled:
            return True
        if not self._lock.acquire(blocking=False):  # a waiter is polling it: leave it to them
            return False
        try:
            if self.settled:
                return True
            error: BaseException | None = None
            try:
                done = self.lane.event_done(self.event)
            except HMCError as exc:
                done, error = True, exc
            if done:
                self.settled = True
        finally:
            self._lock.release()
        if done:
            self._settle(error)
            return True
        if not self.late and now > self.deadline:
            self.late = True
            self.on_late()
        return False

    def _settle(self, error: BaseException | None) -> None:
        try:
            self.lane.release_event(self.event)
        except HMCError as exc:
            _log.debug("destroying a CUDA event failed: %s", exc)
        self.on_done(error)


class _Waiter:
    """The "hmc-cuda-ipc-wait" thread: the backstop completing requests nobody waits on (or that outlive their wait).

    It looks at each pending event once a millisecond: rarely enough not to compete
    with the callers that poll their own transfers (`_Pending.drive`).
    """

    def __init__(self, interval: float = 0.001) -> None:
        self._cond = threading.Condition()  # guards _pending, _thread and _closed
        self._pending: list[_Pending] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._interval = interval

    def watch(self, item: _Pending) -> None:
        with self._cond:
            self._pending.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hmc-cuda-ipc-wait", daemon=True)
                self._thread.start()
            elif len(self._pending) == 1:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
            time.sleep(self._interval)
            with self._cond:
                items = list(self._pending)
            now = time.monotonic()
            settled = [item for item in items if item.poll(now)]
            if settled:
                with self._cond:
                    for item in settled:
                        self._pending.remove(item)

    def close(self) -> None:
        """Stop once nothing is pending (joined with a bound: a hung GPU leaves a daemon thread behind)."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify()
        if thread is not None:
            thread.join(_CLOSE_S)
