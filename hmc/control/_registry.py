"""The node's ConnBuffers, by id and by name, each owned by one agent session.

An `AgentSession` lives exactly as long as its agent's Attach stream. When the
stream ends (clean close, or the process died and the socket broke) `detach()`
withdraws every buffer of the session, publishes BUFFER_WITHDRAWN for each and
then AGENT_DOWN. Every BUFFER_WITHDRAWN (local, or relayed from a peer daemon)
is also pushed down the other agents' streams so they can drop cached grants.

Names are unique within a node; ids are unique everywhere (agents make them).
Recently withdrawn ids and names are remembered (bounded) so a lookup can say
BufferWithdrawnError rather than UnknownBufferError.

Concurrency: owned by hmcd's event loop; nothing here awaits.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from hmc.control._events import EventBus
from hmc.errors import ArgumentError, BufferWithdrawnError, BusyResourceError, UnknownBufferError
from hmc.v1 import common_pb2, daemon_pb2

__all__ = ["AgentSession", "Registry", "describe_ref"]

log = logging.getLogger("hmc.hmcd")

_WITHDRAWN_MEMORY = 10_000


def describe_ref(ref: daemon_pb2.BufferRef) -> str:
    """A BufferRef for messages: `id 'x'` or `name 'y'`; ArgumentError when empty."""
    which = ref.WhichOneof("ref")
    if which is None or not getattr(ref, which):
        raise ArgumentError("buffer reference is empty: give an id or a name")
    return f"{which} {getattr(ref, which)!r}"


class AgentSession:
    """One attached agent: its identity, its buffers and the queue of messages to send it."""

    def __init__(self, info: common_pb2.AgentInfo, outbox_size: int) -> None:
        self.info = info
        self.buffers: set[str] = set()
        self.attached_at = time.time()
        # Messages for the agent's stream, drained by that stream's writer task; bounded so
        # an agent that stopped reading cannot make hmcd grow without limit.
        self.outbox: asyncio.Queue[daemon_pb2.DaemonMessage] = asyncio.Queue(maxsize=outbox_size)

    @property
    def agent_id(self) -> str:
        return self.info.id

    def send(self, message: daemon_pb2.DaemonMessage) -> bool:
        """Queue a message for the agent; False when its queue is full."""
        try:
            self.outbox.put_nowait(message)
        except asyncio.QueueFull:
            return False
        return True


class Registry:
    """ConnBuffers of this node and the agent sessions that own them."""

    def __init__(self, node: str, events: EventBus, *, outbox_size: int = 4096) -> None:
        self._node = node
        self._events = events
        self._outbox_size = outbox_size
        self._sessions: dict[str, AgentSession] = {}
        self._by_id: dict[str, common_pb2.BufferDescriptor] = {}
        self._by_name: dict[str, str] = {}
        self._owner: dict[str, AgentSession] = {}
        self._withdrawn_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._withdrawn_names: collections.OrderedDict[str, None] = collections.OrderedDict()
        events.add_listener(self._forward_withdrawn)

    # -- sessions -----------------------------------------------------------------

    def attach(self, info: common_pb2.AgentInfo) -> AgentSession:
        if not info.id:
            raise ArgumentError("agent hello carries no agent id")
        if info.id in self._sessions:
            raise BusyResourceError(f"agent {info.id!r} is already attached to this hmcd")
        session = AgentSession(info, self._outbox_size)
        self._sessions[info.id] = session
        self._events.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_AGENT_UP, agent_id=info.id))
        log.info("agent %s attached (pid %d)", info.id, info.pid)
        return session

    def detach(self, session: AgentSession) -> list[common_pb2.BufferDescriptor]:
        """Withdraw the session's buffers and forget it; idempotent."""
        if self._sessions.get(session.agent_id) is not session:
            return []
        withdrawn = [self._withdraw(buffer_id) for buffer_id in sorted(session.buffers)]
        del self._sessions[session.agent_id]
        self._events.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_AGENT_DOWN, agent_id=session.agent_id))
        log.info("agent %s detached; %d buffer(s) withdrawn", session.agent_id, len(withdrawn))
        return withdrawn

    def session(self, agent_id: str) -> AgentSession | None:
        return self._sessions.get(agent_id)

    @property
    def sessions(self) -> list[AgentSession]:
        return list(self._sessions.values())

    # -- buffers --------------------------------------------------------------------

    def register(self, session: AgentSession, descriptor: common_pb2.BufferDescriptor) -> None:
        """Add a ConnBuffer owned by `session` (ArgumentError on a bad or clashing descriptor)."""
        if not descriptor.id:
            raise ArgumentError("buffer descriptor has no id")
        if descriptor.size <= 0:
            raise ArgumentError(f"buffer {descriptor.id!r} has size {descriptor.size}; it must be positive")
        if not descriptor.HasField("owner") or not descriptor.owner.id:
            descriptor.owner.CopyFrom(session.info)
        elif descriptor.owner.id != session.agent_id:
            raise ArgumentError(f"buffer {descriptor.id!r} names owner {descriptor.owner.id!r}, but agent {session.agent_id!r} registered it")
        if not descriptor.owner.node:
            descriptor.owner.node = self._node
        if descriptor.id in self._by_id:
            raise ArgumentError(f"buffer id {descriptor.id!r} is already registered")
        if descriptor.name and descriptor.name in self._by_name:
            holder = self._owner[self._by_name[descriptor.name]].agent_id
            raise ArgumentError(f"buffer name {descriptor.name!r} is already registered on node {self._node} by agent {holder!r}")
        self._by_id[descriptor.id] = descriptor
        if descriptor.name:
            self._by_name[descriptor.name] = descriptor.id
            self._withdrawn_names.pop(descriptor.name, None)
        self._owner[descriptor.id] = session
        session.buffers.add(descriptor.id)
        self._events.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_BUFFER_ADDED, buffer=descriptor, agent_id=session.agent_id))

    def unregister(self, session: AgentSession, buffer_id: str) -> None:
        if self._owner.get(buffer_id) is not session:
            if buffer_id in self._by_id:
                raise ArgumentError(f"buffer {buffer_id!r} belongs to agent {self._owner[buffer_id].agent_id!r}, not {session.agent_id!r}")
            self._raise_unknown("id", buffer_id)
        self._withdraw(buffer_id)

    def _withdraw(self, buffer_id: str) -> common_pb2.BufferDescriptor:
        descriptor = self._by_id.pop(buffer_id)
        session = self._owner.pop(buffer_id)
        session.buffers.discard(buffer_id)
        _remember(self._withdrawn_ids, buffer_id)
        if descriptor.name and self._by_name.get(descriptor.name) == buffer_id:
            del self._by_name[descriptor.name]
            _remember(self._withdrawn_names, descriptor.name)
        self._events.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN, buffer=descriptor, agent_id=session.agent_id))
        return descriptor

    def find(self, ref: daemon_pb2.BufferRef) -> common_pb2.BufferDescriptor | None:
        """The local buffer `ref` names, or None (ArgumentError for an empty ref)."""
        describe_ref(ref)
        if ref.WhichOneof("ref") == "id":
            return self._by_id.get(ref.id)
        buffer_id = self._by_name.get(ref.name)
        return self._by_id.get(buffer_id) if buffer_id is not None else None

    def require(self, ref: daemon_pb2.BufferRef) -> common_pb2.BufferDescriptor:
        """Like find(), raising UnknownBufferError / BufferWithdrawnError when absent."""
        found = self.find(ref)
        if found is None:
            which = ref.WhichOneof("ref")
            self._raise_unknown(which, getattr(ref, which))
        return found

    def was_withdrawn(self, ref: daemon_pb2.BufferRef) -> bool:
        which = ref.WhichOneof("ref")
        memory = self._withdrawn_ids if which == "id" else self._withdrawn_names
        return getattr(ref, which or "id", "") in memory

    def _raise_unknown(self, which: str | None, value: str) -> None:
        memory = self._withdrawn_ids if which == "id" else self._withdrawn_names
        if value in memory:
            raise BufferWithdrawnError(f"buffer {which} {value!r} was withdrawn from node {self._node}")
        raise UnknownBufferError(f"no buffer with {which} {value!r} on node {self._node}")

    def owner(self, buffer_id: str) -> AgentSession | None:
        return self._owner.get(buffer_id)

    def buffers(self) -> list[common_pb2.BufferDescriptor]:
        return list(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)

    # -- events down agent streams ---------------------------------------------------

    def _forward_withdrawn(self, event: daemon_pb2.Event, relayed: bool) -> None:
        if event.kind != daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN:
            return
        message = daemon_pb2.DaemonMessage(event=event)
        for session in self._sessions.values():
            if session.agent_id != event.agent_id and not session.send(message):
                log.warning("agent %s is not reading its stream; dropped a withdrawal event", session.agent_id)


def _remember(memory: collections.OrderedDict[str, None], key: str) -> None:
    memory[key] = None
    memory.move_to_end(key)
    while len(memory) > _WITHDRAWN_MEMORY:
        memory.popitem(last=False)
