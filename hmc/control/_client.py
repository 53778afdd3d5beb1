"""`hmc.Client`: a synchronous client of hmcd, for users, schedulers and the CLI.

    with Client() as hmcd:                      # unix:<config.socket>
        hmcd.node_info(); hmcd.buffers()
        hmcd.path("prefill-kv", "decode-kv")      # PathChoice: the path and why better ones lost
        hmcd.migrate("prefill-kv", "decode-kv", (src_offsets, dst_offsets, lengths))

Addresses are `unix:/path` or `host:port` (TCP, with the token from the argument
or `Config.token`, over TLS trusting `Config.tls_ca` when that is set). On a unix
socket, every call first checks that the socket and its directory belong to this
user or root and are closed to others (`UntrustedSocketError` otherwise: an
impostor hmcd must not learn anything). Every call has a deadline (`timeout`, default
`Config.timeout_s`); every failure is a typed `hmc.errors.HMCError`, with
UnavailableError naming the address when hmcd is not there.

Concurrency: one sync gRPC channel; methods may be called from several threads.
`events()` iterators each hold one streaming call; close them (or exhaust them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hmc.config import Config
from hmc.control._auth import CHANNEL_OPTIONS, MAX_MESSAGE_BYTES, bearer_metadata, check_socket_dir, open_channel, socket_path
from hmc.control._errors import error_from_proto, rpc_errors, translate_rpc_error
from hmc.control._registry import describe_ref
from hmc.errors import ArgumentError, ClosedResourceError, HMCError, TimeoutError
from hmc.transport._negotiate import PathChoice
from hmc.transport._ranges import MAX_TIMEOUT_S, RangeList, check_notify, check_timeout
from hmc.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

__all__ = ["Client", "EventStream", "NodeHealth"]

_FINAL = frozenset({common_pb2.TRANSFER_STATE_DONE, common_pb2.TRANSFER_STATE_FAILED, common_pb2.TRANSFER_STATE_CANCELLED})
_WAIT_SLACK_S = 1.0
"""A Wait call's own deadline beyond the time hmcd holds it (as libhmc's): an hmcd that stopped answering costs no more."""
_VERDICT_S = 5.0
"""`migrate`: how long past its timeout hmcd's own verdict is waited for (hmcd fails a migration at its timeout)."""
_CANCEL_S = 1.0
"""`migrate`: the bound on cancelling a migration it stopped waiting for."""


def _outcome(status: daemon_pb2.TransferStatus) -> daemon_pb2.TransferStatus:
    """An ended transfer's status when DONE; otherwise its typed error, raised."""
    error = error_from_proto(status.error)
    if status.state != common_pb2.TRANSFER_STATE_DONE and error is not None:
        raise error
    return status


def _text(value: object, what: str) -> str:
    """`value` for a string field of a request: a non-empty str that UTF-8 encodes (no lone surrogates); ArgumentError
    otherwise, before protobuf would raise TypeError or UnicodeEncodeError."""
    if not isinstance(value, str) or not value:
        raise ArgumentError(f"{what} must be a non-empty string, got {value!r}")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ArgumentError(f"{what} {value!r} is not valid text: {exc.reason}") from exc
    return value


def _ref(ref: str | daemon_pb2.BufferRef | common_pb2.BufferDescriptor) -> daemon_pb2.BufferRef:
    """A BufferRef from a name, an `id:<id>` string, a descriptor or a BufferRef."""
    if isinstance(ref, daemon_pb2.BufferRef):
        return ref
    if isinstance(ref, common_pb2.BufferDescriptor):
        return daemon_pb2.BufferRef(id=ref.id)
    ref = _text(ref, "a buffer reference (a name or 'id:<id>')")
    built = daemon_pb2.BufferRef(id=ref[3:]) if ref.startswith("id:") else daemon_pb2.BufferRef(name=ref)
    describe_ref(built)
    return built


class EventStream:
    """hmcd's events as an iterator; ends quietly when its timeout passes."""

    def __init__(self, call: Any, address: str) -> None:
        self._call = call
        self._address = address

    def __iter__(self) -> Iterator[daemon_pb2.Event]:
        return self

    def __next__(self) -> daemon_pb2.Event:
        try:
            return next(self._call)
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call) and exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                raise StopIteration from None
            raise translate_rpc_error(exc, self._address) from exc

    def close(self) -> None:
        self._call.cancel()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class NodeHealth:
    """What `Client.health()` learned: hmcd's grpc.health.v1 status, and which node answered."""

    serving: bool
    """True while hmcd serves (SERVING); False once it has begun to stop (NOT_SERVING)."""
    node: str
    """The node's name (from GetNodeInfo); empty when hmcd is not serving."""


class Client:
    """A connection to one hmcd."""

    def __init__(self, address: str | None = None, *, config: Config | None = None, token: str | None = None, timeout: float | None = None) -> None:
        self._config = config or Config.load()
        self.address = address or f"unix:{self._config.socket}"
        self.timeout = self._config.timeout_s if timeout is None else check_timeout(timeout)
        self._socket = socket_path(self.address)
        self._metadata = bearer_metadata(self._config.token if token is None else token) if self._socket is None else ()
        self._channel = open_channel(self.address, self._config, CHANNEL_OPTIONS)
        self._nodes = daemon_pb2_grpc.NodeServiceStub(self._channel)
        self._registry = daemon_pb2_grpc.RegistryServiceStub(self._channel)
        self._paths = daemon_pb2_grpc.PathServiceStub(self._channel)
        self._transfers = daemon_pb2_grpc.TransferServiceStub(self._channel)
        self._events = daemon_pb2_grpc.EventServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._closed = False

    def _check_usable(self) -> None:
        """Refuse a closed client, and an hmcd socket that another user could have put there (checked on every call:
        gRPC reconnects on its own)."""
        if self._closed:
            raise ClosedResourceError("client is closed")
        if self._socket is not None:
            check_socket_dir(self._socket)

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        self._check_usable()
        with rpc_errors(self.address):
            return method(request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata)

    # -- node ------------------------------------------------------------------------

    def node_info(self) -> daemon_pb2.NodeInfo:
        """Inventory, addresses, peers and counts of the node."""
        return self._call(self._nodes.GetNodeInfo, daemon_pb2.NodeInfoRequest())

    def health(self) -> NodeHealth:
        """hmcd's overall grpc.health.v1 status (service ""), and the node's name while it serves.

        On TCP the check itself needs no token (probes carry none); the node's name does.
        """
        reply = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=""))
        serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        return NodeHealth(serving=serving, node=self.node_info().node if serving else "")

    def devices(self) -> list[common_pb2.DeviceInfo]:
        return list(self.node_info().devices)

    def metrics(self) -> str:
        """Prometheus exposition text."""
        return self._call(self._nodes.GetMetrics, daemon_pb2.MetricsRequest()).text

    # -- buffers and paths ---------------------------------------------------------------

    def buffers(self, local_only: bool = False) -> list[common_pb2.BufferDescriptor]:
        """ConnBuffers of this node, and of the other nodes its directory knows unless `local_only`."""
        return list(self.listing(local_only).buffers)

    def listing(self, local_only: bool = False) -> daemon_pb2.ListBuffersResponse:
        """`buffers()` with `directory_age_s`: how old the view of the other nodes' buffers is (0: live)."""
        return self._call(self._registry.ListBuffers, daemon_pb2.ListBuffersRequest(local_only=local_only))

    def lookup(self, ref: str | daemon_pb2.BufferRef) -> common_pb2.BufferDescriptor:
        """A ConnBuffer by name (or `id:<id>`), here or at a peer."""
        return self._call(self._registry.LookupBuffer, daemon_pb2.LookupBufferRequest(ref=_ref(ref)))

    def path(self, src: str | daemon_pb2.BufferRef, dst: str | daemon_pb2.BufferRef) -> PathChoice:
        """The path hmcd would choose from src to dst, and why every better one was refused."""
        decision = self._call(self._paths.Negotiate, daemon_pb2.NegotiateRequest(src=_ref(src), dst=_ref(dst)))
        return PathChoice.from_proto(decision)

    # -- third-party transfers -------------------------------------------------------------

    def submit(
        self,
        src: str | daemon_pb2.BufferRef,
        dst: str | daemon_pb2.BufferRef,
        src_offsets: Any,
        dst_offsets: Any,
        lengths: Any,
        notify: bytes | None = None,
        timeout: float | None = None,
    ) -> daemon_pb2.TransferStatus:
        """Ask hmcd to move ranges from src to dst; returns the PENDING status (with its `transfer_id`)."""
        ranges = RangeList.build(src_offsets, dst_offsets, lengths)
        request = daemon_pb2.SubmitTransferRequest(
            src=_ref(src), dst=_ref(dst), ranges=ranges.to_proto(), notification=check_notify(notify) or b"", timeout_s=self.timeout if timeout is None else check_timeout(timeout)
        )
        if request.ByteSize() > MAX_MESSAGE_BYTES:  # gRPC would refuse it RESOURCE_EXHAUSTED, which reads as BUSY: retried for ever
            raise ArgumentError(f"a submit of {len(ranges)} ranges is {request.ByteSize()} bytes; hmcd takes at most {MAX_MESSAGE_BYTES}: submit fewer ranges at once")
        return self._call(self._transfers.Submit, request)

    def status(self, transfer_id: str) -> daemon_pb2.TransferStatus:
        """A transfer's status now, without waiting."""
        return self._call(self._transfers.Wait, daemon_pb2.TransferRef(transfer_id=_text(transfer_id, "transfer id"), timeout_s=0.0))

    def wait(self, transfer_id: str, timeout: float | None = None) -> daemon_pb2.TransferStatus:
        """Block until the transfer is DONE (its status) or failed (its typed error); TimeoutError after `timeout`."""
        return _outcome(self._ended(_text(transfer_id, "transfer id"), self.timeout if timeout is None else check_timeout(timeout)))

    def _ended(self, transfer_id: str, limit: float) -> daemon_pb2.TransferStatus:
        """The transfer's final status; TimeoutError when it has not ended within `limit` seconds (or hmcd's errors)."""
        deadline = time.monotonic() + limit
        while True:
            remaining = max(deadline - time.monotonic(), 0.0)
            status = self._call(self._transfers.Wait, daemon_pb2.TransferRef(transfer_id=transfer_id, timeout_s=remaining), timeout=remaining + _WAIT_SLACK_S)
            if status.state in _FINAL:
                return status
            if time.monotonic() >= deadline:
                raise TimeoutError(f"transfer {transfer_id} still {common_pb2.TransferState.Name(status.state)} after {limit:g}s")

    def cancel(self, transfer_id: str) -> daemon_pb2.TransferStatus:
        """Cancel a transfer (best effort: some ranges may have landed)."""
        return self._cancel(_text(transfer_id, "transfer id"), self.timeout)

    def _cancel(self, transfer_id: str, timeout: float) -> daemon_pb2.TransferStatus:
        return self._call(self._transfers.Cancel, daemon_pb2.TransferRef(transfer_id=transfer_id), timeout=timeout)

    def migrate(
        self, src: str | daemon_pb2.BufferRef, dst: str | daemon_pb2.BufferRef, ranges: Any, notify: bytes | None = None, timeout: float | None = None
    ) -> daemon_pb2.TransferStatus:
        """Move KV-cache blocks: `ranges` is (src_offsets, dst_offsets, lengths) or a RangeList; waits for DONE.

        hmcd fails a migration at `timeout`; its verdict is waited for `_VERDICT_S` longer. A migration that has not
        ended then (or whose wait fails) is cancelled before the error is raised (best effort, within `_CANCEL_S`;
        the agent executing it stops at its own deadline in any case). Against an hmcd that stopped answering after
        the submit, this returns within `timeout` + 7 s."""
        if isinstance(ranges, RangeList):
            src_offsets, dst_offsets, lengths = ranges.src, ranges.dst, ranges.lengths
        else:
            try:
                src_offsets, dst_offsets, lengths = ranges
            except (TypeError, ValueError) as exc:
                raise ArgumentError("ranges must be (src_offsets, dst_offsets, lengths) or a RangeList") from exc
        submitted = self.submit(src, dst, src_offsets, dst_offsets, lengths, notify=notify, timeout=timeout)
        try:
            ended = self._ended(submitted.transfer_id, min((self.timeout if timeout is None else timeout) + _VERDICT_S, MAX_TIMEOUT_S))
        except HMCError:  # not ended: stop it before saying so
            with contextlib.suppress(HMCError):
                self._cancel(submitted.transfer_id, min(self.timeout, _CANCEL_S))
            raise
        return _outcome(ended)

    # -- events --------------------------------------------------------------------------

    def events(self, timeout: float | None = None, include_peers: bool = False) -> EventStream:
        """Watch hmcd's events; returns once subscribed. `timeout` ends the stream (None: never)."""
        self._check_usable()
        deadline = None if timeout is None else check_timeout(timeout)
        call = self._events.Watch(daemon_pb2.WatchRequest(include_peers=include_peers), timeout=deadline, metadata=self._metadata)
        try:
            call.initial_metadata()  # hmcd sends it once the subscription exists
        except grpc.RpcError as exc:  # pragma: no cover - initial_metadata() returns on failure too
            raise translate_rpc_error(exc, self.address) from exc
        if call.done() and call.code() not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED):
            with rpc_errors(self.address):
                next(call)
        return EventStream(call, self.address)

    # -- life cycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Release the channel; idempotent."""
        if not self._closed:
            self._closed = True
            self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<hmc.Client {self.address}{' closed' if self._closed else ''}>"
