"""Opening peer connections: the TCP connect, and the versioned handshake both ends run on a new connection.

The initiator says hello, the listener answers with its own hello and a fresh nonce, the initiator proves
the access key of one of the listener's buffers over that nonce (`key_proof`: keys never travel), and only
then does the listener accept frames larger than `HELLO_FRAME`. Both ends refuse another protocol version
(VersionMismatchError). Frames themselves are `hmc.transport._wire`'s.

Concurrency: each call runs on its caller's thread, on a stream nobody else uses yet.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
from collections.abc import Callable

from hmc.errors import HMCError, ProtocolError, UnavailableError, VersionMismatchError
from hmc.transport._wire import _NONCE_BYTES, MAX_FRAME, PROTOCOL_VERSION, FrameStream, _remaining, raise_for_reply
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["accept_handshake", "connect", "handshake", "tune_socket"]


def tune_socket(sock: socket.socket, keepalive_s: float, unacked_s: float) -> None:
    """Detect a silent peer: keepalive probes after `keepalive_s` idle (3 probes, `keepalive_s`/3 apart), and
    the kernel resets the connection when sent data stays unacknowledged for `unacked_s` (TCP_USER_TIMEOUT),
    which also drops what it still held to send.

    A connection within this host (both ends on one address: the kernel's loopback) is switched to Reno, which
    every kernel allows: a pacing congestion control (BBR) only slows it down, there being no network to share
    (2-core VM, a 4 MiB send and its one-byte answer: 1.08 ms under BBR, 0.49 ms under Reno)."""
    idle = max(1, int(keepalive_s))
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, idle // 3))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1000, int(unacked_s * 1000)))
    with contextlib.suppress(OSError, AttributeError):
        if sock.getsockname()[0] == sock.getpeername()[0]:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"reno")


def connect(endpoint: common_pb2.TcpEndpoint, deadline: float, *, buffer_bytes: int = 0) -> socket.socket:
    """A TCP connection to a peer agent's listener (UnavailableError when it cannot be reached)."""
    address = (endpoint.host, endpoint.port)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(_remaining(deadline))
        sock.connect(address)
    except HMCError:
        sock.close()
        raise
    except OSError as exc:
        sock.close()
        raise UnavailableError(f"cannot reach agent at {address[0]}:{address[1]}: {exc}") from exc
    return sock


def _hello(local: common_pb2.AgentInfo, channel: int, nonce: bytes = b"") -> peer_pb2.PeerFrame:
    hello = peer_pb2.PeerHello(protocol_version=PROTOCOL_VERSION, agent=local, channel=channel, nonce=nonce, max_frame=MAX_FRAME)
    return peer_pb2.PeerFrame(hello=hello)


def _check_version(hello: peer_pb2.PeerHello, peer: str) -> None:
    if hello.protocol_version != PROTOCOL_VERSION:
        raise VersionMismatchError(
            f"{peer} speaks peer protocol version {hello.protocol_version}, this agent speaks {PROTOCOL_VERSION}"
        )


def _expect(stream: FrameStream, deadline: float, kind: str, what: str) -> peer_pb2.PeerFrame:
    """The next frame, which must be of `kind` (a reply carrying an error raises that error)."""
    frame = stream.recv(deadline)
    got = frame.WhichOneof("kind")
    if got == "reply":
        raise_for_reply(frame.reply)
    if got != kind:
        raise ProtocolError(f"{stream.peer} answered {what} with {got or 'an empty frame'}")
    return frame


def handshake(
    stream: FrameStream, local: common_pb2.AgentInfo, channel: int, deadline: float, proves: common_pb2.BufferDescriptor
) -> peer_pb2.PeerHello:
    """Initiator side: hellos, then prove `proves`' access key (a buffer of the listener's); typed error if refused."""
    stream.send(_hello(local, channel), deadline=deadline)
    hello = _expect(stream, deadline, "hello", "the hello").hello
    _check_version(hello, stream.peer)
    if len(hello.nonce) != _NONCE_BYTES:
        raise ProtocolError(f"{stream.peer} sent a hello without a nonce")
    stream.nonce = hello.nonce
    stream.peer_max_frame = hello.max_frame or MAX_FRAME
    auth = peer_pb2.Auth(buffer_id=proves.id, key_proof=stream.proof(proves.access_key, proves.registry_epoch))
    stream.send(peer_pb2.PeerFrame(auth=auth), deadline=deadline)
    _expect(stream, deadline, "reply", "the proof")
    return hello


def accept_handshake(
    stream: FrameStream, local: common_pb2.AgentInfo, deadline: float, authenticate: Callable[[FrameStream, peer_pb2.Auth], None]
) -> peer_pb2.PeerHello:
    """Listener side: read the initiator's hello, check its version, answer with ours and a nonce, then check the
    initiator's proof (`authenticate` raises AccessDeniedError & co); only then may larger frames come.

    Raises ProtocolError (VersionMismatchError for other versions) and the
    authentication's error; the caller sends it back as an error reply before
    hanging up.
    """
    frame = stream.recv(deadline)
    if frame.WhichOneof("kind") != "hello":
        raise ProtocolError(f"{stream.peer} did not start with a hello")
    _check_version(frame.hello, stream.peer)
    stream.nonce = secrets.token_bytes(_NONCE_BYTES)
    stream.send(_hello(local, frame.hello.channel, stream.nonce), deadline=deadline)
    auth = stream.recv(deadline)
    if auth.WhichOneof("kind") != "auth":
        raise ProtocolError(f"{stream.peer} did not prove a key after the hello")
    authenticate(stream, auth.auth)
    stream.max_frame = MAX_FRAME
    stream.send(peer_pb2.PeerFrame(reply=peer_pb2.PeerReply()), deadline=deadline)
    return frame.hello
