"""hmcd as a process: serving on unix and TCP (plain and TLS), inventory, health, metrics, authentication, malformed requests."""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from control_fixtures import REPO, DaemonSet, FakeAgent, Hmcd, clean_env, daemon_set, short_tempdir, wait_until

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


def test_a_call_without_the_token_is_refused_at_its_headers_before_any_request_arrives(hmcd: Hmcd) -> None:
    """Refused before hmcd reads a byte of the request: a client without the token must not make hmcd receive and hold
    a message of up to 64 MiB on each of its streams. The request never comes here; a refusal that waited for it
    would end at the call's deadline instead."""
    never = threading.Event()

    def no_request() -> Iterator[daemon_pb2.NodeInfoRequest]:
        never.wait(30)
        yield from ()

    try:
        with grpc.insecure_channel(hmcd.tcp_address) as channel:
            for method, reply in (
                ("/hmc.v1.NodeService/GetNodeInfo", daemon_pb2.NodeInfo),
                ("/hmc.v1.RegistryService/ListBuffers", daemon_pb2.ListBuffersResponse),
            ):
                call = channel.stream_unary(method, request_serializer=daemon_pb2.NodeInfoRequest.SerializeToString, response_deserializer=reply.FromString)
                with pytest.raises(grpc.RpcError) as refused:
                    call(no_request(), timeout=20)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
            watch = channel.stream_stream("/hmc.v1.EventService/Watch", request_serializer=daemon_pb2.NodeInfoRequest.SerializeToString, response_deserializer=daemon_pb2.Event.FromString)
            with pytest.raises(grpc.RpcError) as refused:
                next(watch(no_request(), timeout=20))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        never.set()


def test_health_is_grpc_health_v1_and_needs_no_token_on_tcp(hmcd: Hmcd) -> None:
    """A probe (Kubernetes, a load balancer) checks hmcd over TCP without the token; nothing else is open."""
    with grpc.insecure_channel(hmcd.tcp_address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            stub.Check(health_pb2.HealthCheckRequest(service="hmc.v1.NoSuchService"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as watch:
            next(stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5))
        assert watch.value.code() == grpc.StatusCode.UNAUTHENTICATED  # a stream held open needs the token
        with pytest.raises(grpc.RpcError) as info:
            daemon_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(daemon_pb2.NodeInfoRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with hmcd.client(tcp=True, token="") as client, pytest.raises(AuthenticationError):
        client.health()  # the node's name comes from GetNodeInfo, which needs the token


def test_health_turns_not_serving_when_hmcd_stops(daemons: DaemonSet) -> None:
    stopping = daemons.start("stopping")
    with grpc.insecure_channel(stopping.unix_address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=20)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stopping.process.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING  # sent while calls drain, before the socket goes
        watch.cancel()
    assert stopping.process.wait(timeout=20) == 0


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
    assert 'hmc_rpc_total{code="OK",method="Check"}' in text  # grpc.health.v1
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


GARBAGE = b"\xff\xff\xff\xff\x0f not a protobuf"
MALFORMED = {
    "/hmc.v1.RegistryService/LookupBuffer": [
        GARBAGE,
        b"\x08\x01",  # field ref (a message) sent as a varint: parses, and names no buffer
        b"\x0a\x03\x12\x01\xff",  # ref.name is not UTF-8
        b"\x0a\x10\x12",  # ref claims 16 bytes, 1 follows
    ],
    "/hmc.v1.NodeService/GetNodeInfo": [GARBAGE],
    "/hmc.v1.TransferService/Submit": [GARBAGE, b"\x22\x02\x0a\xff"],
    "/hmc.v1.TransferService/Wait": [b"\x0a\x02\xc3\x28"],  # transfer_id is not UTF-8
}


def test_bytes_that_are_not_the_request_are_invalid_argument_in_one_log_line(hmcd: Hmcd) -> None:
    before = len(hmcd.log_text())
    sent = 0
    with grpc.insecure_channel(hmcd.unix_address) as channel:
        for method, payloads in MALFORMED.items():
            call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            for payload in payloads:
                with pytest.raises(grpc.RpcError) as caught:
                    call(payload, timeout=5)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, payload, caught.value.details())
                assert dict(caught.value.trailing_metadata())["hmc-error-code"] in ("2", "8")
                sent += 1
        attach = channel.stream_stream("/hmc.v1.RegistryService/Attach", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as caught:
            list(attach(iter([GARBAGE]), timeout=5))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in (caught.value.details() or "")
        sent += 1
    with hmcd.client() as client:
        assert client.health().serving
    logged = hmcd.log_text()[before:]  # each line is written before its call's status is sent
    assert "Traceback" not in logged and "UNKNOWN" not in logged
    assert sum("refused" in line for line in logged.splitlines()) == sent, logged


def test_unknown_buffer(hmcd: Hmcd) -> None:
    with hmcd.client() as client, pytest.raises(UnknownBufferError, match="no-such-buffer"):
        client.lookup("no-such-buffer")


def test_bad_configuration_stops_hmcd_at_start_naming_the_key(scratch: str) -> None:
    socket = os.path.join(scratch, "bad.sock")
    for extra, env, key in (
        ((), {"HMC_TIMEOUT_S": "nan"}, "HMC_TIMEOUT_S"),
        (("--static-peer", "nowhere"), {}, "static_peers"),
    ):
        run = subprocess.run(
            [sys.executable, "-m", "hmc.control._hmcd_main", "--socket", socket, "--node", "bad", *extra],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=REPO,
            env=clean_env(**env),
        )
        assert run.returncode == 1 and key in run.stderr, run.stderr
        assert "Traceback" not in run.stderr
        assert not os.path.exists(socket)


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


def _heard_from(sock: socket.socket) -> str:
    """What hmcd did with a silent connection so far: "" nothing yet, "answered" (it sent its HTTP/2 settings: taken),
    "closed" (refused)."""
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return ""
    except ConnectionResetError:
        return "closed"
    return "answered" if data else "closed"


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
@pytest.mark.parametrize(("limits", "soft_after", "taken"), [("256:4096", 4096, range(300, 301)), ("256:256", 256, range(1, 129))])
def test_silent_tcp_connections_cannot_cut_hmcd_off_its_unix_socket(scratch: str, limits: str, soft_after: int, taken: range) -> None:
    """A client without the token holds 300 silent TCP connections, more than the soft limit on open files hmcd was
    started with. hmcd raised that limit to the hard one, and takes at most half of it in TCP connections (gRPC
    closes the rest at once): its own node's clients still get through on the unix socket."""
    hmcd = Hmcd.start(scratch, "flood", token=TOKEN, args=("--log-level", "debug"), env=clean_env(), prefix=("prlimit", f"--nofile={limits}", "--"), cwd=str(REPO))
    held: list[socket.socket] = []
    try:
        limit_line = next(line for line in Path(f"/proc/{hmcd.process.pid}/limits").read_text().splitlines() if line.startswith("Max open files"))
        assert limit_line.split()[3] == str(soft_after)
        assert ("raised the soft limit on open files from 256 to 4096" in hmcd.log_text()) == (soft_after == 4096)
        for _ in range(300):
            held.append(socket.create_connection(("127.0.0.1", hmcd.port), timeout=5))
        wait_until(lambda: all(_heard_from(s) for s in held), 10.0, "hmcd to take or refuse every connection")
        assert sum(_heard_from(s) == "answered" for s in held) in taken
        with hmcd.client(timeout=5.0) as client:
            assert client.node_info().node == "flood"
    finally:
        for sock in held:
            sock.close()
        hmcd.stop()


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


# -- TLS on the TCP listener ----------------------------------------------------------------


class TlsFiles:
    """A CA and a server certificate for 127.0.0.1/localhost it signed, another CA, made at test time."""

    def __init__(self, directory: Path) -> None:
        x509 = pytest.importorskip("cryptography.x509", reason="TLS tests make certificates with the cryptography package")
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        now = datetime.datetime.now(datetime.timezone.utc)

        def name(common: str) -> object:
            return x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, common)])

        def certificate(subject: str, key: object, issuer: str, signer: object, *, ca: bool) -> object:
            builder = (
                x509.CertificateBuilder()
                .subject_name(name(subject))
                .issuer_name(name(issuer))
                .public_key(key.public_key())  # type: ignore[attr-defined]
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            )
            if not ca:
                alt = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
            return builder.sign(signer, hashes.SHA256())  # type: ignore[arg-type]

        def write(file: str, data: bytes) -> str:
            path = directory / file
            path.write_bytes(data)
            path.chmod(0o600)
            return str(path)

        def pem(cert: object) -> bytes:
            return cert.public_bytes(serialization.Encoding.PEM)  # type: ignore[attr-defined]

        ca_key, other_key, server_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
        self.ca = write("ca.pem", pem(certificate("hmc test CA", ca_key, "hmc test CA", ca_key, ca=True)))
        self.other_ca = write("other-ca.pem", pem(certificate("another CA", other_key, "another CA", other_key, ca=True)))
        self.cert = write("server.pem", pem(certificate("hmcd", server_key, "hmc test CA", ca_key, ca=False)))
        self.key = write(
            "server.key", server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        self.other_key = write(
            "other.key", other_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        self.garbage = write("garbage.pem", b"-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")


@pytest.fixture(scope="module")
def tls(daemons: DaemonSet) -> TlsFiles:
    return TlsFiles(Path(daemons.directory))


@pytest.fixture(scope="module")
def tls_hmcd(daemons: DaemonSet, tls: TlsFiles) -> Hmcd:
    return daemons.start("tls-node", token=TOKEN, extra_args=("--tls-cert", tls.cert, "--tls-key", tls.key))


def test_tls_client_with_the_token_is_served(tls_hmcd: Hmcd, tls: TlsFiles) -> None:
    with Client(tls_hmcd.tcp_address, config=tls_hmcd.config(tls_ca=tls.ca)) as client:
        assert client.health().node == "tls-node"
        assert client.node_info().tcp_address == tls_hmcd.tcp_address
    log = tls_hmcd.log_text()
    assert f"tcp {tls_hmcd.tcp_address} (TLS)" in log and "in clear" not in log


def test_tls_client_with_a_wrong_token_is_refused(tls_hmcd: Hmcd, tls: TlsFiles) -> None:
    with Client(tls_hmcd.tcp_address, config=tls_hmcd.config(tls_ca=tls.ca), token="wrong") as client, pytest.raises(AuthenticationError, match="wrong token"):
        client.node_info()


@pytest.mark.parametrize("trust", ["plaintext", "another CA"])
def test_a_client_that_cannot_verify_hmcd_never_gets_through(tls_hmcd: Hmcd, tls: TlsFiles, trust: str) -> None:
    config = tls_hmcd.config(tls_ca=tls.other_ca if trust == "another CA" else "")
    with Client(tls_hmcd.tcp_address, config=config, timeout=5.0) as client, pytest.raises(UnavailableError, match=tls_hmcd.tcp_address):
        client.health()
    with tls_hmcd.client() as client:
        assert client.health().serving  # over unix, still serving


def test_a_token_without_tls_is_warned_about(hmcd: Hmcd) -> None:
    assert "the token crosses the network in clear" in hmcd.log_text()


def test_peer_daemons_speak_tls_when_given_the_ca(daemons: DaemonSet, tls_hmcd: Hmcd, tls: TlsFiles) -> None:
    owner = FakeAgent(tls_hmcd.config())
    trusting = daemons.start("tls-peer", token=TOKEN, static_peers=(tls_hmcd.tcp_address,), extra_args=("--tls-ca", tls.ca))
    blind = daemons.start("plain-peer", token=TOKEN, static_peers=(tls_hmcd.tcp_address,))
    try:
        owner.register("kv-behind-tls", size=4096)
        with trusting.client() as client:
            wait_until(lambda: [p.up for p in client.node_info().peers] == [True], what="tls-peer to see tls-node up")
            assert client.lookup("kv-behind-tls").owner.node == "tls-node"
        with blind.client() as client:
            wait_until(lambda: client.node_info().peers[0].error != "", what="a failed health check from plain-peer")
            assert not client.node_info().peers[0].up
            with pytest.raises(UnavailableError, match=tls_hmcd.tcp_address):
                client.lookup("kv-behind-tls")
    finally:
        owner.close()
        trusting.stop()
        blind.stop()


def _hmcd_exit(scratch: str, *options: str) -> subprocess.CompletedProcess[str]:
    """Run hmcd with `options` on a scratch socket and TCP port 0, expecting it to refuse to start."""
    args = [sys.executable, "-m", "hmc.control._hmcd_main", "--socket", os.path.join(scratch, "x.sock"), "--listen", "127.0.0.1:0", "--node", "x", *options]
    return subprocess.run(args, capture_output=True, text=True, timeout=30, cwd=REPO, env={k: v for k, v in os.environ.items() if not k.startswith("HMC_")})


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("cert only", "tls_cert is set but tls_key is not"),
        ("key only", "tls_key is set but tls_cert is not"),
        ("missing cert", "cannot read tls_cert {scratch}/none.pem"),
        ("garbage cert", "tls_cert {garbage} holds no PEM certificate"),
        ("key of another certificate", "tls_key {other_key} is not an unencrypted PEM private key of tls_cert {cert}"),
        ("garbage ca", "tls_ca {garbage} holds no PEM certificate"),
    ],
)
def test_hmcd_refuses_tls_files_that_do_not_load(tls: TlsFiles, scratch: str, case: str, expected: str) -> None:
    options = {
        "cert only": ("--tls-cert", tls.cert),
        "key only": ("--tls-key", tls.key),
        "missing cert": ("--tls-cert", os.path.join(scratch, "none.pem"), "--tls-key", tls.key),
        "garbage cert": ("--tls-cert", tls.garbage, "--tls-key", tls.key),
        "key of another certificate": ("--tls-cert", tls.cert, "--tls-key", tls.other_key),
        "garbage ca": ("--tls-ca", tls.garbage, "--static-peer", "127.0.0.1:1"),
    }[case]
    run = _hmcd_exit(scratch, *options)
    assert run.returncode == 1, run.stderr
    assert expected.format(scratch=scratch, garbage=tls.garbage, other_key=tls.other_key, cert=tls.cert) in run.stderr
    assert "Traceback" not in run.stderr
    assert not os.path.exists(os.path.join(scratch, "x.sock"))
