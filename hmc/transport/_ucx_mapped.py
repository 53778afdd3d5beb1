"""Ranges of the `ucx` path moved through the peer memory that UCX maps into this process (`ucp_rkey_ptr`).

Where UCX reaches a peer's GPU memory through a mapping (cuda_ipc, between GPUs of one host), UCX 1.22 still
moves each range as a cuMemcpyAsync of its own, at several microseconds of CPU per range (one H100: 4096 x
64 KiB ranges at 12 GB/s; its batched put, cuMemcpyBatchAsync behind `put_sgl_zcopy`, came to cuda_ipc after
1.22). Through the same mapping, the ipc path's batched copy (`hmc.transport._gpu_copy.Lane`) moves a whole
batch with one kernel launch, and a single range with one memcpyAsync polled on the spot. `PeerMemory` keeps
one such lane per local GPU and, in each grant, the peer buffer's mapped address per local GPU (0: UCX maps
none there, and the ranges go as UCX puts and gets).

The mapping is UCX's: it lives in cuda_ipc's cache of opened handles for as long as the peer's memory does;
a grant is used only while it is not revoked and counted in flight (`CallersWorker.copy`), as for
puts and gets.

Concurrency: `_lock` guards the lanes; a grant's `mapped` entries are made under the callers' worker's lock (`CallersWorker`)
(where its remote key is unpacked) and never changed after, so `single` reads its entry without it; copies run
outside both locks, and a lane takes any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hmc import memory
from hmc.errors import AccessDeniedError, TimeoutError
from hmc.memory import Device, DeviceKind
from hmc.transport._base import TransferOp, kind_to_proto
from hmc.transport._gpu_copy import Lane
from hmc.transport._ucx_lanes import STOP_WAIT_S

if TYPE_CHECKING:
    from hmc.memory._gpu import GpuBackend
    from hmc.transport._ucx_engine import RemoteKey
    from hmc.transport._ucx_lanes import Grant

__all__ = ["PeerMemory"]

_log = logging.getLogger(__name__)


class PeerMemory:
    """One copy lane per local GPU, and the copies that go through grants' mapped addresses."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _lanes
        self._lanes: dict[str, Lane] = {}

    def lane(self, device: Device) -> Lane:
        """`device`'s copy lane (made on first use)."""
        with self._lock:
            lane = self._lanes.get(device.name)
            if lane is None:
                backend: GpuBackend = memory.backend_for(device)  # type: ignore[assignment]
                lane = self._lanes[device.name] = Lane(backend, device)
            return lane

    def base(self, grant: Grant, device: Device | None, rkey: RemoteKey) -> int:
        """Where `grant`'s buffer is mapped for local memory on `device` (0: not mapped; always for the host, and for
        memory of another kind than the buffer's), asked of UCX once per grant and GPU; the caller holds the lock of
        `rkey`'s worker."""
        if device is None or device.kind is DeviceKind.HOST or grant.remote_kind != kind_to_proto(device.kind):
            return 0
        mapped = grant.mapped.get(device.name)
        if mapped is None:
            with self.lane(device).current():  # cuda_ipc maps the peer's memory for the current GPU
                mapped = grant.mapped[device.name] = rkey.pointer(grant.address) or 0
        return mapped

    def copy(
        self, device: Device, op: TransferOp, local_base: int, local: Any, remote_base: int, remote: Any, lengths: Any, deadline: float,
    ) -> bool:  # fmt: skip
        """Move one range (ints) or a batch (int64 offset arrays) between local memory and a mapped peer buffer; True once
        the GPU finished, False when `deadline` passed first (the copy may still run: see `settled`)."""
        lane = self.lane(device)
        src_base, src, dst_base, dst = (local_base, local, remote_base, remote) if op is TransferOp.WRITE else (remote_base, remote, local_base, local)
        if isinstance(lengths, int):
            return bool(lane.copy_now(dst_base + dst, src_base + src, lengths, deadline))
        event = lane.enqueue(np.asarray(src, dtype=np.int64), src_base, np.asarray(dst, dtype=np.int64), dst_base, lengths, deadline, record=True)
        if not lane.event_wait(event, deadline):
            return False
        lane.release_event(event)
        return True

    def single(
        self, grant: Grant, device: Device, local_base: int, op: TransferOp, *, enter: Callable[[Grant], None], leave: Callable[[Grant], None],
        pin: Callable[[], None], timeout_s: float, path: str,
    ) -> Callable[[int, int, int], None]:  # fmt: skip
        """copy(local_offset, remote_offset, length): one range through the grant's mapping for `device`, waited for on
        the caller's thread, every name bound (nothing but `enter`/`leave`, the grant's count in flight, between the
        call and the memcpy: a 4 KiB write's whole path, and a 1 GiB one's); `pin`: a copy that may still run counts on
        this end's memory for good."""
        if op is TransferOp.WRITE and grant.read_only:
            def refused(local: int, remote: int, length: int) -> None:
                raise AccessDeniedError(f"buffer {grant.buffer_id} is read-only: its owner grants reads only")

            return refused
        copy_now, mapped, monotonic = self.lane(device).copy_now, grant.mapped[device.name], time.monotonic
        pull = op is TransferOp.READ

        def copy(local: int, remote: int, length: int) -> None:
            enter(grant)
            landed = True
            try:
                if pull:
                    done = copy_now(local_base + local, mapped + remote, length, monotonic() + timeout_s)
                else:
                    done = copy_now(mapped + remote, local_base + local, length, monotonic() + timeout_s)
                if not done:
                    landed = self.settled(device, path)
                    if not landed:
                        pin()  # this end's memory too: the copy may still run
                    raise TimeoutError(f"{path} copy missed its deadline")
            finally:
                if landed:
                    leave(grant)

        return copy

    def settled(self, device: Device, path: str) -> bool:
        """A copy missed its deadline: whether `device`'s lane went idle within `STOP_WAIT_S` more (if not, the caller
        keeps its grant counted in flight: a withdrawal must not free what the GPU may still write)."""
        if self.lane(device).wait_idle(time.monotonic() + STOP_WAIT_S):
            return True
        _log.error("a %s copy on %s still runs %.0f s after its deadline", path, device.name, STOP_WAIT_S)
        return False

    def close(self, deadline: float) -> None:
        with self._lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.close(deadline)
