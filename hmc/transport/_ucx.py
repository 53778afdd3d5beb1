"""The `ucx` and `rdma` paths: one-sided UCX puts and gets between registered ConnBuffers, both ends.

Owner side. Every ConnBuffer is registered with the path's worker once, when it is registered with the agent
(`export`: `ucp_mem_map`, device memory included where UCX found its transports), and unregistered when it is
withdrawn. The packed key, the buffer's address and the worker's address are handed out only in a
BufferGrant (`grant`), to a peer that proved the buffer's access key over its control channel: whoever holds
them can write the memory (as with `ipc`'s grants). The owner's progress thread is what lands puts and gets
that UCX emulates (tcp, shared memory); cma and cuda_ipc land without it.

Initiator side. `post` asks the owner for a grant once per (buffer, key) on the caller's thread, then hands
the transfer to the progress thread (`hmc.transport._ucx_progress`), which connects an endpoint per owner
worker (peer error handling off: HMC learns that a peer died from its control channel, `forget_peer`),
unpacks the key once per grant, and posts the ranges window by window (`_WINDOW_BYTES`, `_WINDOWS` in
flight), each window one call below Python (`Endpoint.post`) followed by a flush whose completion says the
window has landed. The notification that may follow is sent by the agent after the last flush.

Ends. A failed, expired or revoked transfer stops posting at once. UCX cancels no put or get, so a cancel
(the handle's `on_cancel`) and a withdrawal wait, bounded by `_STOP_WAIT_S`, for the windows in flight to
land; an expiry reports at the deadline. A window in flight to an owner that has stopped progressing (a
frozen process, over tcp) can land when that owner resumes, after its transfer ended: at most `_WINDOWS`
windows of that transfer's own bytes, into the same buffer (docs/decisions.md, "The ucx path").

Concurrency: `_lock` guards the grant table; flights, endpoints and keys belong to the progress thread; a
grant's `flights` count is changed on the progress thread and waited for under `_drained`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hmc.errors import AccessDeniedError, ArgumentError, BrokenResourceError, BufferWithdrawnError, HMCError, UnsupportedError
from hmc.memory import DeviceKind, MemoryKind
from hmc.memory._machine import rdma_nics
from hmc.transport import _ucx_engine as engine
from hmc.transport._base import Capabilities, PathName, TransferOp, TransferRequest, Transport
from hmc.transport._ranges import RangeList
from hmc.transport._ucx_progress import Progress
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["RDMA_TRANSPORTS", "UcxTransport"]

_log = logging.getLogger(__name__)

OpenGrant = Callable[[common_pb2.BufferDescriptor, float], peer_pb2.BufferGrant]

RDMA_TRANSPORTS = "rc,dc,ud"
"""UCX's verbs transports: what the `rdma` path restricts its context to."""
_WINDOW_BYTES = 16 << 20
"""Bytes of a transfer posted before its flush; with `_WINDOWS` in flight, what a stopped owner may still get."""
_WINDOWS = 2
_STOP_WAIT_S = 5.0
"""How long a cancel or a withdrawal waits for windows in flight to land."""
_MAX_WORKER_ADDRESS = 1 << 16
_KINDS = {"host": DeviceKind.HOST, "cuda": DeviceKind.CUDA, "rocm": DeviceKind.HIP}
_UCX_MEMORY = {DeviceKind.HOST: "host", DeviceKind.CUDA: "cuda", DeviceKind.HIP: "rocm"}


class _Grant:
    """The right to put into / get from one remote buffer, with the UCX objects that reach it."""

    __slots__ = ("address", "buffer_id", "flights", "key", "owner", "read_only", "revoked", "rkey", "rkey_bytes", "size", "worker")

    def __init__(self, message: peer_pb2.BufferGrant, key: bytes, owner: str) -> None:
        handle = message.handles.ucx
        if not handle.rkey or not handle.worker or len(handle.worker) > _MAX_WORKER_ADDRESS:
            raise UnsupportedError(f"agent {owner} granted buffer {message.buffer_id} without a usable UCX key and worker address")
        self.key, self.owner, self.buffer_id = key, owner, message.buffer_id
        self.address, self.size, self.read_only = handle.address, message.size, message.read_only
        self.worker = bytes(handle.worker)
        self.rkey_bytes = bytes(handle.rkey)
        self.rkey: engine.RemoteKey | None = None
        self.flights = 0
        self.revoked: HMCError | None = None


@dataclasses.dataclass(eq=False)
class _Flight:
    """One transfer on the progress thread: its windows, how many are in flight, whether it ended."""

    request: TransferRequest
    grant: _Grant
    windows: list[RangeList]
    next: int = 0
    in_flight: int = 0
    ended: bool = False
    stopped: bool = False
    landed: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set once no window of the transfer is in flight any more and none will be posted."""


class UcxTransport(Transport):
    """One path (`ucx`, or `rdma`: the same engine on verbs transports) of one agent."""

    def __init__(self, open_grant: OpenGrant, *, path: PathName = PathName.UCX, transports: str = "", library: str = "", timeout_s: float = 30.0) -> None:
        if path not in (PathName.UCX, PathName.RDMA):
            raise ArgumentError(f"the UCX engine serves the ucx and rdma paths, not {path.value}")
        self._open_grant = open_grant
        self._path = path
        self._transports = RDMA_TRANSPORTS if path is PathName.RDMA else transports
        self._library = library
        self._timeout_s = timeout_s
        self._capabilities = Capabilities(path=path, memory_kinds=frozenset(), one_sided=True)
        self._progress: Progress | None = None
        self._lock = threading.Lock()  # guards _grants
        self._drained = threading.Condition(self._lock)  # a grant's last flight ended
        self._grants: dict[str, _Grant] = {}
        self._mappings: dict[str, engine.Mapping] = {}
        """Local buffer id -> its registration (progress thread)."""
        self._endpoints: dict[bytes, engine.Endpoint] = {}
        """Owner worker address -> endpoint (progress thread)."""
        self._flights: set[_Flight] = set()

    @property  # type: ignore[override]
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def unavailable_reason(self) -> str | None:
        """Load UCX and start the worker; why not, when it cannot (no UCX, no RDMA device for `rdma`)."""
        if self._path is PathName.RDMA and not rdma_nics():
            return "no RDMA device on this host (/sys/class/infiniband is empty)"
        try:
            worker = engine.Worker(wakeup=True, transports=self._transports, library=self._library)
        except HMCError as exc:
            return str(exc)
        kinds = frozenset(_KINDS[name] for name in worker.memory_kinds())
        detail = f"UCX {engine.version()}" + (f", transports {self._transports}" if self._transports else "")
        self._capabilities = Capabilities(path=self._path, memory_kinds=kinds, one_sided=True, detail=detail)
        self._progress = Progress(worker, f"hmc-{self._path.value}")
        return None

    def _run(self) -> Progress:
        if self._progress is None:
            raise UnsupportedError(f"the {self._path.value} path is not running")
        return self._progress

    # -- owner side ---------------------------------------------------------------

    def export(self, buffer: Any) -> dict[str, Any]:
        """Register the buffer's memory with the worker (handles go out in grants only)."""
        kind = buffer.region.device.kind if buffer.region.kind is MemoryKind.DEVICE else DeviceKind.HOST
        if self._progress is None or kind not in self._capabilities.memory_kinds:
            return {}
        worker = self._progress.worker

        def register() -> None:
            self._mappings[buffer.id] = worker.map(buffer.region.address, buffer.size, _UCX_MEMORY[kind])

        self._progress.call(register, time.monotonic() + self._timeout_s)
        return {}

    def grant(self, buffer: Any) -> common_pb2.TransportHandles:
        """What a peer that proved `buffer`'s key gets: the packed key, the address and this worker's address."""
        progress = self._run()
        mapping = progress.call(lambda: self._mappings.get(buffer.id), time.monotonic() + self._timeout_s)
        if mapping is None:
            raise UnsupportedError(f"buffer {buffer.id} ({buffer.region.device.name}) is not registered with {self._path.value}")
        handle = common_pb2.UcxHandle(rkey=mapping.rkey, address=mapping.address, worker=progress.worker.address, ucx_version=engine.version())
        return common_pb2.TransportHandles(ucx=handle)

    # -- initiator side -------------------------------------------------------------

    def _grant(self, remote: common_pb2.BufferDescriptor, deadline: float) -> _Grant:
        with self._lock:
            grant = self._grants.get(remote.id)
        if grant is None or grant.key != remote.access_key or grant.revoked is not None:
            grant = _Grant(self._open_grant(remote, deadline), remote.access_key, remote.owner.id)
            with self._lock:
                self._grants[remote.id] = grant
        return grant

    def post(self, request: TransferRequest) -> None:
        try:
            progress = self._run()
            self._local_kind(request.local)
            grant = self._grant(request.remote, request.deadline)
            if grant.read_only and request.op is TransferOp.WRITE:
                raise AccessDeniedError(f"buffer {grant.buffer_id} is read-only: its owner grants reads only")
            if grant.size < request.remote.size:  # the agent checked against the descriptor; the grant is authoritative
                sizes = (request.local.size, grant.size) if request.op is TransferOp.WRITE else (grant.size, request.local.size)
                request.ranges.check(*sizes)
        except HMCError as exc:
            request.completion.finish(exc)
            return
        flight = _Flight(request, grant, request.ranges.chunks(_WINDOW_BYTES))
        request.completion.set_running()
        request.completion.on_cancel = lambda: self._stop(flight)
        try:
            progress.submit(lambda: self._start(flight))
        except HMCError as exc:
            flight.landed.set()
            request.completion.finish(exc)

    def _local_kind(self, local: Any) -> DeviceKind:
        kind = local.region.device.kind if local.region.kind is MemoryKind.DEVICE else DeviceKind.HOST
        if kind not in self._capabilities.memory_kinds:
            raise UnsupportedError(f"{self._path.value} on this agent cannot reach {kind.value} memory")
        return kind

    def _start(self, flight: _Flight) -> None:
        """Progress thread: connect, unpack the key, post the first windows."""
        grant = flight.grant
        if flight.ended:  # cancelled before it started
            return
        with self._lock:
            grant.flights += 1
        self._flights.add(flight)
        try:
            if grant.revoked is not None:
                raise grant.revoked
            if flight.request.local.id not in self._mappings:
                raise UnsupportedError(f"buffer {flight.request.local.id} is not registered with {self._path.value}")
            endpoint = self._endpoints.get(grant.worker)
            if endpoint is None:
                endpoint = self._endpoints[grant.worker] = self._run().worker.connect(grant.worker)
            if grant.rkey is None:
                grant.rkey = endpoint.unpack(grant.rkey_bytes)
        except HMCError as exc:
            self._end(flight, exc)
            return
        self._pump(flight, endpoint)

    def _pump(self, flight: _Flight, endpoint: engine.Endpoint) -> None:
        """Post windows until `_WINDOWS` are in flight (or none is left); end the transfer when all landed."""
        request, grant = flight.request, flight.grant
        while not flight.ended and flight.in_flight < _WINDOWS and flight.next < len(flight.windows):
            window = flight.windows[flight.next]
            flight.next += 1
            if request.op is TransferOp.WRITE:
                local_offsets, remote_offsets, op = window.src, window.dst, "write"
            else:
                local_offsets, remote_offsets, op = window.dst, window.src, "read"
            base = np.uint64(request.local.region.address)
            try:
                endpoint.post(op, self._mappings[request.local.id], local_offsets.astype(np.uint64) + base,
                              remote_offsets.astype(np.uint64) + np.uint64(grant.address), window.lengths, grant.rkey)  # type: ignore[arg-type]
                flush = endpoint.flush_start()
            except HMCError as exc:
                self._end(flight, exc)
                return
            flight.in_flight += 1
            nbytes = window.total
            self._run().watch(flush, request.deadline, lambda error, n=nbytes: self._landed(flight, endpoint, n, error))
        if flight.in_flight == 0 and not flight.ended:
            self._end(flight, None)

    def _landed(self, flight: _Flight, endpoint: engine.Endpoint, nbytes: int, error: BaseException | None) -> None:
        flight.in_flight -= 1
        if error is None and not flight.ended:
            flight.request.completion.add_bytes(nbytes)
            if flight.grant.revoked is not None or flight.stopped:
                error = flight.grant.revoked
            else:
                self._pump(flight, endpoint)
                return
        self._end(flight, error)

    def _end(self, flight: _Flight, error: BaseException | None) -> None:
        """Progress thread: report the end once; release the grant's count once nothing is in flight."""
        if not flight.ended:
            flight.ended = True
            if not flight.stopped:
                flight.request.completion.finish(error)
        if flight.in_flight == 0:
            if flight in self._flights:
                self._flights.discard(flight)
                with self._lock:
                    flight.grant.flights -= 1
                    self._drained.notify_all()
            flight.landed.set()

    def _stop(self, flight: _Flight) -> None:
        """The handle's cancel hook: post no more, wait (bounded) until what is in flight has landed."""
        flight.stopped = True
        progress = self._progress
        if progress is None:
            return
        try:
            progress.submit(lambda: self._end(flight, None))
        except HMCError:
            return
        if not progress.on_thread():
            flight.landed.wait(_STOP_WAIT_S)

    def withdraw(self, buffer_id: str) -> None:
        """A local buffer: unregister its memory. A remote one: revoke the grant, wait (bounded) for its transfers."""
        progress = self._progress
        if progress is None:
            return
        with self._lock:
            grant = self._grants.pop(buffer_id, None)
            if grant is not None:
                grant.revoked = BufferWithdrawnError("the buffer's owner withdrew it")
                self._drained.wait_for(lambda: grant.flights == 0, _STOP_WAIT_S)
        try:
            progress.submit(lambda: self._forget(buffer_id, grant))
        except HMCError:
            pass

    def _forget(self, buffer_id: str, grant: _Grant | None) -> None:
        mapping = self._mappings.pop(buffer_id, None)
        if mapping is not None:
            mapping.unmap()
        if grant is not None and grant.rkey is not None and grant.flights == 0:
            grant.rkey.destroy()

    def forget_peer(self, agent: common_pb2.AgentInfo) -> None:
        """A peer agent went away: its grants are void and the transfers to it fail now."""
        gone = BrokenResourceError(f"agent {agent.id} (pid {agent.pid}) is gone")
        with self._lock:
            grants = [g for g in self._grants.values() if g.owner == agent.id]
            for grant in grants:
                del self._grants[grant.buffer_id]
                grant.revoked = gone
        if grants and self._progress is not None:
            try:
                self._progress.submit(lambda: self._fail_peer(grants, gone))
            except HMCError:
                pass

    def _fail_peer(self, grants: list[_Grant], error: HMCError) -> None:
        workers = {grant.worker for grant in grants}
        for flight in list(self._flights):
            if flight.grant in grants:
                self._end(flight, error)
        for address in workers:
            endpoint = self._endpoints.pop(address, None)
            if endpoint is not None:
                endpoint.close(1e-6)  # without waiting: nobody answers a flush any more

    def close(self) -> None:
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.close()
