"""The `ucx` and `rdma` paths: one-sided UCX puts and gets between registered ConnBuffers, both ends.

Engine. One UCP context per path and agent, with `workers` workers on progress threads of their own (the
lanes, `hmc.transport._ucx_lanes`: large host transfers are split across them), and one worker the callers
drive themselves, one at a time (the callers' worker, `hmc.transport._ucx_inline`: single host ranges up to
`_INLINE_BYTES`, and device memory in up to `_INLINE_RANGES` ranges, posted, flushed and waited for in C on the
caller's thread).

Owner side. Every ConnBuffer is registered with the context once, when it is registered with the agent
(`export`: `ucp_mem_map`, device memory included where UCX found its transports), and unregistered when it is
withdrawn. The packed key, the buffer's address and the workers' addresses are handed out only in a
BufferGrant (`grant`), to a peer that proved the buffer's access key over its control channel: whoever holds
them can write the memory (as with `ipc`'s grants). The owner's progress threads are what land puts and gets
that UCX emulates (tcp, shared memory); cma and cuda_ipc land without them. It also runs reads that askers
want pushed (`push`: a Push frame, checked by the peer server; `_ucx_push`).

Initiator side. `post` asks the owner for a grant once per (buffer, key) on the caller's thread, then moves
the ranges on the caller's thread or hands them to the lanes. GPU memory whose peer buffer UCX maps here
(cuda_ipc: `ucp_rkey_ptr`) moves through that mapping, a batch in one kernel launch, on the caller's thread
(`_ucx_mapped`, through the callers' worker; `map_peers`). Reads from an owner are measured once per pair
of memory kinds (`_probe`: a get and a push by the owner into a scratch buffer) and pushed by the owner where
pushes win (`_pull_by_push`). The notification that may follow is sent by the agent after the transfer ended.

Ends: see the lanes for windows, cancels and the bytes a stopped owner may still get; a withdrawal revokes
the grant (or, for this agent's memory, unregisters it) once no transfer of it is in flight, waiting for that at
most `STOP_WAIT_S`: past that, DeviceError (UCX cancels nothing: the memory must be kept); a dead peer's grants
are void at once (`forget_peer`).

One grant per remote buffer at a time (`_grant`: of first transfers that open one at once, all use the first
that came back); a withdrawal or a peer's loss also reaches grants still being opened (`_Opening`), and
destroys a revoked grant's unpacked keys once nothing uses them (`_drop_keys`). `close` destroys no worker or
context that a thread may still use inside UCX: past its bound it leaves them allocated, and says so.

Concurrency: `_lock` guards the grant table, the openings, the probes, each grant's `flights` and each
registration's `users` (waited for under `_drained`); `_scratch_lock` the scratch buffers; `_map_lock` the registrations;
`CallersWorker.lock` the callers' worker, waited for within the caller's deadline.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from hmc.errors import (
    AccessDeniedError, ArgumentError, BrokenResourceError, BufferWithdrawnError, ClosedResourceError, DeviceError, HMCError, TimeoutError, UnsupportedError,
)  # fmt: skip
from hmc import memory
from hmc.memory import DeviceKind, MemoryKind
from hmc.memory._machine import host_id, rdma_nics
from hmc.transport import _ucx_engine as engine
from hmc.transport._base import Capabilities, InlineCopy, PathName, TransferOp, TransferRequest, Transport, kind_to_proto
from hmc.transport._ranges import RangeList
from hmc.transport._ucx_inline import CallersWorker
from hmc.transport._ucx_lanes import SETTLE_S, STOP_WAIT_S, Grant, Lanes, lanes_on_one_host, may_use_sockets, memory_kind
from hmc.transport._ucx_mapped import PeerMemory
from hmc.transport._ucx_push import PushCompletion, PushTargets, push_message, reply_error
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["RDMA_TRANSPORTS", "UcxTransport"]

_log = logging.getLogger(__name__)

OpenGrant = Callable[[common_pb2.BufferDescriptor, float], peer_pb2.BufferGrant]
RequestPush = Callable[[common_pb2.BufferDescriptor, peer_pb2.Push, float, Callable[[peer_pb2.PeerReply | None, BaseException | None], None]], None]
"""Sends a Push to a buffer's owner over the control channel; the callback hears its reply (or the failure)."""

RDMA_TRANSPORTS = "rc,dc,ud"
"""UCX's verbs transports: what the `rdma` path restricts its context to."""
_INLINE_BYTES = 1 << 20
"""Largest single range of host memory moved on the caller's thread: one put or get and a flush, no thread hop
(device memory always is: its copies end within microseconds; its writes of any size take the agent's fast path)."""
_INLINE_RANGES = 64
"""Device memory in up to this many ranges is moved on the caller's thread; more ranges are posted by the lanes
side by side (UCX costs several microseconds of CPU per range: two threads post about 1.5x the ranges of one)."""
_PROBE_BYTES = 1 << 20
"""Bytes read from an owner as a get and as a push by the owner, timed on the first read (once per pair of memory
kinds), into a scratch buffer of this agent."""
_PUSH_PREFERRED = 0.8
"""Reads go as pushes where a push takes less than this fraction of a get's time."""
_CLOSE_S = STOP_WAIT_S
"""How long `close` waits for the lanes' threads and the callers' worker before it leaves them (and the context) allocated."""
_KINDS = {"host": DeviceKind.HOST, "cuda": DeviceKind.CUDA, "rocm": DeviceKind.HIP}
_UCX_MEMORY = {DeviceKind.HOST: "host", DeviceKind.CUDA: "cuda", DeviceKind.HIP: "rocm"}


class _Scratch:
    """A buffer of this agent that probes read into: its memory and registration."""

    def __init__(self, region: Any, mapping: engine.Mapping) -> None:
        self.region, self.mapping = region, mapping
        self.address, self.size = region.address, region.size

    def close(self) -> None:
        self.mapping.unmap()
        memory.free(self.region)


class _Opening:
    """A grant being opened (`UcxTransport._grant`): a withdrawal of its buffer, or its owner's loss, meanwhile
    sets `revoked`, and the grant that comes back is refused."""

    __slots__ = ("buffer_id", "owner", "revoked")

    def __init__(self, buffer_id: str, owner: str) -> None:
        self.buffer_id, self.owner = buffer_id, owner
        self.revoked: HMCError | None = None


class UcxTransport(Transport):
    """One path (`ucx`, or `rdma`: the same engine on verbs transports) of one agent."""

    def __init__(
        self, open_grant: OpenGrant, request_push: RequestPush, *, path: PathName = PathName.UCX, transports: str = "", library: str = "",
        workers: int = 2, timeout_s: float = 30.0, agent_id: str = "", on_measured: Callable[[common_pb2.PathMeasurement], None] | None = None,
        map_peers: bool = True,
    ) -> None:  # fmt: skip
        """`agent_id`: the agent's, named in its measurements; `on_measured`: told of each pair's first measurement (the
        agent passes it on to hmcd); it must not raise. `map_peers`: move GPU ranges through the peer memory UCX maps
        here, where it maps it (`_ucx_mapped`), instead of one UCX put or get per range."""
        if path not in (PathName.UCX, PathName.RDMA):
            raise ArgumentError(f"the UCX engine serves the ucx and rdma paths, not {path.value}")
        if not 1 <= workers <= 64:
            raise ArgumentError(f"workers must be 1..64, got {workers}")
        self._open_grant = open_grant
        self._request_push = request_push
        self._path = path
        self._transports = RDMA_TRANSPORTS if path is PathName.RDMA else transports
        self._host_id = host_id()
        self._tls = self._transports or os.environ.get("UCX_TLS", "")
        """The transports the context gets: the path's, else UCX_TLS, else UCX's own choice ("")."""
        self._local_lanes = lanes_on_one_host(self._tls, len(os.sched_getaffinity(0)))
        """The most lanes a transfer takes to a peer on this host (`lanes_on_one_host`; 0: every lane)."""
        self._library = library
        self._workers = workers
        self._timeout_s = timeout_s
        """The deadline of an inline copy (the agent gives those no timeout of their own)."""
        self._agent_id = agent_id
        self._on_measured = on_measured
        self._peer_memory = PeerMemory() if map_peers else None
        self._capabilities = Capabilities(path=path, memory_kinds=frozenset(), one_sided=True)
        self._context: engine.Context | None = None
        self._lanes: Lanes | None = None
        self._inline: CallersWorker | None = None
        """Set once the path runs, and kept (closed) once it closed."""
        self._lock = threading.Lock()  # guards _grants, _probes, every grant's flights and every mapping's users
        self._drained = threading.Condition(self._lock)  # a grant's last transfer ended
        self._grants: dict[str, Grant] = {}
        self._openings: set[_Opening] = set()
        """Grants being opened (outside the lock): what a withdrawal or a peer's loss must reach too."""
        self._probes: dict[tuple[str, DeviceKind, int], common_pb2.PathMeasurement] = {}
        """(owner agent, local memory kind, the remote descriptor's device kind) -> what the first read measured."""
        self._targets = PushTargets(workers)
        self._scratch_lock = threading.Lock()  # guards _scratches
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
        dmabuf = memory.dmabuf_kinds() if self._path is PathName.RDMA else frozenset()
        try:
            context = engine.Context(wakeup=True, transports=self._transports, library=self._library, sockets=may_use_sockets(self._tls))
        except HMCError as exc:
            if self._path is PathName.RDMA:
                reach = f"; device memory it would register by dma-buf: {', '.join(sorted(k.value for k in dmabuf)) or 'none'}"
                return f"UCX has no verbs transport for {', '.join(nics)} ({exc}); the libucx wheel has none: set [ucx] library to a verbs-enabled UCX{reach}"
            return str(exc)
        kinds = frozenset(_KINDS[name] for name in context.memory_kinds())
        if self._path is PathName.RDMA:  # a NIC reaches device memory by dma-buf registration (UCX makes it from the export)
            kinds = frozenset({DeviceKind.HOST}) | (kinds & dmabuf)
        detail = f"UCX {engine.version()}, {self._workers} workers" + (f", transports {self._transports}" if self._transports else "")
        self._capabilities = Capabilities(path=self._path, memory_kinds=kinds, one_sided=True, detail=detail)
        self._context = context
        self._lanes = Lanes(context, self._workers, f"hmc-{self._path.value}")
        self._inline = CallersWorker(
            context, path=self._path.value, peer_memory=self._peer_memory, enter=self._enter, release=self._release, flights_lock=self._lock,
            timeout_s=self._timeout_s, inline_bytes=_INLINE_BYTES,
        )  # fmt: skip
        return None

    def _running(self) -> Lanes:
        if self._lanes is None:
            raise UnsupportedError(f"the {self._path.value} path is not running")
        return self._lanes

    # -- owner side ---------------------------------------------------------------

    def export(self, buffer: Any) -> dict[str, Any]:
        """Register the buffer's memory with the context (handles go out in grants only)."""
        kind = memory_kind(buffer)
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
        handle = common_pb2.UcxHandle(rkey=mapping.rkey, address=mapping.address, workers=lanes.addresses, ucx_version=engine.version())
        return common_pb2.TransportHandles(ucx=handle)

    # -- initiator side -------------------------------------------------------------

    def _grant(self, remote: common_pb2.BufferDescriptor, deadline: float) -> Grant:
        """The grant of `remote`: the one in the table, else one opened now. One grant per buffer at a time: the
        opening is asked outside the lock (a round trip), and of several first transfers that opened one at once,
        the first to come back stores its grant and the others use it (theirs, never used, are revoked), so that a
        withdrawal reaches every grant a transfer may use; one withdrawn, or whose owner went away, while it was
        being opened is refused."""
        with self._lock:
            grant = self._grants.get(remote.id)
            if grant is not None and grant.key == remote.access_key and grant.revoked is None:
                return grant
            opening = _Opening(remote.id, remote.owner.id)
            self._openings.add(opening)
        try:
            fresh = Grant.granted(self._open_grant(remote, deadline), remote, self._workers)
        finally:
            with self._lock:
                self._openings.discard(opening)
        with self._lock:
            if opening.revoked is not None:
                fresh.revoked = opening.revoked
                raise opening.revoked
            grant = self._grants.get(remote.id)
            if grant is not None and grant.key == remote.access_key and grant.revoked is None:
                fresh.revoked = ClosedResourceError("a grant opened at the same time is used instead")
                return grant
            if grant is not None and grant.revoked is None:  # another key: the buffer was registered anew, the old one is void
                grant.revoked = BufferWithdrawnError("the buffer's owner registered it anew")
                self._drained.notify_all()
            self._grants[remote.id] = fresh
        return fresh

    def post(self, request: TransferRequest) -> None:
        try:
            self._running()
            if memory_kind(request.local) not in self._capabilities.memory_kinds:
                raise UnsupportedError(f"{self._path.value} on this agent cannot reach {memory_kind(request.local).value} memory")
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
            device = memory_kind(request.local) is not DeviceKind.HOST
            if (device and (len(request.ranges) <= _INLINE_RANGES or self._maps(grant, request.local.region.device, request.deadline))) or (len(request.ranges) == 1 and total <= _INLINE_BYTES):
                self._callers().run(request, grant, mapping)
                request.completion.add_bytes(total)
                request.completion.finish()
                return
        except HMCError as exc:
            request.completion.finish(exc)
            return
        self._launch(request, grant, mapping)

    def _launch(self, request: TransferRequest, grant: Grant, mapping: engine.Mapping, settled: Callable[[], None] | None = None) -> None:
        """Hand the request to the lanes, the grant and this end's memory counting it until nothing of it is in flight
        (then `settled` runs)."""
        lanes = self._running()  # (closed meanwhile: nothing counted that nothing would give back)
        with self._lock:
            grant.flights += 1
            mapping.users += 1

        def ended() -> None:
            self._release(grant, mapping)
            if settled is not None:
                settled()

        here = request.remote is not None and request.remote.owner.host_id == self._host_id  # a pushed read: the asker's host is not said
        lanes.launch(request, grant, mapping, ended, most=self._local_lanes if here else 0)

    def _callers(self) -> CallersWorker:
        """The callers' worker (once the path closed, closed: it refuses copies)."""
        inline = self._inline
        if inline is None:
            raise UnsupportedError(f"the {self._path.value} path is not running")
        return inline

    # -- reads the owner pushes ------------------------------------------------------

    def _reads_pushed(self, request: TransferRequest, grant: Grant, mapping: engine.Mapping) -> bool:
        """Whether reads from this owner into this kind of memory go as pushes by the owner: measured on first use."""
        key = (grant.owner, memory_kind(request.local), request.remote.device.kind)
        with self._lock:
            probe = self._probes.get(key)
        if probe is None:
            probe = self._probe(request, grant, mapping)
            with self._lock:
                self._probes[key] = probe
            if self._on_measured is not None:
                self._on_measured(_copy(probe))
        return probe.push_reads

    def _probe(self, request: TransferRequest, grant: Grant, mapping: engine.Mapping) -> common_pb2.PathMeasurement:
        """Time a get and a push by the owner of (up to) `_PROBE_BYTES` of the remote buffer into a scratch buffer of
        this agent in the read's kind of memory, each the second of two (the first sets up what a pair sets up once)."""
        length = min(_PROBE_BYTES, grant.size)
        scratch = self._scratch(request.local.region.device)
        piece = RangeList.build(0, 0, length)

        def get() -> None:
            self._callers().copy(TransferOp.READ, grant, scratch.mapping, scratch.region.device, scratch.address, 0, 0, length, max(request.deadline - time.monotonic(), 1e-3))

        def push() -> None:
            self._push_and_wait(request.remote, piece, scratch, scratch.mapping, request.deadline)

        get_s = _second_of_two(get)
        try:
            push_s = _second_of_two(push)
        except UnsupportedError:  # an owner that pushes nothing: reads stay gets
            push_s = float("inf")
        return common_pb2.PathMeasurement(
            path=self._path.value, measured_by=self._agent_id, owner_agent=grant.owner, local_kind=kind_to_proto(memory_kind(request.local)), remote_kind=request.remote.device.kind,
            nbytes=length, get_bps=length / get_s, push_bps=length / push_s, push_reads=push_s < _PUSH_PREFERRED * get_s,
        )  # fmt: skip

    def _scratch(self, device: Any) -> _Scratch:
        """The registered buffer of this agent on `device` that probes read into (`_PROBE_BYTES`): made once per
        device, under `_scratch_lock` (concurrent first reads share it: a probe's gets and the owner's pushes may
        still land in it after a timeout, so it is never replaced), and freed on close, after the workers."""
        with self._scratch_lock:
            scratch = self._scratches.get(device.name)
            if scratch is None:
                if self._context is None:
                    raise UnsupportedError(f"the {self._path.value} path is not running")
                region = memory.allocate(_PROBE_BYTES, device)
                kind = device.kind if region.kind is MemoryKind.DEVICE else DeviceKind.HOST
                try:
                    scratch = _Scratch(region, self._context.map(region.address, region.size, _UCX_MEMORY[kind]))
                except BaseException:
                    memory.free(region)
                    raise
                self._scratches[device.name] = scratch
        return scratch

    def _push_and_wait(self, remote: common_pb2.BufferDescriptor, ranges: RangeList, local: Any, mapping: engine.Mapping, deadline: float) -> None:
        ended = threading.Event()
        outcome: list[BaseException | None] = [None]

        def replied(reply: peer_pb2.PeerReply | None, error: BaseException | None) -> None:
            outcome[0] = error if error is not None else reply_error(reply)
            ended.set()

        self._request_push(remote, self._push_message(remote, ranges, local, mapping, deadline), deadline, replied)
        if not ended.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"agent {remote.owner.id} did not push the read in time")
        if outcome[0] is not None:
            raise outcome[0]

    def _push_message(self, remote: common_pb2.BufferDescriptor, ranges: RangeList, local: Any, mapping: engine.Mapping, deadline: float, transfer_id: str = "") -> peer_pb2.Push:
        return push_message(self._path.value, remote, ranges, local, mapping, self._running().addresses, deadline, transfer_id)

    def _pull_by_push(self, request: TransferRequest, mapping: engine.Mapping) -> None:
        """A read as a push by the owner into our registered memory; ends with the owner's reply."""
        ended = threading.Event()
        cancelled = [False]
        completion = request.completion
        with self._lock:  # the owner's puts land in our memory until it replies (its reply waits until they settled)
            mapping.users += 1

        def replied(reply: peer_pb2.PeerReply | None, error: BaseException | None) -> None:
            if reply is not None or isinstance(error, BrokenResourceError):  # not a reply: the owner is gone
                self._release(None, mapping)
            error = error if error is not None else reply_error(reply)
            ended.set()
            if not cancelled[0]:
                if error is None:
                    completion.add_bytes(request.ranges.total)
                completion.finish(error)

        def stop() -> None:  # a cancel waits (bounded) for the reply: the owner's puts land in our memory until then
            cancelled[0] = True
            if time.monotonic() < request.deadline:  # (at the deadline the handle ends; the memory stays counted)
                ended.wait(STOP_WAIT_S)

        try:
            message = self._push_message(request.remote, request.ranges, request.local, mapping, request.deadline, request.transfer_id)
            completion.set_running()
            completion.on_cancel = stop
            self._request_push(request.remote, message, request.deadline + SETTLE_S + STOP_WAIT_S, replied)  # its reply comes once settled
        except HMCError:
            if not ended.is_set():  # never asked (a failed send reaches `replied` first)
                self._release(None, mapping)
            raise

    def push(self, buffer: Any, request: peer_pb2.Push, ranges: RangeList, deadline: float, done: Callable[[BaseException | None], None]) -> None:
        """Owner side: put `ranges` of `buffer` into the asker's memory (its key, address and workers in `request`)."""
        self._running()
        with self._map_lock:
            mapping = self._mappings.get(buffer.id)
        if mapping is None:
            raise UnsupportedError(f"buffer {buffer.id} is not registered with {self._path.value}")
        target = self._target(request.target, request.target_size)
        completion = PushCompletion(done)
        pushed = TransferRequest(request.transfer_id, TransferOp.WRITE, buffer, None, ranges, deadline, completion)  # type: ignore[arg-type]
        if memory_kind(buffer) is DeviceKind.HOST or len(ranges) > _INLINE_RANGES:
            self._launch(pushed, target, mapping, completion.settled)
            return
        try:  # device memory: on this (the control channel's) thread, within microseconds per range
            self._callers().run(pushed, target, mapping)
        except HMCError as exc:
            done(exc)
            return
        done(None)

    def _target(self, handle: common_pb2.UcxHandle, size: int) -> Grant:
        """The asker's memory of a pushed read, as a grant to write it (`PushTargets`)."""
        target, evicted = self._targets.get(handle, size)
        for old in evicted:  # their unpacked keys, where nothing uses them (else they stay until the workers close)
            self._drop_keys(old)
        return target

    def measured(self, local: Any, remote: common_pb2.BufferDescriptor) -> common_pb2.PathMeasurement | None:
        with self._lock:
            probe = self._probes.get((remote.owner.id, memory_kind(local), remote.device.kind))
        return None if probe is None else _copy(probe)

    def measurements(self) -> list[common_pb2.PathMeasurement]:
        with self._lock:
            return [_copy(probe) for probe in self._probes.values()]

    def _enter(self, grant: Grant) -> None:
        """Count a transfer of `grant` in flight (its revocation's error if it was revoked); `_release` ends it."""
        with self._lock:
            if grant.revoked is not None:
                raise grant.revoked
            grant.flights += 1

    def _maps(self, grant: Grant, device: Any, deadline: float) -> bool:
        """Whether a transfer of the grant's buffer with local memory on `device` goes through a mapping (asked once)."""
        inline = self._inline
        return inline is not None and inline.maps(grant, device, deadline)

    def inline(self, local: Any, remote: common_pb2.BufferDescriptor) -> InlineCopy | None:
        """One small range on the caller's thread, once the pair has a grant (after its first transfer)."""
        with self._lock:
            grant = self._grants.get(remote.id)
        with self._map_lock:
            mapping = self._mappings.get(local.id)
        inline = self._inline
        if grant is None or grant.key != remote.access_key or grant.revoked is not None or mapping is None or inline is None:
            return None
        return inline.inline_copy(grant, mapping, local)

    def _release(self, grant: Grant | None, mapping: engine.Mapping | None = None) -> None:
        """A transfer of `grant` (None: a read the owner pushed) through `mapping` (this end's memory) has nothing in
        flight any more (a withdrawal waits for all of them)."""
        with self._lock:
            if grant is not None:
                grant.flights -= 1
            if mapping is not None:
                mapping.users -= 1
            self._drained.notify_all()

    def withdraw(self, buffer_id: str) -> None:
        """A local buffer: unregister its memory once no transfer through it may still run (bounded). A remote one:
        revoke the grant, wait (bounded) for its transfers. Where UCX may still run one (a flush that missed its
        deadline: UCX cancels nothing), DeviceError: the memory must be kept (a local one stays registered)."""
        with self._map_lock:
            mapping = self._mappings.pop(buffer_id, None)
        if mapping is not None:
            with self._lock:
                idle = self._drained.wait_for(lambda: mapping.users == 0, STOP_WAIT_S)
            if not idle:
                raise DeviceError(f"buffer {buffer_id}: {self._path.value} transfers through it still run in UCX, which cancels nothing: keep its memory")
            mapping.unmap()
        withdrawn = BufferWithdrawnError("the buffer's owner withdrew it")
        drained = False
        with self._lock:
            for opening in self._openings:
                if opening.buffer_id == buffer_id:
                    opening.revoked = withdrawn
            grant = self._grants.pop(buffer_id, None)
            if grant is not None:
                grant.revoked = withdrawn
                drained = self._drained.wait_for(lambda: grant.flights == 0, STOP_WAIT_S)
        if grant is None:
            return
        if not drained:
            raise DeviceError(f"buffer {buffer_id} of agent {grant.owner}: {self._path.value} transfers into it may still land (UCX cancels nothing)")
        self._drop_keys(grant)

    def _drop_keys(self, grant: Grant) -> None:
        """Destroy a revoked grant's unpacked keys, where nothing may still use them: each lane its own (on its thread),
        the callers' worker's under its lock (skipped, the key kept until the path closes, where a caller holds it
        past `_KEY_LOCK_S`, or an operation with it did not complete: `CallersWorker.drop_key`)."""
        lanes = self._lanes
        if lanes is not None:
            lanes.drop_keys(grant)
        inline = self._inline
        if inline is not None:
            inline.drop_key(grant)

    def forget_peer(self, agent: common_pb2.AgentInfo) -> None:
        """A peer agent went away: its grants are void and the transfers to it fail now."""
        gone = BrokenResourceError(f"agent {agent.id} (pid {agent.pid}) is gone")
        with self._lock:
            for opening in self._openings:
                if opening.owner == agent.id:
                    opening.revoked = gone
            grants = [g for g in self._grants.values() if g.owner == agent.id]
            for grant in grants:
                del self._grants[grant.buffer_id]
                grant.revoked = gone
        inline = self._inline
        if grants and inline is not None:
            inline.forget(grants)  # their keys and the endpoints to its workers there, at once
        if grants and self._lanes is not None:
            self._lanes.fail_peer(grants, gone)

    def close(self) -> None:
        """Stop the lanes and the callers' worker, then free the probes' scratch buffers and the context, within
        `_CLOSE_S` (and the GPU lanes' own bound). Nothing a thread may still use inside UCX is destroyed under it:
        where a lane's thread did not end, or a caller still held the callers' worker, by then, the context and the
        scratch buffers (which operations that timed out may still reach) are left allocated, with an error logged."""
        deadline = time.monotonic() + _CLOSE_S
        lanes, self._lanes = self._lanes, None
        ended = lanes is None or lanes.close(deadline)
        inline = self._inline  # kept, closed: what still holds an InlineCopy of it is refused
        if inline is not None and not inline.close(deadline):
            ended = False
        if self._peer_memory is not None:
            self._peer_memory.close(time.monotonic() + STOP_WAIT_S)
        with self._scratch_lock:
            scratches, self._scratches = list(self._scratches.values()), {}
        context, self._context = self._context, None
        if not ended:
            _abandoned.append((context, scratches, lanes, inline))
            _log.error("the %s path closed with a UCX worker still in use %.0f s on (a peer that stopped answering?): its context and memory are left allocated", self._path.value, _CLOSE_S)
            return
        for scratch in scratches:
            scratch.close()
        if context is not None:
            context.close()


_abandoned: list[tuple[Any, ...]] = []
"""What closes left allocated because a thread may still use it inside UCX (kept referenced, never freed)."""


def _second_of_two(run: Callable[[], None]) -> float:
    """Seconds the second of two runs took (the first sets up what a pair sets up once)."""
    run()
    started = time.perf_counter()
    run()
    return max(time.perf_counter() - started, 1e-9)


def _copy(measured: common_pb2.PathMeasurement) -> common_pb2.PathMeasurement:
    """A copy for a caller (the table's own messages are never handed out: protobuf messages are mutable)."""
    copy = common_pb2.PathMeasurement()
    copy.CopyFrom(measured)
    return copy
