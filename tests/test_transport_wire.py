"""Framing, handshake and the control channel over real socket pairs."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from hmc.errors import AccessDeniedError, BrokenResourceError, ProtocolError, TimeoutError, UnavailableError, UnsupportedError, VersionMismatchError
from hmc.transport._channel import Channel
from hmc.transport._ranges import iovec_rows
from hmc.transport._splice import LEND_MIN_BYTES, Lender
from hmc.transport._handshake import accept_handshake, connect, handshake
from hmc.transport._wire import (
    HELLO_FRAME,
    INLINE_MAX,
    MAX_FRAME,
    OK_FRAME,
    FrameStream,
    _row_views,
    error_reply,
    framed,
    key_proof,
)
from hmc.v1 import common_pb2, peer_pb2


@pytest.fixture
def streams() -> Iterator[tuple[FrameStream, FrameStream]]:
    a, b = socket.socketpair()
    left, right = FrameStream(a, "left"), FrameStream(b, "right")
    yield left, right
    left.close()
    right.close()


def test_frames_and_payload_travel_zero_copy(streams: tuple[FrameStream, FrameStream], rng: np.random.Generator) -> None:
    left, right = streams
    data = rng.integers(0, 256, 300_000, dtype=np.uint8)
    view = memoryview(data)
    parts = [view[i : i + 97] for i in range(0, 200_000, 100)] + [view[200_000:]]
    frame = peer_pb2.PeerFrame(request_id=7, write=peer_pb2.DataWrite(buffer_id="b"))
    sender = threading.Thread(target=left.send, args=(frame, parts))
    sender.start()
    got = right.recv(time.monotonic() + 5)
    assert got == frame
    out = np.zeros(sum(p.nbytes for p in parts), np.uint8)
    cut = memoryview(out)
    right.recv_into([cut[:5], cut[5:150_000], cut[150_000:]], time.monotonic() + 5)
    sender.join()
    assert np.array_equal(out, np.concatenate([np.asarray(p) for p in parts]))


def test_eof_is_broken_resource(streams: tuple[FrameStream, FrameStream]) -> None:
    left, right = streams
    left.close()
    with pytest.raises(BrokenResourceError):
        right.recv(time.monotonic() + 5)
    with pytest.raises(BrokenResourceError):
        right.recv(time.monotonic() + 5)


def test_idle_timeout_keeps_the_stream_but_a_torn_frame_breaks_it(streams: tuple[FrameStream, FrameStream]) -> None:
    left, right = streams
    with pytest.raises(TimeoutError):
        right.recv(time.monotonic() + 0.05, idle_ok=True)
    left.send(peer_pb2.PeerFrame(request_id=1))
    assert right.recv(time.monotonic() + 5).request_id == 1
    left._tx.sendall(struct.pack("<I", 100)[:2])  # a frame header that never completes
    with pytest.raises(TimeoutError):
        right.recv(time.monotonic() + 0.05, idle_ok=True)
    assert right.broken
    with pytest.raises(BrokenResourceError):
        right.recv(time.monotonic() + 5)


@pytest.mark.parametrize("raw", [struct.pack("<I", MAX_FRAME + 1), struct.pack("<I", 3) + b"\xff\xff\xff"])
def test_oversized_or_undecodable_frames_are_protocol_errors(streams: tuple[FrameStream, FrameStream], raw: bytes) -> None:
    left, right = streams
    left._tx.sendall(raw)
    with pytest.raises(ProtocolError):
        right.recv(time.monotonic() + 5)


def test_handshake_refuses_other_protocol_versions(streams: tuple[FrameStream, FrameStream]) -> None:
    left, right = streams
    me = common_pb2.AgentInfo(id="me")
    left.send(peer_pb2.PeerFrame(hello=peer_pb2.PeerHello(protocol_version=99, agent=me)))
    with pytest.raises(VersionMismatchError):
        accept_handshake(right, common_pb2.AgentInfo(id="them"), time.monotonic() + 5, _refuse)
    right.send(peer_pb2.PeerFrame(reply=error_reply(VersionMismatchError("speaks 1"))))
    with pytest.raises(VersionMismatchError):
        handshake(left, me, peer_pb2.PeerHello.CHANNEL_CONTROL, time.monotonic() + 5, KEYED)


def _refuse(stream: FrameStream, auth: peer_pb2.Auth) -> None:
    raise AccessDeniedError("no buffers here")


KEYED = common_pb2.BufferDescriptor(id="b1", access_key=b"k" * 16)


def _check_proof(stream: FrameStream, auth: peer_pb2.Auth) -> None:
    if auth.buffer_id != KEYED.id or auth.key_proof != key_proof(KEYED.access_key, stream.nonce):
        raise AccessDeniedError("wrong proof")


def test_handshake_exchanges_agent_info_and_proves_a_key_without_sending_it(streams: tuple[FrameStream, FrameStream]) -> None:
    left, right = streams
    result: list[peer_pb2.PeerHello] = []
    server = threading.Thread(target=lambda: result.append(accept_handshake(right, common_pb2.AgentInfo(id="owner"), time.monotonic() + 5, _check_proof)))
    server.start()
    hello = handshake(left, common_pb2.AgentInfo(id="initiator"), peer_pb2.PeerHello.CHANNEL_DATA, time.monotonic() + 5, KEYED)
    server.join()
    assert hello.agent.id == "owner" and result[0].agent.id == "initiator" and result[0].channel == peer_pb2.PeerHello.CHANNEL_DATA
    assert left.nonce == right.nonce and len(left.nonce) == 16 and right.max_frame == MAX_FRAME
    assert left.peer_max_frame == MAX_FRAME


def test_a_frame_past_what_the_peer_accepts_never_leaves(streams: tuple[FrameStream, FrameStream]) -> None:
    left, right = streams
    left.peer_max_frame = 1024
    with pytest.raises(UnsupportedError):
        left.send(peer_pb2.PeerFrame(notify=peer_pb2.Notify(payload=b"x" * 2048)))
    left.send(peer_pb2.PeerFrame(notify=peer_pb2.Notify(payload=b"y" * 16)))  # the stream is intact
    assert right.recv(time.monotonic() + 5).notify.payload == b"y" * 16
    assert left.proof(KEYED.access_key) != KEYED.access_key


def test_a_wrong_proof_is_refused_and_the_listener_keeps_its_hello_bound(streams: tuple[FrameStream, FrameStream]) -> None:
    left, right = streams
    right.max_frame = HELLO_FRAME
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            accept_handshake(right, common_pb2.AgentInfo(id="owner"), time.monotonic() + 5, _check_proof)
        except AccessDeniedError as exc:
            errors.append(exc)
            right.send(peer_pb2.PeerFrame(reply=error_reply(exc)))

    server = threading.Thread(target=serve)
    server.start()
    wrong = common_pb2.BufferDescriptor(id="b1", access_key=b"x" * 16)
    with pytest.raises(AccessDeniedError):
        handshake(left, common_pb2.AgentInfo(id="initiator"), peer_pb2.PeerHello.CHANNEL_DATA, time.monotonic() + 5, wrong)
    server.join()
    assert errors and right.max_frame == HELLO_FRAME


def test_connect_to_a_closed_port_is_unavailable() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(UnavailableError):
        connect(common_pb2.TcpEndpoint(host="127.0.0.1", port=port), time.monotonic() + 5).close()


def test_channel_requests_replies_errors_and_breakage(streams: tuple[FrameStream, FrameStream]) -> None:
    left, right = streams

    def owner(frame: peer_pb2.PeerFrame) -> peer_pb2.PeerReply:
        if frame.notify.key_proof != b"k":
            raise AccessDeniedError("wrong key")
        return peer_pb2.PeerReply(payload_bytes=len(frame.notify.payload))

    server = Channel(right, owner, name="hmc-test-owner").start()
    client = Channel(left, lambda frame: peer_pb2.PeerReply(), name="hmc-test-initiator").start()
    reply = client.request(peer_pb2.PeerFrame(notify=peer_pb2.Notify(key_proof=b"k", payload=b"abc")), time.monotonic() + 5)
    assert reply.payload_bytes == 3
    with pytest.raises(AccessDeniedError):
        client.request(peer_pb2.PeerFrame(notify=peer_pb2.Notify(key_proof=b"x")), time.monotonic() + 5)
    outcome: list[BaseException | None] = []
    done = threading.Event()

    def stalled(frame: peer_pb2.PeerFrame) -> peer_pb2.PeerReply:
        server.close(timeout=0)  # the owner goes away while a request is pending
        raise BrokenResourceError("gone")

    server._handler = stalled
    client.request_async(peer_pb2.PeerFrame(notify=peer_pb2.Notify()), time.monotonic() + 5, lambda r, e: (outcome.append(e), done.set()))
    assert done.wait(5)
    assert isinstance(outcome[0], BrokenResourceError)
    client.close()


@pytest.fixture
def tcp_streams() -> Iterator[tuple[FrameStream, FrameStream]]:
    """A real TCP connection over loopback: lending pages splices them into a TCP socket."""
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    left, right = FrameStream(a, "left"), FrameStream(b, "right")
    yield left, right
    left.close()
    right.close()


def _scattered(rng: np.random.Generator, data: np.ndarray) -> tuple[list[memoryview], np.ndarray]:
    """Views of odd sizes at unaligned offsets (some touching, some not) and their iovec rows."""
    view, cuts, at = memoryview(data), [], 3
    while at < data.size - 70_000:
        length = int(rng.integers(1, 65_537))
        cuts.append((at, length))
        at += length + int(rng.choice([0, 0, 1, 4093]))
    offsets = np.array([c[0] for c in cuts], np.int64)
    lengths = np.array([c[1] for c in cuts], np.int64)
    return [view[o : o + n] for o, n in cuts], iovec_rows(offsets + data.ctypes.data, lengths)


def test_lent_pages_arrive_byte_exact_over_tcp(tcp_streams: tuple[FrameStream, FrameStream], rng: np.random.Generator) -> None:
    left, right = tcp_streams
    data = rng.integers(0, 256, 6_000_000, dtype=np.uint8)
    parts, rows = _scattered(rng, data)
    before = rows.copy()
    frame = peer_pb2.PeerFrame(request_id=9, write=peer_pb2.DataWrite(buffer_id="b"))
    sender = threading.Thread(target=left.send, args=(frame,), kwargs={"deadline": time.monotonic() + 10, "lend": rows})
    sender.start()
    assert right.recv(time.monotonic() + 10) == frame
    out = np.full(sum(p.nbytes for p in parts), 0xA5, np.uint8)
    right.recv_into([memoryview(out)], time.monotonic() + 10)
    sender.join()
    assert np.array_equal(out, np.concatenate([np.asarray(p) for p in parts]))
    assert np.array_equal(rows, before)  # the lender narrows rows while it works and restores them
    assert left._lender.usable  # lent, not copied after a refusal


def test_lender_reports_every_byte_lent(tcp_streams: tuple[FrameStream, FrameStream], rng: np.random.Generator) -> None:
    left, right = tcp_streams
    data = rng.integers(0, 256, 3_000_000, dtype=np.uint8)
    parts, rows = _scattered(rng, data)
    total = sum(p.nbytes for p in parts)
    lender = Lender()
    out = np.full(total, 0x5A, np.uint8)
    receiver = threading.Thread(target=right.recv_into, args=([memoryview(out)], time.monotonic() + 10))
    receiver.start()
    try:
        assert lender.send(left._tx, rows, time.monotonic() + 10) == total
    finally:
        lender.close()
    receiver.join()
    assert np.array_equal(out, np.concatenate([np.asarray(p) for p in parts]))


def test_a_lender_the_kernel_refused_sends_with_a_copy(tcp_streams: tuple[FrameStream, FrameStream], rng: np.random.Generator) -> None:
    left, right = tcp_streams
    left._lender.usable = False  # what a kernel without vmsplice (or one that refused it) leaves behind
    data = rng.integers(0, 256, 1_000_000, dtype=np.uint8)
    parts, rows = _scattered(rng, data)
    sender = threading.Thread(target=left.send, args=(peer_pb2.PeerFrame(request_id=2),), kwargs={"deadline": time.monotonic() + 10, "lend": rows})
    sender.start()
    assert right.recv(time.monotonic() + 10).request_id == 2
    out = np.full(sum(p.nbytes for p in parts), 0x33, np.uint8)
    right.recv_into([memoryview(out)], time.monotonic() + 10)
    sender.join()
    assert np.array_equal(out, np.concatenate([np.asarray(p) for p in parts]))


@pytest.mark.parametrize(("sizes", "sent", "left"), [([5, 7, 3], 0, [5, 7, 3]), ([5, 7, 3], 5, [7, 3]), ([5, 7, 3], 8, [4, 3]), ([5, 7, 3], 15, [])])
def test_what_is_left_after_a_partial_lend(sizes: list[int], sent: int, left: list[int]) -> None:
    data = np.arange(sum(sizes) + 2 * len(sizes), dtype=np.uint8)  # a byte of gap after each piece: rows never touch
    rows, wanted, at = [], [], 0
    for size in sizes:
        rows.append((data.ctypes.data + at, size))
        wanted.append(data[at : at + size].tobytes())
        at += size + 2
    rest = _row_views(np.array(rows, np.uint64), sent)
    assert [len(v) for v in rest] == left
    assert b"".join(bytes(v) for v in rest) == b"".join(wanted)[sent:]


def test_lending_to_a_peer_that_stops_reading_times_out_and_breaks_the_stream(tcp_streams: tuple[FrameStream, FrameStream], rng: np.random.Generator) -> None:
    left, _ = tcp_streams
    data = rng.integers(0, 256, 96 << 20, dtype=np.uint8)
    rows = iovec_rows(np.array([data.ctypes.data], np.int64), np.array([data.size], np.int64))
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        left.send(peer_pb2.PeerFrame(request_id=3), deadline=time.monotonic() + 0.3, lend=rows)
    assert time.monotonic() - started < 3.0
    assert left.broken


def test_a_large_receive_in_steps_leaves_the_stream_ready_for_small_frames(tcp_streams: tuple[FrameStream, FrameStream], rng: np.random.Generator) -> None:
    left, right = tcp_streams
    data = rng.integers(0, 256, 5_000_003, dtype=np.uint8)

    def trickle() -> None:  # the payload arrives unevenly: a slow start, then the rest at once, then a small frame
        view = memoryview(data)
        left.send(peer_pb2.PeerFrame(request_id=1), [view[:300_000]], time.monotonic() + 10)  # not inline: the rest follows raw
        left._tx.settimeout(10.0)
        for at in range(300_000, 1_300_000, 250_000):
            time.sleep(0.01)
            left._tx.sendall(view[at : at + 250_000])
        left._tx.sendall(view[1_300_000:])
        left._tx.settimeout(0.0)
        left.send(peer_pb2.PeerFrame(request_id=2), deadline=time.monotonic() + 10)

    sender = threading.Thread(target=trickle)
    sender.start()
    assert right.recv(time.monotonic() + 10).request_id == 1
    out = np.full(data.size, 0x77, np.uint8)
    right.recv_into([memoryview(out)[:7], memoryview(out)[7:]], time.monotonic() + 10)
    assert np.array_equal(out, data)
    assert right._rx.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    started = time.monotonic()
    assert right.recv(time.monotonic() + 5).request_id == 2
    assert time.monotonic() - started < 1.0
    sender.join()


def test_a_small_payload_given_as_rows_is_copied_byte_exact(tcp_streams: tuple[FrameStream, FrameStream], rng: np.random.Generator) -> None:
    left, right = tcp_streams
    data = rng.integers(0, 256, 100_000, dtype=np.uint8)
    parts, rows = _scattered(rng, data)
    assert sum(p.nbytes for p in parts) < LEND_MIN_BYTES
    left.send(peer_pb2.PeerFrame(request_id=4), deadline=time.monotonic() + 10, lend=rows)
    assert right.recv(time.monotonic() + 10).request_id == 4
    out = np.full(sum(p.nbytes for p in parts), 0x66, np.uint8)
    right.recv_into([memoryview(out)], time.monotonic() + 10)
    assert np.array_equal(out, np.concatenate([np.asarray(p) for p in parts]))


def test_small_payloads_travel_inline_and_larger_ones_after_their_frame(tcp_streams: tuple[FrameStream, FrameStream], rng: np.random.Generator) -> None:
    left, right = tcp_streams
    for size, inline in ((1, 1), (4096, 4096), (INLINE_MAX, INLINE_MAX), (INLINE_MAX + 1, 0)):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        sender = threading.Thread(target=left.send, args=(peer_pb2.PeerFrame(request_id=size), [memoryview(data)], time.monotonic() + 5))
        sender.start()
        assert right.recv(time.monotonic() + 5, spin_s=1e-4).request_id == size
        assert right.inline_bytes == inline  # an inline payload is all here before recv() returns
        out = np.zeros(size, np.uint8)
        right.recv_into([memoryview(out)], time.monotonic() + 5, spin_s=1e-4)
        sender.join()
        assert np.array_equal(out, data)


def test_an_inline_payload_is_taken_whole_before_the_next_frame(tcp_streams: tuple[FrameStream, FrameStream], rng: np.random.Generator) -> None:
    left, right = tcp_streams
    data = rng.integers(0, 256, 100, dtype=np.uint8)
    left.send(peer_pb2.PeerFrame(request_id=1), [memoryview(data)], time.monotonic() + 5)
    left.send(peer_pb2.PeerFrame(request_id=2), deadline=time.monotonic() + 5)
    assert right.recv(time.monotonic() + 5).request_id == 1
    assert right.inline_bytes == 100
    out = np.full(200, 0x77, np.uint8)
    with pytest.raises(ProtocolError):  # more than came inline: nothing is copied
        right.recv_into([memoryview(out)], time.monotonic() + 5)
    assert (out == 0x77).all() and right.broken


def test_empty_ranges_around_an_inline_payload_are_skipped(tcp_streams: tuple[FrameStream, FrameStream], rng: np.random.Generator) -> None:
    """Zero-length views (a peer's zero-length ranges) before, between and after an inline payload's parts: every
    byte lands where it belongs and the call returns (an empty view once stalled the read-ahead forever)."""
    left, right = tcp_streams
    data = rng.integers(0, 256, 100, dtype=np.uint8)
    left.send(peer_pb2.PeerFrame(request_id=1), [memoryview(data)], time.monotonic() + 5)
    assert right.recv(time.monotonic() + 5).request_id == 1 and right.inline_bytes == 100
    out = np.full(120, 0x77, np.uint8)
    view = memoryview(out)
    done = threading.Event()

    def receive() -> None:
        right.recv_into([view[0:0], view[10:40], view[40:40], view[50:120], view[120:120]], time.monotonic() + 5)
        done.set()

    worker = threading.Thread(target=receive, daemon=True)
    worker.start()
    assert done.wait(5.0), "recv_into did not return"
    expected = np.full(120, 0x77, np.uint8)
    expected[10:40], expected[50:120] = data[:30], data[30:]
    assert np.array_equal(out, expected)


def test_a_frame_read_over_an_unread_inline_payload_is_a_protocol_error(tcp_streams: tuple[FrameStream, FrameStream]) -> None:
    left, right = tcp_streams
    left.send(peer_pb2.PeerFrame(request_id=1), [memoryview(b"x" * 64)], time.monotonic() + 5)
    left.send(peer_pb2.PeerFrame(request_id=2), deadline=time.monotonic() + 5)
    assert right.recv(time.monotonic() + 5).request_id == 1
    with pytest.raises(ProtocolError):
        right.recv(time.monotonic() + 5)


@pytest.mark.parametrize(
    ("max_frame", "raw"),
    [
        (HELLO_FRAME, struct.pack("<II", 2 | (1 << 31), 1) + b"\x08\x01x"),  # inline before authentication
        (MAX_FRAME, struct.pack("<II", 2 | (1 << 31), INLINE_MAX + 1)),  # more inline than allowed
        (MAX_FRAME, struct.pack("<II", (HELLO_FRAME + 1) | (1 << 31), 1)),  # an inline frame's own part too large
    ],
)
def test_inline_frames_beyond_their_bounds_are_protocol_errors(tcp_streams: tuple[FrameStream, FrameStream], max_frame: int, raw: bytes) -> None:
    left, right = tcp_streams
    right.max_frame = max_frame
    left._tx.send(raw)
    with pytest.raises(ProtocolError):
        right.recv(time.monotonic() + 5)
    assert right.broken


def test_a_large_frame_body_after_read_ahead_bytes_arrives_whole(tcp_streams: tuple[FrameStream, FrameStream]) -> None:
    left, right = tcp_streams
    big = peer_pb2.PeerFrame(request_id=5, write=peer_pb2.DataWrite(buffer_id="b", ranges=common_pb2.RangeList(lengths=bytes(200_000))))
    def send_both() -> None:  # the small frame's read-ahead takes the start of the large one with it
        left.send(peer_pb2.PeerFrame(request_id=4), deadline=time.monotonic() + 5)
        left.send(big, deadline=time.monotonic() + 5)

    sender = threading.Thread(target=send_both)
    sender.start()
    assert right.recv(time.monotonic() + 5).request_id == 4
    assert right.recv(time.monotonic() + 5) == big
    sender.join()


@pytest.mark.parametrize("ending", ["close", "abort"])
def test_a_peer_that_left_is_seen_before_its_last_frames_are_read(tcp_streams: tuple[FrameStream, FrameStream], ending: str) -> None:
    """`peer_left()`: False while the peer is connected (frames waiting or not), True once it closed or reset the
    connection, although a frame it sent before still waits to be read."""
    left, right = tcp_streams
    assert not right.peer_left()
    left.send(peer_pb2.PeerFrame(request_id=7))
    wait_readable = time.monotonic() + 5
    while not right.readable(0.1):
        assert time.monotonic() < wait_readable
    assert not right.peer_left()  # a frame waits; its sender is still there
    if ending == "close":
        left.close()
    else:
        left.abort()
    seen = time.monotonic() + 5
    while not right.peer_left():
        assert time.monotonic() < seen, "the peer's leaving was not seen"
    assert right.recv(time.monotonic() + 5).request_id == 7  # the frame it sent before is still there to read


# -- a hostile or failing peer: deadlines, descriptors past 1023, claims of memory --------------------------------


def _trickle(sock: socket.socket, data: bytes, stop: threading.Event, gap_s: float) -> None:
    """Send `data` a byte at a time, `gap_s` apart, until done, `stop` or a broken connection (the peer's pace)."""
    for byte in data:
        if stop.is_set():
            return
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return
        stop.wait(gap_s)


def test_a_payload_trickled_past_the_deadline_is_cut_off_there(tcp_streams: tuple[FrameStream, FrameStream], rng: np.random.Generator) -> None:
    """Each byte comes well within the old 1 ms "last chance" that every wait past the deadline got: the receive went
    on landing bytes long after its deadline and then succeeded. Now what lands is what came by the deadline."""
    left, right = tcp_streams
    data = rng.integers(0, 256, 3000, dtype=np.uint8).tobytes()
    out = np.full(len(data), 0xA5, np.uint8)
    stop = threading.Event()
    sender = threading.Thread(target=_trickle, args=(left._tx, data, stop, 0.0001))
    sender.start()
    try:
        with pytest.raises(TimeoutError):
            right.recv_into([memoryview(out)], time.monotonic() + 0.05)
    finally:
        stop.set()
        sender.join(5)
    assert right.broken
    landed = int(np.count_nonzero(out != 0xA5))  # random bytes: a few may equal the poison; a prefix landed, in order
    first_poison = int(np.argmax(out == 0xA5)) if (out == 0xA5).any() else len(out)
    assert bytes(out[:first_poison]) == data[:first_poison] and landed < len(data)


def test_a_frame_trickled_past_its_deadline_is_cut_off(tcp_streams: tuple[FrameStream, FrameStream]) -> None:
    left, right = tcp_streams
    frame = peer_pb2.PeerFrame(request_id=9, write=peer_pb2.DataWrite(buffer_id="b" * 3000)).SerializeToString()
    stop = threading.Event()
    sender = threading.Thread(target=_trickle, args=(left._tx, struct.pack("<I", len(frame)) + frame, stop, 0.0001))
    sender.start()
    try:
        with pytest.raises(TimeoutError):
            right._fill(4 + len(frame), time.monotonic() + 0.05)
    finally:
        stop.set()
        sender.join(5)
    assert right.broken


def test_a_deadline_weeks_away_is_waited_for(tcp_streams: tuple[FrameStream, FrameStream]) -> None:
    """A frame's expiry is a uint32 of milliseconds (49 days): poll() takes at most 2**31 - 1 ms, and raised
    OverflowError (not an hmc error), ending the owner's connection thread without a reply."""
    left, right = tcp_streams
    sender = threading.Timer(0.05, left.send, args=(peer_pb2.PeerFrame(request_id=3),))
    sender.start()
    try:
        assert right.recv(time.monotonic() + 0xFFFFFFFF / 1000).request_id == 3
    finally:
        sender.join(5)


def test_readable_past_descriptor_1023(rng: np.random.Generator) -> None:
    """select() refuses descriptors past 1023 and readable() took that for "readable", so an owner's mailbox poll gave
    up at once and slept on its socket: requests waited for their deadline in any process holding ~1000 files."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE's hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200) if hard == resource.RLIM_INFINITY else min(max(soft, 1200), hard), hard))
    filler = []
    try:
        while not filler or filler[-1] < 1030:
            filler.append(os.open(os.devnull, os.O_RDONLY))
        a, b = socket.socketpair()
        left, right = FrameStream(a, "left"), FrameStream(b, "right")
        try:
            assert right._rx.fileno() > 1023
            assert not right.readable() and not right.readable(0.01)
            left.send(peer_pb2.PeerFrame(request_id=8), deadline=time.monotonic() + 5)
            assert right.readable(5.0)
            assert right.recv(time.monotonic() + 5).request_id == 8
        finally:
            left.close()
            right.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_write_refused_with_a_huge_inline_claim_allocates_nothing(tcp_streams: tuple[FrameStream, FrameStream], rng: np.random.Generator) -> None:
    """A late write's payload is discarded by the size its ranges claim: with 16 bytes inline and ranges claiming
    32 TiB, the claim was allocated first (MemoryError; 3 GiB claims grew the owner by 3 GiB)."""
    left, right = tcp_streams
    left.send(peer_pb2.PeerFrame(request_id=2), [memoryview(rng.integers(0, 256, 16, dtype=np.uint8))], time.monotonic() + 5)
    assert right.recv(time.monotonic() + 5).request_id == 2 and right.inline_bytes == 16
    with pytest.raises(ProtocolError, match="16 bytes inline"):
        right.discard(1 << 45, time.monotonic() + 5)


def test_a_length_word_alone_reserves_little_memory(tcp_streams: tuple[FrameStream, FrameStream]) -> None:
    """A length word of 64 MiB with no body behind it reserved 64 MiB at once (4 bytes from each of 1024 connections:
    64 GiB). The body now grows as it arrives."""
    import tracemalloc

    left, right = tcp_streams
    left._tx.sendall(struct.pack("<I", MAX_FRAME))
    tracemalloc.start()
    try:
        with pytest.raises(TimeoutError):
            right.recv(time.monotonic() + 0.05)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak
    assert right.broken


@pytest.mark.parametrize("framed_once", [False, True])
def test_a_frame_of_several_mib_arrives_whole(tcp_streams: tuple[FrameStream, FrameStream], rng: np.random.Generator, framed_once: bool) -> None:
    """Its buffer doubles from 1 MiB as the bytes come (and the read-ahead's share of it comes first); framed once and
    sent with `send_framed`, over a 4 KiB send buffer, the socket takes it in parts."""
    left, right = tcp_streams
    whole = peer_pb2.PeerFrame(request_id=6, write=peer_pb2.DataWrite(ranges=common_pb2.RangeList(lengths=rng.bytes((5 << 20) + 3))))
    if framed_once:
        left._tx.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    send, what = (left.send_framed, framed(whole.SerializeToString())) if framed_once else (left.send, whole)
    sender = threading.Thread(target=send, args=(what,), kwargs={"deadline": time.monotonic() + 10})
    sender.start()
    try:
        assert right.recv(time.monotonic() + 10) == whole
    finally:
        sender.join(10)


def test_the_ok_reply_framed_once_reads_as_ok_and_a_broken_stream_refuses_it(tcp_streams: tuple[FrameStream, FrameStream]) -> None:
    left, right = tcp_streams
    left.send_framed(OK_FRAME, time.monotonic() + 5)
    assert (answer := right.recv(time.monotonic() + 5)).WhichOneof("kind") == "reply" and not answer.reply.HasField("error")
    left.shutdown()
    with pytest.raises(BrokenResourceError):
        left.send_framed(OK_FRAME, time.monotonic() + 5)


def test_readable_naps_shorter_than_a_millisecond(tcp_streams: tuple[FrameStream, FrameStream], monkeypatch: pytest.MonkeyPatch) -> None:
    """poll() counts whole milliseconds: a 50 us nap (the ring's wait for a copy) must be a look, a nap of 50 us and a
    look, not a 1 ms poll; a frame already there is seen at once, without a nap."""
    import hmc.transport._wire as wire

    naps: list[float] = []
    monkeypatch.setattr(wire.time, "sleep", naps.append)
    left, right = tcp_streams
    assert not right.readable(50e-6)
    assert naps == [50e-6]
    left.send(peer_pb2.PeerFrame(request_id=1), deadline=time.monotonic() + 5)
    assert right.readable(5.0) and right.readable(50e-6)
    assert naps == [50e-6]
