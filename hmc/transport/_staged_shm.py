"""The `staged` path for device memory between two processes of one host: a shared pinned ring.

device -> pinned ring -> device. The initiator creates a ring of `slots` slots of
`slot_bytes` each (8 x 16 MiB) in a file under /dev/shm (the temporary directory
where /dev/shm is too small, as in containers), maps it and pins it (cuMemHostRegister);
the owner maps the same file (and pins it where it has CUDA) on the first frame
naming it, once per data connection. The wire is the ring; the data connection
only carries slot hand-offs: DataWrite / DataRead frames whose `shm` field names
the slot, and the owner's replies, in frame order.

Both sides keep their copy engine fed. WRITE: the initiator queues the device-to-host
copies (one cuMemcpyAsync per range, concatenated) of a chunk into every free slot
at once, hands off the oldest chunk whose copy finished (DataWrite naming the slot),
and collects the replies that arrived meanwhile (select on the socket, no wait),
waiting for one only when no copy is queued. The owner queues each hand-off's
host-to-device copy on its GPU's stream the moment the frame arrives (behind the
earlier ones) and replies from a completion thread once the copy finished; a slot
is reused only after its reply. So the initiator's GPU copies chunk k+1 out while
the owner's GPU copies chunk k in, each over its own PCIe link. READ: the initiator
asks for the first `slots` chunks at once; the owner queues their device-to-host
copies back to back and replies as each finishes; the initiator queues the copy out
of every slot whose reply arrived, waits for the oldest, and asks for the chunk
`slots` further there. Small slots keep the pipeline's fill and drain (one slot's
copy) short; eight of them absorb the hand-off latency.

Either side's memory may be host memory (copied with memmove) or CUDA device
memory. Every wait (socket and GPU) is bounded by the request's deadline, the
owner's by `_OWNER_COPY_S` per slot; a broken connection fails the transfer, and a
transfer that does not end cleanly drops its connection and its ring (the owner
may still be copying into it; the next transfer makes a new one).

Concurrency: each peer's transfers run one after another on that peer's worker
thread ("hmc-staged-shm", started on first use, stopped when the peer is
forgotten), which owns the peer's connection and ring (`_Link.lock` keeps close
from pulling them away mid-transfer); a transfer still queued at its deadline
fails without running. The owner side is `_staged_owner.OwnerSegments`; mappings
and slot copies are `_pinned`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import queue
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np

from hmc.errors import BrokenResourceError, HMCError, ProtocolError, TimeoutError, UnsupportedError
from hmc.memory._machine import host_id
from hmc.transport._base import TransferOp, TransferRequest
from hmc.transport._pinned import PinnedMapping, SlotCopier
from hmc.transport._ranges import RangeList
from hmc.transport._wire import FrameStream, raise_for_reply
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["RING_NAME", "SLOT_BYTES", "ShmStaging", "frame_of", "reply_of", "ring_dirs", "same_host", "shm_available"]

_log = logging.getLogger(__name__)
_SHM_DIR = "/dev/shm"
_PREFIX = "hmc-staged-"
RING_NAME = re.compile(r"hmc-staged-[0-9a-f]{32}")
"""The names ring files have (the owner maps no other file)."""
SLOT_BYTES = 16 << 20
"""A ring slot: the most one chunk of a staged device-memory transfer holds."""
Connect = Callable[[common_pb2.BufferDescriptor, float], FrameStream]


def ring_dirs() -> tuple[str, ...]:
    """Where rings may live: /dev/shm, else (a container's small /dev/shm) the temporary directory."""
    return (_SHM_DIR, tempfile.gettempdir())


def _ring_dir(size: int) -> str:
    """The first ring directory with room for `size` bytes (twice over: two agents may hold rings)."""
    for directory in ring_dirs():
        try:
            stat = os.statvfs(directory)
        except OSError:
            continue
        if os.access(directory, os.W_OK) and stat.f_bavail * stat.f_frsize >= 2 * size:
            return directory
    raise UnsupportedError(f"no room for a {size >> 20} MiB staging ring in {' or '.join(ring_dirs())}")


def shm_available() -> bool:
    return any(os.path.isdir(d) and os.access(d, os.W_OK) for d in ring_dirs())


@functools.cache
def _ring_host() -> str:
    """This host's id where a shared ring can be made here, else "" (asked once: every transfer checks it)."""
    return host_id() if shm_available() else ""


def same_host(agent: common_pb2.AgentInfo) -> bool:
    """True when `agent` runs on this host and a shared ring can be made here."""
    return bool(agent.host_id) and agent.host_id == _ring_host()


# -- initiator side -------------------------------------------------------------


class _Link:
    """One peer's ring (a file named `name`, a full path), data connection, and the worker that runs its transfers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ring: PinnedMapping | None = None
        self.name = ""
        self.stream: FrameStream | None = None
        self.closed = False
        self.requests: queue.SimpleQueue[TransferRequest | None] = queue.SimpleQueue()
        """Transfers waiting for the worker; None stops it."""
        self.worker: threading.Thread | None = None

    def drop_stream(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def drop(self) -> None:
        """After a failed transfer: the connection, and the ring (the owner may still be copying into it)."""
        self.drop_stream()
        if self.ring is not None:
            self.ring.close()
            self.ring = None
            if self.name:
                with contextlib.suppress(OSError):
                    os.unlink(self.name)

    def close(self) -> None:
        self.closed = True
        self.drop()


def _pack(ranges: RangeList, slot_bytes: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Chunks of at most `slot_bytes`: (local offsets, remote offsets, lengths), long ranges cut."""
    chunks: list[tuple[list[int], list[int], list[int]]] = []
    src, dst, lengths = ranges.src.tolist(), ranges.dst.tolist(), ranges.lengths.tolist()
    current: tuple[list[int], list[int], list[int]] = ([], [], [])
    filled = 0
    for s, d, n in zip(src, dst, lengths):
        while n > 0:
            take = min(n, slot_bytes - filled)
            current[0].append(s)
            current[1].append(d)
            current[2].append(take)
            filled += take
            s, d, n = s + take, d + take, n - take
            if filled == slot_bytes:
                chunks.append(current)
                current, filled = ([], [], []), 0
    if filled:
        chunks.append(current)
    return chunks


def frame_of(message: peer_pb2.DataWrite | peer_pb2.DataRead) -> peer_pb2.PeerFrame:
    return peer_pb2.PeerFrame(write=message) if isinstance(message, peer_pb2.DataWrite) else peer_pb2.PeerFrame(read=message)


def reply_of(stream: FrameStream, deadline: float) -> peer_pb2.PeerReply:
    """The next reply on a data connection; a refusal raises its typed error."""
    answer = stream.recv(deadline)
    if answer.WhichOneof("kind") != "reply":
        raise ProtocolError(f"expected a reply on a data connection, got {answer.WhichOneof('kind')}")
    raise_for_reply(answer.reply)
    return answer.reply


def _range_list(offsets: list[int], lengths: list[int], field: str) -> common_pb2.RangeList:
    return common_pb2.RangeList(**{field: np.asarray(offsets, dtype="<i8").tobytes(), "lengths": np.asarray(lengths, dtype="<i8").tobytes()})


class ShmStaging:
    """Initiator side: moves requests that touch device memory through a shared pinned ring.

    The wire is three hooks (`_new_ring`, `_hand_off`, `_answer`); `_staged_tcp_ring.TcpRingStaging`
    replaces them to carry the slots' bytes over TCP between hosts."""

    _WORKER = "hmc-staged-shm"
    """The name of each peer's worker thread."""

    def __init__(self, connect: Connect, *, slots: int = 8, slot_bytes: int = SLOT_BYTES) -> None:
        self._connect = connect
        self._slots = max(2, slots)
        self._slot_bytes = slot_bytes
        self._lock = threading.Lock()  # guards _links, _closed
        self._links: dict[str, _Link] = {}
        self._closed = False
        self._copier = SlotCopier()

    def post(self, request: TransferRequest) -> None:
        """Queue the transfer for its peer's worker thread (started on first use); its completion reports the outcome."""
        if not request.ranges.total:
            request.completion.finish()
            return
        request.completion.set_running()
        with self._lock:
            if self._closed:
                request.completion.finish(BrokenResourceError("the staged path is closed"))
                return
            link = self._links.setdefault(request.remote.owner.id, _Link())
            link.requests.put(request)  # under _lock: a link popped by forget_peer/close gets its None after this
            if link.worker is None:
                link.worker = threading.Thread(target=self._serve, args=(link,), name=self._WORKER, daemon=True)
                link.worker.start()

    def _serve(self, link: _Link) -> None:
        """The link's worker: runs its transfers one after another; once stopped, fails those still queued."""
        while (request := link.requests.get()) is not None:
            if time.monotonic() > request.deadline:
                request.completion.finish(TimeoutError("the transfer waited for its staging ring past its deadline"))
            else:
                self._run(link, request)
        while True:
            try:
                left = link.requests.get_nowait()
            except queue.Empty:
                return
            if left is not None:
                left.completion.finish(BrokenResourceError("the staged path to this agent was closed"))

    def _run(self, link: _Link, request: TransferRequest) -> None:
        owner = request.remote.owner
        if not link.lock.acquire(timeout=max(request.deadline - time.monotonic(), 0.0)):
            request.completion.finish(TimeoutError(f"the staging ring to agent {owner.id} stayed busy until the deadline"))
            return
        try:
            if link.closed:
                raise BrokenResourceError(f"agent {owner.id} went away")
            self._prepare(link, request.remote, request.deadline)
            if request.op is TransferOp.WRITE:
                self._write(link, request)
            else:
                self._read(link, request)
        except HMCError as exc:
            link.drop()
            request.completion.finish(exc)
            return
        except Exception as exc:  # noqa: BLE001 - the driver's own failures must still finish the request
            link.drop()
            request.completion.finish(BrokenResourceError(f"staging failed: {exc}"))
            return
        finally:
            link.lock.release()
        request.completion.finish()

    def _prepare(self, link: _Link, remote: common_pb2.BufferDescriptor, deadline: float) -> None:
        if link.ring is None:
            link.ring, link.name = self._new_ring(self._slots * self._slot_bytes)
        if link.stream is None or link.stream.broken:
            link.drop_stream()
            link.stream = self._connect(remote, deadline)

    def _new_ring(self, size: int) -> tuple[PinnedMapping, str]:
        """A ring the owner maps too: a new file in the ring directory, and its path (named in every hand-off)."""
        name = os.path.join(_ring_dir(size), f"{_PREFIX}{uuid.uuid4().hex}")
        try:
            return PinnedMapping(name, size, create=True), name
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(name)
            if isinstance(exc, OSError):
                raise UnsupportedError(f"cannot make a staging ring at {name}: {exc}") from exc
            raise

    def _hand_off(self, link: _Link, stream: FrameStream, message: peer_pb2.DataWrite | peer_pb2.DataRead, slot: int, nbytes: int, deadline: float) -> None:
        """Send a chunk's request naming its slot of the shared ring (a write's bytes are there already)."""
        assert link.ring is not None
        message.shm.CopyFrom(peer_pb2.ShmSlot(segment=link.name, segment_bytes=link.ring.size, offset=slot * self._slot_bytes))
        stream.send(frame_of(message), deadline=deadline)

    def _answer(self, link: _Link, stream: FrameStream, slot: int, nbytes: int, deadline: float) -> None:
        """Take the owner's reply to the oldest chunk handed off (a read's `nbytes` are in its slot then)."""
        reply_of(stream, deadline)

    def _write(self, link: _Link, request: TransferRequest) -> None:
        """Every free slot gets its chunk's copy queued at once; the oldest finished copy is handed off first,
        replies are collected as they come (a reply is waited for only when no copy is queued)."""
        stream, ring = link.stream, link.ring
        assert stream is not None and ring is not None
        remote, region, deadline, completion = request.remote, request.local.region, request.deadline, request.completion
        chunks = _pack(request.ranges, self._slot_bytes)
        queued: collections.deque[tuple[Callable[[float], None], peer_pb2.DataWrite, int, int]] = collections.deque()  # copying into slots
        inflight: collections.deque[int] = collections.deque()  # bytes of chunks handed off, reply pending
        started = 0
        try:
            while started < len(chunks) or queued or inflight:
                while inflight and stream.readable():  # replies already here free their slots
                    reply_of(stream, deadline)
                    completion.add_bytes(inflight.popleft())
                if completion.cancelled:
                    raise BrokenResourceError("transfer cancelled")
                while started < len(chunks) and len(queued) + len(inflight) < self._slots:
                    local, far, lengths = chunks[started]
                    slot = started % self._slots
                    wait = self._copier.start(region, local, lengths, ring.address + slot * self._slot_bytes, to_slot=True)
                    write = peer_pb2.DataWrite(buffer_id=remote.id, key_proof=stream.proof(remote.access_key), ranges=_range_list(far, lengths, "dst_offsets"), transfer_id=request.transfer_id)
                    queued.append((wait, write, slot, sum(lengths)))
                    started += 1
                if queued:
                    wait, write, slot, nbytes = queued.popleft()
                    wait(deadline)
                    self._hand_off(link, stream, write, slot, nbytes, deadline)
                    inflight.append(nbytes)
                elif inflight:
                    reply_of(stream, deadline)
                    completion.add_bytes(inflight.popleft())
        finally:
            while queued:  # never leave a queued copy running into a ring the next transfer reuses
                with contextlib.suppress(HMCError):
                    queued.popleft()[0](deadline)

    def _read(self, link: _Link, request: TransferRequest) -> None:
        """The owner fills up to `slots` slots ahead; each reply that arrived gets its copy out of the slot queued,
        the oldest copy is waited for, and its slot asked for the next chunk."""
        stream, ring = link.stream, link.ring
        assert stream is not None and ring is not None
        remote, region, deadline, completion = request.remote, request.local.region, request.deadline, request.completion
        chunks = _pack(request.ranges.swapped(), self._slot_bytes)  # (local dst, remote src, lengths)

        def ask(index: int) -> None:
            _, far, lengths = chunks[index]
            read = peer_pb2.DataRead(buffer_id=remote.id, key_proof=stream.proof(remote.access_key), ranges=_range_list(far, lengths, "src_offsets"), transfer_id=request.transfer_id)
            self._hand_off(link, stream, read, index % self._slots, sum(lengths), deadline)

        asked = min(self._slots, len(chunks))
        for index in range(asked):
            ask(index)
        copying: collections.deque[tuple[int, Callable[[float], None]]] = collections.deque()  # slot -> memory copies queued
        answered = 0
        try:
            for _ in range(len(chunks)):
                while answered < asked and (not copying or stream.readable()):
                    local, _, lengths = chunks[answered]
                    self._answer(link, stream, answered % self._slots, sum(lengths), deadline)
                    if completion.cancelled:
                        raise BrokenResourceError("transfer cancelled")
                    slot = ring.address + (answered % self._slots) * self._slot_bytes
                    copying.append((answered, self._copier.start(region, local, lengths, slot, to_slot=False)))
                    answered += 1
                index, wait = copying.popleft()
                wait(deadline)
                completion.add_bytes(sum(chunks[index][2]))
                if asked < len(chunks):
                    ask(asked)
                    asked += 1
        finally:
            while copying:
                with contextlib.suppress(HMCError):
                    copying.popleft()[1](deadline)

    def forget_peer(self, agent: common_pb2.AgentInfo) -> None:
        with self._lock:
            link = self._links.pop(agent.id, None)
        if link is not None:
            self._close_link(link)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
        for link in links:
            self._close_link(link)
        self._copier.close()

    @staticmethod
    def _close_link(link: _Link) -> None:
        link.requests.put(None)
        if link.stream is not None:
            link.stream.shutdown()  # a transfer blocked on it fails now
        if link.lock.acquire(timeout=5.0):
            try:
                link.close()
            finally:
                link.lock.release()
