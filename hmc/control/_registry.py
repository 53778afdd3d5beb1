"""The node's ConnBuffers, by id and by name, each owned by one agent session; names leased to their holders.

Sessions. An `AgentSession` lives as long as its agent's Attach stream. How the
stream ends decides what everyone hears (`detach()`):

- the agent closed it (EOF), or its process is gone: every buffer of the session
  is withdrawn (BUFFER_WITHDRAWN each, then AGENT_DOWN) and its names are free;
- it broke while the agent's process lives (hmcd stopping, a cut or stalled
  stream): the buffers leave the registry (lookups stop serving them) but are not
  announced as withdrawn: the memory is intact, and the agent re-attaches and
  registers them again under the same ids and names. If it does not come back
  within the grace period, or its process dies first, the withdrawal is published then.

Leases. A buffer name belongs to the agent holding it. While the holder's stream
is up, another agent asking for the name gets BusyResourceError naming the holder.
When the stream broke, and across hmcd restarts (the state file of
`hmc.control._leases`), the name stays *reserved* for its holder, known by agent
id and process identity (pid and start time), for `grace_s` while that process
lives: the holder, attached again with the same id from the same process, takes
each name back by registering it, and its hello lists the names it still holds, so
the others are freed at once; anyone else gets BusyResourceError, except a
registration made while hmcd was away (RegisterBuffer.again), which waits for the
reservation to end (`reservation_ended`). A pidfd watch frees a dead holder's
names at once. Only agents on this hmcd's host hold
leases (hmcd cannot see other hosts' processes); the pid is the one the agent's
hello reports.

Epoch. `epoch` grows with every start of hmcd (persisted in the state file,
time-based without one). It goes out in DaemonHello and is stamped into every
descriptor this registry serves. After a restart the registry holds only what
agents registered again, so no descriptor of an earlier epoch is ever served;
`current()` refuses an explicit descriptor of this node that is not registered now.

Events. Every BUFFER_WITHDRAWN and AGENT_DOWN (local, or relayed from a peer
daemon) is pushed down the other agents' streams so they drop what they opened;
relayed BUFFER_ADDED too, so that a buffer of another node that comes back (its
node's lease lost and regained) is usable again.
Recently withdrawn ids and names are remembered (bounded) so a lookup can say
BufferWithdrawnError rather than UnknownBufferError.

Concurrency: owned by hmcd's event loop; nothing here awaits but `reservation_ended`. The state file is
written on the loop whenever the held or reserved names change.
"""

from __future__ import annotations

import asyncio
import contextlib
import collections
import logging
import time
from collections.abc import Callable, Collection
from typing import NoReturn

from hmc.control._events import EventBus
from hmc.memory._machine import host_id as local_host_id
from hmc.control._leases import Lease, LeaseFile, ProcessIdentity, ProcessWatch, next_epoch, process_identity
from hmc.errors import ArgumentError, BufferWithdrawnError, BusyResourceError, ClosedResourceError, StaleDescriptorError, UnavailableError, UnknownBufferError
from hmc.v1 import common_pb2, daemon_pb2

__all__ = ["MAX_NAME_BYTES", "AgentSession", "Registry", "check_name", "describe_ref"]

log = logging.getLogger("hmc.hmcd")

_WITHDRAWN_MEMORY = 10_000
_FORWARDED = frozenset({daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN, daemon_pb2.EVENT_KIND_AGENT_DOWN})


MAX_NAME_BYTES = 64 << 10
"""Longest buffer name or id (UTF-8): each travels in lookups, events and the errors about its buffer (gRPC carries
an error's message in 1 MiB of metadata: a longer one came back as BUSY), and the etcd directory keys on it."""


def check_name(value: object, what: str = "buffer name") -> str:
    """`value` if it is a non-empty str of valid text within `MAX_NAME_BYTES`; ArgumentError otherwise (never
    repeating a long value)."""
    if not isinstance(value, str) or not value:
        raise ArgumentError(f"{what} must be a non-empty string, got {type(value).__name__} {str(value)[:64]!r}")
    try:
        size = len(value.encode())
    except UnicodeEncodeError as exc:
        raise ArgumentError(f"{what} {value[:64]!r} is not valid text: {exc.reason}") from exc
    if size > MAX_NAME_BYTES:
        raise ArgumentError(f"{what} {value[:64]!r}... is {size} bytes long; at most {MAX_NAME_BYTES}")
    return value


def describe_ref(ref: daemon_pb2.BufferRef) -> str:
    """A BufferRef for messages: `id 'x'` or `name 'y'`; ArgumentError when empty or too long."""
    which = ref.WhichOneof("ref")
    if which is None or not getattr(ref, which):
        raise ArgumentError("buffer reference is empty: give an id or a name")
    return f"{which} {check_name(getattr(ref, which), f'buffer {which}')!r}"


class AgentSession:
    """One attached agent: its identity, its buffers and the queue of messages to send it."""

    def __init__(self, info: common_pb2.AgentInfo, outbox_size: int, process: ProcessIdentity | None = None) -> None:
        self.info = info
        self.process = process
        """The agent's process on this host (None: another host, or /proc could not say): what its leases name."""
        self.reads_daemon_clock = False
        """Its hello said it reads hmcd's monotonic deadlines on its own clock (AgentHello.reads_daemon_clock)."""
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


class _Holder:
    """An agent whose names (and, after a broken stream, buffers) wait for it to come back."""

    def __init__(self, agent: common_pb2.AgentInfo, process: ProcessIdentity, why: str, deadline: float) -> None:
        self.agent = agent
        self.process = process
        self.why = why
        self.deadline = deadline
        self.names: set[str] = set()
        self.buffers: dict[str, common_pb2.BufferDescriptor] = {}
        """Buffers taken out of the registry when the stream broke; withdrawn publicly if the agent does not come back."""
        self.watch: ProcessWatch | None = None
        self.timer: asyncio.TimerHandle | None = None

    @property
    def agent_id(self) -> str:
        return self.agent.id

    def describe(self) -> str:
        left = max(self.deadline - time.monotonic(), 0.0)
        return f"agent {self.agent_id!r} (pid {self.process.pid}), which held it when {self.why}; reserved until it takes the name back or lets it go on attaching again, at most {left:.0f}s more"

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.watch is not None:
            self.watch.close()


class Registry:
    """ConnBuffers of this node, the agent sessions that own them, and the names reserved for absent holders."""

    def __init__(
        self,
        node: str,
        events: EventBus,
        *,
        outbox_size: int = 4096,
        state_path: str | None = None,
        grace_s: float = 30.0,
        host_id: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`state_path`: the lease file (None: nothing survives a restart); `grace_s`: how long a name waits for its holder."""
        self._node = node
        self._events = events
        self._outbox_size = outbox_size
        self._file = LeaseFile(state_path) if state_path else None
        self._grace_s = grace_s
        self._host_id = host_id or local_host_id()
        self._clock = clock
        self.epoch = next_epoch(0, clock)
        self._sessions: dict[str, AgentSession] = {}
        self._by_id: dict[str, common_pb2.BufferDescriptor] = {}
        self._by_name: dict[str, str] = {}
        self._owner: dict[str, AgentSession] = {}
        self._holders: dict[str, _Holder] = {}
        self._reserved: dict[str, _Holder] = {}
        self._changed = asyncio.Event()  # set (and replaced) whenever a reservation ends
        self._withdrawn_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._withdrawn_names: collections.OrderedDict[str, None] = collections.OrderedDict()
        events.add_listener(self._forward_to_agents)

    # -- start and stop -------------------------------------------------------------

    def restore(self) -> None:
        """At start, on the loop: take the next epoch and reserve the saved names of holders that still live."""
        if self._file is None:
            return
        stored, leases = self._file.load()
        self.epoch = next_epoch(stored, self._clock)
        by_agent: dict[str, list[Lease]] = {}
        for lease in leases:
            by_agent.setdefault(lease.agent_id, []).append(lease)
        for agent_id, held in by_agent.items():
            process = held[0].process
            names = sorted(lease.name for lease in held if lease.process == process)
            if process_identity(process.pid) != process:
                log.info("names %s of agent %s are free: its process %d is gone", names, agent_id, process.pid)
                continue
            agent = common_pb2.AgentInfo(id=agent_id, node=self._node, host_id=self._host_id, pid=process.pid)
            holder = self._hold(agent, process, "hmcd restarted")
            for name in names:
                holder.names.add(name)
                self._reserved[name] = holder
            log.info("reserved names %s for agent %s (pid %d) for %gs", names, agent_id, process.pid, self._grace_s)
        self._save()
        log.info("registry epoch %d", self.epoch)

    def close(self) -> None:
        """hmcd is stopping: stop watching holders. The state file keeps their leases for the next start."""
        for holder in list(self._holders.values()):
            holder.close()
        self._holders.clear()
        self._reserved.clear()

    # -- sessions -----------------------------------------------------------------

    def attach(self, info: common_pb2.AgentInfo, held: Collection[str] | None = None) -> AgentSession:
        """A new session for the agent of `info`; `held` (from its hello: the names it registers again next) frees at
        once what is reserved for it under any other name (None: an older agent; its reservations wait out the grace)."""
        if not info.id:
            raise ArgumentError("agent hello carries no agent id")
        if info.id in self._sessions:
            raise BusyResourceError(f"agent {info.id!r} is already attached to this hmcd")
        process = process_identity(info.pid) if info.host_id == self._host_id else None
        holder = self._holders.get(info.id)
        if holder is not None and holder.process != process:
            raise BusyResourceError(f"agent id {info.id!r} is reserved for its process {holder.process.pid}; this hello comes from pid {info.pid}")
        session = AgentSession(info, self._outbox_size, process)
        self._sessions[info.id] = session
        if holder is not None:
            holder.agent = info
            if held is not None:
                self._let_go(holder, set(held))
        self._events.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_AGENT_UP, agent_id=info.id, agent=info))
        log.info("agent %s attached (pid %d)%s", info.id, info.pid, f"; {len(holder.names)} name(s) reserved for it" if holder else "")
        return session

    def detach(self, session: AgentSession, *, clean: bool) -> None:
        """The session's stream ended (`clean`: the agent closed it); idempotent. See the module's "Sessions"."""
        if self._sessions.get(session.agent_id) is not session:
            return
        del self._sessions[session.agent_id]
        living = None if clean or session.process is None else process_identity(session.process.pid)
        if living is None or living != session.process:
            withdrawn = [self._withdraw(buffer_id) for buffer_id in sorted(session.buffers)]
            holder = self._holders.get(session.agent_id)
            if holder is not None:
                self._release(holder, down=False)
            self._events.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_AGENT_DOWN, agent_id=session.agent_id, agent=session.info))
            log.info("agent %s detached; %d buffer(s) withdrawn", session.agent_id, len(withdrawn))
        else:
            holder = self._holders.get(session.agent_id) or self._hold(session.info, living, "its stream to hmcd broke")
            for buffer_id in sorted(session.buffers):
                descriptor = self._remove(buffer_id)
                holder.buffers[buffer_id] = descriptor
                if descriptor.name:
                    holder.names.add(descriptor.name)
                    self._reserved[descriptor.name] = holder
            log.info("agent %s lost its stream but its process %d lives: %d buffer(s) and their names wait for it", session.agent_id, living.pid, len(holder.buffers))
        self._save()

    def session(self, agent_id: str) -> AgentSession | None:
        return self._sessions.get(agent_id)

    @property
    def sessions(self) -> list[AgentSession]:
        return list(self._sessions.values())

    # -- holders ----------------------------------------------------------------------

    def _hold(self, agent: common_pb2.AgentInfo, process: ProcessIdentity, why: str) -> _Holder:
        loop = asyncio.get_running_loop()
        holder = _Holder(agent, process, why, time.monotonic() + self._grace_s)
        self._holders[agent.id] = holder
        holder.timer = loop.call_later(self._grace_s, self._expire, holder)
        holder.watch = ProcessWatch(process, lambda: self._died(holder))
        return holder

    def _expire(self, holder: _Holder) -> None:
        if self._holders.get(holder.agent_id) is holder:
            alive = process_identity(holder.process.pid) == holder.process
            log.info("agent %s did not take back %s within %gs; released", holder.agent_id, sorted(holder.names) or "its buffers", self._grace_s)
            self._release(holder, down=not alive)
            self._save()

    def _died(self, holder: _Holder) -> None:
        if self._holders.get(holder.agent_id) is holder:
            log.info("process %d of agent %s exited; its reserved names %s are free", holder.process.pid, holder.agent_id, sorted(holder.names))
            self._release(holder, down=True)
            self._save()

    def _release(self, holder: _Holder, *, down: bool) -> None:
        """Free a holder's reservations; publish the withdrawal of what it never took back (and AGENT_DOWN when `down`).

        The caller saves the state file (each caller changes more, and saves once).
        """
        if self._holders.get(holder.agent_id) is holder:
            del self._holders[holder.agent_id]
        holder.close()
        for name in holder.names:
            if self._reserved.get(name) is holder:
                del self._reserved[name]
        for descriptor in holder.buffers.values():
            self._announce_withdrawn(descriptor, holder.agent_id)
        holder.names.clear()
        holder.buffers.clear()
        self._reservations_changed()
        if down and holder.agent_id not in self._sessions:
            self._events.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_AGENT_DOWN, agent_id=holder.agent_id, agent=holder.agent))

    def _reclaim(self, holder: _Holder, descriptor: common_pb2.BufferDescriptor) -> None:
        """The holder registered `descriptor` again: that buffer and name are no longer waiting."""
        holder.buffers.pop(descriptor.id, None)
        if descriptor.name and self._reserved.get(descriptor.name) is holder:
            del self._reserved[descriptor.name]
            holder.names.discard(descriptor.name)
            self._reservations_changed()
        if not holder.names and not holder.buffers:
            del self._holders[holder.agent_id]
            holder.close()

    def _let_go(self, holder: _Holder, held: set[str]) -> None:
        """The holder came back holding only the names in `held`: free its others (withdrawing what waited under them)."""
        gone = sorted(holder.names - held)
        for name in gone:
            holder.names.discard(name)
            if self._reserved.get(name) is holder:
                del self._reserved[name]
        for buffer_id, descriptor in list(holder.buffers.items()):
            if descriptor.name and descriptor.name not in held:
                del holder.buffers[buffer_id]
                self._announce_withdrawn(descriptor, holder.agent_id)
        if gone:
            log.info("agent %s came back without names %s; they are free", holder.agent_id, gone)
            self._reservations_changed()
            self._save()
        if not holder.names and not holder.buffers:
            del self._holders[holder.agent_id]
            holder.close()

    def _reservations_changed(self) -> None:
        """Wake every registration waiting for a reservation to end (`reservation_ended`)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def reserved_for_another(self, session: AgentSession, name: str) -> float | None:
        """Seconds left on the reservation of `name` for another agent whose process lives (None: no such one)."""
        holder = self._reserved.get(name)
        if holder is None or holder.agent_id == session.agent_id or name in self._by_name:
            return None
        if process_identity(holder.process.pid) != holder.process:
            return None
        return max(holder.deadline - time.monotonic(), 0.0)

    async def reservation_ended(self, timeout: float) -> None:
        """Return when a reservation ends (its holder took its name back or let it go, died, or ran out of grace), or
        after `timeout` seconds."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    def _waiting_for(self, buffer_id: str) -> _Holder | None:
        return next((h for h in self._holders.values() if buffer_id in h.buffers), None)

    # -- buffers --------------------------------------------------------------------

    def prepare(self, session: AgentSession, descriptor: common_pb2.BufferDescriptor) -> None:
        """Check that `session` may register `descriptor` and stamp it (owner, node, epoch), changing nothing else:
        ArgumentError on a bad descriptor, BusyResourceError on a name another agent holds."""
        if not descriptor.id:
            raise ArgumentError("buffer descriptor has no id")
        check_name(descriptor.id, "buffer id")
        if descriptor.name:
            check_name(descriptor.name)
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
        waiting = self._waiting_for(descriptor.id)
        if waiting is not None and waiting.agent_id != session.agent_id:
            raise BusyResourceError(f"buffer id {descriptor.id!r} belongs to {waiting.describe()}")
        if descriptor.name:
            self._check_name_free(session, descriptor.name)
        descriptor.registry_epoch = self.epoch

    def register(self, session: AgentSession, descriptor: common_pb2.BufferDescriptor) -> None:
        """Add a ConnBuffer owned by `session` (checked and stamped by `prepare`, which raises what it raises)."""
        if self._sessions.get(session.agent_id) is not session:
            raise ClosedResourceError(f"agent {session.agent_id!r} detached before its buffer {descriptor.id!r} was registered")
        self.prepare(session, descriptor)
        self._by_id[descriptor.id] = descriptor
        if descriptor.name:
            self._by_name[descriptor.name] = descriptor.id
            self._withdrawn_names.pop(descriptor.name, None)
        self._owner[descriptor.id] = session
        session.buffers.add(descriptor.id)
        holder = self._holders.get(session.agent_id)
        if holder is not None:
            self._reclaim(holder, descriptor)
        self._events.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_BUFFER_ADDED, buffer=descriptor, agent_id=session.agent_id))
        if descriptor.name:
            self._save()

    def _check_name_free(self, session: AgentSession, name: str) -> None:
        """Raise unless `session` may take `name` (see the module's "Leases")."""
        held = self._by_name.get(name)
        if held is not None:
            holder = self._owner[held]
            if holder is session:
                raise ArgumentError(f"buffer name {name!r} is already registered by this agent (buffer {held!r})")
            raise BusyResourceError(f"buffer name {name!r} is already registered on node {self._node} by agent {holder.agent_id!r} (pid {holder.info.pid})")
        reserved = self._reserved.get(name)
        if reserved is None or reserved.agent_id == session.agent_id:
            return
        if process_identity(reserved.process.pid) == reserved.process:
            raise BusyResourceError(f"buffer name {name!r} on node {self._node} belongs to {reserved.describe()}")
        log.info("process %d of agent %s is gone; dropping its reservations", reserved.process.pid, reserved.agent_id)
        self._release(reserved, down=True)

    def unregister(self, session: AgentSession, buffer_id: str) -> None:
        if self._owner.get(buffer_id) is not session:
            if buffer_id in self._by_id:
                raise ArgumentError(f"buffer {buffer_id!r} belongs to agent {self._owner[buffer_id].agent_id!r}, not {session.agent_id!r}")
            self._raise_unknown("id", buffer_id)
        if self._withdraw(buffer_id).name:
            self._save()

    def _remove(self, buffer_id: str) -> common_pb2.BufferDescriptor:
        """Take a buffer out of the tables (no event)."""
        descriptor = self._by_id.pop(buffer_id)
        self._owner.pop(buffer_id).buffers.discard(buffer_id)
        if descriptor.name and self._by_name.get(descriptor.name) == buffer_id:
            del self._by_name[descriptor.name]
        return descriptor

    def _withdraw(self, buffer_id: str) -> common_pb2.BufferDescriptor:
        session = self._owner[buffer_id]
        descriptor = self._remove(buffer_id)
        self._announce_withdrawn(descriptor, session.agent_id)
        return descriptor

    def _announce_withdrawn(self, descriptor: common_pb2.BufferDescriptor, agent_id: str) -> None:
        _remember(self._withdrawn_ids, descriptor.id)
        if descriptor.name and descriptor.name not in self._by_name:
            _remember(self._withdrawn_names, descriptor.name)
        self._events.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN, buffer=descriptor, agent_id=agent_id))

    def find(self, ref: daemon_pb2.BufferRef) -> common_pb2.BufferDescriptor | None:
        """The local buffer `ref` names, or None (ArgumentError for an empty ref)."""
        describe_ref(ref)
        if ref.WhichOneof("ref") == "id":
            return self._by_id.get(ref.id)
        buffer_id = self._by_name.get(ref.name)
        return self._by_id.get(buffer_id) if buffer_id is not None else None

    def require(self, ref: daemon_pb2.BufferRef) -> common_pb2.BufferDescriptor:
        """Like find(), raising UnknownBufferError / BufferWithdrawnError when absent (UnavailableError while its holder re-attaches)."""
        found = self.find(ref)
        if found is None:
            which = ref.WhichOneof("ref")
            self._raise_unknown(which, getattr(ref, which))
        return found

    def current(self, descriptor: common_pb2.BufferDescriptor) -> common_pb2.BufferDescriptor:
        """The descriptor to act on for one a caller handed in (a Submit's `dst_descriptor`).

        A buffer of another node: the given one. One of this node served by an earlier
        epoch of this registry: StaleDescriptorError, even when its owner registered it
        again since (a republish invalidates every descriptor of the older epoch). Else
        this registry's descriptor, or UnknownBufferError when it is not registered now.
        """
        if descriptor.owner.node and descriptor.owner.node != self._node:
            return descriptor
        if descriptor.registry_epoch and descriptor.registry_epoch != self.epoch:
            again = "its owner registered it again since: look it up again" if descriptor.id in self._by_id else "its owner has not registered it again"
            raise StaleDescriptorError(
                f"stale descriptor: buffer {descriptor.id!r} was served by registry epoch {descriptor.registry_epoch} of node {self._node}, "
                f"which is now at epoch {self.epoch}; {again}"
            )
        registered = self._by_id.get(descriptor.id)
        if registered is not None:
            return registered
        self._raise_unknown("id", descriptor.id)

    def was_withdrawn(self, ref: daemon_pb2.BufferRef) -> bool:
        which = ref.WhichOneof("ref")
        memory = self._withdrawn_ids if which == "id" else self._withdrawn_names
        return getattr(ref, which or "id", "") in memory

    def _raise_unknown(self, which: str | None, value: str) -> NoReturn:
        holder = self._reserved.get(value) if which == "name" else self._waiting_for(value)
        if holder is not None:
            raise UnavailableError(f"buffer {which} {value!r} on node {self._node} belongs to {holder.describe()}")
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

    # -- leases on disk ----------------------------------------------------------------

    def _save(self) -> None:
        if self._file is None:
            return
        leases = [Lease(name, self._owner[bid].agent_id, process) for name, bid in self._by_name.items() if (process := self._owner[bid].process) is not None]
        leases += [Lease(name, holder.agent_id, holder.process) for name, holder in self._reserved.items()]
        self._file.save(self.epoch, leases)

    # -- events down agent streams ---------------------------------------------------

    def _forward_to_agents(self, event: daemon_pb2.Event, relayed: bool) -> None:
        # another node's buffer (re)appearing tells agents that heard it withdrawn (a lease lost and regained)
        if event.kind not in _FORWARDED and not (relayed and event.kind == daemon_pb2.EVENT_KIND_BUFFER_ADDED):
            return
        message = daemon_pb2.DaemonMessage(event=event)
        for session in self._sessions.values():
            if session.agent_id != event.agent_id and not session.send(message):
                log.warning("agent %s is not reading its stream; dropped a %s event", session.agent_id, daemon_pb2.EventKind.Name(event.kind))


def _remember(memory: collections.OrderedDict[str, None], key: str) -> None:
    memory[key] = None
    memory.move_to_end(key)
    while len(memory) > _WITHDRAWN_MEMORY:
        memory.popitem(last=False)
