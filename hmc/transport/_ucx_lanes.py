"""The lanes of the `ucx` and `rdma` paths: workers on progress threads of their own, and the transfers they run.

UCX moves cma and tcp bytes on the thread that posts or progresses them, so one worker moves at most one
core's worth: a path has `workers` lanes (`hmc.transport._ucx_progress.Progress` each), and a large
transfer is split into one part per lane (`_PART_MIN` bytes at least each; over sockets to a peer on this
host, into at most half this process's cores' worth: `lanes_on_one_host`; a pushed read, whose asker's host
its Push does not say, takes every lane). A lane connects an endpoint to
the owner's worker of the same index (peer error handling off: HMC learns that a peer died from its control
channel, `fail_peer`), unpacks the grant's key once, and posts its part window by window (`_WINDOW_BYTES`,
`_WINDOWS` in flight; device memory in one), each window one call below Python followed by a flush whose
completion says it landed, and a last, confirming flush (UCX completes a cma put into a dead process
without an error of its own, and fails the endpoint afterwards).

A transfer ends when all its parts have: a failed part stops the others from posting, and the end is
reported once nothing of the transfer is in flight, with the first error; a dead peer ends it at once.
At the deadline no window starts any more, and the transfer ends (TimeoutError) once the windows in flight
landed: their flushes are watched `_LANDING_S` longer. UCX cancels nothing, so a flush that misses even that goes
on: the transfer reports its end then, but stays in flight (`on_end` not yet run: its grant and its local memory
still count it) until the flush ends, watched up to `_LINGER_S` more, or for good if it never does. Before, the
flushes expired with the deadline, so a transfer that timed out stopped counting against its grant while its windows
still landed, and the owner's `unregister()` returned before they did (over tcp, tens of MiB landed afterwards; with
an owner slowed by a CPU quota, 99 MiB still after the landing bound). A cancel (the handle's
`on_cancel`) stops posting and waits, bounded by `STOP_WAIT_S`, for what is in flight.

Keys: a revoked grant's key is destroyed by its lane once no part of the grant is on it (`drop_keys`, and the
last part's end), unless something it posted did not complete (a timeout, a failure: `Grant.kept`), which UCX
may still run with the key; those stay until the worker closes.

Concurrency: a lane's endpoints and parts belong to its thread; a transfer's counters to `Transfer.lock`;
a grant's unpacked keys to the lane of their index.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hmc.errors import BrokenResourceError, ClosedResourceError, HMCError, TimeoutError, UnavailableError, UnsupportedError
from hmc.memory import DeviceKind, MemoryKind
from hmc.transport import _ucx_engine as engine
from hmc.transport._base import TransferOp, TransferRequest
from hmc.transport._ranges import RangeList
from hmc.transport._ucx_progress import Missed, Progress
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["SETTLE_S", "STOP_WAIT_S", "Grant", "Lanes", "connect", "lanes_on_one_host", "may_use_sockets", "memory_kind", "sockets_only"]

_WINDOW_BYTES = 64 << 20
"""Bytes of a part posted before its flush. Each flush costs a round of both progress threads (about 0.1 ms
on the 2-core VM), so windows are large; with `_WINDOWS` in flight, what a stopped owner may still get."""
_WINDOWS = 2
_PART_MIN = 4 << 20
"""Smallest share of a transfer worth a lane of its own (as for ipc's threads)."""
_MAX_WORKER_ADDRESS = 1 << 16
_SOCKETS = frozenset({"tcp"})
"""UCX transports whose bytes the owner's threads move too (its worker reads them off the socket), unlike cma's and
shared memory's, which the initiator's thread moves alone."""
_BESIDE = frozenset({"cuda_copy", "rocm_copy", "self"})
"""Transports that only copy between memory kinds next to a network transport (tcp,cuda_copy)."""
STOP_WAIT_S = 5.0
"""How long a cancel or a withdrawal waits for windows in flight to land."""
_LANDING_S = 0.5
"""How long past its deadline a transfer waits for its windows in flight to land before it ends (a healthy owner
lands two 64 MiB windows a lane within tens of milliseconds; one that stopped progressing, never: README, "Failure
semantics"), within the bound on a wait's overrun."""
_LINGER_S = 60.0
"""How long a flush that missed its landing bound is watched on: past that, what it covered counts as in flight for
good (a withdrawal of its grant or of its local memory then fails with DeviceError instead of returning)."""
SETTLE_S = _LANDING_S + _LINGER_S
"""How long past its deadline a transfer may stay in flight before it counts as in flight for good."""


class Grant:
    """The right to put into / get from one remote buffer, with the keys each lane unpacked for it."""

    __slots__ = (
        "address", "buffer_id", "flights", "inline_kept", "inline_rkey", "kept", "key", "mapped", "owner", "read_only", "remote_kind", "revoked", "rkey", "rkeys", "size",
        "workers",
    )  # fmt: skip

    def __init__(
        self, handle: common_pb2.UcxHandle, *, buffer_id: str, size: int, read_only: bool, key: bytes, owner: str, lanes: int, remote_kind: int = 0,
    ) -> None:  # fmt: skip
        workers = [bytes(w) for w in handle.workers]
        if not handle.rkey or not workers or any(not 0 < len(w) <= _MAX_WORKER_ADDRESS for w in workers):
            raise UnsupportedError(f"agent {owner or '?'} gave buffer {buffer_id} without a usable UCX key and worker address")
        self.key, self.owner, self.buffer_id = key, owner, buffer_id
        self.address, self.size, self.read_only = handle.address, size, read_only
        self.workers = workers
        self.rkey = bytes(handle.rkey)
        self.rkeys: list[engine.RemoteKey | None] = [None] * lanes
        """Per lane, unpacked on that lane's thread."""
        self.inline_rkey: engine.RemoteKey | None = None
        """For the callers' own worker (`_ucx_inline.CallersWorker`), unpacked under its lock."""
        self.kept: set[int] = set()
        """Lanes whose key an operation that did not complete (a timeout, a failure) may still use: never destroyed
        before the worker is (UCX keeps using a key for what it still has queued)."""
        self.inline_kept = False
        """The same for the callers' worker's key (under its lock)."""
        self.remote_kind = remote_kind
        """The buffer's device kind (common.proto; 0: not known, as for a pushed read's target)."""
        self.mapped: dict[str, int] = {}
        """Local GPU name -> where UCX maps the buffer for it (0: nowhere); set under the callers' worker's lock (`_ucx_mapped`)."""
        self.flights = 0
        self.revoked: HMCError | None = None

    @classmethod
    def granted(cls, message: peer_pb2.BufferGrant, remote: common_pb2.BufferDescriptor, lanes: int) -> Grant:
        """The grant of `remote` that its owner sent."""
        return cls(
            message.handles.ucx, buffer_id=message.buffer_id, size=message.size, read_only=message.read_only, key=remote.access_key, owner=remote.owner.id,
            lanes=lanes, remote_kind=remote.device.kind,
        )  # fmt: skip

    def worker(self, lane: int) -> bytes:
        return self.workers[lane % len(self.workers)]


class Transfer:
    """One request, split into parts that run on lanes; reported once when every part has ended."""

    def __init__(self, request: TransferRequest, grant: Grant, parts: int, on_end: Callable[[], None]) -> None:
        self.request, self.grant, self._on_end = request, grant, on_end
        self.lock = threading.Lock()  # guards remaining and error
        self.remaining = parts
        self.error: BaseException | None = None
        self.failed = False
        """A part failed: the others post nothing more."""
        self.cancelled = False
        self.ended = threading.Event()
        """Set once every part has ended (a flush that missed its landing bound may still be on: `lingering`)."""
        self.lingering = 0
        """Flushes that missed their landing bound and go on in UCX: until they end, `on_end` waits."""
        self.stuck = False
        """One of them never ended: the transfer stays in flight for good."""
        self.settled = False
        """`on_end` ran (once: a part reported at once for a dead peer may have a flush lingering after)."""

    def _settles(self) -> bool:
        """Under `lock`: whether nothing of it is in flight any more, the first time that holds."""
        if self.settled or self.remaining or self.lingering or self.stuck:
            return False
        self.settled = True
        return True

    def part_ended(self, error: BaseException | None) -> None:
        with self.lock:
            self.remaining -= 1
            if error is not None and self.error is None:
                self.error = error
                self.failed = True
            last = self.remaining == 0
            settled = self._settles()
        if settled:
            self._on_end()
        if last:
            self.ended.set()
            if not self.cancelled:
                self.request.completion.finish(self.error)

    def linger(self) -> None:
        """A flush of it missed its landing bound (it goes on: watched on)."""
        with self.lock:
            self.lingering += 1

    def lingered(self, error: BaseException | None) -> None:
        """A lingering flush ended (`error` None or its failure: nothing of it runs any more) or was given up on
        (Missed: it may run for good)."""
        with self.lock:
            self.lingering -= 1
            self.stuck = self.stuck or isinstance(error, Missed)
            settled = self._settles()
        if settled:
            self._on_end()


@dataclasses.dataclass(eq=False)
class Part:
    """A transfer's share on one lane: its windows and how many are in flight."""

    transfer: Transfer
    lane: Lane
    windows: list[RangeList]
    device: bool
    """Device memory at this end: its copies signal no event, so its flushes are polled without a pause."""
    next: int = 0
    in_flight: int = 0
    confirming: bool = False
    """Its windows all landed; one more flush is out, which fails if UCX failed the endpoint meanwhile (a put
    into a dead process can complete without an error of its own)."""
    stopping: bool = False
    reported: bool = False
    error: BaseException | None = None
    index: int = 0
    """Its lane's index (the grant's key for it is `grant.rkeys[index]`)."""
    dirty: bool = False
    """Something it posted did not complete (a post or flush failed or timed out): its lane's key of the grant stays."""


class Lane:
    """One worker with its progress thread, and the endpoints and parts it drives (its thread only)."""

    def __init__(self, context: engine.Context, name: str) -> None:
        self.progress = Progress(engine.Worker(context), name)
        self.endpoints: dict[bytes, engine.Endpoint] = {}
        self.parts: set[Part] = set()


class Lanes:
    """The workers of one path's context, each on its progress thread, and the transfers they run."""

    def __init__(self, context: engine.Context, count: int, name: str) -> None:
        self.lanes = [Lane(context, f"{name}-{i}") for i in range(count)]
        self._next = itertools.count()

    @property
    def addresses(self) -> list[bytes]:
        """The workers' addresses, in lane order (what a grant hands out)."""
        return [lane.progress.worker.address for lane in self.lanes]

    def launch(self, request: TransferRequest, grant: Grant, mapping: engine.Mapping, on_end: Callable[[], None], *, most: int = 0) -> None:
        """Split the request into one part per lane (above `_PART_MIN` bytes each; at most `most` parts where it is not 0),
        host memory in windows (device copies end within microseconds: nothing to bound), and hand each part to its
        lane; `on_end` runs once nothing of the transfer is in flight any more."""
        total = request.ranges.total
        lanes = self.lanes
        if not lanes:  # closed meanwhile
            on_end()
            request.completion.finish(ClosedResourceError("the UCX path was closed"))
            return
        count = max(1, min(len(lanes), total // _PART_MIN, most or len(lanes)))
        shares = request.ranges.chunks(-(-total // count)) if count > 1 else [request.ranges]
        transfer = Transfer(request, grant, len(shares), on_end)
        first = next(self._next)
        parts = []
        for i, share in enumerate(shares):
            index = (first + i) % len(lanes)
            device = memory_kind(request.local) is not DeviceKind.HOST
            parts.append((index, Part(transfer, lanes[index], [share] if device else share.chunks(_WINDOW_BYTES), device, index=index)))
        request.completion.set_running()
        request.completion.on_cancel = lambda: self._stop(transfer, [part for _, part in parts])
        for index, part in parts:
            try:
                part.lane.progress.submit(lambda index=index, part=part: self._start(index, part, mapping))
            except HMCError as exc:
                self._report(part, exc)

    def _start(self, index: int, part: Part, mapping: engine.Mapping) -> None:
        """Lane thread: connect, unpack the key, post the first windows."""
        grant, transfer, lane = part.transfer.grant, part.transfer, part.lane
        if transfer.cancelled or transfer.failed:
            self._report(part, None)
            return
        lane.parts.add(part)
        try:
            if grant.revoked is not None:
                raise grant.revoked
            address = grant.worker(index)
            endpoint = lane.endpoints.get(address)
            if endpoint is None:
                endpoint = lane.endpoints[address] = connect(lane.progress.worker, address, grant)
            if grant.rkeys[index] is None:
                grant.rkeys[index] = endpoint.unpack(grant.rkey)
        except HMCError as exc:
            self._end(part, exc)
            return
        self._pump(index, part, endpoint, mapping)

    def _pump(self, index: int, part: Part, endpoint: engine.Endpoint, mapping: engine.Mapping) -> None:
        """Post windows until `_WINDOWS` are in flight (or none is left); end the part when all landed."""
        transfer = part.transfer
        request, grant = transfer.request, transfer.grant
        base, remote_base = np.uint64(request.local.region.address), np.uint64(grant.address)
        while not part.stopping and part.in_flight < _WINDOWS and part.next < len(part.windows):
            if transfer.cancelled or transfer.failed or grant.revoked is not None:
                self._end(part, grant.revoked)
                return
            if time.monotonic() > request.deadline:  # no window starts after it; those in flight end the part
                self._end(part, TimeoutError("the transfer missed its deadline"))
                return
            window = part.windows[part.next]
            part.next += 1
            local, remote = (window.src, window.dst) if request.op is TransferOp.WRITE else (window.dst, window.src)
            op = "write" if request.op is TransferOp.WRITE else "read"
            try:
                endpoint.post(op, mapping, local.astype(np.uint64) + base, remote.astype(np.uint64) + remote_base, window.lengths, grant.rkeys[index])  # type: ignore[arg-type]
                flush = endpoint.flush_start()
            except HMCError as exc:
                part.dirty = True  # what it posted before the failure may still run
                self._end(part, exc)
                return
            part.in_flight += 1
            nbytes = window.total
            part.lane.progress.watch(
                flush, request.deadline + _LANDING_S, lambda error, n=nbytes: self._landed(index, part, endpoint, mapping, n, error), busy=part.device,
                then=transfer.lingered, linger=_LINGER_S,
            )  # fmt: skip
        if part.in_flight == 0 and not part.stopping:
            if part.confirming:
                self._end(part, None)
                return
            part.confirming = True
            try:
                flush = endpoint.flush_start()
            except HMCError as exc:
                self._end(part, exc)
                return
            part.in_flight += 1
            part.lane.progress.watch(
                flush, request.deadline + _LANDING_S, lambda error: self._landed(index, part, endpoint, mapping, 0, error), busy=part.device,
                then=transfer.lingered, linger=_LINGER_S,
            )  # fmt: skip

    def _landed(self, index: int, part: Part, endpoint: engine.Endpoint, mapping: engine.Mapping, nbytes: int, error: BaseException | None) -> None:
        part.in_flight -= 1
        if isinstance(error, Missed):  # it goes on, watched on: the transfer stays in flight until it ends
            part.transfer.linger()
        if error is not None:
            part.dirty = True  # a flush that failed or timed out: what it covered may still run
            self._end(part, error)
            return
        part.transfer.request.completion.add_bytes(nbytes)
        if part.stopping:
            self._end(part, None)
        else:
            self._pump(index, part, endpoint, mapping)

    def _end(self, part: Part, error: BaseException | None, *, now: bool = False) -> None:
        """Lane thread: post nothing more; report the part once nothing of it is in flight (`now`: at once, its
        peer is gone and nothing can land)."""
        part.stopping = True
        if error is not None and part.error is None:
            part.error = error
        if part.in_flight == 0 or now:
            self._report(part, part.error)

    def _report(self, part: Part, error: BaseException | None) -> None:
        if not part.reported:
            part.reported = True
            lane, grant = part.lane, part.transfer.grant
            lane.parts.discard(part)
            if part.dirty or part.in_flight:
                grant.kept.add(part.index)
            part.transfer.part_ended(error)
            if grant.revoked is not None and lane.progress.on_thread():  # the grant's last part here may have ended
                self._drop_key(part.index, lane, grant)

    def _stop(self, transfer: Transfer, parts: list[Part]) -> None:
        """The handle's cancel hook: post no more, wait (bounded) until what is in flight has landed."""
        transfer.cancelled = True
        for part in parts:
            try:
                part.lane.progress.submit(lambda part=part: self._end(part, None))
            except HMCError:
                self._report(part, None)
        if not any(lane.progress.on_thread() for lane in self.lanes):
            transfer.ended.wait(STOP_WAIT_S)

    def drop_keys(self, grant: Grant) -> None:
        """A revoked grant's keys are not needed any more: each lane destroys its own, once no part of the grant is on
        it and nothing it posted may still run (else the key stays until the worker closes)."""
        for index, lane in enumerate(self.lanes):
            if grant.rkeys[index] is not None:
                try:
                    lane.progress.submit(lambda index=index, lane=lane: self._drop_key(index, lane, grant))
                except HMCError:  # closed: the worker takes its keys with it
                    pass

    def _drop_key(self, index: int, lane: Lane, grant: Grant) -> None:
        """Lane thread: destroy the revoked grant's key of this lane, when nothing uses it any more."""
        key = grant.rkeys[index]
        if key is None or index in grant.kept or any(part.transfer.grant is grant for part in lane.parts):
            return
        grant.rkeys[index] = None
        key.destroy()

    def fail_peer(self, grants: list[Grant], error: HMCError) -> None:
        """The owner of `grants` is gone: their transfers end now, with `error` (nothing of them can land)."""
        for lane in self.lanes:
            try:
                lane.progress.submit(lambda lane=lane: self._fail_peer(lane, grants, error))
            except HMCError:
                pass

    def _fail_peer(self, lane: Lane, grants: list[Grant], error: HMCError) -> None:
        for part in list(lane.parts):
            if part.transfer.grant in grants:
                self._end(part, error, now=True)
        index = self.lanes.index(lane) if lane in self.lanes else -1
        for grant in grants:
            if index >= 0:
                self._drop_key(index, lane, grant)
        for grant in grants:
            for address in grant.workers:
                endpoint = lane.endpoints.pop(address, None)
                if endpoint is not None:
                    endpoint.close(1e-6)  # without waiting: nobody answers a flush any more

    def close(self, deadline: float) -> bool:
        """Fail what is in flight, destroy the workers, join their threads, all by `deadline`: whether every thread
        ended (False: one may still be inside UCX; its context must stay); idempotent."""
        lanes, self.lanes = self.lanes, []
        for lane in lanes:
            lane.progress.stop(deadline)
        ended = [lane.progress.join(deadline) for lane in lanes]  # every one joined, not only up to the first that did not end
        return all(ended)


def _names(transports: str) -> set[str]:
    """The transports a UCX_TLS list names."""
    return {name.strip() for name in transports.split(",") if name.strip()}


def sockets_only(transports: str) -> bool:
    """Whether a UCX_TLS list leaves UCX nothing but sockets between two processes (e.g. "tcp", "tcp,cuda_copy")."""
    names = _names(transports) - _BESIDE
    return bool(names) and names <= _SOCKETS


def may_use_sockets(transports: str) -> bool:
    """Whether a UCX_TLS list lets UCX use sockets ("": UCX's own choice, which may)."""
    names = _names(transports)
    return not names or bool(names & (_SOCKETS | {"all"}))


def lanes_on_one_host(transports: str, cores: int) -> int:
    """The most lanes a transfer takes to a peer on this host (0: no limit), for `transports` (this agent's UCX_TLS)
    and the `cores` this process may run on. Over sockets each lane keeps a core busy at both ends, its progress
    thread and the owner's worker of its index, and both ends' cores are this host's: at most half of them (2-core
    VM, UCX over tcp, one lane against two, alternated three times: 256 MiB 4.52-4.91 against 4.17-4.53 GB/s,
    4096 x 64 KiB 3.16-3.55 against 2.71-3.09). Over cma or shared memory the owner moves nothing, and between hosts
    each end has its own cores: every lane."""
    return max(1, cores // 2) if sockets_only(transports) else 0


def connect(worker: engine.Worker, address: bytes, grant: Grant) -> engine.Endpoint:
    """An endpoint to the worker a grant named: one UCX cannot reach any more belongs to a peer that is gone."""
    try:
        return worker.connect(address)
    except UnavailableError as exc:
        raise BrokenResourceError(f"agent {grant.owner}, which granted buffer {grant.buffer_id}, cannot be reached any more: {exc}") from exc


def memory_kind(buffer: Any) -> DeviceKind:
    return buffer.region.device.kind if buffer.region.kind is MemoryKind.DEVICE else DeviceKind.HOST
