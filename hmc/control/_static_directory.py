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
import logging

import grpc
from grpc_health.v1 import health_pb2

from hmc.config import Config
from hmc.control._directory import PEER_CALL_S, Directory, Lookup, Peer
from hmc.control._errors import translate_rpc_error
from hmc.control._events import EventBus
from hmc.control._metrics import DaemonMetrics
from hmc.errors import HMCError, UnknownBufferError
from hmc.v1 import common_pb2, daemon_pb2

__all__ = ["StaticDirectory"]

log = logging.getLogger("hmc.hmcd")

_RELAYED = frozenset(
    {
        daemon_pb2.EVENT_KIND_BUFFER_ADDED,
        daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN,
        daemon_pb2.EVENT_KIND_AGENT_UP,
        daemon_pb2.EVENT_KIND_AGENT_DOWN,
    }
)


class StaticDirectory(Directory):
    """Peer daemons from configuration: health, event relay, lookups that fall through."""

    kind = "static"

    def __init__(self, config: Config, events: EventBus, metrics: DaemonMetrics) -> None:
        self._config = config
        self._events = events
        self._metrics = metrics
        self._peers = [Peer.open(address, config) for address in dict.fromkeys(config.static_peers)]
        self._watches: dict[Peer, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def peers(self) -> list[Peer]:
        return [peer for peer in self._peers if not peer.is_self]

    def status(self) -> daemon_pb2.DirectoryStatus:
        nodes = [daemon_pb2.DirectoryNode(node=p.node, tcp_address=p.address, epoch=p.epoch, up=bool(p.up), error=p.error) for p in self.peers]
        return daemon_pb2.DirectoryStatus(kind=self.kind, endpoints=list(self._config.static_peers), connected=True, nodes=nodes)

    async def start(self) -> None:
        for peer in self._peers:
            self._tasks.append(asyncio.create_task(self._check_forever(peer), name=f"hmc-peer:{peer.address}"))

    async def close(self) -> None:
        tasks = self._tasks + list(self._watches.values())
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
            reply = await peer.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout, metadata=peer.metadata)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            if serving and peer.up is not True:
                info = await peer.nodes.GetNodeInfo(daemon_pb2.NodeInfoRequest(), timeout=timeout, metadata=peer.metadata)
                peer.node, peer.epoch = info.node, info.registry_epoch
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
        watch = self._watches.get(peer)
        if up and (watch is None or watch.done()):
            self._watches[peer] = asyncio.create_task(self._relay(peer), name=f"hmc-peer-watch:{peer.address}")
        elif not up and watch is not None:
            watch.cancel()

    async def _relay(self, peer: Peer) -> None:
        """Republish the peer's buffer and agent events until its stream ends."""
        call = peer.events.Watch(daemon_pb2.WatchRequest(include_peers=False), metadata=peer.metadata)
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

    async def lookup(self, ref: daemon_pb2.BufferRef, timeout: float) -> Lookup:
        """Ask the peers (local_only) for `ref`; those marked down are not asked but reported as unanswered."""
        peers = self._askable()
        timeout = min(timeout, PEER_CALL_S)  # a peer that hangs must not hold every lookup for the full timeout
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
            return await peer.registry.LookupBuffer(request, timeout=timeout, metadata=peer.metadata)
        except grpc.RpcError as exc:
            error = translate_rpc_error(exc, peer.address, "peer hmcd")
            if not isinstance(error, UnknownBufferError):
                log.debug("lookup at peer %s failed: %s", peer.address, error)
            return error

    async def list_buffers(self, timeout: float) -> tuple[list[common_pb2.BufferDescriptor], float]:
        """Every peer's local buffers, asked now (unreachable peers contribute nothing)."""

        async def one(peer: Peer) -> list[common_pb2.BufferDescriptor]:
            try:
                reply = await peer.registry.ListBuffers(daemon_pb2.ListBuffersRequest(local_only=True), timeout=timeout, metadata=peer.metadata)
            except grpc.RpcError as exc:
                log.debug("listing buffers at peer %s failed: %s", peer.address, exc)
                return []
            return list(reply.buffers)

        timeout = min(timeout, PEER_CALL_S)
        lists = await asyncio.gather(*(one(peer) for peer in self._askable()))
        return [descriptor for found in lists for descriptor in found], 0.0
