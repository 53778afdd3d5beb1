"""The etcd directory's view of the other nodes: their keys under the prefix, as the watch delivers them.

`apply(key, kv)` takes one change (kv None: deleted), `apply_snapshot(kvs)` a full listing (diffed against
what it holds, so that nothing that changed while the watch was broken is missed). It keeps the nodes'
records, their buffers by (node, id) (ids are each owner's to choose: never trusted across nodes) and the
name claims, and turns changes into events: PEER_UP / PEER_DOWN (this node's own events about a peer) and
relayed BUFFER_ADDED / BUFFER_WITHDRAWN, AGENT_UP / AGENT_DOWN. A node record with a new epoch drops every
buffer of the older one. A key of another shape, or a value that does not parse or does not match its key,
is foreign: ignored (logged), and whatever the key held before is dropped, never served stale.

Concurrency: owned by hmcd's event loop (the directory's watch task); nothing here awaits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from hmc.control._events import EventBus
from hmc.control._metrics import DaemonMetrics
from hmc.v1 import common_pb2, daemon_pb2
from hmc.v1 import etcd_pb2 as pb

__all__ = ["ClusterView", "parse"]

log = logging.getLogger("hmc.hmcd")

_Message = TypeVar("_Message", bound=Message)

_SHAPES = {"nodes": 1, "buffers": 2, "agents": 2}
"""Key kind -> how many parts follow it (names: one or more, a name may hold '/')."""


class ClusterView:
    """The other nodes as etcd holds them (never this node's own keys)."""

    def __init__(self, prefix: bytes, node: str, events: EventBus, metrics: DaemonMetrics, node_changed: Callable[[str, daemon_pb2.DirectoryNode | None], None]) -> None:
        """`node_changed(node, record)`: a node's record changed or went (None)."""
        self._prefix = prefix
        self._node = node
        self._events = events
        self._metrics = metrics
        self._node_changed = node_changed
        self._kvs: dict[bytes, pb.KeyValue] = {}
        self.nodes: dict[str, daemon_pb2.DirectoryNode] = {}
        self.buffers: dict[str, dict[str, common_pb2.BufferDescriptor]] = {}
        """node -> buffer id -> descriptor"""
        self.names: dict[str, tuple[str, str]] = {}
        """name -> (node, buffer id), from the claims"""

    def find(self, ref: daemon_pb2.BufferRef) -> common_pb2.BufferDescriptor | str | None:
        """The descriptor `ref` names, None when none, or why it cannot say (an id several nodes use)."""
        if ref.WhichOneof("ref") == "id":
            found = [held[ref.id] for held in self.buffers.values() if ref.id in held]
            if len(found) > 1:
                return f"buffer id {ref.id!r} is claimed by several nodes ({', '.join(d.owner.node for d in found)}): look it up by name"
            return found[0] if found else None
        node, buffer_id = self.names.get(ref.name, ("", ""))
        return self.buffers.get(node, {}).get(buffer_id)

    def all_buffers(self) -> list[common_pb2.BufferDescriptor]:
        return [descriptor for held in self.buffers.values() for descriptor in held.values()]

    def apply_snapshot(self, kvs: list[pb.KeyValue]) -> None:
        """Bring the cache to a full listing: what vanished is deleted, what is new or changed is put."""
        current = {kv.key: kv for kv in kvs}
        for key in [key for key in self._kvs if key not in current]:
            self.apply(key, None)
        # node records first, so that buffers are checked against their node's epoch
        for kv in sorted(current.values(), key=lambda kv: not kv.key.startswith(self._prefix + b"nodes/")):
            old = self._kvs.get(kv.key)
            if old is None or old.mod_revision != kv.mod_revision:
                self.apply(kv.key, kv)

    def apply(self, key: bytes, kv: pb.KeyValue | None) -> None:
        """One key changed (kv None: deleted): the cache and the events. A key of another shape, or a value that
        does not parse or does not match its key, is foreign: it is ignored (logged), and whatever the key held
        before is dropped (never served stale)."""
        parts = key[len(self._prefix) :].decode(errors="replace").split("/")
        kind, fields = parts[0], parts[1:]
        if kind == "names":
            shape_ok = len(fields) >= 1 and all(fields)  # a name may hold '/'
        else:
            shape_ok = kind in _SHAPES and len(fields) == _SHAPES[kind] and all(fields)
        if not shape_ok:
            if kv is not None:
                log.warning("etcd directory: ignoring a foreign key %r under the prefix", key)
            return
        if kind != "names" and fields[0] == self._node:
            return
        old = self._kvs.pop(key, None)
        if kv is not None:
            self._kvs[key] = kv
        if not self._apply_parsed(kind, fields, old, kv):
            log.warning("etcd directory: ignoring key %r: its value is not what HMC keeps there", key)
            self._kvs.pop(key, None)
            if old is not None:
                self._apply_parsed(kind, fields, old, None)  # what it held before is gone

    def _apply_parsed(self, kind: str, fields: list[str], old: pb.KeyValue | None, kv: pb.KeyValue | None) -> bool:
        """False when `kv`'s value does not parse (or contradicts its key)."""
        if kind == "names":
            return self._apply_name("/".join(fields), kv)
        if kind == "nodes":
            return self._apply_node(fields[0], kv)
        if kind == "buffers":
            return self._apply_buffer(fields[0], fields[1], kv)
        return self._apply_agent(fields[0], old, kv)

    def _apply_name(self, name: str, kv: pb.KeyValue | None) -> bool:
        claim = parse(daemon_pb2.NameClaim, kv.value) if kv is not None else None
        if kv is None or claim is None or claim.node == self._node or not claim.node:
            self.names.pop(name, None)
            return kv is None or claim is not None
        self.names[name] = (claim.node, claim.buffer_id)
        return True

    def _apply_node(self, node: str, kv: pb.KeyValue | None) -> bool:
        record = parse(daemon_pb2.DirectoryNode, kv.value) if kv is not None else None
        if kv is not None and (record is None or record.node != node):
            return False
        old = self.nodes.pop(node, None)
        if record is None:
            self._node_changed(node, None)
            for descriptor in list(self.buffers.get(node, {}).values()):
                self._drop_buffer(descriptor)
            if old is not None:
                log.info("etcd directory: node %s left (epoch %d)", node, old.epoch)
                self._events.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_PEER_DOWN, peer=old.tcp_address or node))
            self._metrics.peers_up.set(len(self.nodes))
            return True
        self.nodes[node] = record
        if old is not None and old.epoch != record.epoch:  # a new start: nothing of the old epoch may be served
            for descriptor in [d for d in self.buffers.get(node, {}).values() if d.registry_epoch < record.epoch]:
                self._drop_buffer(descriptor)
        self._node_changed(node, record)
        if old is None or old.epoch != record.epoch:
            log.info("etcd directory: node %s is up (epoch %d, %s)", node, record.epoch, record.tcp_address or "no TCP address")
            self._events.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_PEER_UP, peer=record.tcp_address or node))
        self._metrics.peers_up.set(len(self.nodes))
        return True

    def _apply_buffer(self, node: str, buffer_id: str, kv: pb.KeyValue | None) -> bool:
        descriptor = parse(common_pb2.BufferDescriptor, kv.value) if kv is not None else None
        if kv is not None and (descriptor is None or descriptor.owner.node != node or descriptor.id != buffer_id):
            return False
        if descriptor is None:
            cached = self.buffers.get(node, {}).get(buffer_id)
            if cached is not None:
                self._drop_buffer(cached)
            return True
        record = self.nodes.get(node)
        if record is not None and descriptor.registry_epoch < record.epoch:
            return True  # of an older epoch than its node's record: never served
        self.buffers.setdefault(node, {})[buffer_id] = descriptor
        self._events.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_BUFFER_ADDED, node=node, buffer=descriptor, agent_id=descriptor.owner.id), relayed=True)
        return True

    def _drop_buffer(self, descriptor: common_pb2.BufferDescriptor) -> None:
        node = descriptor.owner.node
        held = self.buffers.get(node, {})
        if held.get(descriptor.id) is descriptor:
            del held[descriptor.id]
            if not held:
                del self.buffers[node]
            self._kvs.pop(self._prefix + f"buffers/{node}/{descriptor.id}".encode(), None)
            self._events.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN, node=node, buffer=descriptor, agent_id=descriptor.owner.id), relayed=True)

    def _apply_agent(self, node: str, old: pb.KeyValue | None, kv: pb.KeyValue | None) -> bool:
        agent = parse(common_pb2.AgentInfo, kv.value) if kv is not None else None
        if kv is not None and agent is None:
            return False
        if agent is None:
            gone = parse(common_pb2.AgentInfo, old.value) if old is not None else None
            if gone is not None:
                self._events.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_AGENT_DOWN, node=node, agent_id=gone.id, agent=gone), relayed=True)
            return True
        self._events.publish(daemon_pb2.Event(kind=daemon_pb2.EVENT_KIND_AGENT_UP, node=node, agent_id=agent.id, agent=agent), relayed=True)
        return True


def parse(message: type[_Message], value: bytes) -> _Message | None:
    """`value` as a `message`, or None when it is not one (a foreign or corrupt value under our prefix)."""
    try:
        return message.FromString(value)
    except DecodeError:
        return None
