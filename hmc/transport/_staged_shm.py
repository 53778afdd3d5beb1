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
fails without running. On the owner, the connection's
thread queues copies and one completion thread per connection sends the replies
(`OwnerSegments._cond` guards the queue).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import logging
import mmap
import os
import queue
import re
import tempfile
import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from hmc.errors import BrokenResourceError, HMCError, ProtocolError, TimeoutError, UnsupportedError
from hmc.memory import DeviceKind, MemoryKind
from hmc.transport._base import TransferOp, TransferRequest
from hmc.transport._ranges import RangeList
from hmc.transport._wire import FrameStream, error_reply, raise_for_reply
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["SLOT_BYTES", "OwnerSegments", "PinnedMapping", "ShmStaging", "frame_of", "reply_of", "same_host", "shm_available"]

_log = logging.getLogger(__name__)
_SHM_DIR = "/dev/shm"
_PREFIX = "hmc-staged-"
_SEGMENT = re.compile(r"hmc-staged-[0-9a-f]{32}")
_MAX_SEGMENTS = 4
"""Segments one owner connection keeps mapped (an initiator uses one per connection)."""
_OWNER_COPY_S = 30.0
"""Bound on one slot's copy on the owner (a GPU that takes longer fails that chunk)."""
_OWNER_DEPTH = 64
"""Slot copies one owner connection keeps queued (an initiator hands off at most its ring's slot count)."""
_JOIN_S = 2.0
SLOT_BYTES = 16 << 20
"""A ring slot: the most one chunk of a staged device-memory transfer holds."""
_OK = peer_pb2.PeerReply()
_OK_FRAME = peer_pb2.PeerFrame(reply=_OK).SerializeToString()

Connect = Callable[[common_pb2.AgentInfo, float], FrameStream]


def _ring_dirs() -> tuple[str, ...]:
    """Where rings may live: /dev/shm, else (a container's small /dev/shm) the temporary directory."""
    return (_SHM_DIR, tempfile.gettempdir())


def _ring_dir(size: int) -> str:
    """The first ring directory with room for `size` bytes (twice over: two agents may hold rings)."""
    for directory in _ring_dirs():
        try:
            stat = os.statvfs(directory)
        except OSError:
            continue
        if os.access(directory, os.W_OK) and stat.f_bavail * stat.f_frsize >= 2 * size:
            return directory
    raise UnsupportedError(f"no room for a {size >> 20} MiB staging ring in {' or '.join(_ring_dirs())}")


def shm_available() -> bool:
    return any(os.path.isdir(d) and os.access(d, os.W_OK) for d in _ring_dirs())


@functools.cache
def _ring_host() -> str:
    """This host's id where a shared ring can be made here, else "" (asked once: every transfer checks it)."""
    from hmc.control._inventory import host_id

    return host_id() if shm_available() else ""


def same_host(agent: common_pb2.AgentInfo) -> bool:
    """True when `agent` runs on this host and a shared ring can be made here."""
    return bool(agent.host_id) and agent.host_id == _ring_host()


def _cuda() -> Any:
    """The CUDA backend, or None."""
    try:
        from hmc.memory import backend_for

        return backend_for(DeviceKind.CUDA)
    except HMCError:
        return None


def _driver() -> Any:
    from hmc.memory._cuda_driver import driver

    return driver


def _check(result: Any) -> Any:
    from hmc.memory._cuda_driver import check

    return check(result)


class PinnedMapping:
    """A /dev/shm file (`path`), or private memory (`path` None), mapped here and pinned where CUDA is present."""

    def __init__(self, path: str | None, size: int, *, create: bool) -> None:
        if path is None:
            self._mmap = mmap.mmap(-1, size)
        else:
            flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
            fd = os.open(path, flags, 0o600)
            try:
                if create:
                    os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS on first touch
                elif os.fstat(fd).st_size < size:
                    raise ProtocolError(f"shared ring {os.path.basename(path)} is smaller than announced")
                self._mmap = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        self.size = size
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = int(self._array.ctypes.data)
        self._pinned = False
        self._backend = _cuda()
        if self._backend is not None:
            driver = _driver()
            with self._backend.contexts.use_any():
                _check(driver.cuMemHostRegister(self.address, size, driver.CU_MEMHOSTREGISTER_PORTABLE))
            self._pinned = True

    def close(self) -> None:
        if self._pinned:
            self._pinned = False
            driver = _driver()
            try:
                with self._backend.contexts.use_any():
                    _check(driver.cuMemHostUnregister(self.address))
            except HMCError as exc:
                _log.debug("unpinning a shared ring failed: %s", exc)
        self._array = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view still referenced (a traceback's) keeps it mapped until collected
            self._mmap.close()

    def view(self, offset: int, nbytes: int) -> memoryview:
        """`nbytes` of the mapping from `offset`, for sockets to send from or receive into."""
        return memoryview(self._mmap)[offset : offset + nbytes]


def _done(deadline: float) -> None:
    """The wait of a copy that already finished (host memory, copied on the spot)."""


class _Copier:
    """Copies between a region's ranges and a contiguous slot, waiting within a deadline."""

    def __init__(self) -> None:
        self._backend: Any = None  # resolved on the first device copy (a process may never touch CUDA)
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _stream(self, device: Any) -> Any:
        with self._lock:
            stream = self._streams.get(device.index)
            if stream is None:
                stream = self._streams[device.index] = self._backend.stream(device)
            return stream

    def copy(self, region: Any, offsets: list[int], lengths: list[int], slot: int, *, to_slot: bool, deadline: float) -> None:
        self.start(region, offsets, lengths, slot, to_slot=to_slot)(deadline)

    def start(self, region: Any, offsets: list[int], lengths: list[int], slot: int, *, to_slot: bool) -> Callable[[float], None]:
        """Queue the copy (device memory: on this GPU's stream, behind the ones queued before); returns the wait for it."""
        base = region.address
        if region.kind is not MemoryKind.DEVICE:
            position = slot
            for offset, length in zip(offsets, lengths):
                if to_slot:
                    ctypes.memmove(position, base + offset, length)
                else:
                    ctypes.memmove(base + offset, position, length)
                position += length
            return _done
        if self._backend is None:
            self._backend = _cuda()
        if self._backend is None:
            raise UnsupportedError(f"{region.device.name} memory without a CUDA backend in this process")
        from hmc.transport._cuda_copy import spin_until

        driver = _driver()
        stream = self._stream(region.device)
        handle = stream.handle
        position = slot
        contexts, ordinal = self._backend.contexts, region.device.index
        with contexts.use(ordinal):
            for offset, length in zip(offsets, lengths):
                if to_slot:
                    _check(driver.cuMemcpyAsync(position, base + offset, length, handle))
                else:
                    _check(driver.cuMemcpyAsync(base + offset, position, length, handle))
                position += length
            event = _check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING))
            _check(driver.cuEventRecord(event, handle))

        def wait(deadline: float) -> None:
            try:
                if not spin_until(lambda: driver.cuEventQuery(event)[0], deadline):
                    raise TimeoutError("a staging copy did not finish before the deadline")
            finally:
                with contexts.use(ordinal):
                    _check(driver.cuEventDestroy(event))

        return wait

    def close(self) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close()


# -- owner side -----------------------------------------------------------------


class _Queued:
    """One slot hand-off the owner answers in frame order: a copy to wait for, or a reply ready to send.

    `payload`: what follows a successful copy's reply (a read's bytes, sent from a bounce slot)."""

    __slots__ = ("deadline", "payload", "release", "reply", "request_id", "wait")

    def __init__(
        self,
        request_id: int,
        wait: Callable[[float], None],
        reply: peer_pb2.PeerReply | None,
        release: Callable[[], None] | None,
        payload: memoryview | None = None,
    ) -> None:
        self.request_id = request_id
        self.wait = wait
        self.reply = reply
        self.release = release
        self.payload = payload
        self.deadline = _now() + _OWNER_COPY_S


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
        self._copier: _Copier | None = None
        self._cond = threading.Condition()  # guards _queue, _thread, _closed
        self._queue: collections.deque[_Queued] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False

    def slot(self, shm: peer_pb2.ShmSlot, nbytes: int) -> int:
        """The address of `nbytes` at the slot; ProtocolError when the slot is malformed."""
        directory, name = os.path.split(shm.segment)
        if not _SEGMENT.fullmatch(name) or directory not in _ring_dirs():
            raise ProtocolError(f"{shm.segment!r} is not a staging ring")
        if shm.offset + nbytes > shm.segment_bytes:
            raise ProtocolError("a staging slot reaches past its ring")
        mapping = self._mappings.get(shm.segment)
        if mapping is None or mapping.size != shm.segment_bytes:
            try:
                mapping = PinnedMapping(shm.segment, shm.segment_bytes, create=False)
            except OSError as exc:
                raise ProtocolError(f"cannot map staging ring {shm.segment}: {exc}") from exc
            old = self._mappings.pop(shm.segment, None)
            if old is not None:
                self.drain()  # a copy still queued may touch the old mapping
                old.close()
            self._mappings[shm.segment] = mapping
            while len(self._mappings) > _MAX_SEGMENTS:
                self.drain()
                self._mappings.popitem(last=False)[1].close()
        return mapping.address + shm.offset

    def start(
        self,
        request_id: int,
        region: Any,
        offsets: list[int],
        lengths: list[int],
        slot: int,
        *,
        to_slot: bool,
        release: Callable[[], None],
        payload: memoryview | None = None,
    ) -> None:
        """Queue the copy between `slot` and the region's ranges; its reply (followed by `payload`, the slot's bytes,
        when given) goes out once it finished, then `release()` runs."""
        if self._copier is None:
            self._copier = _Copier()
        try:
            wait = self._copier.start(region, offsets, lengths, slot, to_slot=to_slot)
        except HMCError as exc:
            release()
            self.reply(request_id, error_reply(exc))
            return
        if wait is _done and payload is None:
            release()
            self.reply(request_id, _OK)
            return
        try:
            self._push(_Queued(request_id, wait, None, release, payload))
        except HMCError:
            with contextlib.suppress(HMCError):  # the copy was queued: let it end before the slot and buffer go
                wait(_now() + _OWNER_COPY_S)
            release()
            raise

    def reply(self, request_id: int, reply: peer_pb2.PeerReply) -> None:
        """Send `reply` after the replies of the copies queued before it."""
        with self._cond:
            if self._queue:
                self._push_locked(_Queued(request_id, _done, reply, None))
                return
        self._send(request_id, reply)

    def _push(self, item: _Queued) -> None:
        with self._cond:
            self._push_locked(item)

    def _push_locked(self, item: _Queued) -> None:
        if not self._cond.wait_for(lambda: len(self._queue) < _OWNER_DEPTH, max(item.deadline - _now(), 0.0)):
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
            reply, payload = item.reply, None
            if reply is None:
                try:
                    item.wait(item.deadline)
                    reply, payload = _payload_reply(item.payload)
                except Exception as exc:  # noqa: BLE001 - a driver failure still answers its chunk
                    reply = error_reply(exc)
            try:
                self._send(item.request_id, reply, payload)
            finally:
                if item.release is not None:
                    item.release()
            with self._cond:
                self._queue.popleft()
                self._cond.notify_all()

    def _send(self, request_id: int, reply: peer_pb2.PeerReply, payload: memoryview | None = None) -> None:
        try:
            if reply is _OK and not request_id:
                self._stream.send_serialized(_OK_FRAME)
            elif payload is None:
                self._stream.send(peer_pb2.PeerFrame(request_id=request_id, reply=reply))
            else:
                self._stream.send(peer_pb2.PeerFrame(request_id=request_id, reply=reply), [payload], deadline=_now() + _OWNER_COPY_S)
        except HMCError as exc:  # the connection broke: the server's receive loop ends it
            _log.debug("a staging reply was not sent: %s", exc)

    def drain(self) -> None:
        """Wait until every queued copy finished and its reply went out (each copy is bounded by its deadline)."""
        with self._cond:
            last = self._queue[-1].deadline if self._queue else 0.0
            if not self._cond.wait_for(lambda: not self._queue, max(last - _now(), 0.0) + _JOIN_S):
                raise TimeoutError("the owner's staging copies did not finish before their deadline")

    def close(self) -> None:
        """Let the queued copies finish (bounded), then unmap the rings."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(_OWNER_COPY_S + _JOIN_S)
        for mapping in self._mappings.values():
            mapping.close()
        self._mappings.clear()
        if self._copier is not None:
            self._copier.close()


def _payload_reply(payload: memoryview | None) -> tuple[peer_pb2.PeerReply, memoryview | None]:
    """The reply to a finished copy: plain, or announcing the `payload` that follows it."""
    return (_OK, None) if payload is None else (peer_pb2.PeerReply(payload_bytes=payload.nbytes), payload)


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
        self._copier = _Copier()

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
            if _now() > request.deadline:
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
        if not link.lock.acquire(timeout=max(request.deadline - _now(), 0.0)):
            request.completion.finish(TimeoutError(f"the staging ring to agent {owner.id} stayed busy until the deadline"))
            return
        try:
            if link.closed:
                raise BrokenResourceError(f"agent {owner.id} went away")
            self._prepare(link, owner, request.deadline)
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

    def _prepare(self, link: _Link, owner: common_pb2.AgentInfo, deadline: float) -> None:
        if link.ring is None:
            link.ring, link.name = self._new_ring(self._slots * self._slot_bytes)
        if link.stream is None or link.stream.broken:
            link.drop_stream()
            link.stream = self._connect(owner, deadline)

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
                    write = peer_pb2.DataWrite(buffer_id=remote.id, access_key=remote.access_key, ranges=_range_list(far, lengths, "dst_offsets"))
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
            read = peer_pb2.DataRead(buffer_id=remote.id, access_key=remote.access_key, ranges=_range_list(far, lengths, "src_offsets"))
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


def _now() -> float:
    import time

    return time.monotonic()
