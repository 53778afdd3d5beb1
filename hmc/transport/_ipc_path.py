"""The `ipc` path as the agent sees it: one transport and one declaration, a mover per memory kind.

`IpcPath` holds the movers that serve the path on this host, keyed by the kind
of device memory they reach: host memory by cross-memory attach
(`hmc.transport._ipc.IpcTransport`), CUDA memory by CUDA IPC and HIP memory by
HIP IPC (`hmc.transport._gpu_ipc.GpuIpcTransport`, one per family). Its capabilities are
the union of what the available movers declare, so negotiation stays a pure
function of declarations. Each request goes to the mover of the pair's device
memory: the remote buffer's kind when that is device memory, else the local
buffer's; a pair of host buffers goes to the host mover.

Concurrency: the mover table changes only in `unavailable_reason()`, which the
agent calls once before first use; the movers guard their own state.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from hmc.errors import UnsupportedError
from hmc.memory import DeviceKind, MemoryKind
from hmc.transport._base import Capabilities, InlineCopy, PathName, TransferRequest, Transport
from hmc.v1 import common_pb2

__all__ = ["IpcPath"]

_log = logging.getLogger(__name__)

_REMOTE_KIND = {common_pb2.DEVICE_KIND_CUDA: DeviceKind.CUDA, common_pb2.DEVICE_KIND_HIP: DeviceKind.HIP}
"""Device kinds of a descriptor that name device memory (anything else is host memory)."""


def _declare(movers: Mapping[DeviceKind, Transport]) -> Capabilities:
    caps = [mover.capabilities for mover in movers.values()]
    return Capabilities(
        path=PathName.IPC,
        memory_kinds=frozenset(kind for cap in caps for kind in cap.memory_kinds),
        one_sided=bool(caps) and all(cap.one_sided for cap in caps),
        same_host_only=True,
        same_vendor_only=any(cap.same_vendor_only for cap in caps),
        detail="; ".join(cap.detail for cap in caps if cap.detail),
    )


class IpcPath(Transport):
    """The ipc path: dispatches each request to the mover for its pair's memory kinds."""

    def __init__(self, movers: Mapping[DeviceKind, Transport]) -> None:
        for kind, mover in movers.items():
            if mover.capabilities.path is not PathName.IPC or kind not in mover.capabilities.memory_kinds:
                raise ValueError(f"{type(mover).__name__} does not declare ipc for {kind.value} memory")
        self._movers = dict(movers)
        self._capabilities = _declare(self._movers)

    @property  # type: ignore[override]
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def movers(self) -> dict[DeviceKind, Transport]:
        """The movers in use, by the kind of device memory they reach."""
        return dict(self._movers)

    def unavailable_reason(self) -> str | None:
        """Drop the movers that cannot run here; unavailable only when none is left."""
        reasons = []
        for kind, mover in list(self._movers.items()):
            why = mover.unavailable_reason()
            if why is not None:
                _log.info("ipc for %s memory unavailable: %s", kind.value, why)
                reasons.append(f"{kind.value} memory: {why}")
                del self._movers[kind]
                mover.close()
        self._capabilities = _declare(self._movers)
        if not self._movers:
            return "; ".join(reasons) or "no ipc mover on this host"
        return None

    def _mover(self, local: Any, remote: common_pb2.BufferDescriptor) -> Transport:
        kind = _REMOTE_KIND.get(remote.device.kind) or local.region.device.kind
        mover = self._movers.get(kind)
        if mover is None:
            raise UnsupportedError(f"ipc on this agent cannot move {kind.value} memory")
        return mover

    def export(self, buffer: Any) -> dict[str, Any]:
        handles: dict[str, Any] = {}
        for mover in self._movers.values():
            handles.update(mover.export(buffer))
        return handles

    def grant(self, buffer: Any) -> common_pb2.TransportHandles:
        """What an ipc initiator needs to reach `buffer`: pid and address (cross-memory attach, or direct use by an
        agent of this very process), and for device memory its vendor's IPC handle (CUDA or HIP)."""
        handles = common_pb2.TransportHandles(cma=common_pb2.CmaHandle(pid=os.getpid(), address=buffer.region.address))
        if buffer.region.kind is MemoryKind.DEVICE:
            exported = buffer.descriptor.handles
            vendor = [field for field in ("cuda_ipc", "hip_ipc") if exported.HasField(field)]
            if not vendor:
                raise UnsupportedError(f"buffer {buffer.id} is {buffer.region.device.name} memory with no IPC handle this agent could export")
            getattr(handles, vendor[0]).CopyFrom(getattr(exported, vendor[0]))
        return handles

    def withdraw(self, buffer_id: str) -> None:
        for mover in self._movers.values():
            mover.withdraw(buffer_id)

    def forget_peer(self, agent: common_pb2.AgentInfo) -> None:
        for mover in self._movers.values():
            mover.forget_peer(agent)

    def inline(self, local: Any, remote: common_pb2.BufferDescriptor) -> InlineCopy | None:
        return self._mover(local, remote).inline(local, remote)

    def post(self, request: TransferRequest) -> None:
        try:
            mover = self._mover(request.local, request.remote)
        except UnsupportedError as exc:
            request.completion.finish(exc)
            return
        mover.post(request)

    def close(self) -> None:
        for mover in self._movers.values():
            mover.close()
