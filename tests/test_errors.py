"""The exception tree and the wire error table stay one table."""

from __future__ import annotations

import builtins

import pytest

from hmc import errors
from hmc.v1 import common_pb2


def test_error_codes_mirror_the_proto_enum() -> None:
    proto = {name.removeprefix("ERROR_CODE_"): number for name, number in common_pb2.ErrorCode.items()}
    python = {code.name: int(code) for code in errors.ErrorCode}
    assert python == proto


@pytest.mark.parametrize("code", list(errors.ErrorCode)[1:])
def test_every_code_rebuilds_an_error_with_that_code(code: errors.ErrorCode) -> None:
    error = errors.error_from_code(int(code), "boom")
    assert isinstance(error, errors.HMCError)
    assert error.code is code
    assert str(error) == "boom"


def test_unknown_code_is_a_plain_hmc_error() -> None:
    error = errors.error_from_code(9999, "what")
    assert type(error) is errors.HMCError


def test_lifecycle_errors_are_distinct_from_argument_errors() -> None:
    for cls in (errors.ClosedResourceError, errors.BrokenResourceError, errors.BusyResourceError):
        assert issubclass(cls, errors.ResourceError)
        assert not issubclass(cls, errors.ArgumentError)
    assert issubclass(errors.OutOfRangeError, errors.ArgumentError)
    assert issubclass(errors.BufferWithdrawnError, errors.UnknownBufferError)
    assert issubclass(errors.TimeoutError, builtins.TimeoutError)


def test_an_untrusted_socket_is_an_authentication_error() -> None:
    assert issubclass(errors.UntrustedSocketError, errors.AuthenticationError)
    assert issubclass(errors.UntrustedSocketError, PermissionError)
    assert errors.UntrustedSocketError("x").code is errors.ErrorCode.AUTHENTICATION
