"""Sends to peers off the connector thread: one sender thread per peer agent, each with a bounded backlog.

agent.write() blocks its caller until the peer answers when the connection to that peer is new (up to the
write's timeout). The connector thread enforces every deadline, so it never calls it: it posts a job (the
writes of one message or one push) here and gets back an `Outgoing`, which it reads like a TransferHandle.
A sender thread runs its peer's jobs in order; `settle`, called by the connector thread each turn, hands
each finished job's handles (or the error that stopped it) to its Outgoing. One silent peer holds up only
its own sender; a peer's backlog, the number of senders and the jobs not yet settled are all capped (a job
over a cap fails at once, as data). A sender ends when its backlog stays empty for `idle_s`, or on close.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import hmc

_log = logging.getLogger(__name__)

#: The writes of one send, run on a sender thread: it appends each handle it issues to the list it is given,
#: and may check `Outgoing.cancelled` before issuing; what it raises fails the send (and cancels what it issued).
Job = Callable[["Outgoing", list[hmc.TransferHandle]], None]


class Outgoing:
    """A send handed to the outbox: pending, then its issued handles or the error that stopped it.

    Read like a TransferHandle (done, error, cancel) by the connector thread, which alone resolves it.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.handles: list[hmc.TransferHandle] | None = None  # None until issued
        self.failure: BaseException | None = None  # why it was not (fully) issued
        self._cancelled = threading.Event()  # read by the sender thread before it issues

    @property
    def settled(self) -> bool:
        """Whether the sender is done with it: every write it will issue is issued."""
        return self.handles is not None

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def done(self) -> bool:
        return self.handles is not None and all(h.done() for h in self.handles)

    @property
    def error(self) -> BaseException | str | None:
        if self.failure is not None:
            return self.failure
        return next((h.error for h in self.handles or () if h.error is not None), None)

    def cancel(self) -> None:
        self._cancelled.set()
        for handle in self.handles or ():
            handle.cancel()

    def _resolve(self, handles: list[hmc.TransferHandle], failure: BaseException | None) -> None:
        self.handles, self.failure = handles, failure
        if self.cancelled or failure is not None:  # a send that failed part-way is stopped as a whole
            for handle in handles:
                handle.cancel()


class _Sender:
    """One peer's backlog and the thread that works through it."""

    def __init__(self, key: str, depth: int) -> None:
        self.key = key
        self.jobs: queue.Queue[tuple[Outgoing, Job]] = queue.Queue(maxsize=depth)
        self.thread: threading.Thread | None = None
        self.idle_since = time.monotonic()


def peer_key(remote: hmc.BufferDescriptor) -> str:
    """Which sender a send to `remote` goes through: its owner agent at the address named (a silent address blocks only itself)."""
    owner = remote.owner
    return f"{owner.id}@{owner.endpoint.host}:{owner.endpoint.port}|{owner.unix_path}"


class Outbox:
    """Per-peer sender threads, and the finished sends waiting for the connector thread."""

    def __init__(self, max_peers: int = 64, depth: int = 64, idle_s: float = 1.0) -> None:
        self.max_peers, self.depth, self.idle_s = max_peers, depth, idle_s
        self._lock = threading.Lock()  # guards _senders against a sender thread ending as a job is posted
        self._senders: dict[str, _Sender] = {}
        self._unsettled = 0  # connector thread only: posted and not yet settled
        self._done: queue.Queue[tuple[Outgoing, list[hmc.TransferHandle], BaseException | None]] = queue.Queue(maxsize=max_peers * (depth + 1))
        self._stop = threading.Event()

    def post(self, peer: str, job: Job, what: str) -> Outgoing:
        """Queue `job` for `peer`'s sender (connector thread only); over a cap, or closed, it fails at once."""
        out = Outgoing(what)
        if self._stop.is_set():
            out._resolve([], hmc.HMCError(f"{what}: the worker is closing"))
            return out
        if self._unsettled >= self._done.maxsize:
            out._resolve([], hmc.HMCError(f"{what}: {self._unsettled} sends already pending"))
            return out
        with self._lock:
            sender = self._senders.get(peer)
            if sender is None and len(self._senders) >= self.max_peers:
                out._resolve([], hmc.HMCError(f"{what}: sends to {len(self._senders)} peers already pending"))
                return out
            if sender is None:
                sender = self._senders[peer] = _Sender(peer, self.depth)
                sender.thread = threading.Thread(target=self._work, args=(sender,), name="hmc-send", daemon=True)
                sender.thread.start()
            try:
                sender.jobs.put_nowait((out, job))
            except queue.Full:
                out._resolve([], hmc.HMCError(f"{what}: {self.depth} sends to this peer already pending"))
                return out
        self._unsettled += 1
        return out

    def settle(self) -> None:
        """Hand every finished job's handles or error to its Outgoing (connector thread only); log failed sends."""
        while True:
            try:
                out, handles, failure = self._done.get_nowait()
            except queue.Empty:
                return
            self._unsettled -= 1
            out._resolve(handles, failure)
            if failure is not None:
                _log.warning("HMCConnector: %s not sent: %s", out.what, failure)

    def close(self, timeout: float) -> None:
        """Stop every sender (each ends after its current job) and wait for them until `timeout` has passed."""
        self._stop.set()
        with self._lock:
            threads = [s.thread for s in self._senders.values() if s.thread is not None]
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))

    def _work(self, sender: _Sender) -> None:
        while not self._stop.is_set():
            try:
                out, job = sender.jobs.get(timeout=min(self.idle_s, 0.2))
            except queue.Empty:
                with self._lock:  # post() puts under this lock: an empty backlog here stays empty until it is gone
                    if sender.jobs.empty() and time.monotonic() - sender.idle_since >= self.idle_s:
                        del self._senders[sender.key]
                        return
                continue
            handles: list[hmc.TransferHandle] = []
            failure: BaseException | None = None
            try:
                job(out, handles)
            except Exception as exc:  # HMCError from a write, or a bug in the job: the connector thread decides
                failure = exc
            self._done.put_nowait((out, handles, failure))  # room by construction: post() caps the unsettled sends
            sender.idle_since = time.monotonic()
