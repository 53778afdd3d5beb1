"""The `ucx` and `rdma` paths' callers' worker: the one worker of the path's UCP context that callers drive themselves.

A caller moves ranges through it on its own thread, one caller at a time (no thread hop): single host ranges up
to `_INLINE_BYTES`, and device memory in up to `_INLINE_RANGES` ranges (`hmc.transport._ucx` decides which),
posted, flushed and waited for in C. GPU memory whose peer buffer UCX maps here (cuda_ipc: `ucp_rkey_ptr`) moves
through that mapping instead, a batch in one kernel launch, on the caller's thread (`_ucx_mapped`: asked once per
grant and local GPU, under the worker's lock, where the grant's key is unpacked).

The worker keeps one endpoint per owner's worker address and, in each grant, a key of its own (`inline_rkey`,
unpacked on first use). Each copy is counted in flight on its grant by the transport (`enter`, `release`: a
revoked grant refuses it) for as long as it may still touch the grant's memory: one that did not complete, for
good, and on the local memory's mapping too (UCX cancels nothing). A revoked grant's key is
destroyed once nothing of the grant runs, unless an operation with it did not complete (`inline_kept`: then, as
when a caller holds the worker past `_KEY_LOCK_S`, it stays until the path closes); a lost peer's endpoints are
closed without waiting. `close` leaves the worker allocated where a caller still holds it; a closed worker
refuses copies (the path is not running), and its InlineCopies with it.

Concurrency: `lock` guards the worker, its endpoints and grants' inline keys (and where grants are mapped), waited
for within the caller's deadline; a grant's `flights` are the transport's, under its `_lock` (`flights_lock`
here: `enter`, `release`); copies through a mapping run outside the lock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from hmc.errors import AccessDeniedError, HMCError, TimeoutError, UnsupportedError
from hmc.memory import DeviceKind, MemoryKind
from hmc.transport import _ucx_engine as engine
from hmc.transport._base import InlineCopy, TransferOp, TransferRequest
from hmc.transport._ucx_lanes import Grant, connect
from hmc.transport._ucx_mapped import PeerMemory

__all__ = ["CallersWorker"]

_KEY_LOCK_S = 0.5
"""How long a withdrawal waits for the callers' worker to destroy a grant's key there (it is kept otherwise)."""


class CallersWorker:
    """A worker that callers drive themselves, one at a time, for single small ranges (no thread hop).

    `path`: the path's name, in errors; `peer_memory`: copies through the peer memory UCX maps here (None: mapping
    is off); `enter` / `release`: count a copy of a grant in flight and end it (`enter` raises the revocation of a
    revoked grant); `flights_lock`: the lock that guards grants' flights; `timeout_s`: the deadline of an
    InlineCopy's copy; `inline_bytes`: the largest single range of host memory an InlineCopy takes."""

    def __init__(
        self, context: engine.Context, *, path: str, peer_memory: PeerMemory | None, enter: Callable[[Grant], None], release: Callable[[Grant], None],
        flights_lock: threading.Lock, timeout_s: float, inline_bytes: int,
    ) -> None:  # fmt: skip
        self.worker = engine.Worker(context, serialized=True)
        self.lock = threading.Lock()  # one caller at a time: guards the worker, its endpoints and grants' inline keys
        self.endpoints: dict[bytes, engine.Endpoint] = {}
        self.closed = False
        """Set first thing by `close`: copies are refused from then on."""
        self._path = path
        self._peer_memory = peer_memory
        self._enter, self._release, self._flights_lock = enter, release, flights_lock
        self._timeout_s = timeout_s
        self._inline_bytes = inline_bytes

    def copy(
        self, op: TransferOp, grant: Grant, mapping: engine.Mapping, device: Any, local_base: int, local: Any, remote: Any, lengths: Any, timeout_s: float,
    ) -> None:  # fmt: skip
        """Ranges (ints: one; int64 offset arrays: a batch) between local memory at `local_base` on `device` and the
        grant's buffer, checked by the caller, on the caller's thread: through the peer's memory where UCX maps it
        here (a GPU copy), else posted, flushed and waited for in C through the callers' worker."""
        if self.closed:
            raise UnsupportedError(f"the {self._path} path is not running")
        if op is TransferOp.WRITE and grant.read_only:
            raise AccessDeniedError(f"buffer {grant.buffer_id} is read-only: its owner grants reads only")
        deadline = time.monotonic() + timeout_s
        self._enter(grant)
        landed = True
        try:
            self._acquire(deadline)  # not `_locked`: a generator's context costs ~1 us of a 4 KiB put's ~10
            try:
                if grant.revoked is not None:  # its owner went away while this waited (`forget_peer` holds the lock: `forget`)
                    raise grant.revoked
                endpoint, rkey = self._key(grant)
                mapped = self._mapped(grant, device, rkey)
                if not mapped:
                    left = deadline - time.monotonic()  # the wait for the lock came out of the caller's time
                    if left <= 0:
                        raise TimeoutError(f"{self._path} transfer missed its deadline")
                    try:
                        if isinstance(lengths, int):
                            endpoint.rma(op.value, mapping, local_base + local, grant.address + remote, lengths, rkey, left)
                        else:
                            endpoint.rma(op.value, mapping, local.astype(np.uint64) + np.uint64(local_base), remote.astype(np.uint64) + np.uint64(grant.address), lengths, rkey, left)
                    except HMCError:
                        grant.inline_kept = True  # what it posted may still run, with this key: in flight for good
                        landed = False
                        self._pin(mapping)
                        raise
                    return
            finally:
                self.lock.release()
            peers = self._peer_memory
            assert peers is not None  # only it maps
            if not peers.copy(device, op, local_base, local, mapped, remote, lengths, deadline):
                landed = peers.settled(device, self._path)
                if not landed:
                    self._pin(mapping)
                raise TimeoutError(f"{self._path} copy missed its deadline")
        finally:
            if landed:
                self._release(grant)

    def _pin(self, mapping: engine.Mapping) -> None:
        """A copy through `mapping` may still run (UCX or the GPU cancels nothing): it stays counted on it for good."""
        with self._flights_lock:
            mapping.users += 1

    def _acquire(self, deadline: float) -> None:
        """Take the callers' worker's lock, waited for until `deadline` (TimeoutError: another caller holds it, a
        transfer to a peer that does not answer, say; it holds it at most until its own deadline)."""
        if not self.lock.acquire(False) and not self.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"the {self._path} path's callers' worker stayed busy past the deadline (another transfer held it)")

    @contextlib.contextmanager
    def _locked(self, deadline: float) -> Iterator[None]:
        """`_acquire`, released at the block's end."""
        self._acquire(deadline)
        try:
            yield
        finally:
            self.lock.release()

    def _key(self, grant: Grant) -> tuple[engine.Endpoint, engine.RemoteKey]:
        """The callers' worker's endpoint to the grant's owner and its key for the grant (made once); under `lock`."""
        address = grant.worker(0)
        endpoint = self.endpoints.get(address)
        if endpoint is None:
            endpoint = self.endpoints[address] = connect(self.worker, address, grant)
        if grant.inline_rkey is None:
            grant.inline_rkey = endpoint.unpack(grant.rkey)
        return endpoint, grant.inline_rkey

    def _mapped(self, grant: Grant, device: Any, rkey: engine.RemoteKey) -> int:
        """Where UCX maps the grant's buffer for local `device` (0: nowhere, or mapping is off); under `lock`."""
        return 0 if self._peer_memory is None else self._peer_memory.base(grant, device, rkey)

    def maps(self, grant: Grant, device: Any, deadline: float) -> bool:
        """Whether a transfer of the grant's buffer with local memory on `device` goes through a mapping (asked once)."""
        if self.closed or self._peer_memory is None or device is None or device.kind is DeviceKind.HOST:
            return False
        mapped = grant.mapped.get(device.name)
        if mapped is not None:  # never changed once set
            return bool(mapped)
        with self._locked(deadline):
            return bool(self._mapped(grant, device, self._key(grant)[1]))

    def run(self, request: TransferRequest, grant: Grant, mapping: engine.Mapping) -> None:
        """The whole request on the caller's thread (device memory: copies end within microseconds, no thread hop)."""
        remaining = request.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{self._path} transfer missed its deadline")
        ranges = request.ranges
        local, remote = (ranges.src, ranges.dst) if request.op is TransferOp.WRITE else (ranges.dst, ranges.src)
        region = request.local.region
        device = region.device if region.kind is MemoryKind.DEVICE else None
        if len(ranges) == 1:
            self.copy(request.op, grant, mapping, device, region.address, int(local[0]), int(remote[0]), int(ranges.lengths[0]), remaining)
        else:
            self.copy(request.op, grant, mapping, device, region.address, local, remote, ranges.lengths, remaining)

    def inline_copy(self, grant: Grant, mapping: engine.Mapping, local: Any) -> InlineCopy:
        """One small range between `local` (registered as `mapping`) and the grant's buffer on the caller's thread."""
        region = local.region
        base, device = region.address, (region.device if region.kind is MemoryKind.DEVICE else None)

        def write(local_offset: int, remote_offset: int, length: int) -> None:
            self.copy(TransferOp.WRITE, grant, mapping, device, base, local_offset, remote_offset, length, self._timeout_s)

        def read(local_offset: int, remote_offset: int, length: int) -> None:
            self.copy(TransferOp.READ, grant, mapping, device, base, local_offset, remote_offset, length, self._timeout_s)

        if device is None:
            return InlineCopy(write=write, read=read, local_size=local.size, remote_size=grant.size, max_bytes=self._inline_bytes, waits=True)
        # Device memory: a range of any size (post() moves it on the caller's thread too, after ~80 us of request
        # building that this skips); reads past _INLINE_BYTES take the slow path, which may have the owner push them,
        # unless the peer's memory is mapped here (a get is then a GPU copy).
        mapped = grant.mapped.get(device.name)
        if mapped and self._peer_memory is not None:
            write, read = (
                self._peer_memory.single(
                    grant, device, base, op, enter=self._enter, leave=self._release, pin=lambda: self._pin(mapping), timeout_s=self._timeout_s, path=self._path
                )
                for op in (TransferOp.WRITE, TransferOp.READ)
            )
        reads = local.size if mapped else self._inline_bytes
        return InlineCopy(write=write, read=read, local_size=local.size, remote_size=grant.size, max_bytes=local.size, read_max_bytes=reads, waits=True)

    def drop_key(self, grant: Grant) -> None:
        """Destroy a revoked grant's key of the callers' worker under its lock (skipped, the key kept until the path
        closes, where a caller holds it past `_KEY_LOCK_S`, or an operation with it did not complete)."""
        if self.closed or grant.inline_rkey is None or not self.lock.acquire(timeout=_KEY_LOCK_S):
            return
        try:
            self._drop_key(grant)
        finally:
            self.lock.release()

    def _drop_key(self, grant: Grant) -> None:
        """Under `lock`: destroy the revoked grant's key of the callers' worker, unless it must stay."""
        key = grant.inline_rkey
        with self._flights_lock:
            idle = grant.flights == 0  # nothing of it runs (a GPU copy through its mapping that did not settle stays counted)
        if key is not None and idle and not grant.inline_kept:
            grant.inline_rkey = None
            key.destroy()

    def forget(self, grants: Iterable[Grant]) -> None:
        """Revoked grants of a peer that went away: their keys here destroyed, the endpoints to its workers closed."""
        if self.closed:
            return
        with self.lock:
            for grant in grants:
                self._drop_key(grant)
                for address in grant.workers:
                    endpoint = self.endpoints.pop(address, None)
                    if endpoint is not None:
                        endpoint.close(1e-6)  # without waiting: nobody answers a flush any more

    def close(self, deadline: float) -> bool:
        """Refuse copies from now on and close the worker once no caller holds it, waited for until `deadline`; False
        (the worker left allocated) where one still did. Closing it again does nothing."""
        if self.closed:
            return True
        self.closed = True
        if not self.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        try:
            self.worker.close(deadline)
        finally:
            self.lock.release()
        return True
