"""The agent's peer listener under hostile or broken input: typed replies, that connection only; bounded notifications."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import numpy as np
import pytest

from hmc.agent import Agent, ConnBuffer
from hmc.config import Config
from hmc.errors import (
    AccessDeniedError,
    BrokenResourceError,
    BusyResourceError,
    OutOfRangeError,
    ProtocolError,
    UnknownBufferError,
    VersionMismatchError,
    error_from_code,
)
from hmc.testing import PeerProcess
from hmc.transport._ranges import MAX_NOTIFY_BYTES, MAX_TRANSFER_ID, RangeList
from hmc.transport._handshake import connect, handshake
from hmc.transport._wire import FrameStream
from hmc.v1 import common_pb2, peer_pb2

POISON = 0xA5
CONTROL, DATA = peer_pb2.PeerHello.CHANNEL_CONTROL, peer_pb2.PeerHello.CHANNEL_DATA


def _deadline() -> float:
    return time.monotonic() + 5


@pytest.fixture
def target(agent: Agent) -> ConnBuffer:
    return agent.register(np.full(1 << 16, POISON, np.uint8))


def _open(agent: Agent, channel: int, proves: common_pb2.BufferDescriptor) -> FrameStream:
    stream = FrameStream(connect(agent.info.endpoint, _deadline()), "agent")
    handshake(stream, common_pb2.AgentInfo(id="raw-test-peer"), channel, _deadline(), proves)
    return stream


@pytest.fixture
def data_stream(agent: Agent, target: ConnBuffer) -> Iterator[FrameStream]:
    stream = _open(agent, DATA, target.descriptor)
    yield stream
    stream.close()


def _reply_error(stream: FrameStream) -> BaseException | None:
    reply = stream.recv(_deadline()).reply
    return error_from_code(reply.error.code, reply.error.message) if reply.HasField("error") else None


def _write_frame(
    stream: FrameStream, buffer: common_pb2.BufferDescriptor, dst: list[int], lengths: list[int], key: bytes | None = None
) -> peer_pb2.PeerFrame:
    ranges = RangeList.build(np.zeros(len(dst), np.int64), dst, lengths).to_proto()
    proof = stream.proof(buffer.access_key if key is None else key)
    return peer_pb2.PeerFrame(request_id=1, write=peer_pb2.DataWrite(buffer_id=buffer.id, key_proof=proof, ranges=ranges))


def _agent_still_serves(agent: Agent, target: ConnBuffer, make_agent: object) -> None:
    other = make_agent(("staged",))  # type: ignore[operator]
    src = other.register(np.arange(4096, dtype=np.uint8) % 251)
    other.write(src, target.descriptor, 0, 100, 4096).wait()
    assert np.array_equal(target.numpy()[100:4196], src.numpy())


@pytest.mark.parametrize(
    "garbage",
    [b"\x00\x00\x00\x00", b"\xff\xff\xff\xff" + b"x" * 64, struct.pack("<I", 5) + b"\x12\x34\x56\x78\x9a", b"GET / HTTP/1.1\r\n\r\n"],
    ids=["empty-frame", "huge-length", "undecodable", "http"],
)
def test_garbage_before_hello_gets_protocol_error_or_close(agent: Agent, target: ConnBuffer, make_agent: object, garbage: bytes) -> None:
    with socket.create_connection(("127.0.0.1", agent.info.endpoint.port), timeout=5) as raw:
        raw.sendall(garbage)
        stream = FrameStream(raw.dup(), "agent")
        try:
            error = _reply_error(stream)
            assert isinstance(error, ProtocolError)
        except BrokenResourceError:
            pass  # closing this one connection is an acceptable answer too
        finally:
            stream.close()
    _agent_still_serves(agent, target, make_agent)


def test_other_protocol_version_is_refused(agent: Agent) -> None:
    with socket.create_connection(("127.0.0.1", agent.info.endpoint.port), timeout=5) as raw:
        stream = FrameStream(raw.dup(), "agent")
        stream.send(peer_pb2.PeerFrame(hello=peer_pb2.PeerHello(protocol_version=99, channel=CONTROL)))
        assert isinstance(_reply_error(stream), VersionMismatchError)
        stream.close()


def test_refused_data_writes_drain_their_payload_and_write_nothing(data_stream: FrameStream, target: ConnBuffer) -> None:
    d = target.descriptor
    payload = [memoryview(b"\x01" * 4096)]
    cases = [
        (_write_frame(data_stream, d, [(1 << 16) - 4095], [4096]), OutOfRangeError),
        (_write_frame(data_stream, d, [0], [4096], key=b"\x00" * 16), AccessDeniedError),
        (_write_frame(data_stream, common_pb2.BufferDescriptor(id="nope", access_key=d.access_key), [0], [4096]), UnknownBufferError),
    ]
    for frame, error in cases:
        data_stream.send(frame, payload)
        assert isinstance(_reply_error(data_stream), error)
    assert (target.numpy() == POISON).all()
    data_stream.send(_write_frame(data_stream, d, [10], [4096]), payload)  # the same connection still works
    assert _reply_error(data_stream) is None
    assert (target.numpy()[10:4106] == 1).all() and (target.numpy()[4106:] == POISON).all()


@pytest.mark.parametrize("count", [1, 20])  # decoded with struct, and as numpy views of the frame
def test_negative_lengths_close_the_data_connection(data_stream: FrameStream, target: ConnBuffer, count: int) -> None:
    data_stream.send(_write_frame(data_stream, target.descriptor, [64 * i for i in range(count)], [16] * (count - 1) + [-5]))
    assert isinstance(_reply_error(data_stream), ProtocolError)
    with pytest.raises(BrokenResourceError):
        data_stream.recv(_deadline())
    assert (target.numpy() == POISON).all()


@pytest.mark.parametrize("count", [1, 3, 20], ids=["one", "few", "many"])  # few: decoded with struct; many: numpy
def test_short_and_long_range_lists_are_checked_alike(data_stream: FrameStream, target: ConnBuffer, count: int) -> None:
    d, size = target.descriptor, target.size
    dst = [i * 64 for i in range(count)]
    payload = [memoryview(b"\x02" * 16 * count)]
    last = count - 1
    for bad_dst, error in (([*dst[:last], -64], OutOfRangeError), ([*dst[:last], size - 8], OutOfRangeError)):
        data_stream.send(_write_frame(data_stream, d, bad_dst, [16] * count), payload)
        assert isinstance(_reply_error(data_stream), error)
    assert (target.numpy() == POISON).all()
    data_stream.send(_write_frame(data_stream, d, dst, [16] * count), payload)
    assert _reply_error(data_stream) is None
    assert all((target.numpy()[o : o + 16] == 2).all() for o in dst)
    if count == 1:
        return  # no offsets at all means offset 0 (as RangeList.from_proto reads it)
    wire = RangeList.build(np.zeros(count, np.int64), dst, 16).to_proto()
    wire.dst_offsets = wire.dst_offsets[:-8]  # one offset short
    data_stream.send(peer_pb2.PeerFrame(request_id=2, write=peer_pb2.DataWrite(buffer_id=d.id, key_proof=data_stream.proof(d.access_key), ranges=wire)), payload)
    assert isinstance(_reply_error(data_stream), ProtocolError)


@pytest.mark.parametrize("count", [1, 20])
def test_absurd_lengths_close_the_data_connection(data_stream: FrameStream, target: ConnBuffer, count: int) -> None:
    data_stream.send(_write_frame(data_stream, target.descriptor, [0] * count, [16] * (count - 1) + [1 << 41]))
    assert isinstance(_reply_error(data_stream), ProtocolError)
    with pytest.raises(BrokenResourceError):
        data_stream.recv(_deadline())
    assert (target.numpy() == POISON).all()


def test_wrong_requests_on_each_channel_get_protocol_errors(agent: Agent, target: ConnBuffer) -> None:
    control = _open(agent, CONTROL, target.descriptor)
    control.send(_write_frame(control, target.descriptor, [0], [16]))
    assert isinstance(_reply_error(control), ProtocolError)
    control.send(peer_pb2.PeerFrame(request_id=2, notify=peer_pb2.Notify(buffer_id=target.id, key_proof=control.proof(b"bad"), transfer_id="t")))
    assert isinstance(_reply_error(control), AccessDeniedError)
    control.close()
    data = _open(agent, DATA, target.descriptor)
    data.send(peer_pb2.PeerFrame(request_id=3, open=peer_pb2.OpenBuffer(buffer_id=target.id)))
    assert isinstance(_reply_error(data), ProtocolError)
    data.close()
    assert agent.notifications(0) == []


def test_peer_dying_mid_payload_leaves_the_agent_serving(agent: Agent, target: ConnBuffer, make_agent: object) -> None:
    stream = _open(agent, DATA, target.descriptor)
    stream.send(_write_frame(stream, target.descriptor, [0], [60000]), [memoryview(b"\x02" * 100)])
    stream.close()
    _agent_still_serves(agent, target, make_agent)


def test_a_notification_too_large_or_with_a_long_transfer_id_is_refused_and_never_delivered(agent: Agent, target: ConnBuffer, make_agent: object) -> None:
    """A peer that skips the sender's checks (`check_notify`) is refused by the owner, on that request only."""
    control = _open(agent, CONTROL, target.descriptor)

    def notify(request_id: int, payload: bytes, transfer_id: str) -> BaseException | None:
        proof = control.proof(target.descriptor.access_key)
        control.send(peer_pb2.PeerFrame(request_id=request_id, notify=peer_pb2.Notify(buffer_id=target.id, key_proof=proof, transfer_id=transfer_id, payload=payload)))
        return _reply_error(control)

    assert isinstance(notify(1, b"\x07" * (MAX_NOTIFY_BYTES + 1), "t-big"), ProtocolError)
    assert isinstance(notify(2, b"\x07", "t" * (MAX_TRANSFER_ID + 1)), ProtocolError)
    assert agent.notifications(0) == []
    largest = bytes(range(256)) * (MAX_NOTIFY_BYTES // 256)
    assert notify(3, largest, "t" * MAX_TRANSFER_ID) is None  # the same connection goes on; the largest of each passes
    [delivered] = agent.notifications(0)
    assert (delivered.payload, delivered.transfer_id, delivered.sender_agent) == (largest, "t" * MAX_TRANSFER_ID, "raw-test-peer")
    control.close()
    _agent_still_serves(agent, target, make_agent)


def test_an_owner_that_does_not_drain_refuses_notifications_past_its_inbox_and_takes_them_again_once_drained(
    config: Config, rng: np.random.Generator
) -> None:
    """A real peer process sends; the owner holds at most `notify_inbox_bytes`: the sender's transfer fails BUSY (its
    data landed: the notification is what was refused), and once drained the same notification is taken."""
    size = 1 << 16
    with Agent(config.replace(notify_inbox_bytes=1 << 20), daemon=False) as owner:
        peer = PeerProcess(config)
        try:
            target = owner.register(np.full(size, POISON, np.uint8))
            data = rng.integers(0, 256, size, dtype=np.uint8)
            source = peer.register(size)
            peer.fill(source.id, data.tobytes())
            notes = [rng.integers(0, 256, MAX_NOTIFY_BYTES // 2, dtype=np.uint8).tobytes() for _ in range(3)]
            peer.transfer("write", source.id, target.descriptor, 0, 0, 4096, notify=notes[0])
            peer.transfer("write", source.id, target.descriptor, 4096, 4096, 4096, notify=notes[1])  # exactly full
            with pytest.raises(BusyResourceError, match="undrained"):
                peer.transfer("write", source.id, target.descriptor, 8192, 8192, 4096, notify=notes[2])
            expected = np.full(size, POISON, np.uint8)
            expected[:12288] = data[:12288]  # the refused notification's data landed before it was sent
            assert np.array_equal(target.numpy(), expected)
            assert [n.payload for n in owner.notifications(0)] == notes[:2]
            peer.transfer("write", source.id, target.descriptor, 8192, 8192, 4096, notify=notes[2])
            assert [n.payload for n in owner.notifications(5.0)] == notes[2:]
        finally:
            peer.close()
