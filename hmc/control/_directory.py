"""The static directory: peer hmcd daemons at fixed TCP addresses (`Config.static_peers`).

- Health: each peer is checked every `Config.peer_check_interval_s` with a
  grpc.health.v1 Check (service ""); a change publishes PEER_UP or PEER_DOWN (the
  first successful check is an "up" change; the first failed one of a never-seen
  peer is a "down" change). A peer coming up is also asked its node name
  (GetNodeInfo, which needs our token: a peer refusing it stays down, with the
  reason). A peer that turns out to be this very node (a shared peer list) is skipped.
- Events: while a peer is up, its BUFFER_* and AGENT_* events are followed
  (Watch) and republished here as relayed events, so local agents hear about
  withdrawals on other nodes.
- Lookups fall through to peers with `local_only=True` (so they never bounce on),
  asked concurrently; the first peer in configuration order that knows the buffer
  wins. Peers marked down are skipped; they and the peers that fail to answer are
  returned, so that hmcd says "unavailable" rather than "unknown" when they might
  hold the buffer.

Concurrency: owned by hmcd's event loop: one health task per peer ("hmc-peer:<addr>")
and, while it is up, one watch task; `close()` cancels and awaits them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hmc.config import Config
from hmc.control._auth import bearer_metadata, open_aio_channel
from hmc.control._errors import translate_rpc_error
from hmc.control._events import EventBus
from hmc.control._metrics import DaemonMetrics
from hmc.errors import HMCError, UnknownBufferError
from hmc.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

__all__ = ["Peer", "StaticDirectory"]

log = logging.getLogger("hmc.hmcd")

_RELAYED = frozenset(
    {
        daemon_pb2.EVENT_KIND_BUFFER_ADDED,
        daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN,
        daemon_pb2.EVENT_KIND_AGENT_UP,
        daemon_pb2.EVENT_KIND_AGENT_DOWN,
    }
)

_PEER_CALL_S = 5.0
"""Longest a lookup or listing waits for one peer (health checks mark a hung peer down meanwhile)."""

CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 64 << 20),
)


@dataclasses.dataclass(eq=False)
class Peer:
    """One static peer daemon and what this node last learned about it."""

    address: str
    channel: grpc.aio.Channel
    node: str = ""
    up: bool | None = None
    is_self: bool = False
    error: str = ""
    watch: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.nodes = daemon_pb2_grpc.NodeServiceStub(self.channel)
        self.registry = daemon_pb2_grpc.RegistryServiceStub(self.channel)
        self.transfers = daemon_pb2_grpc.TransferServiceStub(self.channel)
        self.events = daemon_pb2_grpc.EventServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def status(self) -> daemon_pb2.PeerStatus:
        return daemon_pb2.PeerStatus(address=self.address, node=self.node, up=bool(self.up), error=self.error)


class StaticDirectory:
    """Peer daemons from configuration: health, event relay, lookups that fall through."""

    def __init__(self, config: Config, events: EventBus, metrics: DaemonMetrics) -> None:
        self._config = config
        self._events = events
        self._metrics = metrics
        self._metadata = bearer_metadata(config.token)
        self._peers = [Peer(address, open_aio_channel(address, config, CHANNEL_OPTIONS)) for address in dict.fromkeys(config.static_peers)]
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def peers(self) -> list[Peer]:
        return [peer for peer in self._peers if not peer.is_self]

    def statuses(self) -> list[daemon_pb2.PeerStatus]:
        return [peer.status() for peer in self.peers]

    def start(self) -> None:
        for peer in self._peers:
            self._tasks.append(asyncio.create_task(self._check_forever(peer), name=f"hmc-peer:{peer.address}"))

    async def close(self) -> None:
        tasks = self._tasks + [peer.watch for peer in self._peers if peer.watch is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        for peer in self._peers:
            await peer.channel.close()

    # -- health ---------------------------------------------------------------------

    async def _check_forever(self, peer: Peer) -> None:
        interval = max(self._config.peer_check_interval_s, 0.05)
        while not peer.is_self:
            await self.check(peer, timeout=min(interval * 2, 5.0, self._config.timeout_s))
            await asyncio.sleep(interval)

    async def check(self, peer: Peer, timeout: float) -> None:
        """One health check (and the node's name when the peer comes up); publishes PEER_UP/PEER_DOWN on a change."""
        try:
            reply = await peer.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout, metadata=self._metadata)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            if serving and peer.up is not True:
                info = await peer.nodes.GetNodeInfo(daemon_pb2.NodeInfoRequest(), timeout=timeout, metadata=self._metadata)
                peer.node = info.node
        except grpc.RpcError as exc:
            self._mark(peer, False, str(translate_rpc_error(exc, peer.address, "peer hmcd")))
            return
        if peer.node == self._config.node:
            log.info("static peer %s is this node (%s); skipping it", peer.address, peer.node)
            peer.is_self = True
            return
        self._mark(peer, serving, "" if serving else "peer reports not serving")

    def _mark(self, peer: Peer, up: bool, error: str) -> None:
        peer.error = error
        if peer.up is not up:
            peer.up = up
            kind = daemon_pb2.EVENT_KIND_PEER_UP if up else daemon_pb2.EVENT_KIND_PEER_DOWN
            (log.info if up else log.warning)("peer %s (%s) is %s%s", peer.address, peer.node or "?", "up" if up else "down", f": {error}" if error else "")
            self._events.publish(daemon_pb2.Event(kind=kind, peer=peer.address))
            self._metrics.peers_up.set(sum(1 for p in self._peers if p.up and not p.is_self))
        if up and (peer.watch is None or peer.watch.done()):
            peer.watch = asyncio.create_task(self._relay(peer), name=f"hmc-peer-watch:{peer.address}")
        elif not up and peer.watch is not None:
            peer.watch.cancel()

    async def _relay(self, peer: Peer) -> None:
        """Republish the peer's buffer and agent events until its stream ends."""
        call = peer.events.Watch(daemon_pb2.WatchRequest(include_peers=False), metadata=self._metadata)
        try:
            async for event in call:
                if event.kind in _RELAYED:
                    relayed = daemon_pb2.Event()
                    relayed.CopyFrom(event)
                    relayed.sequence = 0
                    relayed.peer = peer.address
                    self._events.publish(relayed, relayed=True)
        except grpc.RpcError as exc:
            log.debug("event stream of peer %s ended: %s", peer.address, exc.code() if isinstance(exc, grpc.Call) else exc)
        finally:
            call.cancel()

    # -- lookups ----------------------------------------------------------------------

    def _askable(self) -> list[Peer]:
        return [peer for peer in self.peers if peer.up is not False]

    async def lookup(self, ref: daemon_pb2.BufferRef, timeout: float) -> tuple[tuple[common_pb2.BufferDescriptor, Peer] | None, list[str]]:
        """Ask the peers (local_only) for `ref`: the descriptor and the peer that has it (or None), and the
        peers that could not answer ("address: why"; those marked down are not asked)."""
        peers = self._askable()
        timeout = min(timeout, _PEER_CALL_S)  # a peer that hangs must not hold every lookup for the full timeout
        request = daemon_pb2.LookupBufferRequest(ref=ref, local_only=True)
        replies = await asyncio.gather(*(self._lookup_one(peer, request, timeout) for peer in peers))
        unanswered = [f"{peer.address}: {peer.error or 'down'}" for peer in self.peers if peer.up is False]
        for peer, reply in zip(peers, replies):
            if isinstance(reply, common_pb2.BufferDescriptor):
                return (reply, peer), []
            if not isinstance(reply, UnknownBufferError):
                unanswered.append(f"{peer.address}: {reply}")
        return None, unanswered

    async def _lookup_one(self, peer: Peer, request: daemon_pb2.LookupBufferRequest, timeout: float) -> common_pb2.BufferDescriptor | HMCError:
        try:
            return await peer.registry.LookupBuffer(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            error = translate_rpc_error(exc, peer.address, "peer hmcd")
            if not isinstance(error, UnknownBufferError):
                log.debug("lookup at peer %s failed: %s", peer.address, error)
            return error

    async def list_buffers(self, timeout: float) -> list[common_pb2.BufferDescriptor]:
        """Every peer's local buffers (unreachable peers contribute nothing)."""

        async def one(peer: Peer) -> list[common_pb2.BufferDescriptor]:
            try:
                reply = await peer.registry.ListBuffers(daemon_pb2.ListBuffersRequest(local_only=True), timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                log.debug("listing buffers at peer %s failed: %s", peer.address, exc)
                return []
            return list(reply.buffers)

        timeout = min(timeout, _PEER_CALL_S)
        lists = await asyncio.gather(*(one(peer) for peer in self._askable()))
        return [descriptor for found in lists for descriptor in found]

    # -- forwarded transfers ------------------------------------------------------------

    async def submit(self, peer: Peer, request: daemon_pb2.SubmitTransferRequest, timeout: float) -> daemon_pb2.TransferStatus:
        return await self._call(peer, peer.transfers.Submit, request, timeout)

    async def wait(self, peer: Peer, ref: daemon_pb2.TransferRef, timeout: float) -> daemon_pb2.TransferStatus:
        return await self._call(peer, peer.transfers.Wait, ref, timeout)

    async def cancel(self, peer: Peer, ref: daemon_pb2.TransferRef, timeout: float) -> daemon_pb2.TransferStatus:
        return await self._call(peer, peer.transfers.Cancel, ref, timeout)

    async def _call(self, peer: Peer, method: grpc.aio.UnaryUnaryMultiCallable, request: object, timeout: float) -> daemon_pb2.TransferStatus:
        try:
            return await method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, peer.address, "peer hmcd") from exc

    def peer(self, address: str) -> Peer | None:
        return next((peer for peer in self._peers if peer.address == address), None)
