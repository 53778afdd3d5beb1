"""What agents measure between them reaches hmcd (issue 14): `hmc path` shows the figures, hmcd's own transfers
take the faster direction, a restarted hmcd has them back, and a measurement only ever speaks for its sender.

Real hmcd processes, real agents over UCX (tcp), real gRPC; `Measurements` itself against hostile input."""

from __future__ import annotations

import concurrent.futures
import json
import math
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from control_fixtures import REPO, DaemonSet, Hmcd, agent_info, clean_env, daemon_set, descriptor, wait_until
from ucx_support import requires_ucx

from hmc.agent import Agent
from hmc.config import Config, PathPolicy
from hmc.control._agent_link import DaemonLink
from hmc.control._measurements import Measurements
from hmc.errors import ProtocolError, UnavailableError
from hmc.memory import DeviceKind
from hmc.transport import _ucx as ucx_transport
from hmc.transport._base import Capabilities, PathName
from hmc.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

POISON = 0x5A
SIZE = 1 << 20
UCX_ONLY = {"HMC_PATHS_ALLOW": "ucx"}


@pytest.fixture(scope="module")
def daemons() -> Iterator[DaemonSet]:
    yield from daemon_set()


@pytest.fixture
def hmcd(daemons: DaemonSet) -> Hmcd:
    return daemons.start(f"measure-{uuid.uuid4().hex[:6]}", env=UCX_ONLY)


def _config(hmcd: Hmcd) -> Config:
    return hmcd.config().replace(policy=PathPolicy(allow=("ucx",)), ucx_transports="tcp")


def _cli_path(hmcd: Hmcd, src: str, dst: str) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-m", "hmc.cli._main", "path", src, dst, "--json", "--address", hmcd.unix_address],
        capture_output=True, text=True, timeout=60, env=clean_env(), cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def _measured_path(hmcd: Hmcd, src: str, dst: str) -> common_pb2.PathMeasurement | None:
    with hmcd.client() as client:
        return client.path(src, dst).measured


# -- through real hmcd and agents ---------------------------------------------------------


@requires_ucx
def test_a_read_measured_by_an_agent_shows_in_hmc_path_and_comes_back_after_an_hmcd_restart(daemons: DaemonSet, hmcd: Hmcd) -> None:
    rng = np.random.default_rng(14)
    data = rng.integers(0, 256, SIZE, dtype=np.uint8)
    with Agent(_config(hmcd), daemon=True) as owner, Agent(_config(hmcd), daemon=True) as reader:
        src = owner.register(data.copy(), name="m-src")
        sink = reader.register(np.full(SIZE, POISON, np.uint8), name="m-dst")
        assert _measured_path(hmcd, "m-src", "m-dst") is None  # nothing read yet: the declared choice alone
        reader.read(sink, src.descriptor, 0, 0, SIZE).wait()
        assert np.array_equal(sink.numpy(), data)
        wait_until(lambda: _measured_path(hmcd, "m-src", "m-dst") is not None, what="hmcd to hear of the measurement")

        shown = _cli_path(hmcd, "m-src", "m-dst")
        measured = shown["measured"]
        assert isinstance(measured, dict) and shown["path"] == "ucx"
        assert measured["measured_by"] == reader.id and measured["owner_agent"] == owner.id and measured["path"] == "ucx"
        assert measured["local_kind"] == measured["remote_kind"] == "DEVICE_KIND_HOST" and int(measured["nbytes"]) > 0
        assert float(measured["get_bps"]) > 0 and f"measured by agent {reader.id}" in str(shown["reason"])
        assert shown["preferred_op"] == ("write" if measured.get("push_reads") else "read")
        assert _cli_path(hmcd, "m-dst", "m-src")["measured"] is None  # bytes the other way: nobody measured that
        assert reader.path_to(sink, src.descriptor).measured == _measured_path(hmcd, "m-src", "m-dst")

        hmcd.process.kill()
        hmcd.process.wait(timeout=30)
        again = daemons.restart(hmcd, env=UCX_ONLY)
        def resent() -> bool:
            try:
                return _measured_path(again, "m-src", "m-dst") is not None
            except UnavailableError:  # the names wait for their agents to attach again
                return False

        wait_until(resent, timeout=20, what="the agents to attach again and resend")
        assert _measured_path(again, "m-src", "m-dst").measured_by == reader.id  # type: ignore[union-attr]


@requires_ucx
@pytest.mark.parametrize("gets_win", [True, False])
def test_hmcds_transfer_has_the_reader_execute_where_gets_win(hmcd: Hmcd, gets_win: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the pair measured gets faster than the owner's pushes, hmcd has dst's agent READ; else src's agent WRITEs."""
    monkeypatch.setattr(ucx_transport, "_PUSH_PREFERRED", 0.0 if gets_win else 1e9)
    rng = np.random.default_rng(16 + gets_win)
    data = rng.integers(0, 256, SIZE, dtype=np.uint8)
    tag = uuid.uuid4().hex[:6]
    with Agent(_config(hmcd), daemon=True) as owner, Agent(_config(hmcd), daemon=True) as reader:
        src = owner.register(data.copy(), name=f"x-src-{tag}")
        sink = reader.register(np.full(SIZE, POISON, np.uint8), name=f"x-dst-{tag}")
        reader.read(sink, src.descriptor, 0, 0, 4096).wait()  # measured on first use
        wait_until(lambda: _measured_path(hmcd, f"x-src-{tag}", f"x-dst-{tag}") is not None, what="hmcd to hear of the measurement")
        sink.numpy()[:] = POISON
        offsets = rng.permutation(SIZE // 4096)[:64].astype(np.int64) * 4096
        with hmcd.client() as client:
            status = client.submit(f"x-src-{tag}", f"x-dst-{tag}", offsets, offsets, 4096)
            done = client.wait(status.transfer_id, timeout=30)
        assert done.state == common_pb2.TRANSFER_STATE_DONE and done.path == "ucx"
        assert done.executor_agent == (reader.id if gets_win else owner.id)
        expected = np.full(SIZE, POISON, np.uint8)
        for offset in offsets.tolist():
            expected[offset : offset + 4096] = data[offset : offset + 4096]
        assert np.array_equal(sink.numpy(), expected)


def _attach_with(hmcd: Hmcd, *messages: daemon_pb2.AgentMessage) -> grpc.RpcError | None:
    """A raw Attach stream: a hello, then `messages`; the error it ended with (None: hmcd kept it open until EOF)."""
    hello = daemon_pb2.AgentMessage(hello=daemon_pb2.AgentHello(protocol_version=1, agent=agent_info(node=hmcd.name)))
    with grpc.insecure_channel(hmcd.unix_address) as channel:
        call = daemon_pb2_grpc.RegistryServiceStub(channel).Attach(iter([hello, *messages]), timeout=10)
        try:
            replies = list(call)
        except grpc.RpcError as exc:
            return exc
    assert replies[0].hello.takes_measurements  # hmcd says it takes them
    return None


def _valid(owner: str, **changes: object) -> common_pb2.PathMeasurement:
    fields: dict[str, object] = {
        "path": "ucx", "owner_agent": owner, "local_kind": common_pb2.DEVICE_KIND_HOST, "remote_kind": common_pb2.DEVICE_KIND_HOST,
        "nbytes": 65536, "get_bps": 2e9, "push_bps": 1e9, "push_reads": False,
    }  # fmt: skip
    fields.update(changes)
    return common_pb2.PathMeasurement(**fields)  # type: ignore[arg-type]


@requires_ucx
def test_a_measurement_speaks_only_for_its_sender_and_a_malformed_one_ends_only_its_stream(hmcd: Hmcd) -> None:
    with Agent(_config(hmcd), daemon=True) as owner, Agent(_config(hmcd), daemon=True) as reader:
        src = owner.register(np.full(SIZE, 1, np.uint8), name="s-src")
        sink = reader.register(np.full(SIZE, POISON, np.uint8), name="s-dst")
        # Another agent claims to be the reader and to have measured the pair: hmcd files it under the sender.
        forged = _valid(owner.id, measured_by=reader.id)
        assert _attach_with(hmcd, daemon_pb2.AgentMessage(measured=forged)) is None
        assert _measured_path(hmcd, "s-src", "s-dst") is None
        ended = _attach_with(hmcd, daemon_pb2.AgentMessage(measured=_valid(owner.id, get_bps=math.nan)))
        assert ended is not None and dict(ended.trailing_metadata())["hmc-error-code"] == str(int(ProtocolError.code))
        with hmcd.client() as client:
            assert client.health().serving and {b.name for b in client.listing().buffers} >= {"s-src", "s-dst"}
        reader.read(sink, src.descriptor, 0, 0, 4096).wait()  # the reader's own stream still works: it measures
        wait_until(lambda: _measured_path(hmcd, "s-src", "s-dst") is not None, what="the reader's own measurement")


class _Hmcd(daemon_pb2_grpc.RegistryServiceServicer):
    """An hmcd's Attach as another release answers it (`takes` or not), over real gRPC: what the agent sent, by kind."""

    def __init__(self, takes: bool) -> None:
        self.takes = takes
        self.kinds: list[str] = []
        self.ended = threading.Event()

    def Attach(self, request_iterator: Iterator[daemon_pb2.AgentMessage], context: grpc.ServicerContext) -> Iterator[daemon_pb2.DaemonMessage]:
        next(request_iterator)  # the hello
        yield daemon_pb2.DaemonMessage(hello=daemon_pb2.DaemonHello(protocol_version=1, node="other-release", takes_measurements=self.takes))
        for message in request_iterator:
            self.kinds.append(message.WhichOneof("kind") or "")
        self.ended.set()


@pytest.mark.parametrize("takes", [False, True])
def test_an_agent_sends_measurements_only_to_an_hmcd_that_takes_them(tmp_path: Path, takes: bool) -> None:
    """An hmcd of an older release ends the stream on a message it does not know: the agent sends it none."""
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    socket = directory / "hmcd.sock"
    hmcd = _Hmcd(takes)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    daemon_pb2_grpc.add_RegistryServiceServicer_to_server(hmcd, server)
    server.add_insecure_port(f"unix:{socket}")
    server.start()
    try:
        link = DaemonLink(Config(socket=str(socket), timeout_s=5.0), agent_info(), lambda _: None)
        link.measured(_valid("owner"))
        link.report(daemon_pb2.TransferReport(transfer_id="t", state=common_pb2.TRANSFER_STATE_DONE))  # after it, in order
        link.close()
        assert hmcd.ended.wait(10)
        assert hmcd.kinds == (["measured", "report"] if takes else ["report"])
    finally:
        server.stop(0)


# -- Measurements -------------------------------------------------------------------------


def _buffer(agent_id: str) -> common_pb2.BufferDescriptor:
    """Host memory of agent `agent_id`, which offers ucx."""
    buffer = descriptor("", 4096)
    buffer.owner.CopyFrom(agent_info(agent_id))
    buffer.owner.transports.append(Capabilities(path=PathName.UCX, memory_kinds=frozenset({DeviceKind.HOST}), one_sided=True).to_proto())
    return buffer


@pytest.mark.parametrize(
    "changes",
    [
        {"path": "ipc"}, {"path": ""}, {"owner_agent": ""}, {"owner_agent": "x" * 129}, {"owner_agent": "a\nb"},
        {"local_kind": 7}, {"remote_kind": common_pb2.DEVICE_KIND_UNSPECIFIED}, {"nbytes": 0}, {"nbytes": (1 << 40) + 1},
        {"get_bps": math.nan}, {"get_bps": math.inf}, {"get_bps": 0.0}, {"get_bps": -1.0}, {"get_bps": 2e15},
        {"push_bps": math.nan}, {"push_bps": -1.0}, {"push_bps": math.inf},
    ],
)  # fmt: skip
def test_a_measurement_no_agent_sends_is_refused_and_nothing_is_kept(changes: dict[str, object]) -> None:
    table = Measurements(PathPolicy(allow=("ucx",)))
    with pytest.raises(ProtocolError):
        table.record("reader", _valid("owner", **changes))
    assert len(table) == 0


def test_measurements_are_the_latest_per_pair_bounded_per_agent_and_go_with_their_agent() -> None:
    table = Measurements(PathPolicy(allow=("ucx",)), per_agent=3)
    src, dst = _buffer("owner"), _buffer("reader")
    table.record("reader", _valid("owner", get_bps=1e9, push_bps=4e9, push_reads=True))
    choice = table.choose(src, dst)
    assert choice.preferred_op == "write" and choice.measured is not None and choice.measured.measured_by == "reader"
    assert "get 1.00 GB/s, owner's push 4.00 GB/s: reads are pushed by the owner" in choice.reason
    table.record("reader", _valid("owner", get_bps=5e9, push_bps=1e9, push_reads=False))  # the latest wins
    assert table.choose(src, dst).preferred_op == "read" and len(table) == 1
    assert table.choose(dst, src).measured is None  # the other direction was never measured
    for index in range(5):  # other owners push the oldest out
        table.record("reader", _valid(f"other-{index}"))
    assert len(table) == 3 and table.choose(src, dst).measured is None
    table.record("reader", _valid("owner"))
    table.forget("reader")
    assert len(table) == 0 and table.choose(src, dst).measured is None
