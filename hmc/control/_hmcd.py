"""hmcd, the per-node daemon: the parts wired together and served over gRPC.

    Daemon(config)
      inventory    host, devices (vendor override applied), RDMA NICs, transports
      events       EventBus: Watch subscribers, sequence numbers
      registry     ConnBuffers of attached agents; names leased across restarts (state file beside the socket)
      directory    static peers, or etcd: where other nodes and their buffers are found
      transfers    third-party transfers executed by agents on instruction
      metrics      a CollectorRegistry of this daemon only

Two grpc.aio servers share the servicers: one behind `unix:<config.socket>`
and, when `config.listen` is set, one on TCP with the token interceptor (and TLS
when `config.tls_cert`/`tls_key` are set). Port 0 picks a free port;
`tcp_address` reports it. The unix socket is hmcd's `UnixDoor` (see `_auth`): a
private 0700 directory, a 0600 socket, and peer credentials checked per
connection (hmcd's own uid and root are admitted), spliced to the gRPC server's
socket beside it (`<socket>.grpc`).

Concurrency: everything runs on one asyncio loop (uvloop when importable, see
`_hmcd_main`), the loop that called `start()`. The only other thread is the
optional metrics HTTP exporter ("hmc-metrics-http"), which only reads metrics.
The door's splices are asyncio protocols on the same loop.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import resource
import time

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2

from hmc.config import Config
from hmc.control._auth import MAX_MESSAGE_BYTES, TokenInterceptor, UnixDoor, prepare_socket_path, served_path, server_credentials
from hmc.control._directory import Peer, open_directory
from hmc.control._errors import ErrorBoundary
from hmc.control._events import EventBus
from hmc.control._inventory import Inventory
from hmc.control._leases import state_path_for
from hmc.control._metrics import DaemonMetrics
from hmc.control._registry import Registry, describe_ref
from hmc.control._services import PROTOCOL_VERSION, add_services
from hmc.control._measurements import Measurements
from hmc.control._transfers import TransferTable
from hmc.errors import ArgumentError, BufferWithdrawnError, ClosedResourceError, UnavailableError, UnknownBufferError
from hmc.v1 import common_pb2, daemon_pb2

__all__ = ["Daemon"]

log = logging.getLogger("hmc.hmcd")

SERVER_OPTIONS = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
)

_TCP_HANDSHAKE_MS = 10_000
"""A TCP connection that has not sent its HTTP/2 settings (and finished TLS) by then is closed (gRPC's default: 120 s)."""
_TCP_CONNECTIONS_MAX = 1 << 16


def tcp_options() -> tuple[tuple[str, int], ...]:
    """The TCP server's bounds on its connections: at most half the descriptors hmcd may open (the rest stay for the
    unix socket, its agents and peers; gRPC closes a connection over the bound at once), each given
    `_TCP_HANDSHAKE_MS` to start speaking."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = _TCP_CONNECTIONS_MAX if soft == resource.RLIM_INFINITY else max(min(soft // 2, _TCP_CONNECTIONS_MAX), 16)
    return (("grpc.max_allowed_incoming_connections", limit), ("grpc.server_handshake_timeout_ms", _TCP_HANDSHAKE_MS))


def _version() -> str:
    try:
        return importlib.metadata.version("hmc")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class Daemon:
    """One hmcd. `await start()`, then `await wait_stopped()`; `await stop()` from anywhere on its loop."""

    def __init__(self, config: Config, *, inventory: Inventory | None = None, lease_grace_s: float = 30.0) -> None:
        """`lease_grace_s`: how long a buffer name waits for its holder to attach again (after a restart or a broken stream)."""
        self.config = config
        self.inventory = inventory or Inventory.collect(config)
        self.metrics = DaemonMetrics()
        self.events = EventBus(config.node)
        self.events.add_listener(self._observe_event)
        self.registry = Registry(config.node, self.events, state_path=state_path_for(config.socket), grace_s=lease_grace_s, host_id=self.inventory.host_id)
        self.directory = open_directory(config, self.events, self.metrics, self.registry, self.node_record)
        self.measurements = Measurements(config.policy)
        self.transfers = TransferTable(config, self.registry, self.resolve, self.metrics, self.measurements.choose)
        self.tcp_address = ""
        self.metrics_port = 0
        self.health = health.aio.HealthServicer()
        """grpc.health.v1 on every server: NOT_SERVING until started, SERVING while up, NOT_SERVING from stop() on."""
        self._servers: list[grpc.aio.Server] = []
        self._started = time.monotonic()
        self._started_at = time.time()
        self._stopped: bool = False
        self._owns_socket = False  # True once this daemon bound the socket files (only then may it remove them)
        self._door: UnixDoor | None = None
        self._tls = False

    @property
    def unix_address(self) -> str:
        return f"unix:{self.config.socket}"

    # -- life cycle -------------------------------------------------------------------

    async def start(self, metrics_port: int | None = None) -> None:
        """Bind the unix socket (and TCP when configured) and start serving."""
        if self._servers or self._stopped:
            raise ClosedResourceError("hmcd already started")
        try:
            await self._start(metrics_port)
        except BaseException:
            await self.stop(grace=0)
            raise

    async def _start(self, metrics_port: int | None) -> None:
        boundary = ErrorBoundary(self.metrics.observe_rpc)
        await self.health.set(health.OVERALL_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)  # until every part is up
        prepare_socket_path(self.config.socket)
        self.registry.restore()  # the state file lives in the socket's directory, checked just above
        unix = grpc.aio.server(interceptors=[boundary], options=SERVER_OPTIONS)
        add_services(self, unix)
        served = served_path(self.config.socket)
        old_umask = os.umask(0o177)  # the socket file is born 0600 (no window before the chmod)
        try:
            if not unix.add_insecure_port(f"unix:{served}"):
                raise UnavailableError(f"cannot listen on unix:{served}")
            await unix.start()
        finally:
            os.umask(old_umask)
        self._servers.append(unix)
        self._owns_socket = True
        os.chmod(served, 0o600)
        self._door = UnixDoor(self.config.socket, served)
        await self._door.start()
        if self.config.listen:
            await self._start_tcp(boundary)
        if metrics_port is not None and not self.config.metrics:
            log.warning("metrics are disabled (metrics = false); not serving them over HTTP")
        elif metrics_port is not None:
            host = self.config.listen.rsplit(":", 1)[0] if self.config.listen else "127.0.0.1"
            self.metrics_port = self.metrics.serve_http(host.strip("[]") or "0.0.0.0", metrics_port)
        await self.directory.start()
        await self.health.set(health.OVERALL_HEALTH, health_pb2.HealthCheckResponse.SERVING)
        self._started = time.monotonic()
        log.info(
            "hmcd %s serving node %s on %s%s%s",
            _version(),
            self.config.node,
            self.unix_address,
            f" and tcp {self.tcp_address}{' (TLS)' if self._tls else ''}" if self.tcp_address else "",
            f"; metrics on http port {self.metrics_port}" if self.metrics_port else "",
        )

    async def _start_tcp(self, boundary: ErrorBoundary) -> None:
        host, sep, port = self.config.listen.rpartition(":")
        if not sep or not port.isdigit():
            raise ArgumentError(f"listen address {self.config.listen!r} must look like HOST:PORT")
        credentials = server_credentials(self.config)
        interceptors: list[grpc.aio.ServerInterceptor] = [boundary]
        if self.config.token:
            interceptors.insert(0, TokenInterceptor(self.config.token))
            if credentials is None:
                log.warning("hmcd listens on TCP %s with a token but without TLS: the token crosses the network in clear (set tls_cert and tls_key)", self.config.listen)
        else:
            log.warning("hmcd listens on TCP %s without a token: anyone who can reach it may use it", self.config.listen)
        tcp = grpc.aio.server(interceptors=interceptors, options=(*SERVER_OPTIONS, *tcp_options()))
        add_services(self, tcp)
        try:
            bound = tcp.add_insecure_port(self.config.listen) if credentials is None else tcp.add_secure_port(self.config.listen, credentials)
        except RuntimeError as exc:
            raise UnavailableError(f"cannot listen on {self.config.listen}: {exc}") from exc
        if bound == 0:
            raise UnavailableError(f"cannot listen on {self.config.listen} (address in use or not local)")
        await tcp.start()
        self._servers.append(tcp)
        self.tcp_address = f"{host}:{bound}"
        self._tls = credentials is not None

    async def stop(self, grace: float = 0.5) -> None:
        """Stop serving: end watches, fail pending transfers (their executors told to stop first, and given `grace`
        seconds to confirm), give unary calls `grace` seconds, then cancel what remains (agents' streams, which
        never end on their own); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()  # NOT_SERVING for good, while calls drain
        self.events.close()
        await self.transfers.close(grace)  # executors get `grace` to confirm they stopped
        for server in self._servers:
            await server.stop(grace)
        if self._door is not None:
            await self._door.close()
        await self.directory.close()
        self.registry.close()
        self.metrics.close()
        if self._owns_socket:
            for path in (self.config.socket, served_path(self.config.socket)):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        log.info("hmcd stopped")

    async def wait_stopped(self) -> None:
        for server in self._servers:
            await server.wait_for_termination()

    # -- shared by the services ----------------------------------------------------------

    async def resolve(self, ref: daemon_pb2.BufferRef, local_only: bool, timeout: float) -> tuple[common_pb2.BufferDescriptor, Peer | None]:
        """The buffer `ref` names: here first, then at the static peers unless `local_only`.

        Not found, and a peer that might hold it did not answer (down, partitioned,
        refusing our token): UnavailableError naming those peers, never "unknown".
        """
        what = describe_ref(ref)
        local = self.registry.find(ref)
        if local is not None:
            return local, None
        if local_only:
            self.registry.require(ref)
        found, unanswered = await self.directory.lookup(ref, timeout)
        if found is not None:
            return found
        if not unanswered and not self.directory.peers:
            self.registry.require(ref)  # nobody else to ask: the local answer, as precise as it gets
        if self.registry.was_withdrawn(ref):
            raise BufferWithdrawnError(f"buffer {what} was withdrawn from node {self.config.node}")
        if unanswered:
            raise UnavailableError(f"buffer {what} is not on node {self.config.node}, and peers that may hold it did not answer: {'; '.join(unanswered)}")
        asked = ", ".join(peer.node or peer.address for peer in self.directory.peers)
        raise UnknownBufferError(f"no buffer with {what} on node {self.config.node} or its peers ({asked})")

    def node_info(self) -> daemon_pb2.NodeInfo:
        inv = self.inventory
        return daemon_pb2.NodeInfo(
            node=inv.node,
            host_id=inv.host_id,
            hostname=inv.hostname,
            version=_version(),
            protocol_version=PROTOCOL_VERSION,
            devices=inv.devices,
            rdma_devices=inv.rdma_devices,
            transports=inv.transports,
            absent_backends=inv.absent_backends,
            unix_address=self.unix_address,
            tcp_address=self.tcp_address,
            peers=self.directory.statuses(),
            agents=len(self.registry.sessions),
            buffers=len(self.registry),
            uptime_s=time.monotonic() - self._started,
            registry_epoch=self.registry.epoch,
            directory=self.directory.status(),
        )

    def node_record(self) -> daemon_pb2.DirectoryNode:
        """What this node publishes about itself in a directory."""
        return daemon_pb2.DirectoryNode(
            node=self.config.node, host_id=self.inventory.host_id, epoch=self.registry.epoch, tcp_address=self.tcp_address, version=_version(), started=self._started_at
        )

    def _observe_event(self, event: daemon_pb2.Event, relayed: bool) -> None:
        self.metrics.observe_event(event, relayed)
        if not relayed:
            self.metrics.agents.set(len(self.registry.sessions))
            self.metrics.buffers.set(len(self.registry))
