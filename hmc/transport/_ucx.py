"""The `ucx` and `rdma` paths: one-sided UCX puts and gets between registered ConnBuffers, both ends.

Engine. One UCP context per path and agent, with `workers` workers ("lanes"), each driven by its own progress
thread (`hmc.transport._ucx_progress`). Several lanes because UCX moves cma and tcp bytes on the thread that
posts or progresses them: one worker moves at most one core's worth, so a large transfer is split across the
lanes (NIXL's UCX backend has `num_workers` for the same reason).

Owner side. Every ConnBuffer is registered with the context once, when it is registered with the agent
(`export`: `ucp_mem_map`, device memory included where UCX found its transports), and unregistered when it is
withdrawn. The packed key, the buffer's address and the workers' addresses are handed out only in a
BufferGrant (`grant`), to a peer that proved the buffer's access key over its control channel: whoever holds
them can write the memory (as with `ipc`'s grants). The owner's progress threads are what land puts and gets
that UCX emulates (tcp, shared memory); cma and cuda_ipc land without them.

Initiator side. `post` asks the owner for a grant once per (buffer, key) on the caller's thread, then splits
the transfer into one part per lane (above `_PART_MIN` bytes each) and hands each to its lane, which connects
an endpoint to the owner's worker of the same index (peer error handling off: HMC learns that a peer died
from its control channel, `forget_peer`), unpacks the key once, and posts the part's ranges window by window
(`_WINDOW_BYTES`, `_WINDOWS` in flight), each window one call below Python (`Endpoint.post`) followed by a
flush whose completion says the window has landed. The notification that may follow is sent by the agent
after the transfer ended.

Ends. A transfer ends when all its parts have: a failed part stops the others from posting, and the end is
reported once nothing of the transfer is in flight, with the first error. A dead peer ends it at once (nothing
of it can land any more); an expiry at the deadline. UCX cancels no put or get, so a cancel (the handle's
`on_cancel`) and a withdrawal wait, bounded by `_STOP_WAIT_S`, for the windows in flight to land. A window in
flight to an owner that has stopped progressing (a frozen process, over tcp) can land when that owner
resumes, after its transfer ended: at most `_WINDOWS` windows per lane of that transfer's own bytes, into the
same buffer (docs/decisions.md, "The ucx and rdma paths").

Concurrency: `_lock` guards the grant table and each grant's `flights` (waited for under `_drained`); a
lane's endpoints and parts belong to its progress thread; a transfer's own counters to `_Transfer.lock`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hmc.errors import AccessDeniedError, ArgumentError, BrokenResourceError, BufferWithdrawnError, HMCError, TimeoutError, UnavailableError, UnsupportedError
from hmc import memory
from hmc.memory import DeviceKind, MemoryKind
from hmc.memory._machine import rdma_nics
from hmc.transport import _ucx_engine as engine
from hmc.transport._base import Capabilities, InlineCopy, PathName, TransferOp, TransferRequest, Transport
from hmc.transport._ranges import RangeList
from hmc.transport._ucx_progress import Progress
from hmc.transport._wire import raise_for_reply
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["RDMA_TRANSPORTS", "UcxTransport"]

_log = logging.getLogger(__name__)

OpenGrant = Callable[[common_pb2.BufferDescriptor, float], peer_pb2.BufferGrant]
RequestPush = Callable[[common_pb2.BufferDescriptor, peer_pb2.Push, float, Callable[[peer_pb2.PeerReply | None, BaseException | None], None]], None]
"""Sends a Push to a buffer's owner over the control channel; the callback hears its reply (or the failure)."""

RDMA_TRANSPORTS = "rc,dc,ud"
"""UCX's verbs transports: what the `rdma` path restricts its context to."""
_WINDOW_BYTES = 64 << 20
"""Bytes of a part posted before its flush. Each flush costs a round of both progress threads (about 0.1 ms
on the 2-core VM), so windows are large; with `_WINDOWS` in flight, what a stopped owner may still get."""
_WINDOWS = 2
_PART_MIN = 4 << 20
"""Smallest share of a transfer worth a lane of its own (as for ipc's threads)."""
_INLINE_BYTES = 1 << 20
"""Largest single range of host memory moved on the caller's thread: one put or get and a flush, no thread hop
(device memory always is: its copies end within microseconds)."""
_INLINE_RANGES = 64
"""Device memory in up to this many ranges is moved on the caller's thread; more ranges are posted by the lanes
side by side (UCX costs several microseconds of CPU per range: two threads post about 1.5x the ranges of one)."""
_PROBE_BYTES = 1 << 20
"""Bytes read from an owner as a get and as a push by the owner, timed on the first read (once per pair of memory
kinds), into a scratch buffer of this agent."""
_PUSH_PREFERRED = 0.8
"""Reads go as pushes where a push takes less than this fraction of a get's time."""
_TARGETS = 256
"""Askers' memories of pushed reads kept unpacked."""
_STOP_WAIT_S = 5.0
"""How long a cancel or a withdrawal waits for windows in flight to land."""
_MAX_WORKER_ADDRESS = 1 << 16
_KINDS = {"host": DeviceKind.HOST, "cuda": DeviceKind.CUDA, "rocm": DeviceKind.HIP}
_UCX_MEMORY = {DeviceKind.HOST: "host", DeviceKind.CUDA: "cuda", DeviceKind.HIP: "rocm"}


class _Grant:
    """The right to put into / get from one remote buffer, with the keys each lane unpacked for it."""

    __slots__ = ("address", "buffer_id", "flights", "inline_rkey", "key", "owner", "read_only", "revoked", "rkey", "rkeys", "size", "workers")

    def __init__(self, handle: common_pb2.UcxHandle, *, buffer_id: str, size: int, read_only: bool, key: bytes, owner: str, lanes: int) -> None:
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
        """For the callers' own worker (`_Inline`), unpacked under its lock."""
        self.flights = 0
        self.revoked: HMCError | None = None

    @classmethod
    def granted(cls, message: peer_pb2.BufferGrant, key: bytes, owner: str, lanes: int) -> _Grant:
        return cls(message.handles.ucx, buffer_id=message.buffer_id, size=message.size, read_only=message.read_only, key=key, owner=owner, lanes=lanes)

    def worker(self, lane: int) -> bytes:
        return self.workers[lane % len(self.workers)]


class _Transfer:
    """One request, split into parts that run on lanes; reported once when every part has ended."""

    def __init__(self, request: TransferRequest, grant: _Grant, parts: int, on_end: Callable[[], None]) -> None:
        self.request, self.grant, self._on_end = request, grant, on_end
        self.lock = threading.Lock()  # guards remaining and error
        self.remaining = parts
        self.error: BaseException | None = None
        self.failed = False
        """A part failed: the others post nothing more."""
        self.cancelled = False
        self.ended = threading.Event()
        """Set once no part has anything in flight any more."""

    def part_ended(self, error: BaseException | None) -> None:
        with self.lock:
            self.remaining -= 1
            if error is not None and self.error is None:
                self.error = error
                self.failed = True
            last = self.remaining == 0
        if last:
            self._on_end()
            self.ended.set()
            if not self.cancelled:
                self.request.completion.finish(self.error)


@dataclasses.dataclass(eq=False)
class _Part:
    """A transfer's share on one lane: its windows and how many are in flight."""

    transfer: _Transfer
    lane: _Lane
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


@dataclasses.dataclass(frozen=True)
class _Probe:
    """A get and a push by the owner, timed once per (owner, local memory kind, remote memory kind)."""

    nbytes: int
    get_bps: float
    push_bps: float
    push_reads: bool


class _Scratch:
    """A buffer of this agent that probes read into: its memory and registration."""

    def __init__(self, region: Any, mapping: engine.Mapping) -> None:
        self.region, self.mapping = region, mapping
        self.address, self.size = region.address, region.size

    def close(self) -> None:
        self.mapping.unmap()
        memory.free(self.region)


class _Done:
    """The completion of a read the owner pushes: `done` hears its end, once."""

    on_cancel: Callable[[], None] | None = None
    cancelled = False

    def __init__(self, done: Callable[[BaseException | None], None]) -> None:
        self._done: Callable[[BaseException | None], None] | None = done

    def set_running(self) -> None:
        return None

    def add_bytes(self, nbytes: int) -> None:
        return None

    def finish(self, error: BaseException | None = None) -> None:
        done, self._done = self._done, None
        if done is not None:
            done(error)


class _Lane:
    """One worker with its progress thread, and the endpoints and parts it drives (its thread only)."""

    def __init__(self, context: engine.Context, name: str) -> None:
        self.progress = Progress(engine.Worker(context), name)
        self.endpoints: dict[bytes, engine.Endpoint] = {}
        self.parts: set[_Part] = set()


class _Inline:
    """A worker that callers drive themselves, one at a time, for single small ranges (no thread hop)."""

    def __init__(self, context: engine.Context) -> None:
        self.worker = engine.Worker(context, serialized=True)
        self.lock = threading.Lock()  # one caller at a time: guards the worker, its endpoints and grants' inline keys
        self.endpoints: dict[bytes, engine.Endpoint] = {}


class UcxTransport(Transport):
    """One path (`ucx`, or `rdma`: the same engine on verbs transports) of one agent."""

    def __init__(
        self, open_grant: OpenGrant, request_push: RequestPush, *, path: PathName = PathName.UCX, transports: str = "", library: str = "",
        workers: int = 2, timeout_s: float = 30.0,
    ) -> None:  # fmt: skip
        if path not in (PathName.UCX, PathName.RDMA):
            raise ArgumentError(f"the UCX engine serves the ucx and rdma paths, not {path.value}")
        if not 1 <= workers <= 64:
            raise ArgumentError(f"workers must be 1..64, got {workers}")
        self._open_grant = open_grant
        self._request_push = request_push
        self._path = path
        self._transports = RDMA_TRANSPORTS if path is PathName.RDMA else transports
        self._library = library
        self._workers = workers
        self._timeout_s = timeout_s
        """The deadline of an inline copy (the agent gives those no timeout of their own)."""
        self._capabilities = Capabilities(path=path, memory_kinds=frozenset(), one_sided=True)
        self._context: engine.Context | None = None
        self._lanes: list[_Lane] = []
        self._inline: _Inline | None = None
        self._next_lane = itertools.count()
        self._lock = threading.Lock()  # guards _grants, _probes, _targets and every grant's flights
        self._drained = threading.Condition(self._lock)  # a grant's last transfer ended
        self._grants: dict[str, _Grant] = {}
        self._probes: dict[tuple[str, DeviceKind, int], _Probe] = {}
        """(owner agent, local memory kind, the remote descriptor's device kind) -> what the first read measured."""
        self._targets: dict[tuple[bytes, int, int, tuple[bytes, ...]], _Grant] = {}
        self._scratches: dict[str, _Scratch] = {}
        """Device name -> the probes' scratch buffer there."""
        self._map_lock = threading.Lock()  # guards _mappings
        self._mappings: dict[str, engine.Mapping] = {}
        """Local buffer id -> its registration."""

    @property  # type: ignore[override]
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def unavailable_reason(self) -> str | None:
        """Load UCX and start the lanes; why not, when it cannot (no UCX; for `rdma`, no NIC or no verbs)."""
        nics = [name for name, _ in rdma_nics()]
        if self._path is PathName.RDMA and not nics:
            return "no RDMA device on this host (/sys/class/infiniband is empty)"
        try:
            context = engine.Context(wakeup=True, transports=self._transports, library=self._library)
        except HMCError as exc:
            if self._path is PathName.RDMA:
                return f"UCX has no verbs transport for {', '.join(nics)} ({exc}); the libucx wheel has none: set [ucx] library to a verbs-enabled UCX"
            return str(exc)
        kinds = frozenset(_KINDS[name] for name in context.memory_kinds())
        detail = f"UCX {engine.version()}, {self._workers} workers" + (f", transports {self._transports}" if self._transports else "")
        self._capabilities = Capabilities(path=self._path, memory_kinds=kinds, one_sided=True, detail=detail)
        self._context = context
        self._lanes = [_Lane(context, f"hmc-{self._path.value}-{i}") for i in range(self._workers)]
        self._inline = _Inline(context)
        return None

    def _running(self) -> list[_Lane]:
        if not self._lanes:
            raise UnsupportedError(f"the {self._path.value} path is not running")
        return self._lanes

    # -- owner side ---------------------------------------------------------------

    def export(self, buffer: Any) -> dict[str, Any]:
        """Register the buffer's memory with the context (handles go out in grants only)."""
        kind = _kind(buffer)
        if self._context is None or kind not in self._capabilities.memory_kinds:
            return {}
        mapping = self._context.map(buffer.region.address, buffer.size, _UCX_MEMORY[kind])
        with self._map_lock:
            self._mappings[buffer.id] = mapping
        return {}

    def grant(self, buffer: Any) -> common_pb2.TransportHandles:
        """What a peer that proved `buffer`'s key gets: the packed key, the address and the workers' addresses."""
        lanes = self._running()
        with self._map_lock:
            mapping = self._mappings.get(buffer.id)
        if mapping is None:
            raise UnsupportedError(f"buffer {buffer.id} ({buffer.region.device.name}) is not registered with {self._path.value}")
        workers = [lane.progress.worker.address for lane in lanes]
        handle = common_pb2.UcxHandle(rkey=mapping.rkey, address=mapping.address, workers=workers, ucx_version=engine.version())
        return common_pb2.TransportHandles(ucx=handle)

    # -- initiator side -------------------------------------------------------------

    def _grant(self, remote: common_pb2.BufferDescriptor, deadline: float) -> _Grant:
        with self._lock:
            grant = self._grants.get(remote.id)
        if grant is None or grant.key != remote.access_key or grant.revoked is not None:
            grant = _Grant.granted(self._open_grant(remote, deadline), remote.access_key, remote.owner.id, len(self._lanes))
            with self._lock:
                self._grants[remote.id] = grant
        return grant

    def post(self, request: TransferRequest) -> None:
        try:
            lanes = self._running()
            if _kind(request.local) not in self._capabilities.memory_kinds:
                raise UnsupportedError(f"{self._path.value} on this agent cannot reach {_kind(request.local).value} memory")
            with self._map_lock:
                mapping = self._mappings.get(request.local.id)
            if mapping is None:
                raise UnsupportedError(f"buffer {request.local.id} is not registered with {self._path.value}")
            grant = self._grant(request.remote, request.deadline)
            if grant.read_only and request.op is TransferOp.WRITE:
                raise AccessDeniedError(f"buffer {grant.buffer_id} is read-only: its owner grants reads only")
            if grant.size < request.remote.size:  # the agent checked against the descriptor; the grant is authoritative
                sizes = (request.local.size, grant.size) if request.op is TransferOp.WRITE else (grant.size, request.local.size)
                request.ranges.check(*sizes)
            if request.op is TransferOp.READ and self._reads_pushed(request, grant, mapping):
                self._pull_by_push(request, mapping)
                return
            total = request.ranges.total
            device = _kind(request.local) is not DeviceKind.HOST
            if (device and len(request.ranges) <= _INLINE_RANGES) or (len(request.ranges) == 1 and total <= _INLINE_BYTES):
                self._run_inline(request, grant, mapping)
                request.completion.add_bytes(total)
                request.completion.finish()
                return
        except HMCError as exc:
            request.completion.finish(exc)
            return
        self._launch(request, grant, mapping, lanes)

    def _launch(self, request: TransferRequest, grant: _Grant, mapping: engine.Mapping, lanes: list[_Lane]) -> None:
        """Split the request into one part per lane (above `_PART_MIN` bytes each), host memory in windows (device
        copies end within microseconds: nothing to bound), and hand each part to its lane."""
        total = request.ranges.total
        count = max(1, min(len(lanes), total // _PART_MIN))
        shares = request.ranges.chunks(-(-total // count)) if count > 1 else [request.ranges]
        transfer = _Transfer(request, grant, len(shares), lambda: self._release(grant))
        with self._lock:
            grant.flights += 1
        first = next(self._next_lane)
        parts = []
        for i, share in enumerate(shares):
            index = (first + i) % len(lanes)
            device = _kind(request.local) is not DeviceKind.HOST
            parts.append((index, _Part(transfer, lanes[index], [share] if device else share.chunks(_WINDOW_BYTES), device)))
        request.completion.set_running()
        request.completion.on_cancel = lambda: self._stop(transfer, [part for _, part in parts])
        for index, part in parts:
            try:
                part.lane.progress.submit(lambda index=index, part=part: self._start(index, part, mapping))
            except HMCError as exc:
                self._report(part, exc)

    # -- reads the owner pushes ------------------------------------------------------

    def _reads_pushed(self, request: TransferRequest, grant: _Grant, mapping: engine.Mapping) -> bool:
        """Whether reads from this owner into this kind of memory go as pushes by the owner: measured on first use."""
        key = (grant.owner, _kind(request.local), request.remote.device.kind)
        with self._lock:
            probe = self._probes.get(key)
        if probe is None:
            probe = self._probe(request, grant, mapping)
            with self._lock:
                self._probes[key] = probe
        return probe.push_reads

    def _probe(self, request: TransferRequest, grant: _Grant, mapping: engine.Mapping) -> _Probe:
        """Time a get and a push by the owner of (up to) `_PROBE_BYTES` of the remote buffer into a scratch buffer of
        this agent in the read's kind of memory, each the second of two (the first sets up what a pair sets up once)."""
        length = min(_PROBE_BYTES, grant.size)
        scratch = self._scratch(request.local.region.device, length)
        piece = RangeList.build(0, 0, length)

        def get() -> None:
            self._copy_inline(TransferOp.READ, grant, scratch.mapping, scratch.address, 0, length, max(request.deadline - time.monotonic(), 1e-3))

        def push() -> None:
            self._push_and_wait(request.remote, piece, scratch, scratch.mapping, request.deadline)

        get_s = _second_of_two(get)
        try:
            push_s = _second_of_two(push)
        except UnsupportedError:  # an owner that pushes nothing: reads stay gets
            push_s = float("inf")
        return _Probe(length, length / get_s, length / push_s, push_s < _PUSH_PREFERRED * get_s)

    def _scratch(self, device: Any, size: int) -> _Scratch:
        """A registered buffer of this agent on `device` for probes (made once per device, freed on close)."""
        with self._lock:
            scratch = self._scratches.get(device.name)
        if scratch is None or scratch.size < size:
            region = memory.allocate(_PROBE_BYTES, device)
            kind = device.kind if region.kind is MemoryKind.DEVICE else DeviceKind.HOST
            if self._context is None:
                raise UnsupportedError(f"the {self._path.value} path is not running")
            scratch = _Scratch(region, self._context.map(region.address, region.size, _UCX_MEMORY[kind]))
            with self._lock:
                old, self._scratches[device.name] = self._scratches.get(device.name), scratch
            if old is not None:
                old.close()
        return scratch

    def _push_and_wait(self, remote: common_pb2.BufferDescriptor, ranges: RangeList, local: Any, mapping: engine.Mapping, deadline: float) -> None:
        ended = threading.Event()
        outcome: list[BaseException | None] = [None]

        def replied(reply: peer_pb2.PeerReply | None, error: BaseException | None) -> None:
            outcome[0] = error if error is not None else _reply_error(reply)
            ended.set()

        self._request_push(remote, self._push_message(remote, ranges, local, mapping, deadline, ""), deadline, replied)
        if not ended.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"agent {remote.owner.id} did not push the read in time")
        if outcome[0] is not None:
            raise outcome[0]

    def _push_message(self, remote: common_pb2.BufferDescriptor, ranges: RangeList, local: Any, mapping: engine.Mapping, deadline: float, transfer_id: str) -> peer_pb2.Push:
        target = common_pb2.UcxHandle(rkey=mapping.rkey, address=mapping.address, workers=[lane.progress.worker.address for lane in self._running()], ucx_version=engine.version())
        expires_ms = max(1, min(int((deadline - time.monotonic()) * 1000), (1 << 32) - 1))
        return peer_pb2.Push(buffer_id=remote.id, path=self._path.value, ranges=ranges.to_proto(), target=target, target_size=local.size, transfer_id=transfer_id, expires_ms=expires_ms)

    def _pull_by_push(self, request: TransferRequest, mapping: engine.Mapping) -> None:
        """A read as a push by the owner into our registered memory; ends with the owner's reply."""
        ended = threading.Event()
        cancelled = [False]
        completion = request.completion

        def replied(reply: peer_pb2.PeerReply | None, error: BaseException | None) -> None:
            error = error if error is not None else _reply_error(reply)
            ended.set()
            if not cancelled[0]:
                if error is None:
                    completion.add_bytes(request.ranges.total)
                completion.finish(error)

        def stop() -> None:  # the owner's puts land in our memory until it replies (bounded by its deadline)
            cancelled[0] = True
            ended.wait(_STOP_WAIT_S)

        message = self._push_message(request.remote, request.ranges, request.local, mapping, request.deadline, request.transfer_id)
        completion.set_running()
        completion.on_cancel = stop
        self._request_push(request.remote, message, request.deadline, replied)

    def push(self, buffer: Any, request: peer_pb2.Push, ranges: RangeList, deadline: float, done: Callable[[BaseException | None], None]) -> None:
        """Owner side: put `ranges` of `buffer` into the asker's memory (its key, address and workers in `request`)."""
        lanes = self._running()
        with self._map_lock:
            mapping = self._mappings.get(buffer.id)
        if mapping is None:
            raise UnsupportedError(f"buffer {buffer.id} is not registered with {self._path.value}")
        target = self._target(request.target, request.target_size)
        pushed = TransferRequest(request.transfer_id, TransferOp.WRITE, buffer, None, ranges, deadline, _Done(done))  # type: ignore[arg-type]
        if _kind(buffer) is DeviceKind.HOST or len(ranges) > _INLINE_RANGES:
            self._launch(pushed, target, mapping, lanes)
            return
        try:  # device memory: on this (the control channel's) thread, within microseconds per range
            self._run_inline(pushed, target, mapping)
        except HMCError as exc:
            done(exc)
            return
        done(None)

    def _target(self, handle: common_pb2.UcxHandle, size: int) -> _Grant:
        """The asker's memory of a pushed read, as a grant to write it (cached: the same buffer is pushed into again)."""
        key = (bytes(handle.rkey), handle.address, size, tuple(handle.workers))
        with self._lock:
            target = self._targets.get(key)
            if target is None:
                if len(self._targets) >= _TARGETS:
                    for old in list(self._targets)[: _TARGETS // 2]:  # their unpacked keys stay with the workers until they close
                        del self._targets[old]
                target = self._targets[key] = _Grant(handle, buffer_id="(a pushed read's target)", size=size, read_only=False, key=b"", owner="", lanes=len(self._lanes))
        return target

    def measured(self, local: Any, remote: common_pb2.BufferDescriptor) -> tuple[str, str] | None:
        with self._lock:
            probe = self._probes.get((remote.owner.id, _kind(local), remote.device.kind))
        if probe is None:
            return None
        how = "reads are pushed by the owner" if probe.push_reads else "reads are gets"
        note = f"measured with agent {remote.owner.id} on {probe.nbytes} bytes: get {probe.get_bps / 1e9:.2f} GB/s, owner's push {probe.push_bps / 1e9:.2f} GB/s: {how}"
        return note, "write" if probe.push_reads else "read"

    def _copy_inline(self, op: TransferOp, grant: _Grant, mapping: engine.Mapping, local_addresses: Any, remote_offsets: Any, lengths: Any, timeout_s: float) -> None:
        """Ranges (ints: one; arrays: a batch) on the caller's thread through the callers' worker, checked by the
        caller: posted, flushed and waited for in C."""
        inline = self._inline
        if inline is None:
            raise UnsupportedError(f"the {self._path.value} path is not running")
        if op is TransferOp.WRITE and grant.read_only:
            raise AccessDeniedError(f"buffer {grant.buffer_id} is read-only: its owner grants reads only")
        with self._lock:
            if grant.revoked is not None:
                raise grant.revoked
            grant.flights += 1
        try:
            with inline.lock:
                address = grant.worker(0)
                endpoint = inline.endpoints.get(address)
                if endpoint is None:
                    endpoint = inline.endpoints[address] = _connect(inline.worker, address, grant)
                if grant.inline_rkey is None:
                    grant.inline_rkey = endpoint.unpack(grant.rkey)
                remote = grant.address + remote_offsets if isinstance(remote_offsets, int) else remote_offsets.astype(np.uint64) + np.uint64(grant.address)
                endpoint.rma(op.value, mapping, local_addresses, remote, lengths, grant.inline_rkey, timeout_s)
        finally:
            self._release(grant)

    def _run_inline(self, request: TransferRequest, grant: _Grant, mapping: engine.Mapping) -> None:
        """The whole request on the caller's thread (device memory: copies end within microseconds, no thread hop)."""
        remaining = request.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{self._path.value} transfer missed its deadline")
        ranges = request.ranges
        local, remote = (ranges.src, ranges.dst) if request.op is TransferOp.WRITE else (ranges.dst, ranges.src)
        base = request.local.region.address
        if len(ranges) == 1:
            self._copy_inline(request.op, grant, mapping, base + int(local[0]), int(remote[0]), int(ranges.lengths[0]), remaining)
        else:
            self._copy_inline(request.op, grant, mapping, local.astype(np.uint64) + np.uint64(base), remote, ranges.lengths, remaining)

    def inline(self, local: Any, remote: common_pb2.BufferDescriptor) -> InlineCopy | None:
        """One small range on the caller's thread, once the pair has a grant (after its first transfer)."""
        with self._lock:
            grant = self._grants.get(remote.id)
        with self._map_lock:
            mapping = self._mappings.get(local.id)
        if grant is None or grant.key != remote.access_key or grant.revoked is not None or mapping is None:
            return None
        base = local.region.address

        def write(local_offset: int, remote_offset: int, length: int) -> None:
            self._copy_inline(TransferOp.WRITE, grant, mapping, base + local_offset, remote_offset, length, self._timeout_s)

        def read(local_offset: int, remote_offset: int, length: int) -> None:
            self._copy_inline(TransferOp.READ, grant, mapping, base + local_offset, remote_offset, length, self._timeout_s)

        return InlineCopy(write=write, read=read, local_size=local.size, remote_size=grant.size, max_bytes=_INLINE_BYTES, waits=True)

    def _release(self, grant: _Grant) -> None:
        """A transfer of `grant` has nothing in flight any more (a withdrawal waits for all of them)."""
        with self._lock:
            grant.flights -= 1
            self._drained.notify_all()

    def _start(self, index: int, part: _Part, mapping: engine.Mapping) -> None:
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
                endpoint = lane.endpoints[address] = _connect(lane.progress.worker, address, grant)
            if grant.rkeys[index] is None:
                grant.rkeys[index] = endpoint.unpack(grant.rkey)
        except HMCError as exc:
            self._end(part, exc)
            return
        self._pump(index, part, endpoint, mapping)

    def _pump(self, index: int, part: _Part, endpoint: engine.Endpoint, mapping: engine.Mapping) -> None:
        """Post windows until `_WINDOWS` are in flight (or none is left); end the part when all landed."""
        transfer = part.transfer
        request, grant = transfer.request, transfer.grant
        base, remote_base = np.uint64(request.local.region.address), np.uint64(grant.address)
        while not part.stopping and part.in_flight < _WINDOWS and part.next < len(part.windows):
            if transfer.cancelled or transfer.failed or grant.revoked is not None:
                self._end(part, grant.revoked)
                return
            window = part.windows[part.next]
            part.next += 1
            local, remote = (window.src, window.dst) if request.op is TransferOp.WRITE else (window.dst, window.src)
            op = "write" if request.op is TransferOp.WRITE else "read"
            try:
                endpoint.post(op, mapping, local.astype(np.uint64) + base, remote.astype(np.uint64) + remote_base, window.lengths, grant.rkeys[index])  # type: ignore[arg-type]
                flush = endpoint.flush_start()
            except HMCError as exc:
                self._end(part, exc)
                return
            part.in_flight += 1
            nbytes = window.total
            part.lane.progress.watch(flush, request.deadline, lambda error, n=nbytes: self._landed(index, part, endpoint, mapping, n, error), busy=part.device)
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
            part.lane.progress.watch(flush, request.deadline, lambda error: self._landed(index, part, endpoint, mapping, 0, error), busy=part.device)

    def _landed(self, index: int, part: _Part, endpoint: engine.Endpoint, mapping: engine.Mapping, nbytes: int, error: BaseException | None) -> None:
        part.in_flight -= 1
        if error is not None:
            self._end(part, error)
            return
        part.transfer.request.completion.add_bytes(nbytes)
        if part.stopping:
            self._end(part, None)
        else:
            self._pump(index, part, endpoint, mapping)

    def _end(self, part: _Part, error: BaseException | None, *, now: bool = False) -> None:
        """Lane thread: post nothing more; report the part once nothing of it is in flight (`now`: at once, its
        peer is gone and nothing can land)."""
        part.stopping = True
        if error is not None and part.error is None:
            part.error = error
        if part.in_flight == 0 or now:
            self._report(part, part.error)

    def _report(self, part: _Part, error: BaseException | None) -> None:
        if not part.reported:
            part.reported = True
            part.lane.parts.discard(part)
            part.transfer.part_ended(error)

    def _stop(self, transfer: _Transfer, parts: list[_Part]) -> None:
        """The handle's cancel hook: post no more, wait (bounded) until what is in flight has landed."""
        transfer.cancelled = True
        for part in parts:
            try:
                part.lane.progress.submit(lambda part=part: self._end(part, None))
            except HMCError:
                self._report(part, None)
        if not any(lane.progress.on_thread() for lane in self._lanes):
            transfer.ended.wait(_STOP_WAIT_S)

    def withdraw(self, buffer_id: str) -> None:
        """A local buffer: unregister its memory. A remote one: revoke the grant, wait (bounded) for its transfers."""
        with self._map_lock:
            mapping = self._mappings.pop(buffer_id, None)
        if mapping is not None:
            mapping.unmap()
        with self._lock:
            grant = self._grants.pop(buffer_id, None)
            if grant is not None:
                grant.revoked = BufferWithdrawnError("the buffer's owner withdrew it")
                self._drained.wait_for(lambda: grant.flights == 0, _STOP_WAIT_S)

    def forget_peer(self, agent: common_pb2.AgentInfo) -> None:
        """A peer agent went away: its grants are void and the transfers to it fail now."""
        gone = BrokenResourceError(f"agent {agent.id} (pid {agent.pid}) is gone")
        with self._lock:
            grants = [g for g in self._grants.values() if g.owner == agent.id]
            for grant in grants:
                del self._grants[grant.buffer_id]
                grant.revoked = gone
        inline = self._inline
        if grants and inline is not None:
            with inline.lock:
                for grant in grants:
                    for address in grant.workers:
                        endpoint = inline.endpoints.pop(address, None)
                        if endpoint is not None:
                            endpoint.close(1e-6)  # without waiting: nobody answers a flush any more
        for lane in self._lanes if grants else ():
            try:
                lane.progress.submit(lambda lane=lane: self._fail_peer(lane, grants, gone))
            except HMCError:
                pass

    def _fail_peer(self, lane: _Lane, grants: list[_Grant], error: HMCError) -> None:
        for part in list(lane.parts):
            if part.transfer.grant in grants:
                self._end(part, error, now=True)
        for grant in grants:
            for address in grant.workers:
                endpoint = lane.endpoints.pop(address, None)
                if endpoint is not None:
                    endpoint.close(1e-6)  # without waiting: nobody answers a flush any more

    def close(self) -> None:
        with self._lock:
            scratches, self._scratches = list(self._scratches.values()), {}
        for scratch in scratches:
            scratch.close()
        lanes, self._lanes = self._lanes, []
        for lane in lanes:
            lane.progress.close()
        inline, self._inline = self._inline, None
        if inline is not None:
            with inline.lock:
                inline.worker.close()
        if self._context is not None:
            self._context.close()
            self._context = None


def _second_of_two(run: Callable[[], None]) -> float:
    """Seconds the second of two runs took (the first sets up what a pair sets up once)."""
    run()
    started = time.perf_counter()
    run()
    return max(time.perf_counter() - started, 1e-9)


def _reply_error(reply: peer_pb2.PeerReply | None) -> HMCError | None:
    try:
        raise_for_reply(reply)  # type: ignore[arg-type]
    except HMCError as exc:
        return exc
    return None


def _connect(worker: engine.Worker, address: bytes, grant: _Grant) -> engine.Endpoint:
    """An endpoint to the worker a grant named: one UCX cannot reach any more belongs to a peer that is gone."""
    try:
        return worker.connect(address)
    except UnavailableError as exc:
        raise BrokenResourceError(f"agent {grant.owner}, which granted buffer {grant.buffer_id}, cannot be reached any more: {exc}") from exc


def _kind(buffer: Any) -> DeviceKind:
    return buffer.region.device.kind if buffer.region.kind is MemoryKind.DEVICE else DeviceKind.HOST
