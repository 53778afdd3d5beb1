"""A small asyncio client of etcd's v3 gRPC API: keys, transactions, leases and watches.

Why our own (docs/decisions.md): the maintained asyncio clients either take one
`host:port` with an insecure channel only (aetcd) or are synchronous (etcd3). hmcd
needs several endpoints, TLS with client certificates, and a deadline on every call,
which are a few lines over grpc.aio and the messages of proto/hmc/v1/etcd.proto.

Endpoints are tried in turn: a call that finds its endpoint unreachable moves on to
the next (within the call's deadline), and the client stays on the one that answered.
Endpoints are `host:port`, `http://host:port` or `https://host:port`; TLS is on for
https endpoints and whenever a CA, certificate or key is configured.

Every failure is an `hmc.errors` error: an unreachable etcd (every endpoint) or a
deadline is UnavailableError, anything else etcd refuses is ProtocolError.

Concurrency: one asyncio loop (hmcd's); calls may run concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from hmc.control._auth import MAX_MESSAGE_BYTES
from hmc.errors import ArgumentError, HMCError, ProtocolError, UnavailableError
from hmc.v1 import etcd_pb2 as pb

__all__ = ["EtcdClient", "EtcdSettings", "prefix_end"]

log = logging.getLogger("hmc.hmcd")

_CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with `prefix` (etcd's convention)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class EtcdSettings:
    """Where etcd is and how to reach it (from `Config`: etcd_endpoints, etcd_ca, etcd_cert, etcd_key)."""

    def __init__(self, endpoints: Sequence[str], *, ca: str = "", cert: str = "", key: str = "") -> None:
        if not endpoints:
            raise ArgumentError("the etcd directory needs at least one endpoint (etcd_endpoints)")
        self.targets: list[str] = []
        tls = bool(ca or cert or key)
        for endpoint in endpoints:
            scheme, sep, rest = endpoint.partition("://")
            if not sep:
                scheme, rest = "http", endpoint
            if scheme not in ("http", "https") or not rest or "/" in rest.rstrip("/"):
                raise ArgumentError(f"etcd endpoint {endpoint!r} must look like host:port, http://host:port or https://host:port")
            tls = tls or scheme == "https"
            self.targets.append(rest.rstrip("/"))
        if bool(cert) != bool(key):
            raise ArgumentError("etcd TLS needs both a client certificate and its key (etcd_cert, etcd_key), or neither")
        self.endpoints = list(endpoints)
        self.credentials = grpc.ssl_channel_credentials(_read(ca), _read(key), _read(cert)) if tls else None


def _read(path: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ArgumentError(f"cannot read etcd TLS file {path}: {exc}") from exc


class _Methods:
    """The etcd methods HMC calls, bound to one channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        def unary(path: str, reply: Any) -> grpc.aio.UnaryUnaryMultiCallable:
            return channel.unary_unary(path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=reply.FromString)

        def stream(path: str, reply: Any) -> grpc.aio.StreamStreamMultiCallable:
            return channel.stream_stream(path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=reply.FromString)

        self.range = unary("/etcdserverpb.KV/Range", pb.RangeResponse)
        self.put = unary("/etcdserverpb.KV/Put", pb.PutResponse)
        self.delete = unary("/etcdserverpb.KV/DeleteRange", pb.DeleteRangeResponse)
        self.txn = unary("/etcdserverpb.KV/Txn", pb.TxnResponse)
        self.grant = unary("/etcdserverpb.Lease/LeaseGrant", pb.LeaseGrantResponse)
        self.revoke = unary("/etcdserverpb.Lease/LeaseRevoke", pb.LeaseRevokeResponse)
        self.keepalive = stream("/etcdserverpb.Lease/LeaseKeepAlive", pb.LeaseKeepAliveResponse)
        self.watch = stream("/etcdserverpb.Watch/Watch", pb.WatchResponse)
        self.status = unary("/etcdserverpb.Maintenance/Status", pb.StatusResponse)


class EtcdClient:
    """etcd over grpc.aio with endpoint failover; every call bounded by `timeout` seconds."""

    def __init__(self, settings: EtcdSettings) -> None:
        self._settings = settings
        self._channels: list[grpc.aio.Channel | None] = [None] * len(settings.targets)
        self._current = 0

    @property
    def endpoint(self) -> str:
        """The endpoint calls go to now."""
        return self._settings.endpoints[self._current]

    def _methods(self, index: int) -> _Methods:
        channel = self._channels[index]
        if channel is None:
            target = self._settings.targets[index]
            credentials = self._settings.credentials
            channel = grpc.aio.insecure_channel(target, _CHANNEL_OPTIONS) if credentials is None else grpc.aio.secure_channel(target, credentials, _CHANNEL_OPTIONS)
            self._channels[index] = channel
        return _Methods(channel)

    async def close(self) -> None:
        channels, self._channels = self._channels, [None] * len(self._channels)
        for channel in channels:
            if channel is not None:
                await channel.close()

    def _attempts(self, timeout: float) -> Iterator[tuple[int, float]]:
        """(endpoint index, seconds it may take) for the current endpoint, then the others in turn, within `timeout`:
        one endpoint may not take the whole deadline while others remain to be tried."""
        deadline = time.monotonic() + timeout
        count = len(self._channels)
        for attempt in range(count):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            yield (self._current + attempt) % count, left if attempt == count - 1 else max(left / (count - attempt), min(left, 0.5))

    def _answered(self, index: int) -> None:
        if index != self._current:
            log.info("etcd: now using endpoint %s", self._settings.endpoints[index])
            self._current = index

    async def _call(self, name: str, request: Any, timeout: float) -> Any:
        """One unary call on the first endpoint that answers within `timeout` (UnavailableError: none did)."""
        failures: list[str] = []
        for index, share in self._attempts(timeout):
            try:
                reply = await getattr(self._methods(index), name)(request, timeout=share)
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
                if code not in _UNREACHABLE:
                    raise ProtocolError(f"etcd at {self._settings.endpoints[index]} refused {name}: {_details(exc)}") from exc
                failures.append(f"{self._settings.endpoints[index]}: {_details(exc)}")
                continue
            self._answered(index)
            return reply
        raise UnavailableError(f"etcd unreachable within {timeout:g}s ({'; '.join(failures) or 'no time left'})")

    # -- keys ---------------------------------------------------------------------------

    async def get_prefix(self, prefix: bytes, timeout: float) -> pb.RangeResponse:
        return await self._call("range", pb.RangeRequest(key=prefix, range_end=prefix_end(prefix)), timeout)

    async def get(self, key: bytes, timeout: float) -> pb.KeyValue | None:
        reply = await self._call("range", pb.RangeRequest(key=key), timeout)
        return reply.kvs[0] if reply.kvs else None

    async def put(self, key: bytes, value: bytes, timeout: float, lease: int = 0) -> pb.PutResponse:
        return await self._call("put", pb.PutRequest(key=key, value=value, lease=lease), timeout)

    async def delete(self, key: bytes, timeout: float, *, prefix: bool = False) -> pb.DeleteRangeResponse:
        return await self._call("delete", pb.DeleteRangeRequest(key=key, range_end=prefix_end(key) if prefix else b""), timeout)

    async def txn(self, request: pb.TxnRequest, timeout: float) -> pb.TxnResponse:
        return await self._call("txn", request, timeout)

    async def status(self, timeout: float) -> pb.StatusResponse:
        return await self._call("status", pb.StatusRequest(), timeout)

    # -- leases -------------------------------------------------------------------------

    async def grant(self, ttl_s: int, timeout: float) -> pb.LeaseGrantResponse:
        reply = await self._call("grant", pb.LeaseGrantRequest(TTL=ttl_s), timeout)
        if reply.error:
            raise ProtocolError(f"etcd refused a lease of {ttl_s}s: {reply.error}")
        return reply

    async def revoke(self, lease: int, timeout: float) -> None:
        try:
            await self._call("revoke", pb.LeaseRevokeRequest(ID=lease), timeout)
        except ProtocolError as exc:
            if "not found" not in str(exc):  # already expired: what revoking wanted
                raise

    async def keepalive(self, lease: int, timeout: float) -> int:
        """Renew `lease` once: the TTL etcd granted again (0: the lease has expired)."""
        failures: list[str] = []
        for index, share in self._attempts(timeout):
            call = self._methods(index).keepalive(timeout=share)
            try:
                await call.write(pb.LeaseKeepAliveRequest(ID=lease))
                reply = await call.read()
            except grpc.RpcError as exc:
                failures.append(f"{self._settings.endpoints[index]}: {_details(exc)}")
                continue
            finally:
                call.cancel()
            if reply is grpc.aio.EOF:
                failures.append(f"{self._settings.endpoints[index]}: stream ended")
                continue
            self._answered(index)
            return int(reply.TTL)
        raise UnavailableError(f"etcd unreachable within {timeout:g}s renewing lease {lease:x} ({'; '.join(failures) or 'no time left'})")

    # -- watches ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def watch_prefix(self, prefix: bytes, start_revision: int, timeout: float) -> AsyncIterator[AsyncIterator[pb.WatchResponse]]:
        """A watch of every key under `prefix` from `start_revision` on: an async iterator of responses.

        Created within `timeout` (UnavailableError otherwise); it ends (UnavailableError) when
        the stream breaks, and with ProtocolError when etcd cancels it (a compacted revision).
        """
        # "hasleader": etcd ends the watch when its member loses the cluster's leader, rather than leaving it open and silent
        call = self._methods(self._current).watch(metadata=(("hasleader", "true"),))
        try:
            create = pb.WatchCreateRequest(key=prefix, range_end=prefix_end(prefix), start_revision=start_revision, prev_kv=True)
            try:
                await asyncio.wait_for(call.write(pb.WatchRequest(create_request=create)), timeout)
                first = await asyncio.wait_for(call.read(), timeout)
            except (grpc.RpcError, asyncio.TimeoutError) as exc:
                self._current = (self._current + 1) % len(self._channels)  # the next watch tries the next endpoint
                raise UnavailableError(f"etcd watch on {self.endpoint} not created: {_details(exc)}") from exc
            if first is grpc.aio.EOF or not first.created:
                raise UnavailableError("etcd ended the watch stream before creating the watch")
            if first.canceled:
                raise ProtocolError(f"etcd refused the watch: {first.cancel_reason or 'cancelled'} (compacted at {first.compact_revision})")
            yield _responses(call, first)
        finally:
            call.cancel()


async def _responses(call: Any, first: pb.WatchResponse) -> AsyncIterator[pb.WatchResponse]:
    if first.events:
        yield first
    while True:
        try:
            reply = await call.read()
        except grpc.RpcError as exc:
            raise UnavailableError(f"etcd watch broke: {_details(exc)}") from exc
        if reply is grpc.aio.EOF:
            raise UnavailableError("etcd ended the watch stream")
        if reply.canceled:
            raise ProtocolError(f"etcd cancelled the watch: {reply.cancel_reason or 'no reason given'} (compacted at {reply.compact_revision})")
        yield reply


def _details(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, HMCError):
        return str(exc)
    return repr(exc)
