"""The mapping cache of the GPU `ipc` path: peers' buffers mapped through vendor IPC, local host buffers page-locked, one lane per GPU.

Grants. The initiator asks the owner once per (peer, buffer): OpenBuffer with the
buffer's access key over the control connection; the owner checks the key and
answers with a BufferGrant carrying the buffer's CUDA IPC handle, its size and
whether it is read-only. The initiator maps the handle (cuIpcOpenMemHandle
through the CUDA backend) in the context of the GPU that will run the copies,
since a mapping made on one GPU is out of reach of kernels on another (one
mapping per exported allocation and GPU, reference-counted). It keeps the
mapping for later transfers and closes it when the owner withdraws the buffer
(once the copies in flight into it have finished: the owner's unregister()
waits for that acknowledgement) or when the peer is lost. A grant from an agent
of this very process is used directly (its address is valid here): a process
cannot open its own IPC handle.

Page-locking. Local host memory is page-locked once per buffer
(cuMemHostRegister, undone when the buffer is unregistered) so the GPU reaches
it directly; where the driver refuses, the buffer is marked unpinnable and each
range is one cuMemcpyAsync.

Concurrency contract: `_MappingCache` is mixed into the transport, which owns the
state it reads. `_lock` guards `_mappings`, `_pinned`, `_lanes` and `_closed`
and is never held across a grant, a driver call or a wait; `_pin_lock`
serializes page-locking (the driver refuses overlapping registrations). Two
threads may map the same buffer at once: the first to publish wins and the
loser's mapping is closed. Each mapping or page-locked buffer counts the copies
using it (`_Use`): `enter`/`leave` are lock-free under the GIL, `revoke` stops
new copies and the resource is closed exactly once, when revoked and idle.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hmc.errors import ArgumentError, BufferWithdrawnError, ClosedResourceError, HMCError, UnsupportedError
from hmc.memory import DeviceKind, MemoryKind, MemoryRegion
from hmc.memory._base import Device
from hmc.transport._gpu_copy import Lane
from hmc.v1 import common_pb2, peer_pb2

if TYPE_CHECKING:
    from hmc.memory._gpu import GpuBackend

_log = logging.getLogger(__name__)

OpenGrant = Callable[[common_pb2.BufferDescriptor, float], peer_pb2.BufferGrant]

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


class _MappingCache:
    """Mappings, page-locked buffers and lanes of the GPU ipc transport (mixed into `GpuIpcTransport`, which sets this state)."""

    _backend: GpuBackend
    _kind: DeviceKind
    _handle: str
    """The grant field carrying this family's IPC handle ("cuda_ipc", "hip_ipc")."""
    _open_grant: OpenGrant
    _lock: threading.Lock
    _pin_lock: threading.Lock
    _mappings: dict[tuple[str, int], _Mapping]
    _pinned: dict[str, Any]
    _lanes: dict[int, Lane]
    _closed: bool

    def _copier(self, local: MemoryRegion, remote: common_pb2.DeviceInfo) -> Device:
        """The GPU that runs a pair's copies: the local buffer's, else the one the peer's memory lives on.

        That GPU is matched by uuid (processes may number GPUs differently); one this
        process cannot see (CUDA_VISIBLE_DEVICES) is reached from the first GPU it can.
        """
        if local.kind is MemoryKind.DEVICE and local.device.kind is self._kind:
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
        """Open the grant's IPC handle for `device` (kernels there can then reach it)."""
        read_only = bool(grant.read_only)
        if grant.handles.HasField("cma") and grant.handles.cma.pid == os.getpid():  # an agent of this process: its address is valid here
            self._peer_link(device, remote.device)
            return _Mapping(grant.handles.cma.address, grant.size, device, remote.access_key, remote.owner.id, read_only, _Use(lambda: None))
        if not grant.handles.HasField(self._handle):
            raise UnsupportedError(f"the owner of buffer {remote.id} granted no {self._kind.value} IPC handle")
        try:
            region = self._backend.open_ipc(getattr(grant.handles, self._handle), device, grant.size)
        except ArgumentError as exc:
            raise UnsupportedError(f"buffer {remote.id}: {exc}") from exc
        return _Mapping(region.address, grant.size, device, remote.access_key, remote.owner.id, read_only, _Use(region.free))

    def _peer_link(self, device: Device, remote: common_pb2.DeviceInfo) -> None:
        """Memory of this process on another GPU: enable peer access to it (IPC mappings get theirs from the driver)."""
        for other in self._backend.devices():
            if other.uuid == remote.uuid and other.index != device.index:
                self._backend.enable_peer_access(device.index, other.index)

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
        runtime = self._backend.runtime
        with runtime.use(lane.ordinal):
            if region.kind is MemoryKind.HOST_PINNED:
                return _Pinned(runtime.mapped_pointer(region.address), _Use(lambda: None))
            if region.size == 0:
                return None
            try:
                pointer = runtime.register_host(region.address, region.size)
            except HMCError as exc:  # e.g. already registered, perhaps only in part
                _log.info("cannot page-lock the %d-byte host buffer at %#x (%s): one copy per range", region.size, region.address, exc)
                return None

        def unregister() -> None:
            with runtime.use(lane.ordinal):
                runtime.unregister_host(region.address)

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
