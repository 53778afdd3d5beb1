"""hmcd as a process: serving on unix and TCP, inventory, health, metrics, authentication, malformed requests."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from control_fixtures import REPO, DaemonSet, FakeAgent, Hmcd, daemon_set, short_tempdir

from hmc.config import Config
from hmc.control import Client
from hmc.errors import ArgumentError, AuthenticationError, ProtocolError, UnavailableError, UnknownBufferError
from hmc.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

TOKEN = "test-token-123"


@pytest.fixture(scope="module")
def daemons() -> Iterator[DaemonSet]:
    yield from daemon_set()


@pytest.fixture(scope="module")
def hmcd(daemons: DaemonSet) -> Hmcd:
    return daemons.start("node-a", token=TOKEN, extra_args=("--metrics-port", "0"))


def test_node_info_over_unix(hmcd: Hmcd) -> None:
    with hmcd.client() as client:
        info = client.node_info()
        assert info.node == "node-a"
        assert info.protocol_version == 1
        assert info.unix_address == hmcd.unix_address
        assert info.tcp_address == hmcd.tcp_address  # the port bound for port 0
        assert info.devices[0].name == "host"
        assert {t.path for t in info.transports} >= {"local", "staged"}
        assert client.devices()[0].kind == common_pb2.DEVICE_KIND_HOST
        assert client.health().serving


def test_tcp_needs_the_token(hmcd: Hmcd) -> None:
    with hmcd.client(tcp=True) as client:
        assert client.health().node == "node-a"
    with hmcd.client(tcp=True, token="wrong") as client, pytest.raises(AuthenticationError, match="wrong token"):
        client.node_info()
    with hmcd.client(tcp=True, token="") as client, pytest.raises(AuthenticationError, match="missing"):
        client.buffers()
    with hmcd.client(tcp=True, token="wrong") as client, pytest.raises(AuthenticationError):
        list(client.events(timeout=1.0))


def test_unix_socket_is_private(hmcd: Hmcd) -> None:
    assert stat.S_IMODE(os.stat(hmcd.socket).st_mode) == 0o600


@pytest.fixture
def scratch() -> Iterator[str]:
    directory = short_tempdir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_unreachable_hmcd_is_unavailable_and_names_the_address(scratch: str) -> None:
    missing = os.path.join(scratch, "nobody.sock")
    with Client(config=Config(socket=missing, timeout_s=2.0)) as client, pytest.raises(UnavailableError, match="nobody.sock"):
        client.health()


def test_metrics_text_over_grpc_and_http(hmcd: Hmcd) -> None:
    with hmcd.client() as client:
        client.health()
        text = client.metrics()
    for name in ("hmc_agents", "hmc_buffers", "hmc_peers_up", "hmc_transfers_active", "hmc_rpc_total", "hmc_events_total"):
        assert name in text
    assert 'hmc_rpc_total{code="OK",method="Health"}' in text
    port = next(line.rsplit(" ", 1)[-1] for line in hmcd.log_text().splitlines() if "metrics on http port" in line)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert b"hmc_agents" in reply.read()


def test_malformed_requests_are_invalid_argument(hmcd: Hmcd) -> None:
    agent = FakeAgent(hmcd.config())
    try:
        agent.register("well-formed", size=4096)
        with grpc.insecure_channel(hmcd.unix_address) as channel:
            registry = daemon_pb2_grpc.RegistryServiceStub(channel)
            transfers = daemon_pb2_grpc.TransferServiceStub(channel)
            paths = daemon_pb2_grpc.PathServiceStub(channel)
            calls = [
                lambda: registry.LookupBuffer(daemon_pb2.LookupBufferRequest(), timeout=5),
                lambda: paths.Negotiate(daemon_pb2.NegotiateRequest(src=daemon_pb2.BufferRef(name="well-formed")), timeout=5),
                lambda: transfers.Submit(
                    daemon_pb2.SubmitTransferRequest(
                        src=daemon_pb2.BufferRef(name="well-formed"),
                        dst=daemon_pb2.BufferRef(name="well-formed"),
                        ranges=common_pb2.RangeList(src_offsets=b"garbage", dst_offsets=b"\x00" * 8, lengths=b"\x01" * 8),
                    ),
                    timeout=5,
                ),
                lambda: transfers.Wait(daemon_pb2.TransferRef(transfer_id=""), timeout=5),
            ]
            for call in calls:
                with pytest.raises(grpc.RpcError) as caught:
                    call()
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
                assert dict(caught.value.trailing_metadata())["hmc-error-code"] in ("2", "8")
        with hmcd.client() as client:
            with pytest.raises(ProtocolError, match="whole number of int64"):
                client._call(  # noqa: SLF001 - a malformed request the public API cannot build
                    client._transfers.Submit,  # noqa: SLF001
                    daemon_pb2.SubmitTransferRequest(
                        src=daemon_pb2.BufferRef(name="well-formed"), dst=daemon_pb2.BufferRef(name="well-formed"), ranges=common_pb2.RangeList(lengths=b"123")
                    ),
                )
            with pytest.raises(ArgumentError):
                client.lookup("")
            assert client.health().serving  # still up
    finally:
        agent.close()


def test_unknown_buffer(hmcd: Hmcd) -> None:
    with hmcd.client() as client, pytest.raises(UnknownBufferError, match="no-such-buffer"):
        client.lookup("no-such-buffer")


def test_help_answers() -> None:
    out = subprocess.run([sys.executable, "-m", "hmc.control._hmcd_main", "--help"], capture_output=True, text=True, timeout=30, cwd=REPO, check=True).stdout
    for option in ("--config", "--socket", "--listen", "--port-file", "--token", "--node", "--static-peer", "--log-level", "--metrics-port"):
        assert option in out


def test_second_hmcd_on_the_same_socket_refuses(hmcd: Hmcd) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "hmc.control._hmcd_main", "--socket", hmcd.socket, "--node", "clash"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
    )
    assert run.returncode == 1
    assert "already serving" in run.stderr
    with hmcd.client() as client:
        assert client.health().serving


def test_a_taken_tcp_port_is_refused_cleanly(hmcd: Hmcd, scratch: str) -> None:
    socket = os.path.join(scratch, "late.sock")
    run = subprocess.run(
        [sys.executable, "-m", "hmc.control._hmcd_main", "--socket", socket, "--listen", hmcd.tcp_address, "--node", "late"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
    )
    assert run.returncode == 1
    assert "cannot listen on" in run.stderr
    assert not os.path.exists(socket)  # the unix socket it had bound is gone again
