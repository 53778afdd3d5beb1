"""Who may talk to hmcd: a shared token on TCP, file permissions on the unix socket.

- TCP: when `Config.token` is set, every call must carry the metadata
  `authorization: Bearer <token>`; `TokenInterceptor` (installed only on the TCP
  server) ends any other call UNAUTHENTICATED with code AUTHENTICATION. An empty
  token leaves TCP open (hmcd logs a warning at start).
- unix socket: created inside a 0700 directory (made here when missing) and
  chmod-ed 0600, so only the daemon's user can connect.
- Clients (the `Client`, the agent's link, peer daemons) attach the token with
  `bearer_metadata()` on every call.

Concurrency: stateless; the interceptor runs on the server's event loop.
"""

from __future__ import annotations

import hmac
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from hmc.control._errors import ERROR_CODE_KEY
from hmc.errors import ErrorCode, UnavailableError

__all__ = ["TokenInterceptor", "bearer_metadata", "prepare_socket_path", "secure_socket_file"]

_HEADER = "authorization"


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token` (empty when there is no token)."""
    return ((_HEADER, f"Bearer {token}"),) if token else ()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose bearer token is not `token`."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        given = next((value for key, value in details.invocation_metadata or () if key == _HEADER), None)
        if given is not None and hmac.compare_digest(str(given).encode(), self._expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return handler
        why = "missing authorization metadata" if given is None else "wrong token"
        return _refusing(handler, f"hmcd requires a valid token on TCP: {why}")


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call UNAUTHENTICATED."""
    trailing = ((ERROR_CODE_KEY, str(int(ErrorCode.AUTHENTICATION))),)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message, trailing_metadata=trailing)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message, trailing_metadata=trailing)
        yield  # pragma: no cover - makes this an async generator

    for attr in ("unary_unary", "stream_unary", "unary_stream", "stream_stream"):
        if getattr(handler, attr) is not None:
            streaming = attr.endswith("_stream")
            return handler._replace(**{attr: refuse_stream if streaming else refuse})
    return handler


def prepare_socket_path(path: str) -> None:
    """Make the socket's directory (0700 when created here) and clear a stale socket.

    Raises UnavailableError when another process is already serving on `path`.
    """
    socket_path = Path(path)
    directory = socket_path.parent
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
        os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask
    if socket_path.exists() or socket_path.is_symlink():
        if not stat.S_ISSOCK(socket_path.lstat().st_mode):
            raise UnavailableError(f"{path} exists and is not a socket; refusing to replace it")
        if _someone_listens(path):
            raise UnavailableError(f"another hmcd is already serving on unix:{path}")
        socket_path.unlink()


def secure_socket_file(path: str) -> None:
    """Restrict the bound socket to its owner (0600)."""
    os.chmod(path, 0o600)


def _someone_listens(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
        return True
