"""The etcd directory: nodes, agents and ConnBuffers of a cluster in etcd, under one lease per hmcd.

Keys, under `Config.etcd_prefix` (P), every one attached to its hmcd's lease:

    P/nodes/<node>               DirectoryNode: host id, registry epoch, TCP address
    P/agents/<node>/<agent id>   AgentInfo
    P/buffers/<node>/<buffer id> BufferDescriptor (stamped with the registry epoch)
    P/names/<name>               NameClaim: the one buffer of the cluster holding the name

Joining. hmcd takes a lease (`etcd_lease_ttl_s`) and creates its node record in a
transaction (the key must not exist). A record of this very host from an earlier start
(an older epoch: a restart faster than the TTL), or from this start under a lease it lost
track of (the same epoch), is taken over by revoking that lease, which drops all its keys
at once; a record of another host, or of a newer start, is a BusyResourceError (two hmcd
claim one node name); an unreadable or lease-less record is removed. Then everything
local is published. The lease is renewed every TTL/3 counted from the last renewal, and
at once again after a failure, so only etcd saying it expired loses it: then the writer
joins again and republishes.

Publishing. Every write of this node's keys, joining included, is done by one task in
queue order, so a withdrawal and a later registration of the same buffer land in that
order and nothing queued around a rejoin is lost. A registration is accepted only once
its record is in etcd (`publish`, awaited by the Attach handler, at most the TTL); its
name is claimed in the same transaction (cluster-wide unique: BusyResourceError naming
the holder); whatever fails, what it may have written is taken back. Withdrawals and
agents coming and going follow hmcd's own events.

Watching. One watch over P (from a consistent snapshot's revision) feeds the
`ClusterView` of the other nodes (`_etcd_view`), which turns changes into events; after
the watch breaks, a fresh snapshot is diffed against it, so nothing that happened
meanwhile is missed. Lookups and listings answer from it; transfers whose source another
node owns are forwarded to that node's hmcd (a channel per node, retired after a grace
when the node leaves or starts again).

Partition. While etcd cannot be reached (the watch broken or the lease not renewed
within the TTL), lookups and listings are served read-only from the view, with its age,
a lookup that misses says UnavailableError rather than "unknown", and registrations
wait for etcd up to the TTL, then fail with UnavailableError.

Concurrency: owned by hmcd's event loop: tasks "hmc-etcd-lease" (renewals),
"hmc-etcd-watch" and "hmc-etcd-writer" (joins and writes); `close()` cancels them and
revokes the lease.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from hmc.config import Config
from hmc.control._directory import Directory, Lookup, Peer
from hmc.control._etcd import EtcdClient, EtcdSettings
from hmc.control._etcd_view import ClusterView, parse
from hmc.control._events import EventBus
from hmc.control._metrics import DaemonMetrics
from hmc.control._registry import Registry
from hmc.errors import ArgumentError, BusyResourceError, HMCError, ProtocolError, UnavailableError
from hmc.v1 import common_pb2, daemon_pb2
from hmc.v1 import etcd_pb2 as pb


__all__ = ["EtcdDirectory"]

log = logging.getLogger("hmc.hmcd")

_RETRY_S = 0.25
"""Pause between attempts while etcd cannot be reached."""


@dataclasses.dataclass(eq=False)
class _Write:
    """One queued change of this node's keys; `done` resolves when etcd has it (or it gave up)."""

    run: Callable[[int], Awaitable[None]]
    deadline: float | None = None
    done: asyncio.Future[None] | None = None


class EtcdDirectory(Directory):
    """This node's records in etcd, and a watched cache of everyone else's."""

    kind = "etcd"

    def __init__(self, config: Config, events: EventBus, metrics: DaemonMetrics, registry: Registry, record: Callable[[], daemon_pb2.DirectoryNode]) -> None:
        if "/" in config.node:
            raise ArgumentError(f"node name {config.node!r} may not contain '/' with the etcd directory (it is part of etcd keys)")
        self._config = config
        self._registry = registry
        self._record = record
        self._node = config.node
        self._ttl = config.etcd_lease_ttl_s
        self._client = EtcdClient(EtcdSettings(config.etcd_endpoints, ca=config.etcd_ca, cert=config.etcd_cert, key=config.etcd_key))
        self._prefix = config.etcd_prefix.encode() + b"/"
        self._lease = 0
        self._joined = asyncio.Event()
        self._renewed = 0.0
        self._watching = False
        self._last_in_sync = time.monotonic()
        self._error = "not joined yet"
        self._writes: asyncio.Queue[_Write] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._view = ClusterView(self._prefix, self._node, events, metrics, self._node_changed)
        self._peers: dict[str, Peer] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        events.add_listener(self._follow_local)

    # -- keys -------------------------------------------------------------------------

    def _key(self, *parts: str) -> bytes:
        return self._prefix + "/".join(parts).encode()

    # -- life cycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Join within the configured timeout (BusyResourceError: the node name is another host's);
        an unreachable etcd only delays joining, which the writer goes on trying in the background."""
        try:
            await self._join(self._config.timeout_s)
        except UnavailableError as exc:
            self._error = str(exc)
            log.warning("etcd directory: cannot join yet, retrying in the background: %s", exc)
        self._tasks = [
            asyncio.create_task(self._keep_lease(), name="hmc-etcd-lease"),
            asyncio.create_task(self._watch_forever(), name="hmc-etcd-watch"),
            asyncio.create_task(self._write_forever(), name="hmc-etcd-writer"),
        ]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in [*self._tasks, *self._retiring]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._retiring, return_exceptions=True)
        self._tasks.clear()
        if self._lease:
            try:
                await self._client.revoke(self._lease, min(self._config.timeout_s, 2.0))  # leave at once rather than after the TTL
            except HMCError as exc:
                log.info("etcd directory: could not revoke lease %x on leaving (it expires within %ds): %s", self._lease, self._ttl, exc)
        while not self._writes.empty():
            _fail(self._writes.get_nowait(), UnavailableError("hmcd is stopping"))
        for peer in self._peers.values():
            await peer.channel.close()
        await self._client.close()

    # -- joining and the lease ------------------------------------------------------------

    async def _join(self, timeout: float) -> None:
        """Take a lease, claim the node record, publish everything local. Only `start()` and the writer call it,
        so no write of this node's keys runs meanwhile."""
        deadline = time.monotonic() + timeout
        grant = await self._client.grant(self._ttl, _left(deadline))
        try:
            await self._claim_node(grant.ID, deadline)
            await self._publish_everything(grant.ID, deadline)
        except BaseException:
            try:
                await self._client.revoke(grant.ID, max(deadline - time.monotonic(), 0.5))
            except HMCError:
                pass  # it expires on its own
            raise
        self._lease, self._renewed, self._error = grant.ID, time.monotonic(), ""
        self._joined.set()
        log.info("etcd directory: node %s joined at %s (lease %x, ttl %ds, epoch %d)", self._node, self._client.endpoint, grant.ID, self._ttl, self._registry.epoch)

    async def _claim_node(self, lease: int, deadline: float) -> None:
        """Create this node's record; take over a record of this very host from an earlier start, or from this
        start under a lease it lost track of (same epoch); refuse another host's or a newer start's."""
        key = self._key("nodes", self._node)
        record = self._record()
        for _ in range(8):
            txn = pb.TxnRequest(
                compare=[_absent(key)],
                success=[pb.RequestOp(request_put=pb.PutRequest(key=key, value=record.SerializeToString(), lease=lease))],
                failure=[pb.RequestOp(request_range=pb.RangeRequest(key=key))],
            )
            reply = await self._client.txn(txn, _left(deadline))
            if reply.succeeded:
                return
            kvs = reply.responses[0].response_range.kvs
            if not kvs:
                continue  # expired meanwhile
            held = parse(daemon_pb2.DirectoryNode, kvs[0].value)
            if held is not None and held.host_id != record.host_id:
                raise BusyResourceError(
                    f"node name {self._node!r} is held in etcd by an hmcd on host {held.host_id!r} (epoch {held.epoch}, {held.tcp_address or 'no TCP address'}); "
                    f"each node needs its own name (it frees within {self._ttl}s of that hmcd stopping)"
                )
            if held is not None and held.epoch > record.epoch:
                raise BusyResourceError(f"node {self._node!r} is held in etcd by a newer start of hmcd on this host (epoch {held.epoch} > {record.epoch})")
            if held is None or not kvs[0].lease:  # unreadable, or not under a lease: not a live hmcd's; remove it as it is
                log.warning("etcd directory: removing an unreadable or lease-less record at %r", key)
                same = pb.Compare(key=key, target=pb.Compare.MOD, result=pb.Compare.EQUAL, mod_revision=kvs[0].mod_revision)
                await self._client.txn(pb.TxnRequest(compare=[same], success=[pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=key))]), _left(deadline))
                continue
            log.info("etcd directory: taking over node %s from %s (epoch %d, lease %x)", self._node, "its earlier start" if held.epoch < record.epoch else "a lost lease", held.epoch, kvs[0].lease)
            await self._client.revoke(kvs[0].lease, _left(deadline))
        raise UnavailableError(f"node record {key!r} kept changing in etcd while being claimed")

    async def _publish_everything(self, lease: int, deadline: float) -> None:
        for session in self._registry.sessions:
            await self._client.put(self._key("agents", self._node, session.agent_id), session.info.SerializeToString(), _left(deadline), lease)
        for descriptor in self._registry.buffers():
            try:
                await self._put_buffer(descriptor, lease, deadline)
            except BusyResourceError as exc:  # only after a partition longer than the TTL: another node took the name
                log.error("etcd directory: %s; buffer %s is published without its name (found by id only)", exc, descriptor.id)
                nameless = common_pb2.BufferDescriptor()
                nameless.CopyFrom(descriptor)
                nameless.name = ""
                await self._put_buffer(nameless, lease, deadline)

    async def _keep_lease(self) -> None:
        """Renew the lease every TTL/3, counted from the last renewal; after a failure, again at once (every
        `_RETRY_S`), so a blip shorter than about 2/3 of the TTL never loses it. Only etcd saying it expired
        does: then the writer joins again."""
        interval = self._ttl / 3
        while True:
            lease = self._lease
            if not lease:
                await self._joined.wait()
                continue
            await asyncio.sleep(max(self._renewed + interval - time.monotonic(), 0.0))
            left = self._renewed + self._ttl - time.monotonic()
            try:
                ttl = await self._client.keepalive(lease, max(min(interval, left), _RETRY_S))
            except UnavailableError as exc:
                self._error = str(exc)
                await asyncio.sleep(_RETRY_S)
                continue
            except Exception as exc:  # noqa: BLE001 - renewing is this node's membership: it must go on
                log.exception("etcd directory: renewing the lease failed")
                self._error = f"lease renewal failed: {exc!r}"
                await asyncio.sleep(_RETRY_S)
                continue
            if lease != self._lease:
                continue
            if ttl <= 0:
                log.warning("etcd directory: lease %x of node %s expired; joining again", lease, self._node)
                self._lease = 0
                self._joined.clear()
                self._writes.put_nowait(_Write(_nothing))  # wake the writer: it joins
            else:
                self._renewed = time.monotonic()
                if self._watching:
                    self._last_in_sync = self._renewed

    # -- writes: one ordered queue ------------------------------------------------------

    async def publish(self, descriptor: common_pb2.BufferDescriptor, timeout: float) -> None:
        """Queued behind earlier writes; waits for etcd at most the lease's TTL (longer, and this node's keys are gone
        anyway). Whatever fails, nothing of it stays in etcd: its record and claim are taken back (queued)."""
        done = asyncio.get_running_loop().create_future()
        timeout = min(timeout, self._ttl)
        deadline = time.monotonic() + timeout
        self._writes.put_nowait(_Write(lambda lease: self._put_buffer(descriptor, lease, deadline), deadline, done))
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout + 0.5)  # the writer fails it at the deadline, if it gets to it
        except asyncio.TimeoutError:
            self.unpublish(descriptor)
            raise UnavailableError(f"the etcd directory could not record buffer {descriptor.id} in time: {self._error or 'etcd unreachable'}") from None
        except BusyResourceError:
            raise  # the transaction wrote nothing: the name is another buffer's
        except BaseException:
            self.unpublish(descriptor)  # it may have landed although the answer did not
            raise

    def unpublish(self, descriptor: common_pb2.BufferDescriptor) -> None:
        self._queue_delete(descriptor)

    async def _write_forever(self) -> None:
        """Join when not joined, then apply the queued writes in order; a write waits (across a rejoin) until etcd
        has it or its deadline passes; writes without a deadline wait as long as it takes."""
        write: _Write | None = None
        while True:
            if write is not None and write.deadline is not None and time.monotonic() >= write.deadline:
                _fail(write, UnavailableError(f"the etcd directory could not record this within its deadline: {self._error or 'etcd unreachable'}"))
                write = None
            if not self._lease:
                if not await self._try_join():
                    await asyncio.sleep(_RETRY_S)
                    continue
            if write is None:
                write = await self._writes.get()
                continue  # check its deadline and the lease first
            lease = self._lease
            try:
                await write.run(lease)
            except (UnavailableError, ProtocolError) as exc:
                if isinstance(exc, ProtocolError) and "lease not found" not in str(exc):
                    log.error("etcd directory: etcd refused a change of this node's keys: %s", exc)
                    _fail(write, exc)
                    write = None
                    continue
                self._error = str(exc)  # unreachable, or the lease went away meanwhile: again (after joining again)
                await asyncio.sleep(_RETRY_S)
                continue
            except HMCError as exc:
                _fail(write, exc)
            except Exception as exc:  # noqa: BLE001 - one bad write must not stop this node's others
                log.exception("etcd directory: a write failed")
                _fail(write, HMCError(f"the etcd directory failed to record this: {exc!r}"))
            else:
                if write.done is not None and not write.done.done():
                    write.done.set_result(None)
            write = None

    async def _try_join(self) -> bool:
        try:
            await self._join(min(self._config.timeout_s, self._ttl))  # queued writes wait meanwhile: not longer than this
        except UnavailableError as exc:
            self._error = str(exc)
            return False
        except Exception as exc:  # noqa: BLE001 - BusyResourceError, ProtocolError, a bug: keep trying, say why
            self._error = str(exc)
            log.error("etcd directory: cannot join: %s", exc)
            await asyncio.sleep(self._ttl / 3)
            return False
        return True

    async def _put_buffer(self, descriptor: common_pb2.BufferDescriptor, lease: int, deadline: float) -> None:
        """The buffer's record, and its name claimed in the same transaction."""
        put = pb.RequestOp(request_put=pb.PutRequest(key=self._key("buffers", self._node, descriptor.id), value=descriptor.SerializeToString(), lease=lease))
        if not descriptor.name:
            await self._client.txn(pb.TxnRequest(success=[put]), _left(deadline))
            return
        name_key = self._key("names", descriptor.name)
        claim = daemon_pb2.NameClaim(node=self._node, buffer_id=descriptor.id, epoch=descriptor.registry_epoch).SerializeToString()
        claim_op = pb.RequestOp(request_put=pb.PutRequest(key=name_key, value=claim, lease=lease))
        reply = await self._client.txn(pb.TxnRequest(compare=[_absent(name_key)], success=[claim_op, put], failure=[pb.RequestOp(request_range=pb.RangeRequest(key=name_key))]), _left(deadline))
        if reply.succeeded:
            return
        kvs = reply.responses[0].response_range.kvs
        held = parse(daemon_pb2.NameClaim, kvs[0].value) if kvs else None
        if kvs and held is None:
            raise BusyResourceError(f"buffer name {descriptor.name!r} is held in etcd by a value HMC cannot read (at {name_key!r})")
        if held is not None and held.node == self._node and held.buffer_id == descriptor.id:
            same = pb.Compare(key=name_key, target=pb.Compare.VALUE, result=pb.Compare.EQUAL, value=kvs[0].value)
            if (await self._client.txn(pb.TxnRequest(compare=[same], success=[claim_op, put]), _left(deadline))).succeeded:
                return
        if held is None:
            raise UnavailableError(f"buffer name {descriptor.name!r} changed hands in etcd while being claimed; try again")
        raise BusyResourceError(f"buffer name {descriptor.name!r} is held cluster-wide by buffer {held.buffer_id!r} on node {held.node!r} (etcd)")

    def _queue_delete(self, descriptor: common_pb2.BufferDescriptor) -> None:
        buffer_key = self._key("buffers", self._node, descriptor.id)

        async def delete(lease: int) -> None:
            # One transaction: the buffer and, where it is still ours (it may have moved on since), its name go together.
            # Two let a peer see the buffer gone while its name was still held, and refuse the name (BUSY) in between.
            ops = [pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=buffer_key))]
            if not descriptor.name:
                await self._client.txn(pb.TxnRequest(success=ops), self._config.timeout_s)
                return
            name_key = self._key("names", descriptor.name)
            claim = daemon_pb2.NameClaim(node=self._node, buffer_id=descriptor.id, epoch=descriptor.registry_epoch).SerializeToString()
            same = pb.Compare(key=name_key, target=pb.Compare.VALUE, result=pb.Compare.EQUAL, value=claim)
            both = [*ops, pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=name_key))]
            await self._client.txn(pb.TxnRequest(compare=[same], success=both, failure=ops), self._config.timeout_s)

        self._writes.put_nowait(_Write(delete))

    def _follow_local(self, event: daemon_pb2.Event, relayed: bool) -> None:
        """This node's own changes, as hmcd publishes them, into the write queue."""
        if relayed or self._closed:
            return
        if event.kind == daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN:
            self._queue_delete(event.buffer)
        elif event.kind in (daemon_pb2.EVENT_KIND_AGENT_UP, daemon_pb2.EVENT_KIND_AGENT_DOWN):
            key = self._key("agents", self._node, event.agent_id)
            if event.kind == daemon_pb2.EVENT_KIND_AGENT_UP:
                value = event.agent.SerializeToString()
                self._writes.put_nowait(_Write(lambda lease: self._client.put(key, value, self._config.timeout_s, lease)))
            else:
                self._writes.put_nowait(_Write(lambda lease: self._client.delete(key, self._config.timeout_s)))

    # -- the watch and the cache ----------------------------------------------------------

    async def _watch_forever(self) -> None:
        while True:
            try:
                snapshot = await self._client.get_prefix(self._prefix, self._config.timeout_s)
                self._view.apply_snapshot(snapshot.kvs)
                async with self._client.watch_prefix(self._prefix, snapshot.header.revision + 1, self._config.timeout_s) as responses:
                    self._watching = True
                    if self._lease:
                        self._last_in_sync = time.monotonic()
                    async for response in responses:
                        for event in response.events:
                            self._view.apply(event.kv.key, event.kv if event.type == pb.Event.PUT else None)
            except (UnavailableError, ProtocolError) as exc:
                if self._watching:
                    log.warning("etcd directory: watch lost, serving the cache read-only: %s", exc)
                self._error = str(exc)
            except Exception as exc:  # noqa: BLE001 - the watch is this node's view of the cluster: it must go on
                log.exception("etcd directory: the watch failed; starting it again")
                self._error = f"watch failed: {exc!r}"
            finally:
                self._watching = False
            await asyncio.sleep(_RETRY_S)

    def _node_changed(self, node: str, record: daemon_pb2.DirectoryNode | None) -> None:
        peer = self._peers.get(node)
        if peer is not None and (record is None or peer.address != record.tcp_address or peer.epoch != record.epoch):
            self._retire(node)

    def _retire(self, node: str) -> None:
        """Close the channel to `node`'s old hmcd once transfers forwarded through it had time to end."""
        peer = self._peers.pop(node, None)
        if peer is None or self._closed:
            return

        async def close_later() -> None:
            try:
                await asyncio.sleep(2 * self._config.timeout_s)
            finally:
                await peer.channel.close()

        task = asyncio.get_running_loop().create_task(close_later(), name=f"hmc-etcd-retire:{node}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    # -- what the directory answers -------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._watching and bool(self._lease) and time.monotonic() - self._renewed < self._ttl

    def age(self) -> float:
        """Seconds since the cache was last known to be in sync with etcd (0 while it is)."""
        return 0.0 if self.connected else time.monotonic() - self._last_in_sync

    def _peer(self, node: str) -> Peer | None:
        record = self._view.nodes.get(node)
        if record is None or not record.tcp_address:
            return None
        peer = self._peers.get(node)
        if peer is None:
            peer = self._peers[node] = Peer.open(record.tcp_address, self._config, node=node, up=True, epoch=record.epoch)
        return peer

    @property
    def peers(self) -> list[Peer]:
        return [peer for node in self._view.nodes if (peer := self._peer(node)) is not None]

    async def lookup(self, ref: daemon_pb2.BufferRef, timeout: float) -> Lookup:
        descriptor = self._view.find(ref)
        if isinstance(descriptor, str):
            return None, [descriptor]
        if descriptor is not None:
            node = descriptor.owner.node
            peer = self._peer(node)
            if peer is not None:
                return (descriptor, peer), []
            return None, [f"node {node}: its hmcd has no TCP listener (set listen) to forward to"]
        if not self.connected:
            return None, [f"etcd: this node's view is {self.age():.1f}s old ({self._error or 'not in sync'})"]
        return None, []

    async def list_buffers(self, timeout: float) -> tuple[list[common_pb2.BufferDescriptor], float]:
        return self._view.all_buffers(), self.age()

    def statuses(self) -> list[daemon_pb2.PeerStatus]:
        return [daemon_pb2.PeerStatus(address=record.tcp_address, node=node, up=True) for node, record in sorted(self._view.nodes.items())]

    def status(self) -> daemon_pb2.DirectoryStatus:
        now = time.monotonic()
        age = self.age()
        counts = {node: len(held) for node, held in self._view.buffers.items()}
        nodes = []
        for node, record in sorted(self._view.nodes.items()):
            view = daemon_pb2.DirectoryNode()
            view.CopyFrom(record)
            view.up, view.age_s, view.buffers = True, age, counts.get(node, 0)
            nodes.append(view)
        return daemon_pb2.DirectoryStatus(
            kind=self.kind,
            endpoints=list(self._config.etcd_endpoints),
            prefix=self._config.etcd_prefix,
            connected=self.connected,
            partitioned_s=age,
            lease_id=self._lease,
            lease_ttl_s=self._ttl,
            lease_renewed_s=now - self._renewed if self._lease else 0.0,
            nodes=nodes,
            error="" if self.connected else self._error,
        )


def _absent(key: bytes) -> pb.Compare:
    return pb.Compare(key=key, target=pb.Compare.VERSION, result=pb.Compare.EQUAL, version=0)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise UnavailableError("etcd did not answer within the deadline")
    return left


async def _nothing(lease: int) -> None:
    """A write that writes nothing: wakes the writer."""


def _fail(write: _Write, error: HMCError) -> None:
    if write.done is not None and not write.done.done():
        write.done.set_exception(error)
