"""hmcd's Prometheus metrics, in a `CollectorRegistry` that belongs to one daemon.

Names (all prefixed `hmc_`):

    hmc_agents                    agents attached now
    hmc_buffers                   ConnBuffers registered now (local)
    hmc_peers_up                  static peers answering health checks
    hmc_transfers_active{state}   third-party transfers pending or running now
    hmc_transfers_total{state}    third-party transfers that ended, by final state
    hmc_transfer_bytes_total      bytes moved by third-party transfers that ended DONE
    hmc_events_total{kind}        events published
    hmc_rpc_total{method,code}    gRPC calls served, by method and status

Concurrency: prometheus-client's metrics are thread-safe; the daemon's loop
updates them and the optional HTTP exporter thread ("hmc-metrics-http") reads them.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, start_http_server

from hmc.v1 import common_pb2, daemon_pb2

__all__ = ["DaemonMetrics"]


def _state_name(state: int) -> str:
    return common_pb2.TransferState.Name(state).removeprefix("TRANSFER_STATE_").lower()


class DaemonMetrics:
    """The metrics of one hmcd (never the process-global registry)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.agents = Gauge("hmc_agents", "Agents attached to this hmcd", registry=r)
        self.buffers = Gauge("hmc_buffers", "ConnBuffers registered with this hmcd", registry=r)
        self.peers_up = Gauge("hmc_peers_up", "Static peers answering health checks", registry=r)
        self.transfers = Gauge("hmc_transfers_active", "Third-party transfers pending or running now, by state", ["state"], registry=r)
        self.transfers_total = Counter("hmc_transfers", "Third-party transfers that ended, by final state", ["state"], registry=r)
        self.transfer_bytes = Counter("hmc_transfer_bytes", "Bytes moved by third-party transfers that completed", registry=r)
        self.events = Counter("hmc_events", "Events published, by kind", ["kind"], registry=r)
        self.rpcs = Counter("hmc_rpc", "gRPC calls served, by method and status code", ["method", "code"], registry=r)
        for state in ("pending", "running"):
            self.transfers.labels(state=state).set(0)
        self._http: WSGIServer | None = None
        self._http_thread: threading.Thread | None = None

    def text(self) -> str:
        """The Prometheus exposition text."""
        return generate_latest(self.registry).decode()

    def observe_rpc(self, method: str, code: str) -> None:
        self.rpcs.labels(method=method, code=code).inc()

    def observe_event(self, event: daemon_pb2.Event, relayed: bool = False) -> None:
        kind = daemon_pb2.EventKind.Name(event.kind).removeprefix("EVENT_KIND_").lower()
        self.events.labels(kind=kind).inc()

    def transfer_moved(self, old_state: int | None, new_state: int) -> None:
        """A transfer changed state (old_state None: it was just created)."""
        if old_state is not None and old_state in (common_pb2.TRANSFER_STATE_PENDING, common_pb2.TRANSFER_STATE_RUNNING):
            self.transfers.labels(state=_state_name(old_state)).dec()
        if new_state in (common_pb2.TRANSFER_STATE_PENDING, common_pb2.TRANSFER_STATE_RUNNING):
            self.transfers.labels(state=_state_name(new_state)).inc()
        else:
            self.transfers_total.labels(state=_state_name(new_state)).inc()

    def serve_http(self, host: str, port: int) -> int:
        """Also expose /metrics over HTTP (thread "hmc-metrics-http"); returns the bound port."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        thread.name = "hmc-metrics-http"
        self._http, self._http_thread = server, thread
        return int(server.server_port)

    def close(self) -> None:
        """Stop the HTTP exporter; idempotent."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._http_thread is not None:
            self._http_thread.join(timeout=5)
            self._http_thread = None
