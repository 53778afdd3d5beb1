"""A loopback transport: several agents of one process reach each other's buffers directly.

It declares itself as a one-sided same-host path (`ipc`, detail "loopback") so
that negotiation between two in-process agents picks it, and copies through a
buffer table shared by all the agents built with the same `fabric` (checked on
every transfer, so a withdrawal by one agent is seen at once by the others). Tests use it
to exercise the agent and the conformance suite without sockets or processes.

Concurrency: as LocalTransport; the shared table is thread-safe.
"""

from __future__ import annotations

from typing import Any

from hmc.agent._buffers import BufferTable
from hmc.memory import DeviceKind
from hmc.transport._base import Capabilities, PathName
from hmc.transport._local import LocalTransport

__all__ = ["LoopbackTransport"]

_LOOPBACK = Capabilities(
    path=PathName.IPC,
    memory_kinds=frozenset({DeviceKind.HOST}),
    one_sided=True,
    same_host_only=True,
    detail="loopback (in-process, for tests)",
)


class LoopbackTransport(LocalTransport):
    """Copies between agents that share `fabric` (create one BufferTable per test)."""

    def __init__(self, fabric: BufferTable) -> None:
        super().__init__(fabric, capabilities=_LOOPBACK)
        self._fabric = fabric

    def export(self, buffer: Any) -> dict[str, Any]:
        self._fabric.add(buffer)
        return {}

    def withdraw(self, buffer_id: str) -> None:
        self._fabric.remove(buffer_id, timeout=0)

    def inline(self, local: Any, remote: Any) -> None:
        """No fast path: the other agent's withdrawals reach this one only through the shared table."""
        return None
