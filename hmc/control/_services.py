"""hmcd's gRPC servicers: thin adapters from the contract in daemon.proto to the daemon's parts.

Servicers raise `HMCError`s; the `ErrorBoundary` interceptor turns them into
statuses. Every handler bounds its waits by the call's deadline and
`Config.timeout_s`, whichever is sooner.

Concurrency: every handler runs on hmcd's event loop. An agent's Attach stream
has two tasks: the handler reads the agent's messages; a writer task drains the
session's outbox (acks, instructions, events) into the stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2_grpc

from hmc.control._errors import abort
from hmc.control._registry import AgentSession, describe_ref
from hmc.errors import ErrorCode, HMCError, ProtocolError, TimeoutError, UnsupportedError, VersionMismatchError
from hmc.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from hmc.control._hmcd import Daemon

__all__ = ["add_services"]

log = logging.getLogger("hmc.hmcd")

_RESERVATION_SLACK_S = 0.05
"""Past a reservation's end before a waiting registration looks again (its timer ends it at that moment)."""

PROTOCOL_VERSION = common_pb2.PROTOCOL_VERSION_1


def call_timeout(daemon: Daemon, context: grpc.aio.ServicerContext, limit: float | None = None) -> float:
    """Seconds this call may still spend: its deadline or `limit` (default: the configured timeout), whichever is sooner."""
    remaining = context.time_remaining()
    limit = daemon.config.timeout_s if limit is None else limit
    return max(min(limit, remaining - 0.05) if remaining is not None else limit, 0.0)


class NodeServicer(daemon_pb2_grpc.NodeServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon

    async def GetNodeInfo(self, request: daemon_pb2.NodeInfoRequest, context: grpc.aio.ServicerContext) -> daemon_pb2.NodeInfo:
        return self._daemon.node_info()

    async def GetMetrics(self, request: daemon_pb2.MetricsRequest, context: grpc.aio.ServicerContext) -> daemon_pb2.MetricsResponse:
        if not self._daemon.config.metrics:
            raise UnsupportedError("metrics are disabled on this hmcd (config: metrics = false)")
        return daemon_pb2.MetricsResponse(text=self._daemon.metrics.text())


class RegistryServicer(daemon_pb2_grpc.RegistryServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon

    async def Attach(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        daemon = self._daemon
        hello = await self._read_hello(context)
        if hello is None:
            return
        if not hello.agent.node:
            hello.agent.node = daemon.config.node
        session = daemon.registry.attach(hello.agent, hello.held.names if hello.HasField("held") else None)
        session.reads_daemon_clock = hello.reads_daemon_clock
        writer: asyncio.Task[None] | None = None
        clean = False  # the agent closed its stream (EOF): it is gone; otherwise it may come back (registry: "Sessions")
        registering: dict[str, asyncio.Task[None]] = {}  # buffer id -> its registration, waiting for the directory
        try:
            greeting = daemon_pb2.DaemonHello(
                protocol_version=PROTOCOL_VERSION, node=daemon.config.node, host_id=daemon.inventory.host_id, registry_epoch=daemon.registry.epoch,
                takes_measurements=True, monotonic_s=time.monotonic(),
            )
            await context.write(daemon_pb2.DaemonMessage(hello=greeting))
            writer = asyncio.create_task(_drain(session, context), name=f"hmc-attach-writer:{session.agent_id}")
            while True:
                message = await context.read()
                if message is grpc.aio.EOF:
                    clean = True
                    break
                await self._handle(session, message, registering)
        finally:
            for task in registering.values():
                task.cancel()  # nothing of it stays published (see _register)
            await asyncio.gather(*registering.values(), return_exceptions=True)
            if writer is not None:
                writer.cancel()
            daemon.transfers.agent_lost(session)
            daemon.measurements.forget(session.agent_id)
            daemon.registry.detach(session, clean=clean)

    async def _read_hello(self, context: grpc.aio.ServicerContext) -> daemon_pb2.AgentHello | None:
        try:
            first = await asyncio.wait_for(context.read(), self._daemon.config.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"agent sent no hello within {self._daemon.config.timeout_s:g}s") from None
        if first is grpc.aio.EOF:
            return None
        if first.WhichOneof("kind") != "hello":
            await abort(context, ProtocolError(f"the first message on an Attach stream must be a hello, got {first.WhichOneof('kind')}"), grpc.StatusCode.FAILED_PRECONDITION)
        if first.hello.protocol_version != PROTOCOL_VERSION:
            await abort(
                context,
                VersionMismatchError(f"agent speaks protocol version {first.hello.protocol_version}; this hmcd speaks {PROTOCOL_VERSION}"),
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        return first.hello

    async def _handle(self, session: AgentSession, message: daemon_pb2.AgentMessage, registering: dict[str, asyncio.Task[None]]) -> None:
        """One message of the agent's stream. A registration runs as a task of its own (it may wait for the
        directory: etcd), so the agent's other messages (reports, other registrations) never wait behind it;
        an unregister of a buffer still registering waits for that registration first."""
        kind = message.WhichOneof("kind")
        registry = self._daemon.registry
        if kind == "register":
            request = message.register
            if request.descriptor.id in registering:  # two at once of one id: the second may not undo the first
                error = common_pb2.Error(code=int(ErrorCode.INVALID_ARGUMENT), message=f"buffer id {request.descriptor.id!r} is being registered already")
                await session.outbox.put(daemon_pb2.DaemonMessage(ack=daemon_pb2.Ack(request_id=request.request_id, error=error)))
                return
            task = asyncio.create_task(self._register_and_ack(session, request), name=f"hmc-register:{request.descriptor.id}")
            registering[request.descriptor.id] = task
            task.add_done_callback(lambda done: registering.pop(request.descriptor.id, None) if registering.get(request.descriptor.id) is done else None)
        elif kind == "unregister":
            earlier = registering.get(message.unregister.buffer_id)
            if earlier is not None:
                await asyncio.wait([earlier])
            error = _attempt(lambda: registry.unregister(session, message.unregister.buffer_id))
            await session.outbox.put(daemon_pb2.DaemonMessage(ack=daemon_pb2.Ack(request_id=message.unregister.request_id, error=error)))
        elif kind == "report":
            self._daemon.transfers.report(session, message.report)
        elif kind == "measured":
            self._daemon.measurements.record(session.agent_id, message.measured)
        else:
            raise ProtocolError(f"unexpected {kind or 'empty'} message on the Attach stream of agent {session.agent_id!r}")

    async def _register_and_ack(self, session: AgentSession, request: daemon_pb2.RegisterBuffer) -> None:
        try:
            error = await self._register(session, request.descriptor, request.again)
        except Exception as exc:  # noqa: BLE001 - a bug must still answer the agent, which waits for this ack
            log.exception("registering buffer %s failed", request.descriptor.id)
            error = common_pb2.Error(code=int(ErrorCode.INTERNAL), message=f"hmcd failed to register buffer {request.descriptor.id!r}: {exc!r}")
        await session.outbox.put(daemon_pb2.DaemonMessage(ack=daemon_pb2.Ack(request_id=request.request_id, error=error)))

    async def _register(self, session: AgentSession, descriptor: common_pb2.BufferDescriptor, again: bool = False) -> common_pb2.Error | None:
        """Check, then publish in the directory (which may refuse a name another node holds, or wait for etcd), then register.

        `again`: the agent registered it while hmcd was away; a name reserved for another live agent is waited for
        until that reservation ends, then checked again (see RegisterBuffer.again)."""
        daemon = self._daemon
        while True:
            try:
                daemon.registry.prepare(session, descriptor)
                break
            except HMCError as exc:
                left = daemon.registry.reserved_for_another(session, descriptor.name) if again and descriptor.name else None
                if left is None:
                    return common_pb2.Error(code=int(exc.code), message=str(exc))
                log.info("buffer %s: its name %r is reserved for another agent; waiting up to %.1fs for that to end", descriptor.id, descriptor.name, left)
                await daemon.registry.reservation_ended(left + _RESERVATION_SLACK_S)
        try:
            await daemon.directory.publish(descriptor, daemon.config.timeout_s / 2)  # answered before the agent's own deadline
        except HMCError as exc:
            return common_pb2.Error(code=int(exc.code), message=str(exc))
        except asyncio.CancelledError:  # the stream ended meanwhile: nothing may stay published
            daemon.directory.unpublish(descriptor)
            raise
        error = _attempt(lambda: daemon.registry.register(session, descriptor))
        if error is not None:
            daemon.directory.unpublish(descriptor)
        return error

    async def LookupBuffer(self, request: daemon_pb2.LookupBufferRequest, context: grpc.aio.ServicerContext) -> common_pb2.BufferDescriptor:
        descriptor, _ = await self._daemon.resolve(request.ref, request.local_only, call_timeout(self._daemon, context))
        return descriptor

    async def ListBuffers(self, request: daemon_pb2.ListBuffersRequest, context: grpc.aio.ServicerContext) -> daemon_pb2.ListBuffersResponse:
        found, age = self._daemon.registry.buffers(), 0.0
        if not request.local_only:
            others, age = await self._daemon.directory.list_buffers(call_timeout(self._daemon, context))
            found += others
        return daemon_pb2.ListBuffersResponse(buffers=found, directory_age_s=age)


def _attempt(action: object) -> common_pb2.Error | None:
    """Run a registry change; its HMCError as a wire Error (None when it worked)."""
    try:
        action()  # type: ignore[operator]
    except HMCError as exc:
        return common_pb2.Error(code=int(exc.code), message=str(exc))
    return None


async def _drain(session: AgentSession, context: grpc.aio.ServicerContext) -> None:
    """Write the session's queued messages to its stream until cancelled or broken."""
    try:
        while True:
            message = await session.outbox.get()
            await context.write(message)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the stream broke; the reader sees it end too
        log.debug("writing to agent %s failed: %s", session.agent_id, exc)


class PathServicer(daemon_pb2_grpc.PathServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon

    async def Negotiate(self, request: daemon_pb2.NegotiateRequest, context: grpc.aio.ServicerContext) -> common_pb2.PathDecision:
        timeout = call_timeout(self._daemon, context)
        describe_ref(request.src), describe_ref(request.dst)
        (src, _), (dst, _) = await asyncio.gather(self._daemon.resolve(request.src, False, timeout), self._daemon.resolve(request.dst, False, timeout))
        return self._daemon.measurements.choose(src, dst).to_proto()


class TransferServicer(daemon_pb2_grpc.TransferServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon

    async def Submit(self, request: daemon_pb2.SubmitTransferRequest, context: grpc.aio.ServicerContext) -> daemon_pb2.TransferStatus:
        return await self._daemon.transfers.submit(request, call_timeout(self._daemon, context))

    async def Wait(self, request: daemon_pb2.TransferRef, context: grpc.aio.ServicerContext) -> daemon_pb2.TransferStatus:
        return await self._daemon.transfers.wait(request, call_timeout(self._daemon, context, limit=request.timeout_s))

    async def Cancel(self, request: daemon_pb2.TransferRef, context: grpc.aio.ServicerContext) -> daemon_pb2.TransferStatus:
        return await self._daemon.transfers.cancel(request, call_timeout(self._daemon, context))


SUBSCRIBED_KEY = "hmc-subscribed"
"""Initial metadata of a Watch that is subscribed (a failed call sends none: clients without a poll on the call, as
gRPC C++'s, tell the two apart by it)."""


class EventServicer(daemon_pb2_grpc.EventServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon

    async def Watch(self, request: daemon_pb2.WatchRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[daemon_pb2.Event]:
        subscription = self._daemon.events.subscribe(request.include_peers)
        try:
            await context.send_initial_metadata(((SUBSCRIBED_KEY, "1"),))  # the client's cue that it is subscribed
            async for event in subscription:
                yield event
        finally:
            self._daemon.events.unsubscribe(subscription)


def add_services(daemon: Daemon, server: grpc.aio.Server) -> None:
    """Register every hmcd service on `server`, grpc.health.v1 included (one servicer shared by all of hmcd's servers)."""
    health_pb2_grpc.add_HealthServicer_to_server(daemon.health, server)
    daemon_pb2_grpc.add_NodeServiceServicer_to_server(NodeServicer(daemon), server)
    daemon_pb2_grpc.add_RegistryServiceServicer_to_server(RegistryServicer(daemon), server)
    daemon_pb2_grpc.add_PathServiceServicer_to_server(PathServicer(daemon), server)
    daemon_pb2_grpc.add_TransferServiceServicer_to_server(TransferServicer(daemon), server)
    daemon_pb2_grpc.add_EventServiceServicer_to_server(EventServicer(daemon), server)
