"""The thread that drives a UCX worker: every UCX call of the `ucx` and `rdma` paths runs on it.

A UCP worker is single-threaded (`hmc.transport._ucx_engine.Worker`), and the owner of remote memory must
progress it for puts and gets over tcp or shared memory to land. So each path's worker has one named thread
("hmc-ucx-<path>") that runs the commands other threads queue (`call` waits for the result, `submit` does
not), progresses the worker, polls the background requests it was asked to `watch` (flushes), and sleeps on
the worker's event file descriptor when there is nothing to do (`ucp_worker_arm`; with poll(), which takes
descriptors past 1023, as a process with many files open has), woken by an eventfd when a command is
queued. It keeps polling a little after the last event (`_SPIN_IDLE_S`, longer while requests
are outstanding: `_SPIN_WATCHING_S`; without a pause while a device copy is, which signals no event), in C
with the GIL released so that several progress threads do not take turns at it, and while
requests are outstanding it sleeps at most `_POLL_S` at a time, so a transport that signals no events still
completes.

Closing: `stop` tells the thread to destroy its worker (its endpoints' flushes given up by a deadline), `join`
says whether it ended by then; one that did not may still be inside UCX, so its context must stay.

Concurrency: `_lock` guards the command queue, `_closed`, `_close_by` and the wake-up eventfd's life (it is
written and closed under the lock, so no write reaches a closed descriptor or another file that took its
number); everything else belongs to the thread.
"""

from __future__ import annotations

import collections
import heapq
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from hmc.errors import ClosedResourceError, HMCError, TimeoutError
from hmc.transport._ucx_engine import Request, Worker

__all__ = ["Missed", "Progress"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
_POLL_S = 0.001
"""Longest sleep while requests are outstanding (a transport without events is polled this often)."""
_SPIN_WATCHING_S = 200e-6
"""How long the thread keeps progressing without events before it sleeps, while requests are outstanding (a tcp
send resumes when the peer drained its socket, about this soon, and UCX does not always signal it)."""
_SPIN_IDLE_S = 50e-6
"""The same after the last event when nothing is outstanding (the owner of a ping-pong answers sooner)."""
_JOIN_S = 5.0
"""How long `close` waits for the thread by default (its worker's endpoints are closed within this, less `_CLOSE_MARGIN_S`)."""
_CLOSE_MARGIN_S = 1.0
"""What the thread keeps, of the time `close` gives it, for destroying its worker after closing the endpoints."""


class Missed(TimeoutError):
    """A watched request missed its deadline: it goes on in UCX, which cancels nothing (watched on where `then` asks)."""


Done = Callable[[BaseException | None], None]
"""Called on the progress thread once a watched request ended: None, or the `hmc.errors` error."""


class _Watch:
    __slots__ = ("busy", "deadline", "done", "linger", "request", "then")

    def __init__(self, request: Request, deadline: float, done: Done, busy: bool, then: Done | None = None, linger: float = 0.0) -> None:
        self.request, self.deadline, self.done, self.busy = request, deadline, done, busy
        self.then, self.linger = then, linger

    def __lt__(self, other: _Watch) -> bool:
        return self.deadline < other.deadline


class Progress:
    """Runs `worker` on a thread of its own until `close()`; owns the worker from then on."""

    def __init__(self, worker: Worker, name: str) -> None:
        self.worker = worker
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()  # guards _commands, _closed, _close_by and writes to (and the close of) _wake
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._closed = False
        self._close_by = float("inf")
        """When the thread's closing of its worker's endpoints gives up waiting (set with `_closed`, under the lock)."""
        self._watched: list[_Watch] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, command: Callable[[], None]) -> None:
        """Run `command` on the progress thread soon (it must not raise: errors go where it sends them)."""
        with self._lock:  # the wake-up too: the thread closes the eventfd under this lock once closed and drained
            if self._closed:
                raise ClosedResourceError("the UCX progress thread is closed")
            self._commands.append(command)
            os.eventfd_write(self._wake, 1)

    def on_thread(self) -> bool:
        """Whether the caller is the progress thread."""
        return threading.current_thread() is self._thread

    def call(self, command: Callable[[], _T], deadline: float) -> _T:
        """Run `command` on the progress thread and return its result (or raise its error), by `deadline`."""
        if self.on_thread():
            return command()
        finished = threading.Event()
        result: list[Any] = []

        def run() -> None:
            try:
                result.append((True, command()))
            except BaseException as exc:  # handed to the caller, whatever it is
                result.append((False, exc))
            finished.set()

        self.submit(run)
        if not finished.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError("the UCX progress thread did not answer in time")
        ok, value = result[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def watch(self, request: Request, deadline: float, done: Done, *, busy: bool = False, then: Done | None = None, linger: float = 0.0) -> None:
        """Poll `request` until it ends or `deadline` passes (Missed), then call `done` once; called on the
        progress thread (from a command). `busy`: without sleeping meanwhile (a device copy ends without an event on
        the worker's file descriptor). `then`: UCX cancels nothing, so a request that missed `deadline` goes on; it
        stays watched up to `linger` seconds more, and `then` gets whether it ended (None, or its error) or may still
        run (Missed: a request's own TimeoutError, UCS_ERR_TIMED_OUT, means it ended)."""
        heapq.heappush(self._watched, _Watch(request, deadline, done, busy, then, linger))

    def _run(self) -> None:
        worker = self.worker
        poller = select.poll()  # not select(): it refuses descriptors past 1023, which a process with many files has
        for fd in (worker.fd(), self._wake):
            poller.register(fd, select.POLLIN)
        idle_since = time.monotonic()
        while True:
            ran = self._run_commands()
            if ran is None:
                break
            events = worker.progress(64)
            if self._watched:
                self._poll()
            if ran or events:
                idle_since = time.monotonic()
                continue
            now = time.monotonic()
            spin = _SPIN_WATCHING_S if self._watched else _SPIN_IDLE_S
            if now - idle_since < spin or any(w.busy for w in self._watched):
                worker.spin([w.request for w in self._watched], self._wake, spin)  # in C, the GIL released
                continue
            timeout = min(_POLL_S, max(0.0, self._watched[0].deadline - now)) if self._watched else None
            if worker.arm():
                poller.poll(None if timeout is None else timeout * 1000.0)
            idle_since = time.monotonic()
        self._fail_all(ClosedResourceError("the UCX path was closed"))
        with self._lock:
            close_by = self._close_by
        worker.close(close_by)
        with self._lock:  # no submit() or close() writes to it from now on (its number may be reused at once)
            os.close(self._wake)

    def _run_commands(self) -> int | None:
        """Run the queued commands; how many (None: closed)."""
        try:
            os.eventfd_read(self._wake)
        except BlockingIOError:
            pass
        ran = 0
        while True:
            with self._lock:
                if not self._commands:
                    return None if self._closed else ran
                command = self._commands.popleft()
            try:
                command()
            except Exception:  # a command must report its own errors; one that does not is a bug, not a reason to stop
                _log.exception("UCX command failed")
            ran += 1

    def _poll(self) -> None:
        now, keep = time.monotonic(), []
        watched, self._watched = self._watched, []  # a callback below may watch more
        for watch in watched:
            try:
                finished = watch.request.done()
                error: BaseException | None = None
            except HMCError as exc:
                finished, error = True, exc
            if not finished and now > watch.deadline:
                if watch.then is not None:  # it goes on: watched until it ends or lingered, then told to `then`
                    watch.done(Missed("the UCX operation missed its deadline"))
                    keep.append(_Watch(watch.request, now + watch.linger, watch.then, False))
                    continue
                finished, error = True, Missed("the UCX operation missed its deadline")
            if finished:
                watch.request.release()
                watch.done(error)
            else:
                keep.append(watch)
        self._watched.extend(keep)
        heapq.heapify(self._watched)

    def _fail_all(self, error: HMCError) -> None:
        watched, self._watched = self._watched, []
        for watch in watched:
            watch.request.release()
            watch.done(error)

    def stop(self, deadline: float) -> None:
        """Tell the thread to fail what is still watched and destroy the worker (its endpoints' closes given up by
        `deadline`, less `_CLOSE_MARGIN_S`); returns at once; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._close_by = deadline - _CLOSE_MARGIN_S
            os.eventfd_write(self._wake, 1)  # under the lock: the thread may otherwise have closed the eventfd already

    def join(self, deadline: float) -> bool:
        """Wait until `deadline` for the thread to end (after `stop`): whether it did. False: it may still run inside
        UCX, and the worker's context must then stay (the caller leaks it rather than free what is in use)."""
        if self.on_thread():
            return False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def close(self, deadline: float | None = None) -> bool:
        """`stop`, then `join` (by default within `_JOIN_S`): whether the thread ended; idempotent."""
        deadline = time.monotonic() + _JOIN_S if deadline is None else deadline
        self.stop(deadline)
        return self.join(deadline)
