"""The gRPC <-> hmc.errors boundary, and the Client's arguments and life cycle."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest
from control_fixtures import DaemonSet, Hmcd, daemon_set

from hmc.config import Config
from hmc.control import Client
from hmc.control._client import _ref
from hmc.control._errors import ERROR_CODE_KEY, error_from_proto, error_to_proto, grpc_status, translate_rpc_error
from hmc.errors import (
    ArgumentError,
    AuthenticationError,
    BufferWithdrawnError,
    ClosedResourceError,
    ErrorCode,
    HMCError,
    OutOfRangeError,
    TimeoutError,
    UnavailableError,
    error_from_code,
)
from hmc.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc


class _FakeRpcError(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """What a failed sync call raises, without a server."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()) -> None:
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing

    def initial_metadata(self) -> tuple[()]:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: object) -> bool:
        return False


@pytest.mark.parametrize("code", [c for c in ErrorCode if c is not ErrorCode.OK])
def test_every_error_code_round_trips(code: ErrorCode) -> None:
    original = error_from_code(code, f"boom {code.name}")
    wire = _FakeRpcError(grpc_status(code), str(original), ((ERROR_CODE_KEY, str(int(code))),))
    rebuilt = translate_rpc_error(wire, "unix:/x")
    assert type(rebuilt) is type(original) and rebuilt.code == code and str(rebuilt) == f"boom {code.name}"
    assert type(error_from_proto(error_to_proto(original))) is type(original)


def test_statuses_without_our_metadata() -> None:
    unavailable = translate_rpc_error(_FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connect failed"), "unix:/run/x.sock")
    assert isinstance(unavailable, UnavailableError) and "unix:/run/x.sock" in str(unavailable)
    assert isinstance(translate_rpc_error(_FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, ""), "a"), TimeoutError)
    assert isinstance(translate_rpc_error(_FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, ""), "a"), AuthenticationError)
    assert isinstance(translate_rpc_error(_FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, ""), "a"), ArgumentError)
    odd = translate_rpc_error(_FakeRpcError(grpc.StatusCode.DATA_LOSS, "?"), "a")
    assert type(odd) is HMCError and "DATA_LOSS" in str(odd)
    garbage = translate_rpc_error(_FakeRpcError(grpc.StatusCode.NOT_FOUND, "x", ((ERROR_CODE_KEY, "not-a-number"),)), "a")
    assert garbage.code == ErrorCode.UNKNOWN_BUFFER
    assert error_from_proto(common_pb2.Error()) is None
    assert error_to_proto(ValueError("plain")).code == ErrorCode.INTERNAL
    assert isinstance(error_from_proto(common_pb2.Error(code=6, message="gone")), BufferWithdrawnError)


def test_buffer_references() -> None:
    assert _ref("kv").name == "kv"
    assert _ref("id:abc").id == "abc"
    assert _ref(common_pb2.BufferDescriptor(id="d1")).id == "d1"
    given = daemon_pb2.BufferRef(name="n")
    assert _ref(given) is given
    for bad in ("", None, 3):
        with pytest.raises(ArgumentError):
            _ref(bad)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def daemons() -> Iterator[DaemonSet]:
    yield from daemon_set()


@pytest.fixture(scope="module")
def hmcd(daemons: DaemonSet) -> Hmcd:
    return daemons.start("client")


def test_client_life_cycle(hmcd: Hmcd) -> None:
    client = Client(config=hmcd.config())
    assert "unix:" in repr(client)
    with client:
        assert client.health().serving
    client.close()  # idempotent
    with pytest.raises(ClosedResourceError):
        client.health()
    with pytest.raises(ClosedResourceError):
        client.events(timeout=1.0)


def test_events_end_quietly_at_their_timeout(hmcd: Hmcd) -> None:
    with hmcd.client() as client:
        assert list(client.events(timeout=0.3)) == []
        for bad in (float("nan"), float("inf"), -1.0, "abc"):
            with pytest.raises(ArgumentError, match="timeout"):
                client.events(timeout=bad)  # type: ignore[arg-type]


def test_migrate_checks_its_ranges(hmcd: Hmcd) -> None:
    with hmcd.client() as client:
        with pytest.raises(ArgumentError, match="ranges"):
            client.migrate("a", "b", [1, 2])
        with pytest.raises(ArgumentError, match="differ in length"):
            client.submit("a", "b", [0, 1], [0], [1, 1])


_BAD_ARGUMENTS: dict[str, Callable[[Client], object]] = {
    "notify str": lambda c: c.migrate("a", "b", (0, 0, 16), notify="hello", timeout=5.0),  # type: ignore[arg-type]
    "notify int": lambda c: c.migrate("a", "b", (0, 0, 16), notify=5, timeout=5.0),  # type: ignore[arg-type]
    "wait int": lambda c: c.wait(5, timeout=1.0),  # type: ignore[arg-type]
    "cancel int": lambda c: c.cancel(7),  # type: ignore[arg-type]
    "status list": lambda c: c.status([1]),  # type: ignore[arg-type]
    "wait surrogate": lambda c: c.wait("\udcff", timeout=1.0),
    "cancel surrogate": lambda c: c.cancel("t\udcff"),
    "name surrogate": lambda c: c.migrate("\udcff", "b", (0, 0, 16), timeout=5.0),
    "id surrogate": lambda c: c.lookup("id:\udcff"),
}


@pytest.mark.parametrize("call", _BAD_ARGUMENTS.values(), ids=_BAD_ARGUMENTS.keys())
def test_arguments_of_the_wrong_type_or_not_text_are_argument_errors(hmcd: Hmcd, call: Callable[[Client], object]) -> None:
    """Transfer ids, buffer names and notifications protobuf cannot take raise ArgumentError, never TypeError or
    UnicodeEncodeError, and before anything is sent (hmcd has no buffer named "a": a sent request would say so)."""
    with hmcd.client() as client, pytest.raises(ArgumentError, match="notify must be bytes|must be a non-empty string|not valid text"):
        call(client)


class _StoppedAfterSubmit(daemon_pb2_grpc.TransferServiceServicer):  # type: ignore[misc]
    """An hmcd that takes a submit and then answers nothing (as one stopped then would): Wait and Cancel hold until the
    caller gives up."""

    def __init__(self) -> None:
        self.cancels = 0

    def Submit(self, request: daemon_pb2.SubmitTransferRequest, context: grpc.ServicerContext) -> daemon_pb2.TransferStatus:
        return daemon_pb2.TransferStatus(transfer_id=f"{request.src.name}-1", state=common_pb2.TRANSFER_STATE_PENDING)

    def Wait(self, request: daemon_pb2.TransferRef, context: grpc.ServicerContext) -> daemon_pb2.TransferStatus:
        if request.transfer_id == "failing-1":  # except this one, which failed on its own
            error = common_pb2.Error(code=common_pb2.ERROR_CODE_OUT_OF_RANGE, message="range #0 is outside the buffer")
            return daemon_pb2.TransferStatus(transfer_id=request.transfer_id, state=common_pb2.TRANSFER_STATE_FAILED, error=error)
        return self._hold(context)

    def Cancel(self, request: daemon_pb2.TransferRef, context: grpc.ServicerContext) -> daemon_pb2.TransferStatus:
        self.cancels += 1
        return self._hold(context)

    @staticmethod
    def _hold(context: grpc.ServicerContext) -> daemon_pb2.TransferStatus:
        ended = threading.Event()
        context.add_callback(ended.set)  # the caller's deadline ends the call
        ended.wait(60)
        return daemon_pb2.TransferStatus()


@pytest.fixture
def stopped_hmcd() -> Iterator[tuple[str, _StoppedAfterSubmit]]:
    """(address, servicer) of a served `_StoppedAfterSubmit`."""
    servicer = _StoppedAfterSubmit()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    daemon_pb2_grpc.add_TransferServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def test_a_migration_against_an_hmcd_that_stopped_answering_is_cancelled_and_ends_within_its_bound(
    stopped_hmcd: tuple[str, _StoppedAfterSubmit], monkeypatch: pytest.MonkeyPatch
) -> None:
    """hmcd's verdict is waited for `_VERDICT_S` past the timeout, a Wait call holds at most 1 s more, the cancel that
    follows 1 s: not the client's call timeout (30 s here), nor 5 s of slack per Wait call."""
    from hmc.control import _client

    monkeypatch.setattr(_client, "_VERDICT_S", 1.0)  # the bound's shape, sooner
    address, servicer = stopped_hmcd
    with Client(address, config=Config(), token="t" * 32, timeout=30.0) as client:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            client.migrate("held", "b", ([0], [0], [1]), timeout=0.5)
        took = time.monotonic() - started
    assert servicer.cancels == 1
    assert 1.5 <= took < 4.5, took  # 0.5 + 1.0, then at most a Wait's 1 s slack and the cancel's 1 s


def test_a_migration_that_failed_raises_its_error_and_is_not_cancelled(stopped_hmcd: tuple[str, _StoppedAfterSubmit]) -> None:
    """A migration hmcd reports FAILED has ended: its typed error, no cancel; the longest timeout is accepted (the
    verdict's 5 s stay within the 1e6 s bound)."""
    address, servicer = stopped_hmcd
    with Client(address, config=Config(), token="t" * 32, timeout=30.0) as client, pytest.raises(OutOfRangeError, match="outside the buffer"):
        client.migrate("failing", "b", ([0], [0], [1]), timeout=1e6)
    assert servicer.cancels == 0


def test_default_address_comes_from_config(tmp_path: object) -> None:
    config = Config(socket="/tmp/hmc-client-default.sock", timeout_s=1.0)
    with Client(config=config) as client:
        assert client.address == "unix:/tmp/hmc-client-default.sock" and client.timeout == 1.0
    with Client("127.0.0.1:1", config=config, timeout=0.5) as client, pytest.raises(UnavailableError, match="127.0.0.1:1"):
        client.health()
