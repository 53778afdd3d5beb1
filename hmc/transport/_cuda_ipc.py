"""The `ipc` path for CUDA memory: the peer's device memory mapped through CUDA IPC, bytes moved by device copies.

Access model (as for host memory in `hmc.transport._ipc`). The initiator asks
the owner once per (peer, buffer): OpenBuffer with the buffer's access key over
the control connection; the owner checks the key and answers with a BufferGrant
carrying the buffer's CUDA IPC handle, its size and whether it is read-only.
The initiator maps the handle (cuIpcOpenMemHandle through the CUDA backend) in
the context of the GPU that will run the copies, since a mapping made on one
GPU is out of reach of kernels on another (one mapping per exported allocation
and GPU, reference-counted). It keeps the mapping for later transfers and
closes it when the owner withdraws the buffer (once the copies in flight into
it have finished: the owner's unregister() waits for that acknowledgement) or
when the peer is lost. Every range is bounds-checked against the granted size,
and writes into a read-only grant are refused, before anything is queued. A
grant from an agent of this very process is used directly (its address is
valid here): a process cannot open its own IPC handle.

Moving bytes (`hmc.transport._cuda_copy.Lane`). The copies run on the GPU of
the local buffer when it is device memory (a WRITE pushes, a READ pulls, over
NVLink), else on the GPU the peer's memory lives on. One range is one
cuMemcpyAsync; a batch is one table upload and one gather/scatter kernel
launch. Local host memory is page-locked once per buffer (cuMemHostRegister,
undone when the buffer is unregistered) so the GPU reaches it directly; where
the driver refuses, each range is one cuMemcpyAsync. The two GPUs must reach
each other (NVLink or PCIe peer access; cuIpcOpenMemHandle enables it for the
mapping). Local device memory and a peer's *host* memory meet through a
page-locked bounce buffer and the host-memory ipc transport (cross-memory
attach), one chunk at a time.

Completion. Requests up to `sync_bytes` are waited for on the caller's thread,
polling the stream, before post() returns. Larger ones record a CUDA event and
hand the transfer handle a `drive` (`TransferHandle.drive_with`): the thread
that calls wait() or done() polls the event itself and completes the request
(no hand-off to another thread). The "hmc-cuda-ipc-wait" thread is only the
backstop for requests nobody waits on: it looks at their events once a
millisecond. A request whose deadline passes first fails with TimeoutError; its
buffers stay counted as in use until the GPU is done.

Ordering: as with any one-sided path, the caller makes sure the bytes it writes
are ready (their producing stream synchronized) before write(); the bytes of a
transfer are in place once its handle is done.

Concurrency: `_lock` guards the mapping, page-locked buffer and lane tables;
`_pin_lock` serializes page-locking. Each mapping or page-locked buffer counts
the copies using it (`_Use`) so withdrawal waits for them and closes it once.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hmc.errors import (
    AccessDeniedError,
    ArgumentError,
    BufferWithdrawnError,
    ClosedResourceError,
    HMCError,
    TimeoutError,
    UnsupportedError,
)
from hmc.memory import DeviceKind, MemoryKind, MemoryRegion
from hmc.memory import backend_for as memory_backend
from hmc.memory._base import Device
from hmc.memory._cuda_driver import check, driver
from hmc.transport._base import Capabilities, InlineCopy, PathName, TransferOp, TransferRequest, Transport
from hmc.transport._cuda_copy import Lane, mapped_pointer
from hmc.transport._ranges import RangeList
from hmc.v1 import common_pb2, peer_pb2

if TYPE_CHECKING:
    from hmc.memory._cuda import CudaBackend

__all__ = ["CudaIpcTransport"]

_log = logging.getLogger(__name__)

OpenGrant = Callable[[common_pb2.BufferDescriptor, float], peer_pb2.BufferGrant]

_CUDA = common_pb2.DEVICE_KIND_CUDA
_WITHDRAW_S = 5.0
_CLOSE_S = 2.0
_UNPINNABLE = object()
"""Marks a local host buffer the driver would not page-lock (its ranges go one copy each)."""


class _Use:
    """Copies in flight through one resource (a mapping, a page-locked buffer); closed once, when revoked and idle.

    `enter`/`leave` are the hot path: a list append/pop (atomic under the GIL)
    and a flag check; only the close decision takes the lock.
    """

    __slots__ = ("_close", "_closed", "_lock", "inflight", "revoked")

    def __init__(self, close: Callable[[], None]) -> None:
        self._close = close
        self._closed = False
        self._lock = threading.Lock()  # makes "revoked and idle -> close" happen once
        self.inflight: list[None] = []
        self.revoked = False

    def enter(self) -> None:
        self.inflight.append(None)
        if self.revoked:
            self.leave()
            raise BufferWithdrawnError("the buffer was withdrawn")

    def leave(self) -> None:
        self.inflight.pop()
        if self.revoked and not self.inflight:
            self._close_once()

    def leave_closed(self) -> None:
        """After an inlined leave() (the pop done by the caller) found the resource revoked and idle."""
        self._close_once()

    def revoke(self, deadline: float) -> None:
        """No new copies; close now if idle, else wait (bounded) for the last copy to close it."""
        self.revoked = True
        if not self.inflight:
            self._close_once()
        while not self._closed and time.monotonic() < deadline:
            time.sleep(0.0002)

    def _close_once(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._close()
        except HMCError as exc:
            _log.warning("closing a CUDA ipc resource failed: %s", exc)


class _Mapping:
    """A peer's buffer as this process reaches it."""

    __slots__ = ("address", "agent_id", "device", "key", "read_only", "size", "use")

    def __init__(self, address: int, size: int, device: Device, key: bytes, agent_id: str, read_only: bool, use: _Use) -> None:
        self.address, self.size, self.device = address, size, device
        self.key, self.agent_id, self.read_only = key, agent_id, read_only
        self.use = use


class _Pinned:
    """A local host buffer page-locked for the GPUs: `pointer` is its device-side address."""

    __slots__ = ("pointer", "use")

    def __init__(self, pointer: int, use: _Use) -> None:
        self.pointer, self.use = pointer, use


class _Staging:
    """The bounce buffer dressed as a local buffer for the host mover."""

    __slots__ = ("id", "region", "size")

    def __init__(self, region: MemoryRegion) -> None:
        self.id = "cuda-ipc-bounce"
        self.region = region
        self.size = region.size


class _Latch:
    """The Completion of a sub-request handed to the host mover; the parent's cancellation shows through."""

    __slots__ = ("_event", "_parent", "error")

    def __init__(self, parent: Any) -> None:
        self._event = threading.Event()
        self._parent = parent
        self.error: BaseException | None = None

    @property
    def cancelled(self) -> bool:
        return bool(self._parent.cancelled)

    def set_running(self) -> None:
        return None

    def add_bytes(self, nbytes: int) -> None:
        return None

    def finish(self, error: BaseException | None = None) -> None:
        if not self._event.is_set():
            self.error = error
            self._event.set()

    def wait(self, deadline: float) -> None:
        if not self._event.wait(max(deadline - time.monotonic(), 0.0)):
            raise TimeoutError("ipc transfer missed its deadline")
        if self.error is not None:
            raise self.error


class _Pending:
    """A request's CUDA event, completed once: by whoever waits on it (`drive`) or by the backstop thread (`poll`)."""

    __slots__ = ("_lock", "deadline", "event", "lane", "late", "on_done", "on_late", "settled")

    def __init__(self, lane: Lane, event: Any, deadline: float, on_done: Callable[[BaseException | None], None], on_late: Callable[[], None]) -> None:
        self.lane, self.event, self.deadline = lane, event, deadline
        self.on_done, self.on_late = on_done, on_late
        self.late = False
        self.settled = False
        self._lock = threading.Lock()  # one thread at a time looks at the event; the one that sees it done settles

    def drive(self, deadline: float) -> None:
        """Poll the event on the caller's thread until it is done (then complete the request) or `deadline` passed."""
        if self.settled:
            return
        with self._lock:
            if self.settled:
                return
            error: BaseException | None = None
            try:
                done = self.lane.event_wait(self.event, deadline)
            except HMCError as exc:
                done, error = True, exc
            if not done:
                return
            self.settled = True
        self._settle(error)

    def poll(self, now: float) -> bool:
        """One look (the backstop thread): True once settled, by this call or another thread."""
        if self.settled:
            return True
        if not self._lock.acquire(blocking=False):  # a waiter is polling it: leave it to them
            return False
        try:
            if self.settled:
                return True
            error: BaseException | None = None
            try:
                done = self.lane.event_done(self.event)
            except HMCError as exc:
                done, error = True, exc
            if done:
                self.settled = True
        finally:
            self._lock.release()
        if done:
            self._settle(error)
            return True
        if not self.late and now > self.deadline:
            self.late = True
            self.on_late()
        return False

    def _settle(self, error: BaseException | None) -> None:
        try:
            self.lane.release_event(self.event)
        except HMCError as exc:
            _log.debug("destroying a CUDA event failed: %s", exc)
        self.on_done(error)


class _Waiter:
    """The "hmc-cuda-ipc-wait" thread: the backstop completing requests nobody waits on (or that outlive their wait).

    It looks at each pending event once a millisecond: rarely enough not to compete
    with the callers that poll their own transfers (`_Pending.drive`).
    """

    def __init__(self, interval: float = 0.001) -> None:
        self._cond = threading.Condition()  # guards _pending, _thread and _closed
        self._pending: list[_Pending] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._interval = interval

    def watch(self, item: _Pending) -> None:
        with self._cond:
            self._pending.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hmc-cuda-ipc-wait", daemon=True)
                self._thread.start()
            elif len(self._pending) == 1:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
            time.sleep(self._interval)
            with self._cond:
                items = list(self._pending)
            now = time.monotonic()
            settled = [item for item in items if item.poll(now)]
            if settled:
                with self._cond:
                    for item in settled:
                        self._pending.remove(item)

    def close(self) -> None:
        """Stop once nothing is pending (joined with a bound: a hung GPU leaves a daemon thread behind)."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify()
        if thread is not None:
            thread.join(_CLOSE_S)


class CudaIpcTransport(Transport):
    """CUDA device memory of another process of this host, mapped through CUDA IPC (initiator side)."""

    capabilities = Capabilities(
        path=PathName.IPC,
        memory_kinds=frozenset({DeviceKind.CUDA}),  # local host memory to a peer's CUDA memory works too, but host memory as a peer's is the host mover's
        one_sided=True,
        same_host_only=True,
        same_vendor_only=True,
        detail="cuda ipc (peer copies, one gather/scatter kernel per batch)",
    )

    def __init__(
        self,
        backend: CudaBackend,
        open_grant: OpenGrant,
        *,
        host: Transport | None = None,
        timeout_s: float = 30.0,
        sync_bytes: int = 4 << 20,
        bounce_bytes: int = 16 << 20,
    ) -> None:
        self._backend = backend
        self._open_grant = open_grant
        self._host = host
        self._timeout_s = timeout_s
        self._sync_bytes = sync_bytes
        self._bounce_bytes = bounce_bytes
        self._lock = threading.Lock()  # guards _mappings, _pinned, _lanes, _closed
        self._pin_lock = threading.Lock()  # one page-locking at a time (the driver refuses overlapping ones)
        self._mappings: dict[tuple[str, int], _Mapping] = {}  # by (peer buffer id, ordinal of the GPU that opened it)
        self._pinned: dict[str, Any] = {}
        self._lanes: dict[int, Lane] = {}
        self._waiter = _Waiter()
        self._closed = False

    @classmethod
    def probe(cls, open_grant: OpenGrant, **options: Any) -> CudaIpcTransport | None:
        """The transport, or None where this host has no CUDA backend (no cuda-python, driver or GPU)."""
        try:
            backend = memory_backend(DeviceKind.CUDA)
        except UnsupportedError:
            return None
        return cls(backend, open_grant, **options)  # type: ignore[arg-type]

    def copy_engines(self) -> dict[str, str]:
        """How each GPU in use moves batches of ranges: "nvrtc", "cupy" (the kernel), "memcpy" or "unloaded"."""
        with self._lock:
            return {lane.device.name: lane.kernel_kind for lane in self._lanes.values()}

    # -- lifecycle -----------------------------------------------------------------

    def export(self, buffer: Any) -> dict[str, Any]:
        region = buffer.region
        if region.kind is not MemoryKind.DEVICE or region.device.kind is not DeviceKind.CUDA:
            return {}
        return self._backend.export_handles(region)

    def withdraw(self, buffer_id: str) -> None:
        """Close the mapping of a withdrawn peer buffer, or undo the page-locking of an unregistered local one."""
        with self._lock:
            mappings = [self._mappings.pop(key) for key in [k for k in self._mappings if k[0] == buffer_id]]
            pinned = self._pinned.pop(buffer_id, None)
        deadline = time.monotonic() + _WITHDRAW_S
        for mapping in mappings:
            mapping.use.revoke(deadline)
        if isinstance(pinned, _Pinned):
            pinned.use.revoke(deadline)

    def forget_peer(self, agent: common_pb2.AgentInfo) -> None:
        """Close every mapping into the memory of an agent that went away."""
        with self._lock:
            gone = [key for key, mapping in self._mappings.items() if mapping.agent_id == agent.id]
            mappings = [self._mappings.pop(key) for key in gone]
        deadline = time.monotonic() + _WITHDRAW_S
        for mapping in mappings:
            mapping.use.revoke(deadline)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            mappings, self._mappings = list(self._mappings.values()), {}
            pinned, self._pinned = [p for p in self._pinned.values() if isinstance(p, _Pinned)], {}
            lanes, self._lanes = list(self._lanes.values()), {}
        self._waiter.close()
        deadline = time.monotonic() + _CLOSE_S
        for use in [m.use for m in mappings] + [p.use for p in pinned]:
            use.revoke(deadline)
        for lane in lanes:
            lane.close(deadline)

    # -- transfers -------------------------------------------------------------------

    def post(self, request: TransferRequest) -> None:
        try:
            if request.remote.device.kind == _CUDA:
                self._post_mapped(request)
            elif request.local.region.kind is MemoryKind.DEVICE:
                self._post_bounced(request)
            else:
                raise UnsupportedError("host memory on both sides is moved by the host ipc transport")
        except HMCError as exc:
            request.completion.finish(exc)

    def _post_mapped(self, request: TransferRequest) -> None:
        """Local memory <-> a peer's mapped device memory, on one lane."""
        device = self._copier(request.local.region, request.remote.device)
        mapping = self._mapping(request.remote, device, request.deadline)
        ranges = request.ranges
        if request.op is TransferOp.WRITE:
            if mapping.read_only:
                raise AccessDeniedError(f"buffer {request.remote.id} is read-only: its owner grants reads only")
            if mapping.size < request.remote.size:  # the agent checked against the descriptor; the grant is authoritative
                ranges.check(request.local.size, mapping.size)
        elif mapping.size < request.remote.size:
            ranges.check(mapping.size, request.local.size)
        base, lane, per_range, local_use = self._local_side(request.local, device)
        src_base, dst_base = (base, mapping.address) if request.op is TransferOp.WRITE else (mapping.address, base)
        uses = _enter(mapping.use, local_use)
        request.completion.set_running()
        sync = ranges.total <= self._sync_bytes
        try:
            event = lane.enqueue(ranges.src, src_base, ranges.dst, dst_base, ranges.lengths, request.deadline, per_range=per_range, record=not sync)
            if sync:
                finished = lane.wait_idle(request.deadline)
        except HMCError:
            _leave(uses)
            raise
        if not sync:
            pending = _Pending(lane, event, request.deadline, _finisher(request, uses), _expirer(request))
            drive_with = getattr(request.completion, "drive_with", None)
            if drive_with is not None:
                drive_with(pending.drive)
            self._waiter.watch(pending)
        elif finished:
            _leave(uses)
            request.completion.finish()
        else:
            self._linger(lane, uses)
            raise TimeoutError("ipc transfer missed its deadline")

    def _post_bounced(self, request: TransferRequest) -> None:
        """Local device memory <-> a peer's host memory: GPU copy to a page-locked bounce buffer, then cross-memory attach."""
        if self._host is None:
            raise UnsupportedError("device memory to a peer's host memory needs the host ipc transport, which this agent lacks")
        region, deadline = request.local.region, request.deadline
        lane = self._lane(region.device)
        request.completion.set_running()
        with lane.bounce(self._bounce_bytes, deadline) as bounce:
            for chunk in request.ranges.chunks(bounce.size):
                if request.completion.cancelled:
                    return
                staged = np.concatenate(([0], np.cumsum(chunk.lengths)[:-1])).astype(np.int64)
                if request.op is TransferOp.WRITE:
                    lane.enqueue(chunk.src, region.address, staged, bounce.pointer, chunk.lengths, deadline)
                    self._settle(lane, deadline)
                    self._host_copy(request, bounce.region, RangeList(staged, chunk.dst, chunk.lengths))
                else:
                    self._host_copy(request, bounce.region, RangeList(chunk.src, staged, chunk.lengths))
                    lane.enqueue(staged, bounce.pointer, chunk.dst, region.address, chunk.lengths, deadline)
                    self._settle(lane, deadline)
                request.completion.add_bytes(chunk.total)
        request.completion.finish()

    def _host_copy(self, request: TransferRequest, staging: MemoryRegion, ranges: RangeList) -> None:
        assert self._host is not None
        latch = _Latch(request.completion)
        self._host.post(TransferRequest(request.transfer_id, request.op, _Staging(staging), request.remote, ranges, request.deadline, latch))
        latch.wait(request.deadline)

    @staticmethod
    def _settle(lane: Lane, deadline: float) -> None:
        if not lane.wait_idle(deadline):
            raise TimeoutError("ipc transfer missed its deadline")

    def _linger(self, lane: Lane, uses: tuple[_Use, ...]) -> None:
        """A request gave up waiting: keep its buffers in use until the GPU is really done with them."""
        self._waiter.watch(_Pending(lane, lane.record(), float("inf"), lambda _: _leave(uses), lambda: None))

    # -- the single-range fast path ---------------------------------------------------

    def inline(self, local: Any, remote: common_pb2.BufferDescriptor) -> InlineCopy | None:
        if remote.device.kind != _CUDA:
            return None
        device = self._copier(local.region, remote.device)
        with self._lock:
            mapping = self._mappings.get((remote.id, device.index))
        if mapping is None or mapping.key != remote.access_key:
            return None
        base, lane, _, local_use = self._local_side(local, device)
        remote_base, timeout, use = mapping.address, self._timeout_s, mapping.use
        one = self._one
        if local_use is None:  # device memory on both sides (the common case): no second use to hold
            copy_now, inflight, monotonic = lane.copy_now, use.inflight, time.monotonic

            def one(lane: Lane, use: _Use, local_use: _Use | None, dst: int, src: int, length: int, timeout: float) -> None:
                inflight.append(None)  # use.enter(), inlined
                if use.revoked:
                    use.leave()
                    raise BufferWithdrawnError("the buffer was withdrawn")
                try:
                    finished = copy_now(dst, src, length, monotonic() + timeout)
                except HMCError:
                    use.leave()
                    raise
                if not finished:
                    self._linger(lane, (use,))
                    raise TimeoutError("ipc copy missed its deadline")
                inflight.pop()  # use.leave(), inlined
                if use.revoked and not inflight:
                    use.leave_closed()

        def write(local_offset: int, remote_offset: int, length: int) -> None:
            if mapping.read_only:
                raise AccessDeniedError(f"buffer {remote.id} is read-only: its owner grants reads only")
            one(lane, use, local_use, remote_base + remote_offset, base + local_offset, length, timeout)

        def read(local_offset: int, remote_offset: int, length: int) -> None:
            one(lane, use, local_use, base + local_offset, remote_base + remote_offset, length, timeout)

        return InlineCopy(write=write, read=read, local_size=local.size, remote_size=mapping.size)

    def _one(self, lane: Lane, use: _Use, local_use: _Use | None, dst: int, src: int, length: int, timeout: float) -> None:
        uses = _enter(use, local_use)
        try:
            finished = lane.copy_now(dst, src, length, time.monotonic() + timeout)
        except HMCError:
            _leave(uses)
            raise
        if not finished:
            self._linger(lane, uses)
            raise TimeoutError("ipc copy missed its deadline")
        _leave(uses)

    # -- mappings, page-locked buffers and lanes ---------------------------------------

    def _copier(self, local: MemoryRegion, remote: common_pb2.DeviceInfo) -> Device:
        """The GPU that runs a pair's copies: the local buffer's, else the one the peer's memory lives on.

        That GPU is matched by uuid (processes may number GPUs differently); one this
        process cannot see (CUDA_VISIBLE_DEVICES) is reached from the first GPU it can.
        """
        if local.kind is MemoryKind.DEVICE and local.device.kind is DeviceKind.CUDA:
            return local.device
        devices = self._backend.devices()
        for device in devices:
            if remote.uuid and device.uuid == remote.uuid:
                return device
        return devices[0]

    def _mapping(self, remote: common_pb2.BufferDescriptor, device: Device, deadline: float) -> _Mapping:
        """The peer buffer mapped for the GPU `device`, asking its owner for a grant the first time."""
        key = (remote.id, device.index)
        with self._lock:
            mapping = self._mappings.get(key)
        if mapping is not None and mapping.key == remote.access_key:
            return mapping
        grant = self._open_grant(remote, deadline)  # the owner checks the access key
        mapping = self._map(grant, remote, device)
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                current = self._mappings.get(key)
                if current is not None and current.key == remote.access_key:
                    winner = current
                else:
                    self._mappings[key] = winner = mapping
        if closed:
            mapping.use.revoke(0.0)
            raise ClosedResourceError("the agent is closed")
        if winner is not mapping:  # another thread mapped it meanwhile
            mapping.use.revoke(0.0)
        return winner

    def _map(self, grant: peer_pb2.BufferGrant, remote: common_pb2.BufferDescriptor, device: Device) -> _Mapping:
        """Open the grant's CUDA IPC handle in `device`'s context (kernels there can then reach it)."""
        read_only = bool(grant.read_only)
        if grant.handles.HasField("cma") and grant.handles.cma.pid == os.getpid():  # an agent of this process: its address is valid here
            self._peer_link(device, remote.device)
            return _Mapping(grant.handles.cma.address, grant.size, device, remote.access_key, remote.owner.id, read_only, _Use(lambda: None))
        if not grant.handles.HasField("cuda_ipc"):
            raise UnsupportedError(f"the owner of buffer {remote.id} granted no CUDA IPC handle")
        try:
            region = self._backend.open_ipc(grant.handles.cuda_ipc, device, grant.size)
        except ArgumentError as exc:
            raise UnsupportedError(f"buffer {remote.id}: {exc}") from exc
        return _Mapping(region.address, grant.size, device, remote.access_key, remote.owner.id, read_only, _Use(region.free))

    def _peer_link(self, device: Device, remote: common_pb2.DeviceInfo) -> None:
        """Memory of this process on another GPU: enable peer access to it (IPC mappings get theirs from the driver)."""
        for other in self._backend.devices():
            if other.uuid == remote.uuid and other.index != device.index:
                self._backend.contexts.enable_peer_access(device.index, other.index)

    def _local_side(self, local: Any, device: Device) -> tuple[int, Lane, bool, _Use | None]:
        """(device-side base address of the local buffer, the lane that copies, one copy per range?, the use to hold)."""
        region = local.region
        lane = self._lane(device)
        if region.kind is MemoryKind.DEVICE:
            return region.address, lane, False, None
        pinned = self._pinned_host(local, lane)
        if pinned is None:
            return region.address, lane, True, None
        return pinned.pointer, lane, False, pinned.use

    def _pinned_host(self, local: Any, lane: Lane) -> _Pinned | None:
        with self._lock:
            pinned = self._pinned.get(local.id)
        if pinned is None:
            with self._pin_lock:
                with self._lock:
                    pinned = self._pinned.get(local.id)
                if pinned is None:
                    pinned = self._pin(local.region, lane) or _UNPINNABLE
                    with self._lock:
                        self._pinned[local.id] = pinned
        return pinned if isinstance(pinned, _Pinned) else None

    def _pin(self, region: MemoryRegion, lane: Lane) -> _Pinned | None:
        """Page-lock a local host buffer and map it for the GPUs (None where the driver refuses)."""
        contexts = self._backend.contexts
        with contexts.use(lane.ordinal):
            if region.kind is MemoryKind.HOST_PINNED:
                return _Pinned(mapped_pointer(region.address), _Use(lambda: None))
            if region.size == 0:
                return None
            flags = int(driver.CU_MEMHOSTREGISTER_PORTABLE) | int(driver.CU_MEMHOSTREGISTER_DEVICEMAP)
            status = driver.cuMemHostRegister(region.address, region.size, flags)[0]
            if status != driver.CUresult.CUDA_SUCCESS:  # e.g. already registered, perhaps only in part
                _log.info("cannot page-lock the %d-byte host buffer at %#x (%s): one copy per range", region.size, region.address, status)
                return None
            pointer = mapped_pointer(region.address)

        def unregister() -> None:
            with contexts.use(lane.ordinal):
                check(driver.cuMemHostUnregister(region.address))

        return _Pinned(pointer, _Use(unregister))

    def _lane(self, device: Device) -> Lane:
        with self._lock:
            if self._closed:
                raise ClosedResourceError("the agent is closed")
            lane = self._lanes.get(device.index)
            if lane is None:
                lane = self._lanes[device.index] = Lane(self._backend, device)
            return lane


def _enter(use: _Use, local_use: _Use | None) -> tuple[_Use, ...]:
    use.enter()
    if local_use is None:
        return (use,)
    try:
        local_use.enter()
    except HMCError:
        use.leave()
        raise
    return (use, local_use)


def _leave(uses: tuple[_Use, ...]) -> None:
    for use in uses:
        use.leave()


def _finisher(request: TransferRequest, uses: tuple[_Use, ...]) -> Callable[[BaseException | None], None]:
    def done(error: BaseException | None) -> None:
        _leave(uses)
        request.completion.finish(error)

    return done


def _expirer(request: TransferRequest) -> Callable[[], None]:
    return functools.partial(request.completion.finish, TimeoutError("ipc transfer missed its deadline"))

