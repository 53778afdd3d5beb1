"""The `ipc` path for host memory: cross-memory attach (`process_vm_writev`/`readv`).

One-sided and single-copy: the initiator copies straight between its own memory
and the owner's, the kernel doing the work; no staging, no owner thread involved.

Access model. The owner grants access once per (peer, buffer): the initiator
sends OpenBuffer with the buffer's access key over the control connection and the
owner answers with a BufferGrant (pid, address, size, read-only flag). The
initiator bounds-checks every range against the *granted* size before any copy,
so it never writes past the buffer's end, and refuses every write into a
read-only grant (AccessDeniedError) before a byte moves: the kernel would let
it through, since the pages themselves are usually writable. The owner revokes
a grant with a Withdrawn frame when the buffer is unregistered; the initiator
acknowledges only after its in-flight copies into that buffer have finished, so
unregister() returns before the memory can be reused. The kernel's ptrace access check (same uid; Yama scope, relaxed by each
agent with PR_SET_PTRACER_ANY) is the process-level guard.

Speed. The kernel pins the remote pages of every remote iovec entry separately,
so many-range batches are sorted by remote address (destination ranges never
overlap: the agent refuses such batches) and each side's touching
neighbours are merged into one entry; the two sides' entries need not match,
only their bytes. Up to 16 ranges, iovecs are packed with struct; beyond, built
with numpy, at most IOV_MAX entries per side per call, partial transfers
resumed at the exact byte. Transfers up to `inline_bytes` run on the caller's
thread; larger ones on `threads` named workers, one share of at least 4 MiB
each. A single range over an established grant has a precomputed fast path
(`inline()`): two struct packs and one syscall.

Concurrency: grants are guarded by `_lock`; each grant's `inflight` list is
appended/popped around every copy (atomic under the GIL) so withdrawal can wait
for copies to drain. The worker pool is owned by the transport.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import os
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hmc.errors import AccessDeniedError, BrokenResourceError, BufferWithdrawnError, DeviceError, HMCError, TimeoutError, UnsupportedError
from hmc.memory import DeviceKind, MemoryKind
from hmc.transport._base import Capabilities, InlineCopy, PathName, TransferOp, TransferRequest, Transport
from hmc.transport._ranges import RangeList, iovec_rows
from hmc.transport._wire import IOV_MAX
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["IpcTransport", "allow_ptrace_peers"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc_fast = ctypes.CDLL(None)  # no errno bookkeeping: the inline path re-issues a failed call on _libc to learn why
_SYSCALL_ARGS = (ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong)
_writev, _readv = _libc.process_vm_writev, _libc.process_vm_readv
_writev_fast, _readv_fast = _libc_fast.process_vm_writev, _libc_fast.process_vm_readv
for _fn in (_writev, _readv, _writev_fast, _readv_fast):
    _fn.argtypes = _SYSCALL_ARGS
    _fn.restype = ctypes.c_ssize_t
_PACK_IOVEC = struct.Struct("=QQ").pack
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

OpenGrant = Callable[[common_pb2.BufferDescriptor, float], peer_pb2.BufferGrant]


def allow_ptrace_peers() -> None:
    """Let any same-uid process attach to this one's memory under Yama ptrace scope 1 (best effort)."""
    _libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)


def _syscall_error(err: int, pid: int) -> HMCError:
    if err == errno.ESRCH:
        return BrokenResourceError(f"peer process {pid} is gone")
    if err in (errno.EPERM, errno.ENOSYS):
        return UnsupportedError(f"cross-memory attach to pid {pid} refused: {os.strerror(err)}")
    if err == errno.EFAULT:
        return DeviceError(f"cross-memory attach to pid {pid}: address not mapped (buffer freed by its owner?)")
    return DeviceError(f"cross-memory attach to pid {pid} failed: {os.strerror(err)}")


class _Grant:
    """The right to copy into/out of one remote buffer, as granted by its owner."""

    __slots__ = ("address", "buffer_id", "inflight", "key", "pid", "read_only", "revoked", "size")

    def __init__(self, message: peer_pb2.BufferGrant, key: bytes) -> None:
        self.key = key
        self.pid = message.handles.cma.pid
        self.address = message.handles.cma.address
        self.size = message.size
        self.read_only = message.read_only
        self.buffer_id = message.buffer_id
        self.inflight: list[None] = []
        self.revoked: HMCError | None = None
        """Why the grant is void (the owner withdrew the buffer, or its agent is gone); raised by every later copy."""

    def denied(self) -> AccessDeniedError:
        return AccessDeniedError(f"buffer {self.buffer_id} is read-only: its owner grants reads only")

    def enter(self) -> None:
        self.inflight.append(None)
        if self.revoked is not None:
            self.inflight.pop()
            raise self.revoked

    def drain(self, deadline: float) -> None:
        self.revoked = BufferWithdrawnError("the buffer's owner withdrew it")
        while self.inflight and time.monotonic() < deadline:
            time.sleep(0.0002)


class _Running:
    """The copies of one request still running; the handle's cancel hook stops them and waits for them to return,
    so nothing of a transfer that has ended lands afterwards (a syscall in progress finishes first)."""

    __slots__ = ("cond", "count", "stopped")

    def __init__(self) -> None:
        self.cond = threading.Condition()  # guards count
        self.count = 0
        self.stopped = False

    def enter(self) -> None:
        with self.cond:
            self.count += 1

    def exit(self) -> None:
        with self.cond:
            self.count -= 1
            self.cond.notify_all()

    def stop(self) -> None:
        self.stopped = True
        with self.cond:
            self.cond.wait_for(lambda: self.count == 0, _STOP_WAIT_S)


_STOP_WAIT_S = 5.0
"""Bound on how long a cancel waits for a running copy to return (one syscall of at most a part's bytes)."""
_FEW = 16
"""Up to this many ranges, iovecs are packed from Python ints with struct: numpy's fixed costs exceed the whole job."""
_IOV_STRUCTS = [struct.Struct(f"={2 * n}Q") for n in range(_FEW + 1)]


def _copy_few(call: Any, pid: int, local: list[int], remote: list[int], lengths: list[int], request: TransferRequest, running: _Running) -> bool:
    """`_copy_iovecs` for at most `_FEW` ranges (addresses and lengths as lists, consumed)."""
    while True:
        if running.stopped or request.completion.cancelled or time.monotonic() > request.deadline:
            return False
        count = len(lengths)
        if count == 1:
            want = lengths[0]
            got = call(pid, _PACK_IOVEC(local[0], want), 1, _PACK_IOVEC(remote[0], want), 1, 0)
        else:
            pack = _IOV_STRUCTS[count].pack
            want = sum(lengths)
            got = call(pid, pack(*_interleave(local, lengths)), count, pack(*_interleave(remote, lengths)), count, 0)
        if got == want:
            return True
        if got < 0:
            raise _syscall_error(ctypes.get_errno(), pid)
        if got == 0:
            raise DeviceError(f"cross-memory attach to pid {pid} made no progress")
        while got >= lengths[0]:  # got < want: some range is left unfinished
            got -= lengths.pop(0)
            local.pop(0)
            remote.pop(0)
        local[0] += got
        remote[0] += got
        lengths[0] -= got


def _interleave(addresses: list[int], lengths: list[int]) -> list[int]:
    out = [0] * (2 * len(lengths))
    out[0::2], out[1::2] = addresses, lengths
    return out


def _narrow(rows: np.ndarray, ends: np.ndarray, first: int, last: int, start: int, stop: int) -> tuple[int, int, int]:
    """Make rows[first..last] cover exactly bytes [start, stop) of their side; returns what `_widen` restores."""
    saved = (int(rows[first, 0]), int(rows[first, 1]), int(rows[last, 1]))
    skip = start - (int(ends[first]) - saved[1])
    rows[first, 0] = saved[0] + skip
    rows[first, 1] = saved[1] - skip
    rows[last, 1] = int(rows[last, 1]) - (int(ends[last]) - stop)
    return saved


def _widen(rows: np.ndarray, first: int, last: int, saved: tuple[int, int, int]) -> None:
    rows[last, 1] = saved[2]
    rows[first, 0], rows[first, 1] = saved[0], saved[1]


def _copy_iovecs(call: Any, pid: int, local: np.ndarray, remote: np.ndarray, request: TransferRequest, running: _Running) -> bool:
    """Copy the bytes of `local` iovec rows to/from `remote` rows (same total, any entry counts).

    Each call takes at most IOV_MAX entries per side, cut at a byte boundary both
    sides share; a partial transfer resumes at the exact byte. Returns False when
    it stopped early because the request was cancelled or expired.
    """
    local_ends = np.cumsum(local[:, 1].astype(np.int64))
    remote_ends = np.cumsum(remote[:, 1].astype(np.int64))
    total = int(local_ends[-1]) if local_ends.size else 0
    local_at, remote_at = local.ctypes.data, remote.ctypes.data
    done = li = ri = 0
    while done < total:
        if running.stopped or request.completion.cancelled or time.monotonic() > request.deadline:
            return False
        stop = min(int(local_ends[min(li + IOV_MAX, local_ends.size) - 1]), int(remote_ends[min(ri + IOV_MAX, remote_ends.size) - 1]))
        lj = int(np.searchsorted(local_ends, stop, side="left"))
        rj = int(np.searchsorted(remote_ends, stop, side="left"))
        local_saved = _narrow(local, local_ends, li, lj, done, stop)
        remote_saved = _narrow(remote, remote_ends, ri, rj, done, stop)
        try:
            got = call(pid, local_at + li * 16, lj - li + 1, remote_at + ri * 16, rj - ri + 1, 0)
        finally:
            _widen(local, li, lj, local_saved)
            _widen(remote, ri, rj, remote_saved)
        if got < 0:
            raise _syscall_error(ctypes.get_errno(), pid)
        if got == 0:
            raise DeviceError(f"cross-memory attach to pid {pid} made no progress")
        done += got
        li = int(np.searchsorted(local_ends, done, side="right"))
        ri = int(np.searchsorted(remote_ends, done, side="right"))
    return True


def _remote_order(ranges: RangeList, op: TransferOp) -> RangeList:
    """`ranges` sorted by remote offset (the kernel pins remote pages per entry: neighbours merge and walk in
    order). Any order lands the same bytes: the agent refused overlapping destinations (`check_disjoint_dst`)."""
    remote = ranges.dst if op is TransferOp.WRITE else ranges.src
    if remote.size < 2 or (remote[1:] >= remote[:-1]).all():
        return ranges
    order = np.argsort(remote)
    return RangeList(ranges.src[order], ranges.dst[order], ranges.lengths[order])


_PART_MIN = 4 << 20
"""Smallest share of a transfer worth a thread of its own: below ~8 MiB a second thread loses more to the
hand-off than it gains (measured on a 2-core VM); above, two threads move ~1.3x the bytes of one."""


def _same_memory(local: Any, grant: _Grant) -> bool:
    """Whether the granted buffer may share bytes with `local` (one process, overlapping addresses)."""
    if grant.pid != os.getpid():
        return False
    base = local.region.address
    return base < grant.address + grant.size and grant.address < base + local.size


class IpcTransport(Transport):
    """Cross-memory attach between processes of one host (initiator side)."""

    capabilities = Capabilities(
        path=PathName.IPC,
        memory_kinds=frozenset({DeviceKind.HOST}),
        one_sided=True,
        same_host_only=True,
        detail="cma (process_vm_writev/readv)",
    )

    def __init__(self, open_grant: OpenGrant, *, threads: int = 2, inline_bytes: int = 1 << 20) -> None:
        self._open_grant = open_grant
        self._threads = max(1, threads)
        self._inline_bytes = inline_bytes
        self._lock = threading.Lock()  # guards _grants and _pool creation
        self._grants: dict[str, _Grant] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def unavailable_reason(self) -> str | None:
        """Probe the syscall on this process and the host's Yama policy."""
        probe, target = ctypes.create_string_buffer(8), ctypes.create_string_buffer(8)
        iov_a = _PACK_IOVEC(ctypes.addressof(probe), 8)
        iov_b = _PACK_IOVEC(ctypes.addressof(target), 8)
        if _writev(os.getpid(), iov_a, 1, iov_b, 1, 0) != 8:
            return f"process_vm_writev unavailable: {os.strerror(ctypes.get_errno())}"
        try:
            with open("/proc/sys/kernel/yama/ptrace_scope") as fh:
                scope = int(fh.read().strip() or 0)
        except (OSError, ValueError):
            return None
        if scope >= 2:
            return f"Yama ptrace_scope={scope} forbids cross-memory attach between unrelated processes"
        return None

    def export(self, buffer: Any) -> dict[str, Any]:
        if buffer.region.kind is MemoryKind.DEVICE:
            return {}
        return {"cma": common_pb2.CmaHandle(pid=os.getpid(), address=buffer.region.address)}

    def withdraw(self, buffer_id: str) -> None:
        """Revoke the grant and wait (bounded) until copies into that buffer have finished."""
        with self._lock:
            grant = self._grants.pop(buffer_id, None)
        if grant is not None:
            grant.drain(time.monotonic() + 5.0)

    def forget_peer(self, agent: common_pb2.AgentInfo) -> None:
        """Drop every grant into the process of an agent that went away."""
        with self._lock:
            gone = [bid for bid, grant in self._grants.items() if grant.pid == agent.pid]
            for bid in gone:
                self._grants.pop(bid).revoked = BrokenResourceError(f"the buffer's owner, agent {agent.id} (pid {agent.pid}), is gone")

    def _grant(self, remote: common_pb2.BufferDescriptor, deadline: float) -> _Grant:
        with self._lock:
            grant = self._grants.get(remote.id)
        if grant is None or grant.key != remote.access_key:
            grant = _Grant(self._open_grant(remote, deadline), remote.access_key)
            with self._lock:
                grant = self._grants.setdefault(remote.id, grant)
        return grant

    def post(self, request: TransferRequest) -> None:
        try:
            grant = self._grant(request.remote, request.deadline)
            if grant.read_only and request.op is TransferOp.WRITE:
                raise grant.denied()
            if grant.size < request.remote.size:  # the agent checked against the descriptor; the grant is authoritative
                if request.op is TransferOp.WRITE:
                    request.ranges.check(request.local.size, grant.size)
                else:
                    request.ranges.check(grant.size, request.local.size)
        except HMCError as exc:
            request.completion.finish(exc)
            return
        request.completion.set_running()
        running = _Running()
        request.completion.on_cancel = running.stop
        ranges, total = request.ranges, request.ranges.total
        if ranges.lengths.size > _FEW and not _same_memory(request.local, grant):
            ranges = _remote_order(ranges, request.op)
        if total <= self._inline_bytes or self._threads == 1:
            self._run(request, grant, ranges, running)
            return
        count = max(1, min(self._threads, total // _PART_MIN))
        if count == 1:
            self._executor().submit(self._run, request, grant, ranges, running)
            return
        parts = ranges.chunks(-(-total // count))
        remaining = [len(parts)]
        lock = threading.Lock()  # guards `remaining` for this request's parts

        def part_done(_: concurrent.futures.Future[None]) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last and not running.stopped:  # a stopped request's handle reports its own end
                request.completion.finish()

        pool = self._executor()
        for part in parts:
            pool.submit(self._run_part, request, grant, part, running).add_done_callback(part_done)

    def _run_part(self, request: TransferRequest, grant: _Grant, ranges: RangeList, running: _Running) -> None:
        try:
            self._copy(request, grant, ranges, running)
        except HMCError as exc:
            if not running.stopped:
                request.completion.finish(exc)

    def _run(self, request: TransferRequest, grant: _Grant, ranges: RangeList, running: _Running) -> None:
        try:
            self._copy(request, grant, ranges, running)
        except HMCError as exc:
            if not running.stopped:
                request.completion.finish(exc)
            return
        if not running.stopped:  # a stopped request's handle reports its own end
            request.completion.finish()

    def _copy(self, request: TransferRequest, grant: _Grant, ranges: RangeList, running: _Running) -> None:
        """Copy `ranges` on this thread (the agent checked and coalesced them)."""
        local_base = request.local.region.address
        if request.op is TransferOp.WRITE:
            call, local_offsets, remote_offsets = _writev, ranges.src, ranges.dst
        else:
            call, local_offsets, remote_offsets = _readv, ranges.dst, ranges.src
        if ranges.lengths.size <= _FEW:
            few = ranges.lengths.tolist()
            local_few = [local_base + o for o in local_offsets.tolist()]
            remote_few = [grant.address + o for o in remote_offsets.tolist()]
            grant.enter()
            running.enter()
            try:
                complete = _copy_few(call, grant.pid, local_few, remote_few, few, request, running)
            finally:
                running.exit()
                grant.inflight.pop()
            if not complete and not request.completion.cancelled:
                raise TimeoutError("ipc transfer missed its deadline")
            request.completion.add_bytes(ranges.total)
            return
        local = iovec_rows(local_offsets + local_base, ranges.lengths)
        remote = iovec_rows(remote_offsets + grant.address, ranges.lengths)
        grant.enter()
        running.enter()
        try:
            complete = _copy_iovecs(call, grant.pid, local, remote, request, running)
        finally:
            running.exit()
            grant.inflight.pop()
        if not complete and not (request.completion.cancelled or running.stopped):
            raise TimeoutError("ipc transfer missed its deadline")
        request.completion.add_bytes(ranges.total)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="hmc-ipc")
            return self._pool

    def inline(self, local: Any, remote: common_pb2.BufferDescriptor) -> InlineCopy | None:
        with self._lock:
            grant = self._grants.get(remote.id)
        if grant is None or grant.key != remote.access_key or local.region.kind is MemoryKind.DEVICE:
            return None
        return InlineCopy(
            write=_denied(grant) if grant.read_only else _single(_writev_fast, _writev, grant, local.region.address),
            read=_single(_readv_fast, _readv, grant, local.region.address),
            local_size=local.size,
            remote_size=grant.size,
        )

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._grants.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _denied(grant: _Grant) -> Callable[[int, int, int], None]:
    """The inline write into a read-only grant: refused before any byte moves."""

    def copy(local_offset: int, remote_offset: int, length: int) -> None:
        raise grant.denied()

    return copy


def _single(call: Any, explain: Any, grant: _Grant, local_base: int) -> Callable[[int, int, int], None]:
    """One range, one syscall: the 4 KiB-write fast path (no numpy, no allocation beyond two packs)."""
    pid, remote_base, inflight, pack = grant.pid, grant.address, grant.inflight, _PACK_IOVEC

    def copy(local_offset: int, remote_offset: int, length: int) -> None:
        inflight.append(None)
        try:
            if grant.revoked is not None:
                raise grant.revoked
            local_iov, remote_iov = pack(local_base + local_offset, length), pack(remote_base + remote_offset, length)
            got = call(pid, local_iov, 1, remote_iov, 1, 0)
            if got != length:  # rare: redo with errno captured (copying the same bytes twice is harmless)
                got = explain(pid, local_iov, 1, remote_iov, 1, 0)
        finally:
            inflight.pop()
        if got != length:
            if got < 0:
                raise _syscall_error(ctypes.get_errno(), pid)
            raise DeviceError(f"cross-memory attach to pid {pid} copied {got} of {length} bytes")

    return copy
