"""The `local` path: both buffers belong to this agent, so a transfer is one copy per range.

Host-to-host ranges are copied with one `memmove` per coalesced range (measured
faster than any numpy gather/scatter, which would copy twice); device memory
goes through the Memory API's backend copy.

Concurrency: stateless apart from the buffer table it reads (thread-safe);
`post()` runs the copy on the caller's thread and completes before returning.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from hmc.errors import AccessDeniedError, HMCError
from hmc.memory import DeviceKind, MemoryKind, copy, devices
from hmc.transport._base import Capabilities, InlineCopy, PathName, TransferOp, TransferRequest, Transport
from hmc.v1 import common_pb2

if TYPE_CHECKING:
    from hmc.agent._buffers import BufferTable, ConnBuffer

__all__ = ["LocalTransport", "copy_ranges"]


def copy_ranges(dst: Any, src: Any, src_offsets: list[int], dst_offsets: list[int], lengths: list[int]) -> None:
    """Copy each range from ConnBuffer `src` to ConnBuffer `dst` (bounds already checked)."""
    if src.region.kind is not MemoryKind.DEVICE and dst.region.kind is not MemoryKind.DEVICE:
        src_base, dst_base, move = src.region.address, dst.region.address, ctypes.memmove
        for s, d, n in zip(src_offsets, dst_offsets, lengths):
            move(dst_base + d, src_base + s, n)
        return
    for s, d, n in zip(src_offsets, dst_offsets, lengths):
        copy(dst.region, src.region, n, dst_offset=d, src_offset=s)


def _read_only(buffer: Any) -> AccessDeniedError:
    return AccessDeniedError(f"buffer {buffer.id} is read-only")


class LocalTransport(Transport):
    """Copies between two ConnBuffers of one agent, found in that agent's buffer table."""

    def __init__(self, table: BufferTable, *, capabilities: Capabilities | None = None) -> None:
        self._table = table
        self.capabilities = capabilities or Capabilities(
            path=PathName.LOCAL,
            memory_kinds=frozenset({DeviceKind.HOST, *(d.kind for d in devices())}),
            one_sided=True,
            same_agent_only=True,
            detail="memmove",
        )

    def _peer_buffer(self, remote: common_pb2.BufferDescriptor) -> ConnBuffer:
        return self._table.get(remote.id, remote.access_key)

    def post(self, request: TransferRequest) -> None:
        try:
            target = self._peer_buffer(request.remote)
            src, dst = (request.local, target) if request.op is TransferOp.WRITE else (target, request.local)
            if dst.region.readonly:
                raise _read_only(dst)
            request.ranges.check(src.size, dst.size)
            request.completion.set_running()
            ranges = request.ranges
            copy_ranges(dst, src, ranges.src.tolist(), ranges.dst.tolist(), ranges.lengths.tolist())
        except HMCError as exc:
            request.completion.finish(exc)
            return
        request.completion.finish()

    def inline(self, local: Any, remote: common_pb2.BufferDescriptor) -> InlineCopy | None:
        target = self._peer_buffer(remote)
        if MemoryKind.DEVICE in (local.region.kind, target.region.kind):
            return None
        local_base, remote_base, move = local.region.address, target.region.address, ctypes.memmove

        def write(local_offset: int, remote_offset: int, length: int) -> None:
            move(remote_base + remote_offset, local_base + local_offset, length)

        def refuse(local_offset: int, remote_offset: int, length: int) -> None:
            raise _read_only(target)

        def read(local_offset: int, remote_offset: int, length: int) -> None:
            move(local_base + local_offset, remote_base + remote_offset, length)

        return InlineCopy(write=refuse if target.region.readonly else write, read=read, local_size=local.size, remote_size=target.size)
