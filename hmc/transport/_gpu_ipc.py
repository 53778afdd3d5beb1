"""The `ipc` path for GPU memory of one vendor: the peer's device memory mapped through vendor IPC (CUDA IPC between
NVIDIA GPUs, HIP IPC between AMD ones), bytes moved by device copies. One transport per GPU family present.

This module is the mover: the transport and its request paths. The grants and
the mapping cache (peer buffers mapped per GPU, local host buffers page-locked,
lanes) are `hmc.transport._gpu_ipc_mappings`; completion (callers driving their
own events, the backstop thread) is `hmc.transport._gpu_ipc_completion`.

Access model (as for host memory in `hmc.transport._ipc`): one grant per (peer,
buffer), mapped in the context of the GPU that runs the copies and kept until
the owner withdraws the buffer or the peer is lost. Every range is
bounds-checked against the granted size, and writes into a read-only grant are
refused, before anything is queued.

Moving bytes (`hmc.transport._gpu_copy.Lane`). The copies run on the GPU of
the local buffer when it is device memory (a WRITE pushes, a READ pulls, over
NVLink or XGMI), else on the GPU the peer's memory lives on. One range is one
memcpyAsync; a batch is a gather/scatter kernel reading its range table in
place (a long one launched in a few parts). Local host memory is page-locked
once per buffer so the GPU reaches it directly; where the runtime refuses,
each range is one memcpyAsync. The two
GPUs must reach each other (NVLink, XGMI or PCIe peer access; opening the IPC
handle enables it for the mapping). Local device memory and a peer's *host* memory
meet through a page-locked bounce buffer and the host-memory ipc transport
(cross-memory attach), one chunk at a time.

Completion. Requests up to `sync_bytes` are waited for on the caller's thread
before post() returns; larger ones are completed by whoever waits on them, or
by the "hmc-cuda-ipc-wait" backstop (`hmc.transport._gpu_ipc_completion`).

Ordering: as with any one-sided path, the caller makes sure the bytes it writes
are ready (their producing stream synchronized) before write(); the bytes of a
transfer are in place once its handle is done.

Concurrency contract: post() and inline() copies run on any caller thread, many
at once. `_lock` guards the mapping, page-locked buffer and lane tables and
`_closed`, and is never held across a grant, a driver call or a wait;
`_pin_lock` serializes page-locking. Each mapping or page-locked buffer counts
the copies using it (`_Use`) so withdrawal (withdraw, forget_peer, close) waits,
bounded, for them and closes it once. close() is idempotent.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hmc.errors import (
    AccessDeniedError,
    BufferWithdrawnError,
    HMCError,
    TimeoutError,
    UnsupportedError,
)
from hmc.memory import DeviceKind, MemoryKind, MemoryRegion
from hmc.memory import backend_for as memory_backend
from hmc.transport._base import Capabilities, InlineCopy, PathName, TransferOp, TransferRequest, Transport, kind_to_proto
from hmc.transport._gpu_copy import Lane
from hmc.transport._gpu_ipc_completion import _CLOSE_S, _Latch, _Pending, _Waiter
from hmc.transport._gpu_ipc_mappings import OpenGrant, _enter, _leave, _Mapping, _MappingCache, _Pinned, _Use
from hmc.transport._ranges import RangeList
from hmc.v1 import common_pb2

if TYPE_CHECKING:
    from hmc.memory._gpu import GpuBackend

__all__ = ["GpuIpcTransport"]

_log = logging.getLogger(__name__)

_HANDLE = {DeviceKind.CUDA: "cuda_ipc", DeviceKind.HIP: "hip_ipc"}
"""The grant field carrying each family's IPC handle."""
_WITHDRAW_S = 5.0


class _Staging:
    """The bounce buffer dressed as a local buffer for the host mover."""

    __slots__ = ("id", "region", "size")

    def __init__(self, region: MemoryRegion) -> None:
        self.id = "gpu-ipc-bounce"
        self.region = region
        self.size = region.size


class GpuIpcTransport(Transport, _MappingCache):
    """Device memory of one GPU family (`backend.kind`) in another process of this host, mapped through that
    vendor's IPC (initiator side)."""

    def __init__(
        self,
        backend: GpuBackend,
        open_grant: OpenGrant,
        *,
        host: Transport | None = None,
        timeout_s: float = 30.0,
        sync_bytes: int = 4 << 20,
        bounce_bytes: int = 16 << 20,
    ) -> None:
        self._backend = backend
        self._kind = backend.kind
        self._proto_kind = kind_to_proto(backend.kind)
        self._handle = _HANDLE[backend.kind]
        family = backend.kind.value
        self.capabilities = Capabilities(
            path=PathName.IPC,
            memory_kinds=frozenset({backend.kind}),  # local host memory to a peer's device memory works too, but host memory as a peer's is the host mover's
            one_sided=True,
            same_host_only=True,
            same_vendor_only=True,
            detail=f"{family} ipc (peer copies, one gather/scatter kernel per batch)",
        )
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
    def probe(cls, kind: DeviceKind, open_grant: OpenGrant, **options: Any) -> GpuIpcTransport | None:
        """The transport for the GPU family `kind`, or None where this process has no backend for it."""
        try:
            backend = memory_backend(kind)
        except UnsupportedError:
            return None
        return cls(backend, open_grant, **options)  # type: ignore[arg-type]

    def copy_engines(self) -> dict[str, str]:
        """How each GPU in use moves batches of ranges: "nvrtc", "cupy", "hiprtc" (the kernel), "memcpy" or "unloaded"."""
        with self._lock:
            return {lane.device.name: lane.kernel_kind for lane in self._lanes.values()}

    # -- lifecycle -----------------------------------------------------------------

    def export(self, buffer: Any) -> dict[str, Any]:
        region = buffer.region
        if region.kind is not MemoryKind.DEVICE or region.device.kind is not self._kind:
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
            if request.remote.device.kind == self._proto_kind:
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
        if remote.device.kind != self._proto_kind:
            return None
        device = self._copier(local.region, remote.device)
        with self._lock:
            mapping = self._mappings.get((remote.id, device.index))
        if mapping is None or mapping.key != remote.access_key:
            return None
        base, lane, _, local_use = self._local_side(local, device)
        remote_base, timeout, use = mapping.address, self._timeout_s, mapping.use
        if local_use is None:  # device memory on both sides (the common case): one closure each, no second use to hold
            write = self._device_copy(lane, use, base, remote_base, refuse=remote.id if mapping.read_only else None)
            read = self._device_copy(lane, use, base, remote_base, pull=True)
            # A range of any size: one memcpyAsync polled here, where a request would first cost ~0.1 ms of building
            # and completion (one H100: 1 GiB in 827 us against 724 for the plain copy).
            return InlineCopy(write=write, read=read, local_size=local.size, remote_size=mapping.size, max_bytes=local.size)

        def write_one(local_offset: int, remote_offset: int, length: int) -> None:
            if mapping.read_only:
                raise AccessDeniedError(f"buffer {remote.id} is read-only: its owner grants reads only")
            self._one(lane, use, local_use, remote_base + remote_offset, base + local_offset, length, timeout)

        def read_one(local_offset: int, remote_offset: int, length: int) -> None:
            self._one(lane, use, local_use, base + local_offset, remote_base + remote_offset, length, timeout)

        return InlineCopy(write=write_one, read=read_one, local_size=local.size, remote_size=mapping.size)

    def _device_copy(
        self, lane: Lane, use: _Use, local_base: int, remote_base: int, *, pull: bool = False, refuse: str | None = None,
    ) -> Callable[[int, int, int], None]:
        """copy(local_offset, remote_offset, length): one copy between device memory here and a mapped peer buffer.

        `_one` with `use.enter()`/`leave()` inlined and every name bound, waited for
        on the caller's thread: the 4 KiB write's whole path below the agent. A
        write (`pull` False) into a buffer whose grant refuses writes raises
        AccessDeniedError naming `refuse`.
        """
        copy_now, inflight, monotonic, timeout, linger = lane.copy_now, use.inflight, time.monotonic, self._timeout_s, self._linger

        def copy(local_offset: int, remote_offset: int, length: int) -> None:
            if refuse is not None:
                raise AccessDeniedError(f"buffer {refuse} is read-only: its owner grants reads only")
            inflight.append(None)  # use.enter(), inlined
            if use.revoked:
                use.leave()
                raise BufferWithdrawnError("the buffer was withdrawn")
            try:
                if pull:
                    finished = copy_now(local_base + local_offset, remote_base + remote_offset, length, monotonic() + timeout)
                else:
                    finished = copy_now(remote_base + remote_offset, local_base + local_offset, length, monotonic() + timeout)
            except HMCError:
                use.leave()
                raise
            if not finished:
                linger(lane, (use,))
                raise TimeoutError("ipc copy missed its deadline")
            inflight.pop()  # use.leave(), inlined
            if use.revoked and not inflight:
                use.leave_closed()

        return copy

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


def _finisher(request: TransferRequest, uses: tuple[_Use, ...]) -> Callable[[BaseException | None], None]:
    def done(error: BaseException | None) -> None:
        _leave(uses)
        request.completion.finish(error)

    return done


def _expirer(request: TransferRequest) -> Callable[[], None]:
    return functools.partial(request.completion.finish, TimeoutError("ipc transfer missed its deadline"))
