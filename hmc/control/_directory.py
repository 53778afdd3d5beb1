"""The directory: where hmcd finds the other nodes and their ConnBuffers (DESIGN.md: "directory").

Two implementations behind one interface, chosen by `Config.directory`:

- `static` (`_static_directory`): peer hmcd at fixed TCP addresses, asked at lookup
  time; the single-node default;
- `etcd` (`_etcd_directory`): every hmcd keeps its node record, agents and buffers in
  etcd under one lease with its registry epoch, and watches everyone else's.

Both pass one conformance suite (tests/test_directory_conformance.py). A `Peer` is
another node's hmcd as a gRPC channel: lookups may ask it, and transfers whose source
it owns are forwarded to it.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2_grpc

from hmc.config import Config
from hmc.control._auth import CHANNEL_OPTIONS, bearer_metadata, open_aio_channel
from hmc.control._errors import translate_rpc_error
from hmc.control._events import EventBus
from hmc.control._metrics import DaemonMetrics
from hmc.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

__all__ = ["Directory", "Lookup", "Peer", "open_directory"]


PEER_CALL_S = 5.0
"""Longest a lookup or listing waits for one peer hmcd."""


@dataclasses.dataclass(eq=False)
class Peer:
    """Another node's hmcd and what this node last learned about it."""

    address: str
    channel: grpc.aio.Channel
    metadata: tuple[tuple[str, str], ...] = ()
    node: str = ""
    up: bool | None = None
    is_self: bool = False
    error: str = ""
    epoch: int = 0

    def __post_init__(self) -> None:
        self.nodes = daemon_pb2_grpc.NodeServiceStub(self.channel)
        self.registry = daemon_pb2_grpc.RegistryServiceStub(self.channel)
        self.transfers = daemon_pb2_grpc.TransferServiceStub(self.channel)
        self.events = daemon_pb2_grpc.EventServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    @classmethod
    def open(cls, address: str, config: Config, **fields: object) -> Peer:
        return cls(address, open_aio_channel(address, config, CHANNEL_OPTIONS), bearer_metadata(config.token), **fields)  # type: ignore[arg-type]

    def status(self) -> daemon_pb2.PeerStatus:
        return daemon_pb2.PeerStatus(address=self.address, node=self.node, up=bool(self.up), error=self.error)

    # -- forwarded transfers: the same calls whatever directory found the peer ----------

    async def submit(self, request: daemon_pb2.SubmitTransferRequest, timeout: float) -> daemon_pb2.TransferStatus:
        return await self._call(self.transfers.Submit, request, timeout)

    async def wait(self, ref: daemon_pb2.TransferRef, timeout: float) -> daemon_pb2.TransferStatus:
        return await self._call(self.transfers.Wait, ref, timeout)

    async def cancel(self, ref: daemon_pb2.TransferRef, timeout: float) -> daemon_pb2.TransferStatus:
        return await self._call(self.transfers.Cancel, ref, timeout)

    async def _call(self, method: grpc.aio.UnaryUnaryMultiCallable, request: object, timeout: float) -> daemon_pb2.TransferStatus:
        try:
            return await method(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, self.address, "peer hmcd") from exc


Lookup = tuple[tuple[common_pb2.BufferDescriptor, Peer] | None, list[str]]
"""A directory's answer: (descriptor, the peer that has it) or None, and the peers that could not answer ("who: why")."""


class Directory(abc.ABC):
    """Where the other nodes and their ConnBuffers are found. Owned by hmcd's event loop."""

    kind: ClassVar[str]

    @property
    @abc.abstractmethod
    def peers(self) -> list[Peer]:
        """The other nodes' daemons that may hold buffers (never this node)."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Join: called once hmcd serves locally (its TCP address known)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Leave and stop every task; idempotent."""

    @abc.abstractmethod
    async def lookup(self, ref: daemon_pb2.BufferRef, timeout: float) -> Lookup:
        """Another node's buffer `ref` names (see `Lookup`)."""

    @abc.abstractmethod
    async def list_buffers(self, timeout: float) -> tuple[list[common_pb2.BufferDescriptor], float]:
        """Every other node's buffers, and the age of that view in seconds (0: live)."""

    async def publish(self, descriptor: common_pb2.BufferDescriptor, timeout: float) -> None:
        """Before a local registration is accepted: make it known (and its name unique) cluster-wide.

        BusyResourceError when another node holds the name; UnavailableError when the
        directory cannot say. The static directory keeps nothing: names are unique per node.
        """

    def unpublish(self, descriptor: common_pb2.BufferDescriptor) -> None:
        """Undo `publish` (queued, never blocking) for a registration that did not happen after all."""

    @abc.abstractmethod
    def status(self) -> daemon_pb2.DirectoryStatus:
        """The directory's view for `hmc status`: nodes, epochs, lease age."""

    def statuses(self) -> list[daemon_pb2.PeerStatus]:
        return [peer.status() for peer in self.peers]


def open_directory(config: Config, events: EventBus, metrics: DaemonMetrics, registry: object, node_record: object) -> Directory:
    """The directory `config.directory` names."""
    if config.directory == "etcd":
        from hmc.control._etcd_directory import EtcdDirectory

        return EtcdDirectory(config, events, metrics, registry, node_record)  # type: ignore[arg-type]
    from hmc.control._static_directory import StaticDirectory

    return StaticDirectory(config, events, metrics)
