"""The `staged` path for device memory between two processes of one host: a shared pinned ring.

device -> pinned ring -> device. The initiator creates a ring of `slots` slots of
`slot_bytes` each (8 x 16 MiB) in a file under /dev/shm (the temporary directory
where /dev/shm is too small, as in containers), maps it and pins it (cuMemHostRegister);
the owner maps the same file (and pins it where it has CUDA) on the first frame
naming it, once per data connection. The wire is the ring; the data connection
only carries slot hand-offs: DataWrite / DataRead frames whose `shm` field names
the slot, and the owner's replies, in frame order.

Chunks are the ranges laid end to end and cut at slot boundaries (`RangeList.packed`,
vectorized); a chunk's copy between device memory and its slot is one batch on the
GPU's lane (`_pinned.SlotCopier`): a few ranges go to the copy engines, many are one
launch of the batched copy kernel, which gathers them into the slot or scatters them
out of it through the slot's device mapping. No call per range.

Both sides keep their GPU copies fed. WRITE: the initiator queues the device-to-host
copies of a chunk into every free slot, hands off the oldest chunk as soon as its copy finished
(DataWrite naming the slot), and collects the replies that arrive while it waits for a copy
(a select on the socket between looks at the copy's event): a slot freed by a reply gets its
next chunk's copy queued at once, behind the copies still running, so the copy engine never
waits for Python. The owner queues each hand-off's host-to-device copy on its GPU's stream the
moment the frame arrives (behind the earlier ones) and replies from a completion thread once
the copy finished; a slot is reused only after its reply. So the initiator's GPU copies chunk
k+1 out while the owner's GPU copies chunk k in, each over its own PCIe link. READ: the
initiator asks for the first `slots` chunks at once; the owner queues their device-to-host
copies back to back and replies as each finishes; the initiator queues the copy out of every
slot whose reply arrived (also while it waits for the oldest copy), and asks for the chunk
`slots` further in the slot whose copy finished. Every chunk is cut from the ranges only
when its slot is free (`RangeList.packed`). Small slots keep
the pipeline's fill and drain short; eight of them absorb the hand-off latency. One H100, both
ends on it, 256 MiB of KV blocks: the GPU timeline showed the copy engine idle 0.5 ms once per
transfer while a reply waited behind a copy, and 0.2-0.6 ms before the first copy while all
chunks were cut; without both, KV went from 0.68-0.77x to 0.76-0.82x of the 1 GiB rate
(bench/results/gpu-1x-nvidia-h100-2026-11-25.json).

Either side's memory may be host memory (copied with memmove) or CUDA device
memory. Every wait (socket and GPU) is bounded by the request's deadline, the
owner's by `_OWNER_COPY_S` per slot; a broken connection fails the transfer, and a
transfer that does not end cleanly drops its connection and its ring (the owner
may still be copying into it; the next transfer makes a new one).

Small transfers (up to `SMALL_BYTES`) run on the caller's thread when the peer's ring
is free: one hand-off each way, the copy's event and the reply polled briefly before
sleeping; the owner answers them from the thread that read the frame. A single range of
up to one slot (the agent's inline route) is handed off through the ring's mailbox page
(`_staged_mailbox`: shared memory, no system call while the owner polls it), and the owner
answers it, as any transfer's last chunk, from the thread that read it when nothing is queued
before it.

Concurrency: each peer's transfers run one after another under the peer's
`_Link.lock`, which owns the peer's connection and ring (and keeps close from
pulling them away mid-transfer): on the peer's worker thread ("hmc-staged-shm",
started on first use, stopped when the peer is forgotten), or, for a small transfer
that finds the lock free, on the caller's thread. A transfer still queued at its
deadline fails without running. The owner side is `_staged_serve` (the frames) and
`_staged_owner.OwnerSegments` (the slot copies); mappings and slot copies are `_pinned`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import struct
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from hmc.errors import BrokenResourceError, HMCError, ProtocolError, TimeoutError, UnsupportedError
from hmc.memory import DeviceKind
from hmc.transport import _gpu_batch
from hmc.transport._base import InlineCopy, TransferOp, TransferRequest
from hmc.transport._pinned import Pending, PinnedMapping, SlotCopier, StuckCopy
from hmc.transport._staged_mailbox import MAILBOX_BYTES, SUPPORTED, Mailbox, encode_request, token_of
from hmc.transport._staged_rings import ring_path
from hmc.transport._deadlines import shares_clock, stamp
from hmc.transport._wire import FrameStream, raise_for_reply
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["SLOT_BYTES", "SMALL_BYTES", "ShmStaging", "frame_of", "reply_of"]

_log = logging.getLogger(__name__)
SLOT_BYTES = 16 << 20
"""A ring slot: the most one chunk of a staged device-memory transfer holds."""
SMALL_BYTES = 256 << 10
"""Transfers up to this size run on the caller's thread when the ring is free (one hand-off each way), and the
owner answers them from the thread that read the frame, when no copy is queued before them."""
_I64 = struct.Struct("<q")
_SHORT_RANGE = 1 << 20
"""Ranges shorter than this on average make a transfer of many short ranges (`ShmStaging._layout`)."""
_NAP_S = 50e-6
"""How long a transfer with chunks in flight sleeps on its connection between looks at its oldest copy."""
_POLL_S = 200e-6
"""How long a small transfer polls for its reply before it sleeps in the receive (a wake-up costs more)."""
_SPIN_RATE = 20e9
"""The least a slot's copy is expected to move, bytes a second (PCIe 4 and later): a wait for a copy of n bytes, or for
the reply to a chunk of n bytes that is all this end waits for, polls for n / this more before sleeping (capped at
`_SPIN_MAX_S`), since waking a thread costs tens to hundreds of microseconds on the project's VMs."""
_SPIN_MAX_S = 1e-3
Connect = Callable[[common_pb2.BufferDescriptor, float], FrameStream]


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
        self.stuck = False
        """A GPU copy into or out of the ring missed its deadline: the ring is abandoned, never unmapped or reused."""
        self.mailbox: Mailbox | None = None
        """The ring's mailbox (`_staged_mailbox`), where small requests go once the connection's owner attached it."""

    def drop_stream(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def drop(self) -> None:
        """After a failed transfer: the connection, and the ring (the owner may still be copying into it); a ring a
        stuck GPU copy may still touch stays mapped and pinned (leaked), only its file goes."""
        self.drop_stream()
        if self.mailbox is not None:  # its views go before the ring is unmapped
            self.mailbox.close()
            self.mailbox = None
        if self.ring is not None:
            if self.stuck:
                _log.warning("a staging copy is stuck on the GPU: its %d MiB ring is abandoned", self.ring.size >> 20)
                self.ring.abandon()
            else:
                self.ring.close()
            self.ring = None
            self.stuck = False
            if self.name:
                with contextlib.suppress(OSError):
                    os.unlink(self.name)

    def close(self) -> None:
        self.closed = True
        self.drop()


def _settle(link: _Link, wait: Callable[[float], None], deadline: float) -> None:
    """Wait for a copy left queued by a failed transfer; one that is stuck marks the link's ring abandoned."""
    try:
        wait(deadline)
    except StuckCopy:
        link.stuck = True
    except HMCError as exc:
        _log.debug("a staging copy left by a failed transfer failed: %s", exc)


def _drop(link: _Link, error: BaseException) -> None:
    """Drop a failed transfer's ring and connection, first letting go of what its traceback's frames hold (views
    of the ring, which would keep it mapped for as long as the error lives)."""
    traceback.clear_frames(error.__traceback__)
    link.drop()


def _copied_first(copy: Pending, stream: FrameStream, deadline: float) -> bool:
    """Wait for a queued copy or for the next reply on `stream`, whichever comes first: False when the reply did
    (its slot can take more work before this copy is waited for), True when the copy finished or `deadline` passed
    (the copy's own wait says which)."""
    while not copy.done():
        if stream.readable(_NAP_S):
            return False
        if time.monotonic() > deadline:
            return True
    return True


def _stepwise(request: TransferRequest) -> bool:
    """Whether this end of `request` queues a slot's batch in steps from Python rather than in one C call
    (`_gpu_batch`): GPU memory whose runtime has no helper here (not built, or its library does not load). The
    other end is taken to have its helper, as an install of the same release does (CUDA and HIP alike)."""
    device = request.local.region.device
    if device.kind not in (DeviceKind.CUDA, DeviceKind.HIP):
        return False
    from hmc.memory import backend_for

    try:
        backend: Any = backend_for(device)
    except HMCError:  # no backend for it here: nothing of it runs in C either
        return True
    return _gpu_batch.helper_for(backend.runtime) is None


def frame_of(message: peer_pb2.DataWrite | peer_pb2.DataRead) -> peer_pb2.PeerFrame:
    return peer_pb2.PeerFrame(write=message) if isinstance(message, peer_pb2.DataWrite) else peer_pb2.PeerFrame(read=message)


def _copy_spin(nbytes: int) -> float:
    """How long a wait for a copy of `nbytes` (or the reply to it) polls beyond the first microseconds (`_SPIN_RATE`)."""
    return min(nbytes / _SPIN_RATE, _SPIN_MAX_S)


def reply_of(stream: FrameStream, deadline: float, spin_s: float = 0.0) -> peer_pb2.PeerReply:
    """The next reply on a data connection (polled for `spin_s` before the receive sleeps: `ShmStaging._reply_spin`);
    a refusal raises its typed error."""
    answer = stream.recv(deadline, spin_s=spin_s)
    if answer.WhichOneof("kind") != "reply":
        raise ProtocolError(f"expected a reply on a data connection, got {answer.WhichOneof('kind')}")
    if stream.inline_bytes and stream.inline_bytes != answer.reply.payload_bytes:
        raise ProtocolError(f"a reply carried {stream.inline_bytes} bytes inline but announced {answer.reply.payload_bytes}")
    raise_for_reply(answer.reply)
    return answer.reply


def _range_list(offsets: np.ndarray, lengths: np.ndarray, field: str) -> common_pb2.RangeList:
    return common_pb2.RangeList(**{field: offsets.tobytes(), "lengths": lengths.tobytes()})


class ShmStaging:
    """Initiator side: moves requests that touch device memory through a shared pinned ring.

    The wire is three hooks (`_new_ring`, `_hand_off`, `_answer`); `_staged_tcp_ring.TcpRingStaging`
    replaces them to carry the slots' bytes over TCP between hosts."""

    _WORKER = "hmc-staged-shm"
    """The name of each peer's worker thread."""
    _PAIRED = True
    """Whether many short ranges may travel in pairs of slots (`_layout`); the TCP ring's owner slots hold one."""
    _MAILBOX = SUPPORTED
    """Whether rings carry a mailbox page (`_staged_mailbox`): the owner maps the ring only on one host."""
    _INLINE_BYTES = SLOT_BYTES
    """The longest single range the agent's inline route moves on the caller's thread (`inline`), within one slot: a
    range of one chunk gains nothing from the worker thread's pipeline and pays its hand-offs (2x-8x the copies' time
    for 1 MiB; docs/decisions.md, "A range of one slot is one round trip")."""

    def __init__(self, connect: Connect, *, slots: int = 8, slot_bytes: int = SLOT_BYTES) -> None:
        self._connect = connect
        self._slots = max(2, slots)
        self._slot_bytes = slot_bytes
        self._lock = threading.Lock()  # guards _links, _closed
        self._links: dict[str, _Link] = {}
        self._closed = False
        self._copier = SlotCopier()

    def post(self, request: TransferRequest) -> None:
        """Run a small transfer here when its peer's ring is free, else queue it for the peer's worker thread
        (started on first use); its completion reports the outcome."""
        if not request.ranges.total:
            request.completion.finish()
            return
        request.completion.set_running()
        with self._lock:
            if self._closed:
                request.completion.finish(BrokenResourceError("the staged path is closed"))
                return
            link = self._links.setdefault(request.remote.owner.id, _Link())
            if request.ranges.total <= SMALL_BYTES and link.requests.empty() and link.lock.acquire(blocking=False):
                small = True
            else:
                small = False
                link.requests.put(request)  # under _lock: a link popped by forget_peer/close gets its None after this
                if link.worker is None:
                    link.worker = threading.Thread(target=self._serve, args=(link,), name=self._WORKER, daemon=True)
                    link.worker.start()
        if small:
            try:
                self._run_locked(link, request)
            finally:
                link.lock.release()

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
        if not link.lock.acquire(timeout=max(request.deadline - time.monotonic(), 0.0)):
            request.completion.finish(TimeoutError(f"the staging ring to agent {request.remote.owner.id} stayed busy until the deadline"))
            return
        try:
            self._run_locked(link, request)
        finally:
            link.lock.release()

    def _run_locked(self, link: _Link, request: TransferRequest) -> None:
        """Move the request through the link's ring (its lock held) and finish its completion."""
        try:
            if link.closed:
                raise BrokenResourceError(f"agent {request.remote.owner.id} went away")
            self._prepare(link, request.remote, request.deadline)
            if request.op is TransferOp.WRITE:
                self._write(link, request)
            else:
                self._read(link, request)
        except HMCError as exc:
            link.stuck = link.stuck or isinstance(exc, StuckCopy)
            _drop(link, exc)
            request.completion.finish(exc)
            return
        except Exception as exc:  # noqa: BLE001 - the driver's own failures must still finish the request
            _drop(link, exc)
            request.completion.finish(BrokenResourceError(f"staging failed: {exc}"))
            return
        if link.closed:  # its peer was forgotten meanwhile: the ring and connection go with this transfer
            link.drop()
        request.completion.finish()

    def inline(self, local: Any, remote: common_pb2.BufferDescriptor, stall_s: float) -> InlineCopy:
        """One range of up to `_INLINE_BYTES` through slot 0 of the peer's ring on the caller's thread, the agent's fast
        path (within `stall_s`): the copy waited for on the spot, one hand-off, the reply polled for about as long as
        the owner's copy takes (`_copy_spin`) before sleeping."""
        owner, region = remote.owner, local.region

        def run(write: bool, local_offset: int, remote_offset: int, length: int) -> None:
            deadline = time.monotonic() + stall_s
            with self._lock:
                if self._closed:
                    raise BrokenResourceError("the staged path is closed")
                link = self._links.setdefault(owner.id, _Link())
            if not link.lock.acquire(timeout=stall_s):
                raise TimeoutError(f"the staging ring to agent {owner.id} stayed busy until the deadline")
            try:
                self._inline_locked(link, remote, write, region, local_offset, remote_offset, length, deadline)
            except HMCError as exc:
                link.stuck = link.stuck or isinstance(exc, StuckCopy)
                _drop(link, exc)
                raise
            except Exception as exc:  # noqa: BLE001 - the driver's own failures are typed here
                _drop(link, exc)
                raise BrokenResourceError(f"staging failed: {exc}") from exc
            finally:
                link.lock.release()

        def write(local_offset: int, remote_offset: int, length: int) -> None:
            run(True, local_offset, remote_offset, length)

        def read(local_offset: int, remote_offset: int, length: int) -> None:
            run(False, local_offset, remote_offset, length)

        longest = min(self._INLINE_BYTES, self._slot_bytes)
        return InlineCopy(write=write, read=read, local_size=local.size, remote_size=remote.size, max_bytes=longest, waits=True)

    def _inline_locked(
        self, link: _Link, remote: common_pb2.BufferDescriptor, write: bool, region: Any, local_offset: int, remote_offset: int, length: int, deadline: float
    ) -> None:
        if link.closed:
            raise BrokenResourceError(f"agent {remote.owner.id} went away")
        self._prepare(link, remote, deadline)
        stream, ring = link.stream, link.ring
        assert stream is not None and ring is not None
        spin = _copy_spin(length)
        if write:
            self._copier.copy(region, (local_offset,), (length,), ring, 0, to_slot=True, deadline=deadline, yield_s=spin)
        proof = stream.proof(remote.access_key, remote.registry_epoch)
        mailbox = link.mailbox
        if mailbox is not None and mailbox.ready(token_of(stream)):
            seq = mailbox.post(encode_request(write, remote.id, proof, remote_offset, length), stream, deadline)
            mailbox.answer(seq, stream, deadline, yield_s=spin)
        else:  # over the socket (naming the mailbox: the owner attaches it then)
            wire = common_pb2.RangeList(lengths=_I64.pack(length))
            if write:
                wire.dst_offsets = _I64.pack(remote_offset)
                message: peer_pb2.DataWrite | peer_pb2.DataRead = peer_pb2.DataWrite(buffer_id=remote.id, ranges=wire, key_proof=proof, last=True)
            else:
                wire.src_offsets = _I64.pack(remote_offset)
                message = peer_pb2.DataRead(buffer_id=remote.id, ranges=wire, key_proof=proof, last=True)
            self._hand_off(link, stream, stamp(message, deadline, shares_clock(remote)), 0, length, deadline)
            if write:
                reply_of(stream, deadline, self._reply_spin(length))
            else:
                self._answer(link, stream, 0, length, deadline)
        if not write:
            self._copier.copy(region, (local_offset,), (length,), ring, 0, to_slot=False, deadline=deadline, yield_s=spin)

    def _prepare(self, link: _Link, remote: common_pb2.BufferDescriptor, deadline: float) -> None:
        if link.ring is None:
            data = self._slots * self._slot_bytes
            if not self._MAILBOX:
                link.ring, link.name = self._new_ring(data)
            else:  # the mailbox page ends the ring, page-aligned
                at = -(-data // MAILBOX_BYTES) * MAILBOX_BYTES
                link.ring, link.name = self._new_ring(at + MAILBOX_BYTES)
                link.mailbox = Mailbox(link.ring.view(at, MAILBOX_BYTES))
        if link.stream is None or link.stream.broken:
            link.drop_stream()
            link.stream = self._connect(remote, deadline)
            if link.mailbox is not None:
                link.mailbox.offer(token_of(link.stream))

    def _new_ring(self, size: int) -> tuple[PinnedMapping, str]:
        """A ring the owner maps too: a new file in the ring directory, and its path (named in every hand-off)."""
        name = ring_path(size)
        try:
            return PinnedMapping(name, size, create=True), name
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(name)
            if isinstance(exc, OSError):
                raise UnsupportedError(f"cannot make a staging ring at {name}: {exc}") from exc
            raise

    def _hand_off(self, link: _Link, stream: FrameStream, message: peer_pb2.DataWrite | peer_pb2.DataRead, at: int, nbytes: int, deadline: float) -> None:
        """Send a chunk's request naming its slot (from byte `at`) of the shared ring (a write's bytes are there already)."""
        self._slot_of(link, message, at)
        stream.send(frame_of(message), deadline=deadline)

    @staticmethod
    def _slot_of(link: _Link, message: peer_pb2.DataWrite | peer_pb2.DataRead, at: int) -> None:
        """Name the ring's slot from byte `at` (and the ring's mailbox) in a request."""
        assert link.ring is not None
        message.shm.segment, message.shm.segment_bytes, message.shm.offset = link.name, link.ring.size, at
        if link.mailbox is not None:
            message.shm.mailbox = link.ring.size - MAILBOX_BYTES

    def _answer(self, link: _Link, stream: FrameStream, at: int, nbytes: int, deadline: float) -> None:
        """Take the owner's reply to the oldest chunk handed off (a read's `nbytes` are in its slot then)."""
        reply_of(stream, deadline, self._reply_spin(nbytes))

    def _reply_spin(self, nbytes: int) -> float:
        """How long a wait for the reply to a chunk of `nbytes`, all this end waits for, polls before it sleeps: about
        as long as the owner's copy of it takes (`_copy_spin`, plus `_POLL_S`)."""
        return min(_POLL_S + _copy_spin(nbytes), _SPIN_MAX_S)

    def _layout(self, request: TransferRequest) -> tuple[int, int]:
        """(chunk size, chunks in flight): one slot per chunk, all slots in flight; pairs of slots for many short
        ranges where this end queues each chunk's batch in steps from Python (`_stepwise`), whose cost per chunk a
        16 MiB copy does not hide (docs/decisions.md, "Every chunk is one 16 MiB slot where both ends batch in one C call")."""
        ranges = request.ranges
        if self._PAIRED and self._slots >= 4 and ranges.total < len(ranges) * _SHORT_RANGE and _stepwise(request):
            return 2 * self._slot_bytes, self._slots // 2
        return self._slot_bytes, self._slots

    def _write(self, link: _Link, request: TransferRequest) -> None:
        """Every free slot gets its chunk's copy queued, until the oldest copy finished: that one is handed off
        first; replies are collected as they come, also while the oldest copy is waited for (a slot a reply frees
        gets its next copy queued at once), and waited for alone only when no copy is queued."""
        stream, ring = link.stream, link.ring
        assert stream is not None and ring is not None
        remote, region, deadline, completion = request.remote, request.local.region, request.deadline, request.completion
        clocked = shares_clock(remote)
        size, slots = self._layout(request)
        chunks = request.ranges.packed(size)
        queued: collections.deque[tuple[Pending, peer_pb2.DataWrite, int, int]] = collections.deque()  # copying into slots
        inflight: collections.deque[int] = collections.deque()  # bytes of chunks handed off, reply pending
        started = 0
        try:
            while started < len(chunks) or queued or inflight:
                while inflight and stream.readable():  # replies already here free their slots
                    reply_of(stream, deadline)
                    completion.add_bytes(inflight.popleft())
                if completion.cancelled:
                    raise BrokenResourceError("transfer cancelled")
                while started < len(chunks) and len(queued) + len(inflight) < slots and not (queued and queued[0][0].done()):
                    chunk = chunks[started]  # (an oldest copy that finished is handed off first: the owner starts sooner)
                    slot = (started % slots) * size
                    wait = self._copier.start(region, chunk.src, chunk.lengths, ring, slot, to_slot=True, deadline=deadline)
                    write = peer_pb2.DataWrite(
                        buffer_id=remote.id, key_proof=stream.proof(remote.access_key, remote.registry_epoch), ranges=_range_list(chunk.dst, chunk.lengths, "dst_offsets"),
                        transfer_id=request.transfer_id, last=started == len(chunks) - 1,
                    )
                    queued.append((wait, write, slot, chunk.total))
                    started += 1
                if queued:
                    if inflight and not _copied_first(queued[0][0], stream, deadline):
                        continue  # a reply came first: its slot takes the next chunk's copy before this one is handed off
                    wait, write, slot, nbytes = queued.popleft()
                    wait(deadline)
                    self._hand_off(link, stream, stamp(write, deadline, clocked), slot, nbytes, deadline)  # stamped as it goes
                    inflight.append(nbytes)
                elif inflight:
                    reply_of(stream, deadline, self._reply_spin(inflight[0]))
                    completion.add_bytes(inflight.popleft())
        finally:
            while queued:  # never leave a queued copy running into a ring the next transfer reuses
                _settle(link, queued.popleft()[0], deadline)

    def _read(self, link: _Link, request: TransferRequest) -> None:
        """The owner fills up to `slots` slots ahead; each reply that arrived gets its copy out of the slot queued,
        the oldest copy is waited for, and its slot asked for the next chunk."""
        stream, ring = link.stream, link.ring
        assert stream is not None and ring is not None
        remote, region, deadline, completion = request.remote, request.local.region, request.deadline, request.completion
        clocked = shares_clock(remote)
        size, slots = self._layout(request)
        chunks = request.ranges.swapped().packed(size)  # src: local destinations, dst: remote sources

        def ask(index: int) -> None:
            chunk = chunks[index]
            read = peer_pb2.DataRead(
                buffer_id=remote.id, key_proof=stream.proof(remote.access_key, remote.registry_epoch), ranges=_range_list(chunk.dst, chunk.lengths, "src_offsets"),
                transfer_id=request.transfer_id, last=index == len(chunks) - 1,
            )
            self._hand_off(link, stream, stamp(read, deadline, clocked), (index % slots) * size, chunk.total, deadline)

        asked = min(slots, len(chunks))
        for index in range(asked):
            ask(index)
        copying: collections.deque[tuple[int, Pending]] = collections.deque()  # slot -> memory copies queued
        answered = done = 0
        try:
            while done < len(chunks):
                while answered < asked and (not copying or stream.readable()):
                    chunk = chunks[answered]
                    at = (answered % slots) * size
                    self._answer(link, stream, at, chunk.total, deadline)
                    if completion.cancelled:
                        raise BrokenResourceError("transfer cancelled")
                    copying.append((answered, self._copier.start(region, chunk.src, chunk.lengths, ring, at, to_slot=False, deadline=deadline)))
                    answered += 1
                if answered < asked and not _copied_first(copying[0][1], stream, deadline):
                    continue  # a reply came first: its copy out of the slot is queued behind this one
                index, wait = copying.popleft()
                wait(deadline)
                done += 1
                completion.add_bytes(chunks[index].total)
                if asked < len(chunks):
                    ask(asked)
                    asked += 1
        finally:
            while copying:
                _settle(link, copying.popleft()[1], deadline)

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
        link.closed = True  # first: a transfer that takes the lock from now on refuses to run (or reconnect)
        link.requests.put(None)
        if link.stream is not None:
            link.stream.shutdown()  # a transfer blocked on it fails now
        if link.lock.acquire(timeout=5.0):
            try:
                link.close()
            finally:
                link.lock.release()
        else:
            _log.warning("a staging ring stayed busy while its peer was forgotten; its transfer drops it when it ends")
