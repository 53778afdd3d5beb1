"""Who may talk to hmcd, and whom its clients trust: tokens and TLS on TCP; owners, modes and peer credentials on the unix socket.

- TCP: when `Config.token` is set, every call must carry the metadata
  `authorization: Bearer <token>`; `TokenInterceptor` (installed only on the TCP
  server) ends any other call UNAUTHENTICATED with code AUTHENTICATION, except
  `grpc.health.v1.Health/Check` (`_OPEN_METHODS`): probes (Kubernetes, load
  balancers) carry no token, and the answer is only SERVING or NOT_SERVING. With
  `Config.tls_cert` + `tls_key` hmcd serves TCP over TLS (`server_credentials`);
  clients and peer daemons speak TLS when `Config.tls_ca` is set
  (`channel_credentials`), trusting that CA only. A token without TLS crosses in
  clear (hmcd warns at start).
- unix socket, hmcd's side: the socket's directory is created 0700; an existing
  one must be a real directory owned by hmcd's euid that grants nothing to group
  or others, and an existing socket file must be hmcd's own
  (`prepare_socket_path`), else hmcd refuses to start with `UntrustedSocketError`.
  `UnixDoor` owns the listening socket: it reads each connection's peer
  credentials (SO_PEERCRED, set by the kernel at connect()) and admits only
  hmcd's own uid and root (`admitted_uids`; hard-coded for now), splicing their bytes
  to the gRPC server on a private socket beside it (`served_path`). Any other
  uid is spliced to a gRPC server that answers every call UNAUTHENTICATED, so
  the caller gets a typed AuthenticationError and hmcd logs one line. gRPC
  itself exposes no peer credentials on unix sockets (`context.peer()` is
  "unix:", `auth_context()` only "insecure"/"local"): see docs/decisions.md.
- unix socket, clients' side (`hmc.Client`, the CLI, the agent's link):
  `check_socket_dir` refuses a socket or directory owned by anyone but the
  caller's euid or root, a directory writable by group or others, a
  world-writable socket, and symlinks: an impostor hmcd must not get the
  agent's access keys.
- Clients attach the token with `bearer_metadata()` on every TCP call.

Concurrency: the checks and credential builders are stateless and run on the
caller's thread. `UnixDoor` and the interceptor run on hmcd's event loop; a
door's connections are owned by it and closed by `close()`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import socket
import ssl
import stat
import struct
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from hmc.config import Config
from hmc.control._errors import ERROR_CODE_KEY
from hmc.errors import ArgumentError, ErrorCode, UnavailableError, UntrustedSocketError

__all__ = [
    "CHANNEL_OPTIONS",
    "MAX_MESSAGE_BYTES",
    "TokenInterceptor",
    "UnixDoor",
    "admitted_uids",
    "bearer_metadata",
    "channel_credentials",
    "check_socket_dir",
    "open_aio_channel",
    "open_channel",
    "peer_credentials",
    "prepare_socket_path",
    "served_path",
    "server_credentials",
    "socket_path",
]

log = logging.getLogger("hmc.hmcd")

MAX_MESSAGE_BYTES = 64 << 20
"""Largest gRPC message hmcd, its clients, agents and peer daemons accept (a listing of thousands of descriptors;
gRPC's default, 4 MiB, refuses it as RESOURCE_EXHAUSTED, which reads as BUSY)."""
CHANNEL_OPTIONS = (
    # A stalled hmcd (stopped, wedged, cut off) ends calls and streams within ~15 s instead of never; hmcd
    # permits pings every 5 s (hmc.control._hmcd.SERVER_OPTIONS).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # hmcd's errors repeat the names given: a long one still arrives as its error, not as BUSY (both limits alike:
    # between them gRPC refuses at random). libhmc's channel is the same.
    ("grpc.max_metadata_size", 1 << 20),
    ("grpc.absolute_max_metadata_size", 1 << 20),
)
"""Every channel to an hmcd: the Python client's, an agent's, a peer daemon's."""

_HEADER = "authorization"
_OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})
"""Calls served on TCP without a token: a health probe, which learns SERVING or NOT_SERVING and nothing else (Watch, a stream, still needs one)."""
_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, one of them the terminating NUL


def admitted_uids() -> frozenset[int]:
    """The uids hmcd admits on its unix socket, and whose sockets clients trust: the effective uid and root."""
    return frozenset({os.geteuid(), 0})


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token` (empty when there is no token)."""
    return ((_HEADER, f"Bearer {token}"),) if token else ()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose bearer token is not `token`, but those in `_OPEN_METHODS`."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        given = next((value for key, value in details.invocation_metadata or () if key == _HEADER), None)
        if details.method in _OPEN_METHODS or given is not None and hmac.compare_digest(str(given).encode(), self._expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return handler
        why = "missing authorization metadata" if given is None else "wrong token"
        return _refusing(handler, f"hmcd requires a valid token on TCP: {why}")


async def _abort_unauthenticated(context: grpc.aio.ServicerContext, message: str) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, message, trailing_metadata=((ERROR_CODE_KEY, str(int(ErrorCode.AUTHENTICATION))),))


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler that ends the call UNAUTHENTICATED as soon as its headers are in, whatever its shape.

    It takes the request as a stream and never reads it: a unary handler would first receive the whole request
    (up to `MAX_MESSAGE_BYTES`), so a client without the token could make hmcd hold a large message per stream."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await _abort_unauthenticated(context, message)

    async def refuse_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await _abort_unauthenticated(context, message)
        yield  # pragma: no cover - makes this an async generator

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, handler.request_deserializer, handler.response_serializer)
    return grpc.stream_unary_rpc_method_handler(refuse, handler.request_deserializer, handler.response_serializer)


# -- TLS ------------------------------------------------------------------------------


def _read(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ArgumentError(f"cannot read {key} {path}: {exc.strerror or exc}") from exc


def server_credentials(config: Config) -> grpc.ServerCredentials | None:
    """TLS credentials of hmcd's TCP listener from `tls_cert` + `tls_key`; None when neither is set.

    Both files are loaded here, so a bad one stops hmcd at start with an
    ArgumentError naming it (gRPC itself would only fail each handshake).
    """
    if not config.tls_cert and not config.tls_key:
        return None
    if not (config.tls_cert and config.tls_key):
        given, missing = ("tls_cert", "tls_key") if config.tls_cert else ("tls_key", "tls_cert")
        raise ArgumentError(f"{given} is set but {missing} is not: TLS on hmcd's TCP listener needs both")
    chain, key = _read(config.tls_cert, "tls_cert"), _read(config.tls_key, "tls_key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_verify_locations(cadata=chain.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as exc:
        raise ArgumentError(f"tls_cert {config.tls_cert} holds no PEM certificate: {exc}") from exc
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key, password=b"")  # never prompt on a tty
    except ssl.SSLError as exc:
        raise ArgumentError(f"tls_key {config.tls_key} is not an unencrypted PEM private key of tls_cert {config.tls_cert}: {exc}") from exc
    return grpc.ssl_server_credentials([(key, chain)])


def channel_credentials(config: Config) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting `tls_ca` only, for TCP channels to hmcd; None when `tls_ca` is not set."""
    if not config.tls_ca:
        return None
    authority = _read(config.tls_ca, "tls_ca")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=authority.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as exc:
        raise ArgumentError(f"tls_ca {config.tls_ca} holds no PEM certificate: {exc}") from exc
    return grpc.ssl_channel_credentials(root_certificates=authority)


def socket_path(address: str) -> str | None:
    """The filesystem path of a `unix:` address; None for TCP."""
    if not address.startswith("unix:"):
        return None
    path = address[len("unix:") :]
    return path[2:] if path.startswith("//") else path


def _credentials_for(address: str, config: Config) -> grpc.ChannelCredentials | None:
    return None if socket_path(address) is not None else channel_credentials(config)


def open_channel(address: str, config: Config, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A sync channel to hmcd at `address`: TLS on TCP when `tls_ca` is set, plaintext on unix sockets."""
    credentials = _credentials_for(address, config)
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def open_aio_channel(address: str, config: Config, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """`open_channel` for grpc.aio (peer daemons)."""
    credentials = _credentials_for(address, config)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


# -- the unix socket: directory, file, peer credentials -----------------------------


def _owner(uid: int) -> str:
    return "root" if uid == 0 else f"uid {uid}"


def _trusted_entry(path: Path, what: str, owners: frozenset[int], forbidden: int, *, directory: bool) -> bool:
    """False when `path` does not exist; else refuse it unless it is a directory (or a socket), not a symlink,
    owned by one of `owners`, without the `forbidden` mode bits."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    except PermissionError as exc:
        raise UntrustedSocketError(f"cannot inspect {what} {path}: {exc.strerror}; it is not this user's") from exc
    if stat.S_ISLNK(info.st_mode):
        raise UntrustedSocketError(f"{what} {path} is a symlink; refusing it (it could point anywhere)")
    if not (stat.S_ISDIR if directory else stat.S_ISSOCK)(info.st_mode):
        raise UntrustedSocketError(f"{what} {path} is not a {'directory' if directory else 'socket'}")
    if info.st_uid not in owners:
        allowed = " or ".join(_owner(uid) for uid in sorted(owners, reverse=True))
        raise UntrustedSocketError(f"{what} {path} is owned by {_owner(info.st_uid)}, not by {allowed}; another user may have put it there")
    loose = stat.S_IMODE(info.st_mode) & forbidden
    if loose:
        who = " and ".join(name for bits, name in ((0o070, "group"), (0o007, "others")) if loose & bits)
        raise UntrustedSocketError(f"{what} {path} has mode {stat.S_IMODE(info.st_mode):04o}: it is open to {who}")
    return True


def check_socket_dir(path: str) -> None:
    """Client side: refuse to talk to hmcd through `path` unless the caller's euid or root owns it and its directory.

    Refused (UntrustedSocketError): a directory or socket that is a symlink, owned
    by another user, a directory writable by group or others, a world-writable
    socket, a socket this user may not inspect. A missing directory or socket
    passes: connecting then fails with UnavailableError naming the address.
    """
    owners = admitted_uids()
    socket_file = Path(path)
    if _trusted_entry(socket_file.parent, "hmcd's socket directory", owners, 0o022, directory=True):
        _trusted_entry(socket_file, "hmcd's socket", owners, 0o002, directory=False)


def served_path(path: str) -> str:
    """Where the gRPC server behind hmcd's door listens: beside the socket, in the same private directory."""
    return f"{path}.grpc"


def prepare_socket_path(path: str) -> None:
    """hmcd's side: make the socket's directory 0700, or check an existing one, and clear stale sockets.

    Raises UntrustedSocketError when the directory is a symlink, not hmcd's euid's,
    or grants anything to group or others, or when a socket file there is not
    hmcd's; UnavailableError when another process serves on `path`; ArgumentError
    when the path is too long for a unix socket.
    """
    if len(os.fsencode(served_path(path))) > _UNIX_PATH_MAX:
        raise ArgumentError(f"socket path {path!r} is too long: a unix socket path holds {_UNIX_PATH_MAX - len('.grpc')} bytes here")
    socket_file = Path(path)
    directory = socket_file.parent
    if not os.path.lexists(directory):
        directory.mkdir(mode=0o700, parents=True)
        os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask
    mine = frozenset({os.geteuid()})
    _trusted_entry(directory, "hmcd's socket directory", mine, 0o077, directory=True)
    for candidate in (socket_file, Path(served_path(path))):
        if not _trusted_entry(candidate, "existing socket file", mine, 0o000, directory=False):
            continue
        if _someone_listens(str(candidate)):
            raise UnavailableError(f"another hmcd is already serving on unix:{candidate}")
        candidate.unlink()


def _someone_listens(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
        return True


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: Any) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected a unix socket, as the kernel recorded them at connect()."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


class _Splice(asyncio.Protocol):
    """One end of two spliced connections: what it reads, the other end writes; back-pressure crosses over."""

    def __init__(self, door: UnixDoor, other: _Splice | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.other = other
        self._door = door
        self._early: list[bytes] = []  # read before the other end existed (uvloop reads despite pause_reading())

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._door.opened(self)

    def join(self, other: _Splice) -> None:
        """From now on what this end reads goes to `other`, starting with what it read so far."""
        self.other = other
        early, self._early = self._early, []
        for data in early:
            self.data_received(data)

    def data_received(self, data: bytes) -> None:
        if self.other is None:
            self._early.append(data)
        elif self.other.transport is not None:
            self.other.transport.write(data)

    def pause_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()

    def eof_received(self) -> bool:
        return False  # gRPC does not half-close: the pair ends

    def connection_lost(self, exc: Exception | None) -> None:
        if self.other is not None:
            self.other.close()
        self._door.closed(self)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _Incoming(_Splice):
    """A connection accepted on hmcd's socket: read nothing until its credentials chose where it goes."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport.pause_reading()  # type: ignore[attr-defined] # bytes read meanwhile wait in _early
        self._door.admit(self, transport.get_extra_info("socket"))


class _Refusal(grpc.GenericRpcHandler):
    """Every method, ended UNAUTHENTICATED with `message`."""

    def __init__(self, message: str) -> None:
        self._message = message

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return grpc.stream_stream_rpc_method_handler(self._refuse)

    async def _refuse(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        await _abort_unauthenticated(context, self._message)


class UnixDoor:
    """hmcd's unix socket: admits connections by their peer credentials and splices them to gRPC.

    `start()` binds `path` (born 0600), serves a refusing gRPC server on a
    private abstract socket, and accepts. A connection whose peer uid is in
    `admitted_uids()` is spliced to `served` (the real gRPC server's socket);
    any other to the refusing server, and hmcd logs one line naming its pid and
    uid. `close()` stops accepting and closes every connection.
    """

    def __init__(self, path: str, served: str) -> None:
        self.path = path
        self._served = served
        self._refusal = f"hmcd-refusal-{os.getpid()}-{secrets.token_hex(8)}"
        self._admitted = admitted_uids()
        self._server: asyncio.AbstractServer | None = None
        self._refuser: grpc.aio.Server | None = None
        self._open: set[_Splice] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        who = " and ".join(_owner(uid) for uid in sorted(self._admitted, reverse=True))
        self._refuser = grpc.aio.server()
        self._refuser.add_generic_rpc_handlers((_Refusal(f"hmcd admits only {who} on its unix socket {self.path}"),))
        if not self._refuser.add_insecure_port(f"unix-abstract:{self._refusal}"):
            raise UnavailableError(f"cannot bind hmcd's refusal socket @{self._refusal}")
        await self._refuser.start()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket file is born 0600: no window before a chmod
        try:
            listener.bind(self.path)
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise UnavailableError(f"cannot listen on hmcd's socket {self.path}: {exc.strerror or exc}") from exc
        finally:
            os.umask(old_umask)
        listener.setblocking(False)
        self._server = await asyncio.get_running_loop().create_unix_server(lambda: _Incoming(self), sock=listener)

    def opened(self, end: _Splice) -> None:
        self._open.add(end)

    def closed(self, end: _Splice) -> None:
        self._open.discard(end)

    def admit(self, incoming: _Incoming, sock: Any) -> None:
        """Choose where `incoming` goes by its peer credentials, and splice it there."""
        pid, uid, _ = peer_credentials(sock)
        if uid in self._admitted:
            target = self._served
        else:
            log.warning("refused a connection on %s from pid %d uid %d: hmcd admits only uids %s", self.path, pid, uid, sorted(self._admitted))
            target = "\0" + self._refusal
        task = asyncio.get_running_loop().create_task(self._splice(incoming, target), name=f"hmc-door:{pid}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _splice(self, incoming: _Incoming, target: str) -> None:
        loop = asyncio.get_running_loop()
        outgoing = _Splice(self, other=incoming)  # linked first: gRPC speaks as soon as it is connected
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.setblocking(False)
        try:
            await loop.sock_connect(upstream, target)
            await loop.create_unix_connection(lambda: outgoing, sock=upstream)
        except OSError as exc:
            upstream.close()
            log.warning("cannot reach hmcd's own gRPC server behind %s: %s", self.path, exc)
            incoming.close()
            return
        if incoming.transport is None or incoming.transport.is_closing():
            outgoing.close()
            return
        incoming.join(outgoing)
        incoming.transport.resume_reading()

    async def close(self) -> None:
        """Stop accepting, close every spliced connection and the refusing server; idempotent."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        for end in list(self._open):
            end.close()
        if self._refuser is not None:
            await self._refuser.stop(0)
            self._refuser = None
