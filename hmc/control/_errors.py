"""gRPC status <-> `hmc.errors`, at exactly one boundary each way.

Server side: `ErrorBoundary` is a server interceptor wrapped around every method
of hmcd. Servicers raise `HMCError`s; the boundary aborts the call with the
matching gRPC status and puts the `ErrorCode` into the trailing metadata key
`hmc-error-code`. Requests are parsed inside the boundary (gRPC's own parsing
would end a malformed one UNKNOWN with a traceback), so bytes that are not the
method's message end INVALID_ARGUMENT with code PROTOCOL; a refused request
(bad argument, malformed message) is logged in one line. Any other exception
is a bug: it is logged with its traceback and the call ends INTERNAL; hmcd
never crashes on a request.

Client side: `rpc_errors(address)` is a context manager that turns a
`grpc.RpcError` into the typed error `hmc.errors.error_from_code` rebuilds from
that metadata, or, for calls that never reached hmcd (nothing listening, deadline
passed), into `UnavailableError` / `TimeoutError` naming the address.

Concurrency: stateless; the interceptor runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from hmc.errors import (
    ArgumentError,
    AuthenticationError,
    CancelledError,
    ErrorCode,
    HMCError,
    ProtocolError,
    TimeoutError,
    UnavailableError,
    error_from_code,
)
from hmc.v1 import common_pb2

__all__ = [
    "ERROR_CODE_KEY",
    "ErrorBoundary",
    "abort",
    "error_from_proto",
    "error_to_proto",
    "grpc_status",
    "rpc_errors",
    "translate_rpc_error",
]

log = logging.getLogger("hmc.hmcd")

ERROR_CODE_KEY = "hmc-error-code"

_STATUS: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.OUT_OF_RANGE: grpc.StatusCode.OUT_OF_RANGE,
    ErrorCode.ACCESS_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.UNKNOWN_BUFFER: grpc.StatusCode.NOT_FOUND,
    ErrorCode.BUFFER_WITHDRAWN: grpc.StatusCode.NOT_FOUND,
    ErrorCode.AUTHENTICATION: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.PROTOCOL: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.VERSION_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorCode.PEER_LOST: grpc.StatusCode.ABORTED,
    ErrorCode.CLOSED: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.BUSY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.NO_PATH: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.DEVICE: grpc.StatusCode.INTERNAL,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.STALE_DESCRIPTOR: grpc.StatusCode.FAILED_PRECONDITION,
}

# For statuses that carry no hmc-error-code (raised by gRPC itself, or a foreign server).
_FALLBACK: dict[grpc.StatusCode, ErrorCode] = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE: ErrorCode.OUT_OF_RANGE,
    grpc.StatusCode.PERMISSION_DENIED: ErrorCode.ACCESS_DENIED,
    grpc.StatusCode.NOT_FOUND: ErrorCode.UNKNOWN_BUFFER,
    grpc.StatusCode.UNAUTHENTICATED: ErrorCode.AUTHENTICATION,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorCode.PROTOCOL,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorCode.TIMEOUT,
    grpc.StatusCode.CANCELLED: ErrorCode.CANCELLED,
    grpc.StatusCode.ABORTED: ErrorCode.PEER_LOST,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorCode.BUSY,
    grpc.StatusCode.UNIMPLEMENTED: ErrorCode.UNSUPPORTED,
    grpc.StatusCode.UNAVAILABLE: ErrorCode.UNAVAILABLE,
}


def grpc_status(code: ErrorCode) -> grpc.StatusCode:
    """The gRPC status an `ErrorCode` travels as."""
    return _STATUS.get(code, grpc.StatusCode.INTERNAL)


def error_to_proto(exc: BaseException) -> common_pb2.Error:
    """An exception as the wire `Error` (non-HMC exceptions become INTERNAL)."""
    code = exc.code if isinstance(exc, HMCError) else ErrorCode.INTERNAL
    return common_pb2.Error(code=int(code), message=str(exc) or type(exc).__name__)


def error_from_proto(error: common_pb2.Error) -> HMCError | None:
    """The typed exception of a wire `Error`, None for OK."""
    if error.code == ErrorCode.OK:
        return None
    return error_from_code(error.code, error.message)


async def abort(context: grpc.aio.ServicerContext, exc: HMCError, status: grpc.StatusCode | None = None) -> None:
    """End the call with `exc`'s status (or `status`) and code; always raises (grpc.aio.AbortError)."""
    await context.abort(status or grpc_status(exc.code), str(exc) or type(exc).__name__, trailing_metadata=((ERROR_CODE_KEY, str(int(exc.code))),))


RpcObserver = Callable[[str, str], None]
"""Called once per finished call with (method, status name)."""


class ErrorBoundary(grpc.aio.ServerInterceptor):
    """Translates servicer exceptions into statuses and reports every call's outcome."""

    def __init__(self, observe: RpcObserver | None = None) -> None:
        self._observe = observe or (lambda method, status: None)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method.rsplit("/", 1)[-1]
        for attr in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, attr)
            if behavior is None:
                continue
            if handler.request_streaming:  # context.read() parses inside the behavior, within the boundary
                return handler._replace(**{attr: self._wrap(method, behavior, None)})
            return handler._replace(request_deserializer=None, **{attr: self._wrap(method, behavior, handler.request_deserializer)})
        return handler

    @contextlib.asynccontextmanager
    async def _served(self, method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Run one call: translate what it raises into a status and report that status once."""
        status = "OK"
        try:
            yield
        except grpc.aio.AbortError:
            status = _status_name(context)
            raise
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        except Exception as exc:
            error = _typed(method, exc)
            status = grpc_status(error.code).name
            await abort(context, error)
        finally:
            self._observe(method, status)

    def _wrap(self, method: str, behavior: Callable[..., Any], parse: Callable[[bytes], Any] | None) -> Callable[..., Any]:
        """`behavior` inside the boundary; `parse` (the method's request deserializer) runs there too."""

        def parsed(request: Any) -> Any:
            return request if parse is None else parse(request)

        if inspect.isasyncgenfunction(behavior):

            async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async with self._served(method, context):
                    async for item in behavior(parsed(request), context):
                        yield item

            return streaming

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with self._served(method, context):
                return await behavior(parsed(request), context)

        return unary


def _typed(method: str, exc: Exception) -> HMCError:
    """`exc` as an HMCError, logged in one line; anything else is a bug, logged with its traceback."""
    if isinstance(exc, DecodeError):
        log.warning("hmcd %s refused a malformed request: %s", method, exc)
        return ProtocolError(f"malformed request to hmcd {method}: {exc}")
    if isinstance(exc, (ArgumentError, ProtocolError)):
        log.info("hmcd %s refused the request: %s", method, exc)
        return exc
    if not isinstance(exc, HMCError):
        log.error("bug: hmcd %s raised %s: %s", method, type(exc).__name__, exc, exc_info=exc)
        return HMCError(f"internal error in hmcd {method}: {type(exc).__name__}: {exc}")
    if exc.code in (ErrorCode.INTERNAL, ErrorCode.DEVICE):
        log.warning("hmcd %s failed: %s", method, exc)
    return exc


def _status_name(context: grpc.aio.ServicerContext) -> str:
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - older grpc.aio contexts have no code()
        return "ABORTED"
    return getattr(code, "name", None) or "ABORTED"


@contextlib.contextmanager
def rpc_errors(address: str, what: str = "hmcd") -> Iterator[None]:
    """Translate `grpc.RpcError` raised inside the block into typed `HMCError`s."""
    try:
        yield
    except grpc.RpcError as exc:
        raise translate_rpc_error(exc, address, what) from exc


def translate_rpc_error(exc: grpc.RpcError, address: str, what: str = "hmcd") -> HMCError:
    """The typed error of a failed call (the client-side half of the boundary)."""
    call = isinstance(exc, (grpc.Call, grpc.aio.AioRpcError))  # an aio call's error is no grpc.Call
    code = exc.code() if call else grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    details = (exc.details() if call else None) or str(exc)  # type: ignore[attr-defined]
    metadata = exc.trailing_metadata() if call else None  # type: ignore[attr-defined]
    for key, value in metadata or ():
        if key == ERROR_CODE_KEY:
            try:
                return error_from_code(int(value), details)
            except ValueError:
                break
    if code == grpc.StatusCode.UNAVAILABLE:
        return UnavailableError(f"{what} is not reachable at {address} (is it running?): {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(f"call to {what} at {address} passed its deadline: {details}")
    if code == grpc.StatusCode.CANCELLED:
        return CancelledError(f"call to {what} at {address} was cancelled: {details}")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"{what} at {address} refused the call: {details}")
    fallback = _FALLBACK.get(code, ErrorCode.INTERNAL)
    return error_from_code(fallback, f"{what} at {address}: {code.name}: {details}")
