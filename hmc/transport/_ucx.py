"""The `ucx` and `rdma` paths: one-sided UCX puts and gets between registered ConnBuffers, both ends.

Engine. One UCP context per path and agent, with `workers` workers on progress threads of their own (the
lanes, `hmc.transport._ucx_lanes`: large host transfers are split across them), and one worker the callers
drive themselves, one at a time (`_Inline`: single host ranges up to `_INLINE_BYTES`, and device memory in
up to `_INLINE_RANGES` ranges, posted, flushed and waited for in C on the caller's thread).

Owner side. Every ConnBuffer is registered with the context once, when it is registered with the agent
(`export`: `ucp_mem_map`, device memory included where UCX found its transports), and unregistered when it is
withdrawn. The packed key, the buffer's address and the workers' addresses are handed out only in a
BufferGrant (`grant`), to a peer that proved the buffer's access key over its control channel: whoever holds
them can write the memory (as with `ipc`'s grants). The owner's progress threads are what land puts and gets
that UCX emulates (tcp, shared memory); cma and cuda_ipc land without them. It also runs reads that askers
want pushed (`push`: a Push frame, checked by the peer server).

Initiator side. `post` asks the owner for a grant once per (buffer, key) on the caller's thread, then moves
the ranges on the caller's thread or hands them to the lanes. GPU memory whose peer buffer UCX maps here
(cuda_ipc: `ucp_rkey_ptr`) moves through that mapping, a batch in one kernel launch, on the caller's thread
(`_ucx_mapped`; `map_peers`). Reads from an owner are measured once per pair
of memory kinds (`_probe`: a get and a push by the owner into a scratch buffer) and pushed by the owner where
pushes win (`_pull_by_push`). The notification that may follow is sent by the agent after the transfer ended.

Ends: see the lanes for windows, cancels and the bytes a stopped owner may still get; a withdrawal revokes
the grant and waits, bounded by `STOP_WAIT_S`, until no transfer of it is in flight; a dead peer's grants are
void at once (`forget_peer`).

Concurrency: `_lock` guards the grant table, the probes, the push targets, the scratch buffers and each
grant's `flights` (waited for under `_drained`); `_map_lock` the registrations; `_Inline.lock` the callers'
worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hmc.errors import AccessDeniedError, ArgumentError, BrokenResourceError, BufferWithdrawnError, HMCError, TimeoutError, UnsupportedError
from hmc import memory
from hmc.memory import DeviceKind, MemoryKind
from hmc.memory._machine import rdma_nics
from hmc.transport import _ucx_engine as engine
from hmc.transport._base import Capabilities, InlineCopy, PathName, TransferOp, TransferRequest, Transport, kind_to_proto
from hmc.transport._ranges import RangeList
from hmc.transport._ucx_lanes import STOP_WAIT_S, Grant, Lanes, connect, memory_kind
from hmc.transport._ucx_mapped import PeerMemory
from hmc.transport._wire import raise_for_reply
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
_TARGETS = 256
"""Askers' memories of pushed reads kept unpacked."""
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
        self._inline: _Inline | None = None
        self._lock = threading.Lock()  # guards _grants, _probes, _targets and every grant's flights
        self._drained = threading.Condition(self._lock)  # a grant's last transfer ended
        self._grants: dict[str, Grant] = {}
        self._probes: dict[tuple[str, DeviceKind, int], common_pb2.PathMeasurement] = {}
        """(owner agent, local memory kind, the remote descriptor's device kind) -> what the first read measured."""
        self._targets: dict[tuple[bytes, int, int, tuple[bytes, ...]], Grant] = {}
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
            context = engine.Context(wakeup=True, transports=self._transports, library=self._library)
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
        self._inline = _Inline(context)
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
        with self._lock:
            grant = self._grants.get(remote.id)
        if grant is None or grant.key != remote.access_key or grant.revoked is not None:
            grant = Grant.granted(self._open_grant(remote, deadline), remote, self._workers)
            with self._lock:
                self._grants[remote.id] = grant
        return grant

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
            if (device and (len(request.ranges) <= _INLINE_RANGES or self._maps(grant, request.local.region.device))) or (len(request.ranges) == 1 and total <= _INLINE_BYTES):
                self._run_inline(request, grant, mapping)
                request.completion.add_bytes(total)
                request.completion.finish()
                return
        except HMCError as exc:
            request.completion.finish(exc)
            return
        self._launch(request, grant, mapping)

    def _launch(self, request: TransferRequest, grant: Grant, mapping: engine.Mapping) -> None:
        """Hand the request to the lanes, the grant counting it until nothing of it is in flight."""
        with self._lock:
            grant.flights += 1
        self._running().launch(request, grant, mapping, lambda: self._release(grant))

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
        scratch = self._scratch(request.local.region.device, length)
        piece = RangeList.build(0, 0, length)

        def get() -> None:
            self._copy_inline(TransferOp.READ, grant, scratch.mapping, scratch.region.device, scratch.address, 0, 0, length, max(request.deadline - time.monotonic(), 1e-3))

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
        target = common_pb2.UcxHandle(rkey=mapping.rkey, address=mapping.address, workers=self._running().addresses, ucx_version=engine.version())
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
            ended.wait(STOP_WAIT_S)

        message = self._push_message(request.remote, request.ranges, request.local, mapping, request.deadline, request.transfer_id)
        completion.set_running()
        completion.on_cancel = stop
        self._request_push(request.remote, message, request.deadline, replied)

    def push(self, buffer: Any, request: peer_pb2.Push, ranges: RangeList, deadline: float, done: Callable[[BaseException | None], None]) -> None:
        """Owner side: put `ranges` of `buffer` into the asker's memory (its key, address and workers in `request`)."""
        self._running()
        with self._map_lock:
            mapping = self._mappings.get(buffer.id)
        if mapping is None:
            raise UnsupportedError(f"buffer {buffer.id} is not registered with {self._path.value}")
        target = self._target(request.target, request.target_size)
        pushed = TransferRequest(request.transfer_id, TransferOp.WRITE, buffer, None, ranges, deadline, _Done(done))  # type: ignore[arg-type]
        if memory_kind(buffer) is DeviceKind.HOST or len(ranges) > _INLINE_RANGES:
            self._launch(pushed, target, mapping)
            return
        try:  # device memory: on this (the control channel's) thread, within microseconds per range
            self._run_inline(pushed, target, mapping)
        except HMCError as exc:
            done(exc)
            return
        done(None)

    def _target(self, handle: common_pb2.UcxHandle, size: int) -> Grant:
        """The asker's memory of a pushed read, as a grant to write it (cached: the same buffer is pushed into again)."""
        key = (bytes(handle.rkey), handle.address, size, tuple(handle.workers))
        with self._lock:
            target = self._targets.get(key)
            if target is None:
                if len(self._targets) >= _TARGETS:
                    for old in list(self._targets)[: _TARGETS // 2]:  # their unpacked keys stay with the workers until they close
                        del self._targets[old]
                target = self._targets[key] = Grant(handle, buffer_id="(a pushed read's target)", size=size, read_only=False, key=b"", owner="", lanes=self._workers)
        return target

    def measured(self, local: Any, remote: common_pb2.BufferDescriptor) -> common_pb2.PathMeasurement | None:
        with self._lock:
            probe = self._probes.get((remote.owner.id, memory_kind(local), remote.device.kind))
        return None if probe is None else _copy(probe)

    def measurements(self) -> list[common_pb2.PathMeasurement]:
        with self._lock:
            return [_copy(probe) for probe in self._probes.values()]

    def _copy_inline(
        self, op: TransferOp, grant: Grant, mapping: engine.Mapping, device: Any, local_base: int, local: Any, remote: Any, lengths: Any, timeout_s: float,
    ) -> None:  # fmt: skip
        """Ranges (ints: one; int64 offset arrays: a batch) between local memory at `local_base` on `device` and the
        grant's buffer, checked by the caller, on the caller's thread: through the peer's memory where UCX maps it
        here (a GPU copy), else posted, flushed and waited for in C through the callers' worker."""
        inline = self._inline
        if inline is None:
            raise UnsupportedError(f"the {self._path.value} path is not running")
        if op is TransferOp.WRITE and grant.read_only:
            raise AccessDeniedError(f"buffer {grant.buffer_id} is read-only: its owner grants reads only")
        deadline = time.monotonic() + timeout_s
        self._enter(grant)
        landed = True
        try:
            with inline.lock:
                endpoint, rkey = self._inline_key(inline, grant)
                mapped = self._mapped(grant, device, rkey)
                if not mapped:
                    if isinstance(lengths, int):
                        endpoint.rma(op.value, mapping, local_base + local, grant.address + remote, lengths, rkey, timeout_s)
                    else:
                        endpoint.rma(op.value, mapping, local.astype(np.uint64) + np.uint64(local_base), remote.astype(np.uint64) + np.uint64(grant.address), lengths, rkey, timeout_s)
                    return
            peers = self._peer_memory
            assert peers is not None  # only it maps
            if not peers.copy(device, op, local_base, local, mapped, remote, lengths, deadline):
                landed = peers.settled(device, self._path.value)
                raise TimeoutError(f"{self._path.value} copy missed its deadline")
        finally:
            if landed:
                self._release(grant)

    def _enter(self, grant: Grant) -> None:
        """Count a transfer of `grant` in flight (its revocation's error if it was revoked); `_release` ends it."""
        with self._lock:
            if grant.revoked is not None:
                raise grant.revoked
            grant.flights += 1

    def _inline_key(self, inline: _Inline, grant: Grant) -> tuple[engine.Endpoint, engine.RemoteKey]:
        """The callers' worker's endpoint to the grant's owner and its key for the grant (made once); under `inline.lock`."""
        address = grant.worker(0)
        endpoint = inline.endpoints.get(address)
        if endpoint is None:
            endpoint = inline.endpoints[address] = connect(inline.worker, address, grant)
        if grant.inline_rkey is None:
            grant.inline_rkey = endpoint.unpack(grant.rkey)
        return endpoint, grant.inline_rkey

    def _mapped(self, grant: Grant, device: Any, rkey: engine.RemoteKey) -> int:
        """Where UCX maps the grant's buffer for local `device` (0: nowhere, or mapping is off); under `_Inline.lock`."""
        return 0 if self._peer_memory is None else self._peer_memory.base(grant, device, rkey)

    def _maps(self, grant: Grant, device: Any) -> bool:
        """Whether a transfer of the grant's buffer with local memory on `device` goes through a mapping (asked once)."""
        inline = self._inline
        if inline is None or self._peer_memory is None:
            return False
        with inline.lock:
            return bool(self._mapped(grant, device, self._inline_key(inline, grant)[1]))

    def _run_inline(self, request: TransferRequest, grant: Grant, mapping: engine.Mapping) -> None:
        """The whole request on the caller's thread (device memory: copies end within microseconds, no thread hop)."""
        remaining = request.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{self._path.value} transfer missed its deadline")
        ranges = request.ranges
        local, remote = (ranges.src, ranges.dst) if request.op is TransferOp.WRITE else (ranges.dst, ranges.src)
        region = request.local.region
        device = region.device if region.kind is MemoryKind.DEVICE else None
        if len(ranges) == 1:
            self._copy_inline(request.op, grant, mapping, device, region.address, int(local[0]), int(remote[0]), int(ranges.lengths[0]), remaining)
        else:
            self._copy_inline(request.op, grant, mapping, device, region.address, local, remote, ranges.lengths, remaining)

    def inline(self, local: Any, remote: common_pb2.BufferDescriptor) -> InlineCopy | None:
        """One small range on the caller's thread, once the pair has a grant (after its first transfer)."""
        with self._lock:
            grant = self._grants.get(remote.id)
        with self._map_lock:
            mapping = self._mappings.get(local.id)
        if grant is None or grant.key != remote.access_key or grant.revoked is not None or mapping is None:
            return None
        region = local.region
        base, device = region.address, (region.device if region.kind is MemoryKind.DEVICE else None)

        def write(local_offset: int, remote_offset: int, length: int) -> None:
            self._copy_inline(TransferOp.WRITE, grant, mapping, device, base, local_offset, remote_offset, length, self._timeout_s)

        def read(local_offset: int, remote_offset: int, length: int) -> None:
            self._copy_inline(TransferOp.READ, grant, mapping, device, base, local_offset, remote_offset, length, self._timeout_s)

        if device is None:
            return InlineCopy(write=write, read=read, local_size=local.size, remote_size=grant.size, max_bytes=_INLINE_BYTES, waits=True)
        # Device memory: a range of any size (post() moves it on the caller's thread too, after ~80 us of request
        # building that this skips); reads past _INLINE_BYTES take the slow path, which may have the owner push them,
        # unless the peer's memory is mapped here (a get is then a GPU copy).
        mapped = grant.mapped.get(device.name)
        if mapped and self._peer_memory is not None:
            write, read = (
                self._peer_memory.single(grant, device, base, op, enter=self._enter, leave=self._release, timeout_s=self._timeout_s, path=self._path.value)
                for op in (TransferOp.WRITE, TransferOp.READ)
            )
        reads = local.size if mapped else _INLINE_BYTES
        return InlineCopy(write=write, read=read, local_size=local.size, remote_size=grant.size, max_bytes=local.size, read_max_bytes=reads, waits=True)

    def _release(self, grant: Grant) -> None:
        """A transfer of `grant` has nothing in flight any more (a withdrawal, which revokes the grant first under the
        lock, waits for all of them: only a revoked grant's end is told)."""
        with self._lock:
            grant.flights -= 1
            if grant.revoked is not None:
                self._drained.notify_all()

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
                self._drained.wait_for(lambda: grant.flights == 0, STOP_WAIT_S)

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
        if grants and self._lanes is not None:
            self._lanes.fail_peer(grants, gone)

    def close(self) -> None:
        with self._lock:
            scratches, self._scratches = list(self._scratches.values()), {}
        for scratch in scratches:
            scratch.close()
        lanes, self._lanes = self._lanes, None
        if lanes is not None:
            lanes.close()
        inline, self._inline = self._inline, None
        if inline is not None:
            with inline.lock:
                inline.worker.close()
        if self._peer_memory is not None:
            self._peer_memory.close(time.monotonic() + STOP_WAIT_S)
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


def _copy(measured: common_pb2.PathMeasurement) -> common_pb2.PathMeasurement:
    """A copy for a caller (the table's own messages are never handed out: protobuf messages are mutable)."""
    copy = common_pb2.PathMeasurement()
    copy.CopyFrom(measured)
    return copy
