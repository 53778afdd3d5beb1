"""The agent: this process's data-plane endpoint.

It registers ConnBuffers, chooses a path per pair of buffers (negotiation over both ends' declared capabilities),
validates and coalesces ranges, and hands transfers to the path's transport. It runs the owner side of every path
in its peer listener, and, when an hmcd is running, registers its buffers there and executes the third-party
transfers hmcd instructs.

Hot path. A single-range transfer given as plain ints, between a pair that has already moved data over a path
offering an inline copy (local, ipc), skips range arrays, negotiation and request objects: bounds check, one copy,
one finished handle. Calls that force `path=` have routes of their own (per remote buffer and path); the pair's
negotiated path serves forced and unforced calls. A route's copy runs within its transport's default deadline, so
a call with a `timeout` of its own takes it only for a range up to 1 MiB whose copy waits on no peer (a device
range of a GiB, or a staged round trip, takes a request that the caller's deadline bounds).
Prepared transfers (`prepare_write`/`prepare_read`, `hmc.agent._prepared`) check their arguments once and vet a
route once, so a post is a lookup and the copy.

Concurrency: every public method may be called from any thread. `_lock` guards
the path cache and the set of remote buffers known to be withdrawn; the buffer
table, transports, peers and server each guard their own state. hmcd
instructions run on the "hmc-instr" executor, never on the link's thread; hmcd's events (other agents'
withdrawals and ends) run on the link's "hmc-daemon-events" thread and land in `events()`. Nothing on the
transfer path touches the link, so transfers go on while hmcd is down (not hmcd's: they stop with the link).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from hmc.agent._buffers import BufferTable, ConnBuffer
from hmc.agent._events import AgentEvent, AgentEventKind, EventInbox
from hmc.agent._instructions import Instructions
from hmc.agent._peers import Peers
from hmc.agent._prepared import PreparedTransfer
from hmc.agent._routes import Route
from hmc.agent._server import PeerServer
from hmc.agent._transports import default_transports, withdraw_everywhere
from hmc.agent._transfer import FINAL_STATES, Notification, NotificationInbox, NotifyStep, TransferHandle, TransferState
from hmc.agent._withdrawals import RemoteWithdrawals
from hmc.config import Config, PathPolicy
from hmc.control._agent_link import DaemonLink
from hmc.control._inventory import apply_vendor_override, device_to_proto
from hmc.control._registry import check_name
from hmc.memory._machine import clock_id, host_id
from hmc.errors import (
    AccessDeniedError,
    ArgumentError,
    BufferWithdrawnError,
    ClosedResourceError,
    DeviceError,
    HMCError,
    NoPathError,
    UnavailableError,
    UnknownBufferError,
    UnsupportedError,
)
from hmc.memory import MemoryRegion
from hmc.memory import register as register_memory
from hmc.transport._base import PathName, TransferOp, TransferRequest, Transport
from hmc.transport._ipc import allow_ptrace_peers
from hmc.transport._negotiate import Endpoint, PathChoice, negotiate
from hmc.transport._ranges import MAX_TIMEOUT_S, RangeList, check_notify, check_timeout
from hmc.transport._wire import PROTOCOL_VERSION, raise_for_reply
from hmc.v1 import common_pb2, daemon_pb2, peer_pb2

__all__ = ["Agent"]

_log = logging.getLogger(__name__)
_UNREGISTER_GRACE_S = 5.0
"""How long unregister() lets transfers into a buffer finish before it cuts their connections."""

_DESCRIPTOR = common_pb2.BufferDescriptor
_LEARNING = frozenset({TransferState.PENDING, TransferState.RUNNING, TransferState.DONE})
"""A single range's states after post() in which the pair's fast path may be learned: a transport offers one only
once the pair is set up (a grant, a mapping), which post() did on the caller's thread; a 1 GiB ipc write still
running on the GPU would otherwise never teach it, and each such write would pay a request (~0.1 ms)."""
_PATH_NAMES = frozenset(p.value for p in PathName)

LinkFactory = Callable[[Config, common_pb2.AgentInfo, Callable[[daemon_pb2.TransferInstruction], None]], Any]


class Agent:
    """The in-process data plane: ConnBuffers, paths and transfers."""

    def __init__(
        self,
        config: Config | None = None,
        *,
        daemon: bool | None = None,
        transports: Sequence[Transport] | None = None,
        link_factory: LinkFactory | None = None,
    ) -> None:
        self.config = config or Config.load()
        self.id = secrets.token_hex(8)
        self.info = common_pb2.AgentInfo(id=self.id)  # completed below, once the listener has its port
        self._lock = threading.Lock()  # guards _paths and local buffers' `outgoing`
        self._paths: dict[tuple[str, str, str, str | None], PathChoice] = {}
        self._withdrawn_remote = RemoteWithdrawals()
        self._closed = False
        self._link: DaemonLink | None = None
        self._buffers = BufferTable(self._registry_epochs)
        self._inbox = NotificationInbox(self.config.notify_inbox_bytes)
        self._instructions = Instructions(
            lambda op, local, remote, ranges, notify, timeout, tid: self._submit(op, local, remote, ranges, notify, timeout, None, tid),
            self._buffers,
            self._report,
        )
        allow_ptrace_peers()
        cfg = self.config
        self._peers = Peers(
            lambda: self.info, on_withdrawn=self._remote_withdrawn, on_lost=self._peer_lost,
            buffer_bytes=cfg.socket_buffer_bytes, keepalive_s=cfg.keepalive_s, unacked_s=cfg.timeout_s,
        )
        self._server = PeerServer(
            cfg.agent_host, info=lambda: self.info, buffers=self._buffers, inbox=self._inbox, buffer_bytes=cfg.socket_buffer_bytes, grant=self._grant, push=self._push,
            max_connections=cfg.peer_max_connections, keepalive_s=cfg.keepalive_s, timeout_s=cfg.timeout_s,
        )
        self._unavailable: dict[PathName, str] = {}
        """Paths this agent does not offer, and why (carried to peers: negotiation names the reason)."""
        self._transports = self._usable(transports if transports is not None else default_transports(self.config, self._buffers, self._peers, self.id, self._measured))
        self.info = common_pb2.AgentInfo(
            id=self.id,
            node=self.config.node,
            host_id=host_id(), clock_id=clock_id(),
            pid=os.getpid(),
            endpoint=common_pb2.TcpEndpoint(host=self.config.agent_host, port=self._server.port),
            transports=[t.capabilities.to_proto() for t in self._transports.values()],
            protocol_version=PROTOCOL_VERSION,
            unavailable=[common_pb2.RejectedPath(path=p.value, reason=r) for p, r in self._unavailable.items() if p not in self._transports],
        )
        self._link = self._attach(daemon, link_factory or self._default_link)

    def _grant(self, path: str, buffer: ConnBuffer) -> common_pb2.TransportHandles:
        """The owner side of OpenBuffer: what `path`'s transport grants to a peer that proved `buffer`'s key."""
        return self._offered(path, buffer).grant(buffer)

    def _push(self, path: str, buffer: ConnBuffer, request: peer_pb2.Push, ranges: RangeList, deadline: float, done: Callable[[BaseException | None], None]) -> None:
        """The owner side of Push: `path`'s transport puts the ranges into the asker's memory."""
        self._offered(path, buffer).push(buffer, request, ranges, deadline, done)

    def _offered(self, path: str, buffer: ConnBuffer) -> Transport:
        transport = self._transports.get(PathName(path)) if path in _PATH_NAMES else None
        if transport is None:
            raise UnsupportedError(f"buffer {buffer.id} cannot be used over path {path!r}: not offered by this agent")
        return transport

    def _usable(self, transports: Sequence[Transport]) -> dict[PathName, Transport]:
        usable: dict[PathName, Transport] = {}
        for transport in transports:
            reason = transport.unavailable_reason()
            if reason is None:
                usable.setdefault(transport.capabilities.path, transport)
            else:
                _log.info("path %s unavailable: %s", transport.capabilities.path.value, reason)
                self._unavailable.setdefault(transport.capabilities.path, reason)
                transport.close()
        return usable

    def _attach(self, daemon: bool | None, factory: LinkFactory) -> Any:
        self._events = EventInbox()  # before the link exists: its events land here (empty in embedded mode)
        if daemon is False or (daemon is None and not os.path.exists(self.config.socket)):
            return None
        try:
            return factory(self.config, self.info, self._instructions.on_instruction)
        except UnavailableError:
            if daemon:
                self.close()
                raise
            _log.warning("hmcd socket %s exists but hmcd is unreachable; running embedded", self.config.socket)
            return None

    # -- buffers ----------------------------------------------------------------

    def register(self, memory: Any, *, name: str | None = None) -> ConnBuffer:
        """Make memory (a MemoryRegion or anything hmc.memory.register accepts) reachable by peers."""
        self._check_open()
        if name is not None and name != "":
            check_name(name)
        region = memory if isinstance(memory, MemoryRegion) else register_memory(memory)
        region.check_alive()
        if name and any(b.name == name for b in self._buffers.values()):
            raise ArgumentError(f"a buffer named {name!r} is already registered on this agent")
        [device] = apply_vendor_override([region.device], self.config.vendor_override)
        descriptor = common_pb2.BufferDescriptor(
            version=1,
            id=secrets.token_hex(8),
            name=name or "",
            owner=self.info,
            device=device_to_proto(device),
            size=region.size,
            access_key=secrets.token_bytes(16),
        )
        buffer = ConnBuffer(region, descriptor)
        for transport in self._transports.values():
            for key, handle in transport.export(buffer).items():
                getattr(descriptor.handles, key).CopyFrom(handle)
        self._buffers.add(buffer)
        if self._link is not None:
            try:
                self._link.register(descriptor)
            except HMCError:
                self._buffers.remove(buffer.id, timeout=0)
                raise
        return buffer

    def unregister(self, buffer: ConnBuffer | str) -> None:
        """Withdraw a buffer: later requests get BufferWithdrawnError, peers that opened it are told, and this returns
        only when no peer can write into the memory any more: receives still running after a grace of
        min(timeout_s, 5 s) have their connections cut (their transfers fail; nothing of them lands afterwards)."""
        buffer_id = buffer if isinstance(buffer, str) else buffer.id
        removed = self._buffers.remove(buffer_id, timeout=0)
        if removed is None:
            raise UnknownBufferError(f"no buffer {buffer_id!r} on this agent")
        with self._lock:  # no transfer of this buffer starts from now on (`_track`): stop those that run
            running, removed.outgoing = [h for h in removed.outgoing if h.state not in FINAL_STATES], []
        for handle in running:
            handle.cancel()  # its transport stops it: nothing of it touches the memory afterwards
        grace = time.monotonic() + min(self.config.timeout_s, _UNREGISTER_GRACE_S)
        unconfirmed = self._server.withdraw(buffer_id, grace)  # grantees drop their grants; one that does not confirm it is cut
        if not self._buffers.wait_unused(buffer_id, grace):
            self._server.cut(buffer_id)
            if not self._buffers.wait_unused(buffer_id, time.monotonic() + _UNREGISTER_GRACE_S):
                raise DeviceError(f"buffer {buffer_id}: transfers of it still run after their connections were cut")
        self._drop_routes(buffer_id)
        removed.inline_routes.clear()
        try:
            withdraw_everywhere(self._transports.values(), buffer_id)
        finally:
            if self._link is not None:
                self._link.unregister(buffer_id)
        if unconfirmed:
            raise DeviceError(f"buffer {buffer_id}: {unconfirmed} did not confirm that nothing of theirs can land in it any more: keep its memory")

    def buffers(self) -> list[ConnBuffer]:
        """The buffers registered on this agent."""
        return self._buffers.values()

    def lookup(self, ref: str) -> common_pb2.BufferDescriptor:
        """Find a buffer by id or name through hmcd (UnavailableError in embedded mode, and at once while hmcd is down)."""
        if self._link is None:
            raise UnavailableError("this agent runs embedded (no hmcd): look buffers up by descriptor instead")
        found = self._link.lookup(ref)
        if found.owner.id != self.id:
            self._remote_added(found.id, found.registry_epoch)  # registered now, at that epoch, whatever this agent heard
        return found

    # -- transfers ----------------------------------------------------------------

    # write() and read() carry the hot path inline rather than in a shared helper: each
    # Python call layer costs ~0.4 us around a ~4 us syscall on the target machines. Any
    # range the route does not admit (other key, out of bounds) takes the slow path,
    # which raises the precise error.

    def write(
        self, local: ConnBuffer, remote: Any, src_offsets: Any, dst_offsets: Any, lengths: Any,
        *, notify: bytes | None = None, timeout: float | None = None, path: str | None = None,
    ) -> TransferHandle:
        """Push ranges of `local` into `remote` (a BufferDescriptor or a ConnBuffer).

        Offsets and lengths are ints or 1-D integer arrays (a single length applies to
        every range); `timeout` is None (the agent's `timeout_s`) or seconds, finite, in
        (0, 1e6]. Destination ranges in `remote` must not overlap (which bytes would land
        last is up to the path); source ranges may. Anything else raises ArgumentError
        (OutOfRangeError for ranges outside a buffer) before a byte moves.
        """
        if notify is None and type(lengths) is int and type(src_offsets) is int and type(dst_offsets) is int:
            try:
                route = local.inline_routes.get(remote.id if path is None else (remote.id, path))
            except (AttributeError, TypeError):  # not a ConnBuffer, a descriptor or a path name: the slow path says which
                route = None
            if (
                route is not None
                and 0 < lengths <= (route.max_bytes if timeout is None else route.timed_max_bytes)
                and (timeout is None or ((type(timeout) is float or type(timeout) is int) and 0 < timeout <= MAX_TIMEOUT_S))
                and 0 <= src_offsets <= route.local_size - lengths
                and 0 <= dst_offsets <= route.remote_size - lengths
                and route.key == (remote.access_key if type(remote) is _DESCRIPTOR else remote.descriptor.access_key)
                and not self._closed
            ):
                try:
                    route.write(src_offsets, dst_offsets, lengths)
                except HMCError as exc:
                    return self._inline_failed(local, route, lengths, exc)
                return TransferHandle.finished(route.path, lengths)
        return self._submit(TransferOp.WRITE, local, remote, RangeList.build(src_offsets, dst_offsets, lengths), notify, timeout, path)

    def read(
        self, local: ConnBuffer, remote: Any, remote_offsets: Any, local_offsets: Any, lengths: Any,
        *, notify: bytes | None = None, timeout: float | None = None, path: str | None = None,
    ) -> TransferHandle:
        """Pull ranges of `remote` (a BufferDescriptor or a ConnBuffer) into `local`.

        Arguments as for `write()`; here the destination is `local`: its ranges must not
        overlap, while ranges of `remote` may (the same bytes read twice).
        """
        if notify is None and type(lengths) is int and type(local_offsets) is int and type(remote_offsets) is int:
            try:
                route = local.inline_routes.get(remote.id if path is None else (remote.id, path))
            except (AttributeError, TypeError):  # not a ConnBuffer, a descriptor or a path name: the slow path says which
                route = None
            if (
                route is not None
                and 0 < lengths <= (route.read_max_bytes if timeout is None else route.timed_read_max_bytes)
                and (timeout is None or ((type(timeout) is float or type(timeout) is int) and 0 < timeout <= MAX_TIMEOUT_S))
                and 0 <= local_offsets <= route.read_size - lengths
                and 0 <= remote_offsets <= route.remote_size - lengths
                and route.key == (remote.access_key if type(remote) is _DESCRIPTOR else remote.descriptor.access_key)
                and not self._closed
            ):
                try:
                    route.read(local_offsets, remote_offsets, lengths)
                except HMCError as exc:
                    return self._inline_failed(local, route, lengths, exc)
                return TransferHandle.finished(route.path, lengths)
        return self._submit(TransferOp.READ, local, remote, RangeList.build(remote_offsets, local_offsets, lengths), notify, timeout, path)

    def prepare_write(
        self, local: ConnBuffer, remote: Any, src_offsets: Any, dst_offsets: Any, lengths: Any,
        *, timeout: float | None = None, path: str | None = None,
    ) -> PreparedTransfer:
        """`write()` of these ranges, checked now and started by each `post()` of the result."""
        return self._prepare(TransferOp.WRITE, local, remote, RangeList.build(src_offsets, dst_offsets, lengths), timeout, path)

    def prepare_read(
        self, local: ConnBuffer, remote: Any, remote_offsets: Any, local_offsets: Any, lengths: Any,
        *, timeout: float | None = None, path: str | None = None,
    ) -> PreparedTransfer:
        """`read()` of these ranges, checked now and started by each `post()` of the result."""
        return self._prepare(TransferOp.READ, local, remote, RangeList.build(remote_offsets, local_offsets, lengths), timeout, path)

    def _prepare(self, op: TransferOp, local: ConnBuffer, remote: Any, ranges: RangeList, timeout: float | None, path: str | None) -> PreparedTransfer:
        timeout = None if timeout is None else check_timeout(timeout)
        self._choose(local, self._checked(op, local, remote, ranges), path)  # NoPathError now, not at the first post
        return PreparedTransfer(self, op, local, remote, ranges.coalesced(), timeout=timeout, path=path)

    @staticmethod
    def _inline_failed(local: ConnBuffer, route: Route, length: int, error: HMCError) -> TransferHandle:
        """A failed inline copy: forget the pair's fast path and report through the handle."""
        local.inline_routes.clear()
        handle = TransferHandle(route.path, length, time.monotonic())
        handle.finish(error)
        return handle

    def _submit(
        self, op: TransferOp, local: ConnBuffer, remote: Any, ranges: RangeList,
        notify: bytes | None, timeout: float | None, path: str | None, transfer_id: str | None = None,
    ) -> TransferHandle:
        timeout = None if timeout is None else check_timeout(timeout)
        notify = check_notify(notify)
        descriptor = self._checked(op, local, remote, ranges)
        ranges = ranges.coalesced()
        choice = self._choose(local, descriptor, path)
        transport = self._transports[choice.path]
        deadline = time.monotonic() + (self.config.timeout_s if timeout is None else timeout)
        handle = TransferHandle(choice.path.value, ranges.total, deadline, transfer_id)
        self._track(local, handle)
        completion: Any = handle
        if notify is not None:
            completion = NotifyStep(handle, lambda h: self._send_notify(descriptor, h, bytes(notify)))
        transport.post(TransferRequest(handle.id, op, local, descriptor, ranges, deadline, completion))
        if (
            notify is None
            and type(transport).inline is not Transport.inline  # offers a fast path at all
            and len(ranges) == 1
            and handle.state in _LEARNING  # not failed: a range still moving (a large one) teaches the route as well
            and (descriptor.id if path is None else (descriptor.id, path)) not in local.inline_routes
        ):
            keys: list[Any] = [] if path is None else [(descriptor.id, path)]
            if path is None or self._own_path(local, descriptor) is choice.path:  # the pair's own path: unforced calls too
                keys.append(descriptor.id)
            self._learn_route(transport, local, descriptor, choice.path.value, keys)
        return handle

    def _track(self, local: ConnBuffer, handle: TransferHandle) -> None:
        """Count `handle` among `local`'s transfers, which unregister cancels (BufferWithdrawnError once it began); ended
        ones are pruned each time the list reaches a power of two from 64 (amortized constant)."""
        with self._lock:
            if self._buffers.withdrawn(local.id):
                raise BufferWithdrawnError(f"{local!r} was unregistered")
            outgoing = local.outgoing
            if len(outgoing) >= 64 and not len(outgoing) & (len(outgoing) - 1):
                outgoing[:] = [h for h in outgoing if h.state not in FINAL_STATES]
            outgoing.append(handle)

    def _checked(self, op: TransferOp, local: ConnBuffer, remote: Any, ranges: RangeList) -> common_pb2.BufferDescriptor:
        """The remote side's descriptor, once the agent is open, both buffers usable and `ranges` within them.

        `ranges.dst` is the destination for both ops (a read's ranges run remote -> local):
        its ranges must be disjoint.
        """
        self._check_open()
        descriptor: common_pb2.BufferDescriptor = remote.descriptor if isinstance(remote, ConnBuffer) else remote
        if type(descriptor) is not _DESCRIPTOR:
            raise ArgumentError(f"remote must be a BufferDescriptor or a ConnBuffer, got {type(remote).__name__}")
        self._check_buffers(local, descriptor)
        if op is TransferOp.WRITE:
            ranges.check(local.size, descriptor.size)
        else:
            if local.region.readonly:
                raise AccessDeniedError(f"{local!r} is read-only: it cannot receive a read")
            ranges.check(descriptor.size, local.size)
        ranges.check_disjoint_dst()
        return descriptor

    def _check_buffers(self, local: ConnBuffer, descriptor: common_pb2.BufferDescriptor) -> None:
        if not isinstance(local, ConnBuffer):
            raise ArgumentError(f"local must be a ConnBuffer of this agent, got {type(local).__name__}")
        if local.descriptor.owner.id != self.id:
            raise ArgumentError(f"{local!r} belongs to another agent; pass it as the remote side")
        self._buffers.get(local.id)
        if descriptor.owner.id == self.id and self._buffers.withdrawn(descriptor.id):
            raise BufferWithdrawnError(f"buffer {descriptor.id} was withdrawn by its owner")
        self._withdrawn_remote.check(descriptor)

    def _own_path(self, local: ConnBuffer, descriptor: common_pb2.BufferDescriptor) -> PathName | None:
        """The path the pair negotiates without `path=` (None when policy leaves it none)."""
        try:
            return self._choose(local, descriptor, None).path
        except HMCError:
            return None

    def _learn_route(self, transport: Transport, local: ConnBuffer, descriptor: common_pb2.BufferDescriptor, path: str, keys: list[Any]) -> None:
        try:
            copy = transport.inline(local, descriptor)
        except HMCError:
            return
        if copy is not None:
            route = Route(copy, descriptor.access_key, path, not local.region.readonly)
            for key in keys:
                local.inline_routes[key] = route

    def _drop_routes(self, remote_id: str) -> None:
        for buffer in self._buffers.values():
            routes = buffer.inline_routes
            for key in list(routes):
                if key == remote_id or (type(key) is tuple and key[0] == remote_id):
                    routes.pop(key, None)

    def _send_notify(self, descriptor: common_pb2.BufferDescriptor, handle: TransferHandle, payload: bytes) -> None:
        if descriptor.owner.id == self.id:
            self._buffers.get(descriptor.id, descriptor.access_key)
            self._inbox.deliver(Notification(descriptor.id, handle.id, payload, self.id))
            handle.finish()
            return

        def acked(reply: peer_pb2.PeerReply | None, error: BaseException | None) -> None:
            if error is None and reply is not None:
                try:
                    raise_for_reply(reply)
                except HMCError as exc:
                    error = exc
            handle.finish(error)

        self._peers.notify(descriptor, handle.id, payload, handle.deadline, acked)

    def notifications(self, timeout: float | None = 0) -> list[Notification]:
        """Notifications peers attached to transfers into this agent's buffers (drained)."""
        return self._inbox.drain(timeout)

    # -- paths ----------------------------------------------------------------

    def path_to(self, local: ConnBuffer, remote: Any) -> PathChoice:
        """The path (and the reasons better ones were refused) between `local` and `remote`."""
        descriptor = remote.descriptor if isinstance(remote, ConnBuffer) else remote
        choice = self._choose(local, descriptor, None)
        measured = self._transports[choice.path].measured(local, descriptor)
        return choice if measured is None else choice.with_measurement(measured)

    def _choose(self, local: ConnBuffer, descriptor: common_pb2.BufferDescriptor, path: str | None) -> PathChoice:
        """Negotiate (or, with `path`, check that path) for the pair; cached per device pair and agent."""
        key = (local.descriptor.device.name, descriptor.owner.id, descriptor.device.name, path)
        with self._lock:
            choice = self._paths.get(key)
        if choice is None:
            if path is not None and path not in _PATH_NAMES:
                raise ArgumentError(f"unknown path {path!r}; known: {', '.join(sorted(_PATH_NAMES))}")
            policy = self.config.policy if path is None else PathPolicy(allow=(path,))
            choice = negotiate(Endpoint.of(local.descriptor), Endpoint.of(descriptor), policy)
            with self._lock:
                self._paths[key] = choice
        if choice.path not in self._transports:
            raise NoPathError(f"path {choice.path.value} was negotiated but this agent has no such transport")
        return choice

    # -- peers and hmcd ----------------------------------------------------------

    def _registry_epochs(self) -> tuple[int, Collection[int]]:
        """The epoch of the hmcd registry this agent's buffers are registered with, and the earlier ones."""
        link = self._link
        return (link.registry_epoch, link.past_epochs) if isinstance(link, DaemonLink) else (0, ())

    def _remote_withdrawn(self, agent_id: str, buffer_id: str, epoch: int = 0) -> None:
        """A remote buffer was withdrawn: by its owner (epoch 0: for good), or at `epoch` of its node's registry
        (after its hmcd started again: a descriptor of a later epoch is good)."""
        self._withdrawn_remote.withdrawn(buffer_id, epoch)
        self._drop_routes(buffer_id)
        withdraw_everywhere(self._transports.values(), buffer_id)  # DeviceError: transfers of it may still land

    def _remote_added(self, buffer_id: str, epoch: int) -> None:
        """A remote buffer is registered again at `epoch` (its node left the directory and came back): that epoch
        is good again, older ones stay refused; one its owner withdrew for good stays withdrawn."""
        self._withdrawn_remote.added(buffer_id, epoch)

    def _peer_lost(self, agent: common_pb2.AgentInfo) -> None:
        for buffer in self._buffers.values():
            buffer.inline_routes.clear()
        for transport in self._transports.values():
            transport.forget_peer(agent)

    def events(self, timeout: float | None = 0) -> list[AgentEvent]:
        """What hmcd told this agent about other agents (buffers withdrawn, agents down) and the link's own
        losses and re-attaches, oldest first (drained); waits up to `timeout` (None: forever) for the first.

        The agent has already acted on each: a withdrawn buffer's next use raises BufferWithdrawnError.
        """
        return self._events.drain(timeout if timeout is None or timeout == 0 else check_timeout(timeout))

    def _default_link(self, config: Config, info: common_pb2.AgentInfo, on_instruction: Callable[[daemon_pb2.TransferInstruction], None]) -> DaemonLink:
        return DaemonLink(
            config, info, on_instruction, self._on_hmcd_event, on_cancel=self._instructions.on_cancel, on_lost=self._on_hmcd_lost, on_attached=self._on_hmcd_attached,
            on_down=lambda _: self._instructions.abandon(),  # hmcd failed what it instructed when it went: none may outlive that verdict
        )

    def _on_hmcd_event(self, event: daemon_pb2.Event) -> None:
        """hmcd's word about another agent (thread "hmc-daemon-events"): act as on the peer's own, then tell the user."""
        if event.kind == daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN and event.buffer.owner.id != self.id:
            try:
                self._remote_withdrawn(event.agent_id, event.buffer.id, event.buffer.registry_epoch)
            finally:
                self._events.deliver(AgentEvent(AgentEventKind.BUFFER_WITHDRAWN, event.buffer.id, event.agent_id, event.buffer.name, event.node))
        elif event.kind == daemon_pb2.EVENT_KIND_BUFFER_ADDED and event.buffer.owner.id != self.id:
            self._remote_added(event.buffer.id, event.buffer.registry_epoch)
        elif event.kind == daemon_pb2.EVENT_KIND_AGENT_DOWN and event.agent_id != self.id:
            self._peer_lost(event.agent if event.HasField("agent") else common_pb2.AgentInfo(id=event.agent_id))
            self._events.deliver(AgentEvent(AgentEventKind.AGENT_DOWN, agent_id=event.agent_id, node=event.node))

    def _on_hmcd_lost(self, error: HMCError) -> None:
        self._events.deliver(AgentEvent(AgentEventKind.HMCD_LOST, agent_id=self.id, detail=str(error)))

    def _on_hmcd_attached(self, hello: daemon_pb2.DaemonHello) -> None:
        self._events.deliver(AgentEvent(AgentEventKind.HMCD_ATTACHED, agent_id=self.id, node=hello.node, detail=f"registry epoch {hello.registry_epoch}"))

    def _measured(self, measured: common_pb2.PathMeasurement) -> None:
        if self._link is not None:  # hmcd hears what a path measured, for `hmc path` and its own transfers
            self._link.measured(measured)

    def _report(self, report: daemon_pb2.TransferReport) -> None:
        if self._link is not None:
            self._link.report(report)

    # -- lifecycle ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError("agent is closed")

    def close(self) -> None:
        """Stop serving peers, close every connection and thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        link = getattr(self, "_link", None)
        if link is not None:
            link.close()
        self._server.close()
        self._peers.close()
        for transport in getattr(self, "_transports", {}).values():
            transport.close()
        self._instructions.close()
        for buffer in self._buffers.values():
            self._buffers.remove(buffer.id, timeout=0)

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Agent {self.id} on {self.config.node} port {self._server.port} paths {','.join(p.value for p in self._transports)}>"
