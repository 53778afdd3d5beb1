"""HMC's one exception tree, and the table that maps it to wire error codes.

    HMCError
    ├── ArgumentError            bad input from the caller; nothing was done
    │   ├── OutOfRangeError      a range falls outside a ConnBuffer
    │   └── UnsupportedError     a device, memory kind or option this build cannot serve
    ├── AccessDeniedError        wrong access key
    ├── AuthenticationError      wrong or missing token on a TCP call; a uid hmcd does not admit
    │   └── UntrustedSocketError a unix socket or its directory that another user could have put there
    ├── UnknownBufferError       no ConnBuffer with that id or name
    │   └── BufferWithdrawnError the ConnBuffer existed and was withdrawn
    │       └── StaleDescriptorError a descriptor from an earlier epoch of its node's registry
    ├── NoPathError              negotiation found no usable path
    ├── ProtocolError            malformed message from a peer
    │   └── VersionMismatchError peers speak incompatible protocol versions
    ├── DeviceError              a device runtime (CUDA, HIP, OS) call failed
    ├── UnavailableError         hmcd or a peer cannot be reached
    ├── TimeoutError             a deadline passed (also a builtin TimeoutError)
    ├── CancelledError           the operation was cancelled
    └── ResourceError            lifecycle errors, after trio
        ├── ClosedResourceError  used after close()
        ├── BrokenResourceError  the peer died or the connection broke
        └── BusyResourceError    concurrent misuse of a single-user resource

Every error carries `code`, the `ErrorCode` of proto/hmc/v1/common.proto; the C ABI
returns the same numbers. Foreign errors (OSError, grpc.RpcError, CUDA results)
are translated at one boundary per layer with `raise ... from exc`.
"""

from __future__ import annotations

import builtins
import enum
from typing import ClassVar

__all__ = [
    "AccessDeniedError",
    "ArgumentError",
    "AuthenticationError",
    "BrokenResourceError",
    "BufferWithdrawnError",
    "BusyResourceError",
    "CancelledError",
    "ClosedResourceError",
    "DeviceError",
    "ErrorCode",
    "HMCError",
    "NoPathError",
    "OutOfRangeError",
    "ProtocolError",
    "ResourceError",
    "StaleDescriptorError",
    "TimeoutError",
    "UnavailableError",
    "UnknownBufferError",
    "UnsupportedError",
    "UntrustedSocketError",
    "VersionMismatchError",
    "error_from_code",
]


class ErrorCode(enum.IntEnum):
    """Mirror of hmc.v1.ErrorCode; a test keeps the two identical."""

    OK = 0
    INTERNAL = 1
    INVALID_ARGUMENT = 2
    OUT_OF_RANGE = 3
    ACCESS_DENIED = 4
    UNKNOWN_BUFFER = 5
    BUFFER_WITHDRAWN = 6
    AUTHENTICATION = 7
    PROTOCOL = 8
    VERSION_MISMATCH = 9
    TIMEOUT = 10
    CANCELLED = 11
    PEER_LOST = 12
    CLOSED = 13
    BUSY = 14
    NO_PATH = 15
    UNSUPPORTED = 16
    DEVICE = 17
    UNAVAILABLE = 18
    STALE_DESCRIPTOR = 19


class HMCError(Exception):
    """Base of every error HMC raises."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL


class ArgumentError(HMCError, ValueError):
    code = ErrorCode.INVALID_ARGUMENT


class OutOfRangeError(ArgumentError):
    code = ErrorCode.OUT_OF_RANGE


class UnsupportedError(ArgumentError):
    code = ErrorCode.UNSUPPORTED


class AccessDeniedError(HMCError, PermissionError):
    code = ErrorCode.ACCESS_DENIED


class AuthenticationError(HMCError, PermissionError):
    code = ErrorCode.AUTHENTICATION


class UntrustedSocketError(AuthenticationError):
    """hmcd's socket, or its directory, is not owned by this user (or root) or is open to others: refused, never used."""


class UnknownBufferError(HMCError, LookupError):
    code = ErrorCode.UNKNOWN_BUFFER


class BufferWithdrawnError(UnknownBufferError):
    code = ErrorCode.BUFFER_WITHDRAWN


class StaleDescriptorError(BufferWithdrawnError):
    """The descriptor was served by an earlier epoch of its node's registry (its hmcd started again
    since): it is never used; look the buffer up again."""

    code = ErrorCode.STALE_DESCRIPTOR


class NoPathError(HMCError):
    code = ErrorCode.NO_PATH


class ProtocolError(HMCError):
    code = ErrorCode.PROTOCOL


class VersionMismatchError(ProtocolError):
    code = ErrorCode.VERSION_MISMATCH


class DeviceError(HMCError):
    code = ErrorCode.DEVICE


class UnavailableError(HMCError, ConnectionError):
    code = ErrorCode.UNAVAILABLE


class TimeoutError(HMCError, builtins.TimeoutError):  # noqa: A001 - deliberate, like trio
    code = ErrorCode.TIMEOUT


class CancelledError(HMCError):
    code = ErrorCode.CANCELLED


class ResourceError(HMCError):
    """A resource's lifecycle forbids the operation."""


class ClosedResourceError(ResourceError):
    code = ErrorCode.CLOSED


class BrokenResourceError(ResourceError, ConnectionError):
    code = ErrorCode.PEER_LOST


class BusyResourceError(ResourceError):
    code = ErrorCode.BUSY


_BY_CODE: dict[ErrorCode, type[HMCError]] = {
    ErrorCode.INTERNAL: HMCError,
    ErrorCode.INVALID_ARGUMENT: ArgumentError,
    ErrorCode.OUT_OF_RANGE: OutOfRangeError,
    ErrorCode.ACCESS_DENIED: AccessDeniedError,
    ErrorCode.UNKNOWN_BUFFER: UnknownBufferError,
    ErrorCode.BUFFER_WITHDRAWN: BufferWithdrawnError,
    ErrorCode.AUTHENTICATION: AuthenticationError,
    ErrorCode.PROTOCOL: ProtocolError,
    ErrorCode.VERSION_MISMATCH: VersionMismatchError,
    ErrorCode.TIMEOUT: TimeoutError,
    ErrorCode.CANCELLED: CancelledError,
    ErrorCode.PEER_LOST: BrokenResourceError,
    ErrorCode.CLOSED: ClosedResourceError,
    ErrorCode.BUSY: BusyResourceError,
    ErrorCode.NO_PATH: NoPathError,
    ErrorCode.UNSUPPORTED: UnsupportedError,
    ErrorCode.DEVICE: DeviceError,
    ErrorCode.UNAVAILABLE: UnavailableError,
    ErrorCode.STALE_DESCRIPTOR: StaleDescriptorError,
}


def error_from_code(code: int, message: str) -> HMCError:
    """Rebuild the typed exception for a wire error code (unknown codes -> HMCError)."""
    try:
        cls = _BY_CODE[ErrorCode(code)]
    except (ValueError, KeyError):
        cls = HMCError
    return cls(message)
