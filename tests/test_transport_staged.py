"""The staged path (pipelined TCP streams) between real processes."""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from control_fixtures import wait_until
from staged_support import data_connection

import hmc.transport._staged as staged
from hmc.agent import Agent
from hmc.config import Config, PathPolicy
from hmc.errors import BrokenResourceError, ProtocolError, TimeoutError
from hmc.testing import PeerProcess, TransportPair, check_transport
from hmc.transport._deadlines import expires_ms, stamp
from hmc.transport._wire import FRAME_RANGES, FrameStream, raise_for_reply
from hmc.v1 import common_pb2, peer_pb2

POISON = 0xA5
STAGED = PathPolicy(allow=("staged",))


def test_staged_conforms(config: Config, make_peer: Callable[..., PeerProcess]) -> None:
    @contextlib.contextmanager
    def pair() -> Iterator[TransportPair]:
        peer = make_peer(("staged",))
        with Agent(config.replace(policy=STAGED), daemon=False) as a:
            yield TransportPair(a, peer, "staged", stalled=peer.stalled)

    check_transport(pair)


def test_peer_process_writes_and_reads_our_buffer(config: Config, make_peer: Callable[..., PeerProcess], rng: np.random.Generator) -> None:
    peer = make_peer(("staged",))
    with Agent(config, daemon=False) as a:
        mine = a.register(np.full((1 << 20) + 1, POISON, np.uint8))
        theirs = peer.register(1 << 20)
        data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
        peer.fill(theirs.id, data.tobytes())
        assert peer.transfer("write", theirs.id, mine.descriptor, 1, 0, (1 << 20) - 1, notify=b"x") == "staged"
        expected = np.full(mine.size, POISON, np.uint8)
        expected[: (1 << 20) - 1] = data[1:]
        assert np.array_equal(mine.numpy(), expected)
        assert [n.payload for n in a.notifications(5.0)] == [b"x"]
        assert peer.transfer("read", theirs.id, mine.descriptor, 0, 0, 1 << 20) == "staged"
        assert peer.contents(theirs.id) == mine.numpy()[: 1 << 20].tobytes()


def test_many_small_ranges_pipeline_over_reused_streams(config: Config, make_peer: Callable[..., PeerProcess], rng: np.random.Generator) -> None:
    peer = make_peer()
    size = 16 << 20
    remote = peer.register(size, fill=POISON)
    with Agent(config.replace(policy=STAGED, staged_chunk_bytes=64 << 10, staged_streams=3), daemon=False) as a:
        src = a.register(rng.integers(0, 256, size, dtype=np.uint8))
        count = 6000
        slots = rng.permutation(size // 2048)[:count]
        lengths = rng.integers(1, 2049, count)
        offsets = rng.integers(0, size - 2048, count)
        for _ in range(2):
            handle = a.write(src, remote, offsets, slots * 2048, lengths)
            handle.wait()
            assert handle.bytes_done == int(lengths.sum())
        expected = np.full(size, POISON, np.uint8)
        for s, d, n in zip(offsets.tolist(), (slots * 2048).tolist(), lengths.tolist()):
            expected[d : d + n] = src.numpy()[s : s + n]
        assert np.array_equal(np.frombuffer(peer.contents(remote.id), np.uint8), expected)
        back = a.register(np.zeros(size, np.uint8))
        landing = rng.permutation(size // 2048)[:count] * 2048  # a read's destination ranges (local) must not overlap
        a.read(back, remote, slots * 2048, landing, lengths).wait()
        check = np.zeros(size, np.uint8)
        for s, d, n in zip((slots * 2048).tolist(), landing.tolist(), lengths.tolist()):
            check[d : d + n] = expected[s : s + n]
        assert np.array_equal(back.numpy(), check)
        senders = [t.name for t in threading.enumerate() if t.name.startswith("hmc-staged-tx-")]
        assert len(senders) == 3, senders


def test_zero_length_batch_completes_without_traffic(config: Config, peer: PeerProcess) -> None:
    remote = peer.register(4096, fill=POISON)
    with Agent(config.replace(policy=STAGED), daemon=False) as a:
        src = a.register(np.ones(4096, np.uint8))
        handle = a.write(src, remote, np.array([], np.int64), np.array([], np.int64), np.array([], np.int64))
        handle.wait()
        assert handle.bytes_total == 0
        assert peer.contents(remote.id) == bytes([POISON]) * 4096


def _staged_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hmc-staged-")]


def test_small_transfers_are_one_round_trip_on_the_callers_thread(config: Config, peer: PeerProcess, rng: np.random.Generator) -> None:
    from hmc.errors import OutOfRangeError
    from hmc.transport._staged import StagedTransport

    remote = peer.register(2 << 20, fill=POISON)
    with Agent(config.replace(policy=STAGED), daemon=False) as a:
        src = a.register(rng.integers(0, 256, 2 << 20, dtype=np.uint8))
        back = a.register(np.zeros(1 << 20, np.uint8))
        for length in (1, 4096, 128 << 10, 256 << 10):  # two ranges: up to 512 KiB in all, inline or not
            handle = a.write(src, remote, [0, 300_000], [length, 600_000], length)
            assert handle.done()  # finished when write() returned
            handle.wait()
            handle = a.read(back, remote, [length, 600_000], [0, 300_000], length)
            assert handle.done()
            handle.wait()
            assert np.array_equal(back.numpy()[:length], src.numpy()[:length])
            assert np.array_equal(back.numpy()[300_000 : 300_000 + length], src.numpy()[300_000 : 300_000 + length])
        with pytest.raises(OutOfRangeError):  # the owner refuses; the connection stays usable
            a.write(src, remote, 0, (2 << 20) - 8, 16, path="staged").wait()
        a.write(src, remote, 0, 0, 4096).wait()
        assert _staged_threads() == []  # no stream was needed
        [transport] = [t for t in a._transports.values() if isinstance(t, StagedTransport)]
        [pipe] = transport._pipes.values()
        assert pipe.round_trips == len(pipe.idle) == 1
        a.write(src, remote, 0, 0, 1 << 20).wait()  # up to 1 MiB: still a round trip
        assert _staged_threads() == []
        a.write(src, remote, 0, 0, (1 << 20) + 1).wait()  # larger: the streams
        assert len([n for n in _staged_threads() if n.startswith("hmc-staged-tx-")]) == config.staged_streams
        assert peer.contents(remote.id)[: (1 << 20) + 1] == src.numpy()[: (1 << 20) + 1].tobytes()


def test_concurrent_small_transfers_share_the_round_trip_connections(config: Config, peer: PeerProcess, rng: np.random.Generator) -> None:
    size, block, writers = 1 << 20, 4096, 8
    remote = peer.register(size, fill=POISON)
    with Agent(config.replace(policy=STAGED), daemon=False) as a:
        src = a.register(rng.integers(0, 256, size, dtype=np.uint8))
        errors: list[BaseException] = []

        def write(first: int) -> None:
            try:
                for slot in range(first, size // block, writers):
                    a.write(src, remote, slot * block, slot * block, block).wait()
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert peer.contents(remote.id) == src.numpy().tobytes()


def _write_of(stream: FrameStream, remote: common_pb2.BufferDescriptor, offset: int, length: int) -> peer_pb2.PeerFrame:
    ranges = common_pb2.RangeList(dst_offsets=struct.pack("<q", offset), lengths=struct.pack("<q", length))
    return peer_pb2.PeerFrame(write=peer_pb2.DataWrite(buffer_id=remote.id, key_proof=stream.proof(remote.access_key), ranges=ranges))


def test_an_inline_write_lands_whole_on_the_owner(peer: PeerProcess, rng: np.random.Generator) -> None:
    remote = peer.register(1 << 16, fill=POISON)
    data = rng.integers(0, 256, 4096, dtype=np.uint8)
    stream = data_connection(peer, remote)
    try:
        stream.send(_write_of(stream, remote, 1000, 4096), [memoryview(data)], time.monotonic() + 5)
        raise_for_reply(stream.recv(time.monotonic() + 5, spin_s=1e-4).reply)
    finally:
        stream.close()
    expected = np.full(1 << 16, POISON, np.uint8)
    expected[1000:5096] = data
    assert peer.contents(remote.id) == expected.tobytes()


@pytest.mark.parametrize("inline", [100, 8192])  # too little for the ranges, too much
def test_an_inline_payload_unlike_its_ranges_is_refused_and_nothing_lands(peer: PeerProcess, rng: np.random.Generator, inline: int) -> None:
    remote = peer.register(1 << 16, fill=POISON)
    stream = data_connection(peer, remote)
    try:
        stream.send(_write_of(stream, remote, 0, 4096), [memoryview(rng.integers(0, 256, inline, dtype=np.uint8))], time.monotonic() + 5)
        with pytest.raises(ProtocolError):  # a typed refusal, then the owner hangs up
            raise_for_reply(stream.recv(time.monotonic() + 5).reply)
        with pytest.raises(BrokenResourceError):
            stream.recv(time.monotonic() + 5)
    finally:
        stream.close()
    assert peer.contents(remote.id) == bytes([POISON]) * (1 << 16)


def test_a_frame_of_more_ranges_than_initiators_send_is_refused_and_nothing_lands(peer: PeerProcess, rng: np.random.Generator) -> None:
    """Initiators cut frames at FRAME_RANGES ranges; the owner made a view per range whatever their number (8.4
    million empty ranges in one 63 MiB frame: 9.6 s of its GIL and 1.8 GiB). One range more is a ProtocolError."""
    count = FRAME_RANGES + 1
    remote = peer.register(count, fill=POISON)
    stream = data_connection(peer, remote)
    ranges = common_pb2.RangeList(dst_offsets=np.arange(count, dtype="<i8").tobytes(), lengths=np.ones(count, "<i8").tobytes())
    frame = peer_pb2.PeerFrame(write=peer_pb2.DataWrite(buffer_id=remote.id, key_proof=stream.proof(remote.access_key), ranges=ranges))
    try:
        stream.send(frame, [memoryview(rng.integers(0, 256, count, dtype=np.uint8))], time.monotonic() + 10)
        with pytest.raises(ProtocolError, match="at most"):
            raise_for_reply(stream.recv(time.monotonic() + 10).reply)
    finally:
        stream.close()
    assert peer.contents(remote.id) == bytes([POISON]) * count


def test_an_inline_frame_cut_short_ends_its_connection_and_nothing_lands(peer: PeerProcess, rng: np.random.Generator) -> None:
    remote = peer.register(1 << 16, fill=POISON)
    stream = data_connection(peer, remote)
    body = _write_of(stream, remote, 0, 4096).SerializeToString()
    data = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    try:
        stream._tx.send(struct.pack("<II", len(body) | (1 << 31), 4096) + body + data[:1000])  # the rest never comes
        started = time.monotonic()
        with pytest.raises(BrokenResourceError):  # the owner gives the rest of a frame 5 s, then hangs up
            stream.recv(started + 30)
        assert time.monotonic() - started < 15
    finally:
        stream.close()
    assert peer.contents(remote.id) == bytes([POISON]) * (1 << 16)


@pytest.mark.parametrize("expect_payload", [False, True])
def test_a_reply_with_bytes_nobody_asked_for_breaks_the_round_trip(expect_payload: bool) -> None:
    """A hostile owner answers with an inline payload that was not asked for (a write's reply) or that its reply
    does not announce (a read's): the round trip raises ProtocolError, so its connection is dropped, not pooled,
    and nothing lands in the read's destination."""
    import socket

    from hmc.transport._staged import _exchange
    from hmc.transport._staged_shm import reply_of

    a, b = socket.socketpair()
    initiator, owner = FrameStream(a, "owner"), FrameStream(b, "initiator")
    try:
        extra = np.full(64, 0x5A, np.uint8)
        owner.send(peer_pb2.PeerFrame(reply=peer_pb2.PeerReply(payload_bytes=32 if expect_payload else 0)), [memoryview(extra)], time.monotonic() + 5)
        into = np.full(32, 0x11, np.uint8)
        with pytest.raises(ProtocolError):
            _exchange(initiator, b"", [], [memoryview(into)] if expect_payload else None, 32, time.monotonic() + 5)
        assert (into == 0x11).all()
    finally:
        initiator.close()
        owner.close()
    c, d = socket.socketpair()
    ring, ring_owner = FrameStream(c, "owner"), FrameStream(d, "initiator")
    try:  # the ring's reply: a write's reply must carry no bytes
        ring_owner.send(peer_pb2.PeerFrame(reply=peer_pb2.PeerReply()), [memoryview(np.ones(16, np.uint8))], time.monotonic() + 5)
        with pytest.raises(ProtocolError):
            reply_of(ring, time.monotonic() + 5)
    finally:
        ring.close()
        ring_owner.close()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_transfer_ids_a_peer_makes_up_do_not_grow_the_owner_without_bound(peer: PeerProcess) -> None:
    """A hostile initiator names a new megabyte-long transfer id in every frame, with the longest deadline a frame can
    carry (and a wrong key proof: the deadline is recorded first): the owner's record of deadlines stays small."""
    remote = peer.register(1 << 16, fill=POISON)
    stream = data_connection(peer, remote)
    try:
        before = _rss_bytes(peer.pid)
        for index in range(300):
            request = peer_pb2.DataRead(buffer_id=remote.id, key_proof=b"wrong", transfer_id=f"{index:08d}" + "x" * (1 << 20), expires_ms=0xFFFFFFFF)
            stream.send(peer_pb2.PeerFrame(read=request), deadline=time.monotonic() + 5)
            assert stream.recv(time.monotonic() + 5).reply.HasField("error")
        grown = _rss_bytes(peer.pid) - before
    finally:
        stream.close()
    assert grown < 64 << 20, f"the owner grew by {grown >> 20} MiB"


def test_the_owners_record_of_deadlines_stays_bounded_and_keeps_recent_ones() -> None:
    from hmc.transport._deadlines import _EXPECTED_MAX, Expiry

    expiry = Expiry(10.0)
    first = expiry.deadline("t-recent", 3_600_000)
    for index in range(3 * _EXPECTED_MAX):  # transfers far from over, each seen once
        expiry.deadline(f"t-{index}", 3_600_000)
        assert len(expiry._deadlines) <= _EXPECTED_MAX
    assert expiry.deadline(f"t-{3 * _EXPECTED_MAX - 1}", 1) > time.monotonic() + 3000  # as first seen, not as now sent
    assert expiry.deadline("t-recent", 1) < first  # forgotten: a later frame gets the deadline it carries
    long_id = "y" * (1 << 20)
    assert expiry.deadline(long_id, 3_600_000) == expiry.deadline(long_id, 1)


@pytest.mark.parametrize("stamped", [float("nan"), float("inf"), -float("inf"), -1.0, 1e308])
def test_a_deadline_a_peer_stamps_can_only_shorten_its_own_transfer(stamped: float) -> None:
    """A frame's `deadline_monotonic_s` is the peer's word: NaN, infinite, negative or huge never gives its transfer more
    than its relative budget, and a past one (its own loss) ends only that transfer."""
    from hmc.transport._deadlines import Expiry

    expiry = Expiry(10.0)
    before = time.monotonic()
    deadline = expiry.deadline("t", 2000, stamped)
    assert deadline <= time.monotonic() + 2.0
    assert deadline >= before + 2.0 or stamped < before  # only a stamp in the past shortens it
    assert expiry.deadline("other", 2000) >= before + 2.0  # another transfer is untouched


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.mark.parametrize("through", ["tcp", "ring"])
def test_a_write_that_timed_out_against_a_frozen_owner_never_lands(
    config: Config, peer: PeerProcess, monkeypatch: pytest.MonkeyPatch, through: str
) -> None:
    """The owner process is stopped while a small write waits in its socket (tcp) or its ring's mailbox (ring: host
    memory forced through the shared ring, as device memory goes); the initiator's deadline passes, it reports
    TimeoutError and hangs up. Once the owner resumes, the request is not served: the destination keeps its bytes."""
    if through == "ring":
        monkeypatch.setattr(staged, "_HOST_KINDS", ())
    remote = peer.register(1 << 16, fill=POISON)
    with Agent(config.replace(policy=STAGED), daemon=False) as agent:
        local = agent.register(np.full(1 << 16, 0x11, np.uint8))
        agent.write(local, remote, 0, 0, 4096).wait()  # the connection (and ring) are up; 0x11 landed
        before = _threads(peer.pid)
        local.numpy()[:4096] = 0x77
        with peer.stalled(), pytest.raises(TimeoutError):
            agent.write(local, remote, 0, 0, 4096, timeout=0.3).wait()
        # resumed: the connection's thread ends, having served the request or not
        wait_until(lambda: _threads(peer.pid) < before, 10.0, "the owner's connection thread to end")
        assert peer.contents(remote.id)[:4096] == bytes([0x11]) * 4096, "a write that timed out landed late"
        agent.write(local, remote, 0, 0, 4096).wait()  # the pair works again, on a new connection
        assert peer.contents(remote.id)[:4096] == bytes([0x77]) * 4096


def test_a_request_that_waited_out_a_frozen_owner_is_served_while_its_initiator_waits(peer: PeerProcess, rng: np.random.Generator) -> None:
    """The owner's look after a pause drops only what an initiator gave up on: a write sent while the owner is stopped
    (longer than the pause it looks for), on a connection still open, is served once it resumes, every byte landed."""
    from hmc.transport._staged_serve import _UNSEEN_S

    remote = peer.register(1 << 16, fill=POISON)
    first, late = rng.integers(0, 256, 4096, dtype=np.uint8), rng.integers(0, 256, 4096, dtype=np.uint8)
    stream = data_connection(peer, remote)
    try:
        stream.send(_write_of(stream, remote, 0, 4096), [memoryview(first)], time.monotonic() + 5)
        raise_for_reply(stream.recv(time.monotonic() + 5).reply)  # the owner took a request: its pause counts from here
        with peer.stalled():
            stream.send(_write_of(stream, remote, 8192, 4096), [memoryview(late)], time.monotonic() + 5)
            stopped = time.monotonic()
            wait_until(lambda: time.monotonic() - stopped > 10 * _UNSEEN_S, 5.0, "the owner to stay stopped past its pause")
        raise_for_reply(stream.recv(time.monotonic() + 10).reply)
    finally:
        stream.close()
    expected = np.full(1 << 16, POISON, np.uint8)
    expected[:4096], expected[8192:12288] = first, late
    assert peer.contents(remote.id) == expected.tobytes()


def test_a_chunk_whose_deadline_passed_while_its_sender_waited_is_never_sent(peer: PeerProcess, rng: np.random.Generator) -> None:
    """A stream's sender is held (another chunk's payload, or its process stopped) while a queued chunk's deadline
    passes: the chunk's frame is built when it can be sent, so it never goes out with the budget it had when queued.
    Its transfer fails TimeoutError and the owner's buffer keeps its bytes."""
    from types import SimpleNamespace

    from hmc.agent._transfer import TransferHandle
    from hmc.transport._base import TransferOp, TransferRequest
    from hmc.transport._ranges import RangeList
    from hmc.transport._staged_streams import Chunk, DataStream, Transfer

    remote = peer.register(1 << 16, fill=POISON)
    data = rng.integers(0, 256, 4096, dtype=np.uint8)
    stream = DataStream(data_connection(peer, remote), "late", lambda _: None, 5.0)
    try:
        deadline = time.monotonic() + 0.3
        handle = TransferHandle("staged", 4096, deadline, "late")
        ranges = RangeList.single(0, 0, 4096)
        transfer = Transfer(TransferRequest("late", TransferOp.WRITE, SimpleNamespace(view=memoryview(data)), remote, ranges, deadline, handle), 1)
        handle.on_cancel = transfer.abort
        with stream._order:  # the sender waits here, as behind another chunk's payload
            assert stream.put(Chunk(transfer, ranges))
            wait_until(lambda: time.monotonic() > deadline, 5.0, "the chunk's deadline to pass")
        wait_until(handle.done, 5.0, "the transfer to end")
        assert isinstance(handle.error, TimeoutError)
    finally:
        stream.close()
    assert peer.contents(remote.id)[:4096] == bytes([POISON]) * 4096, "a chunk past its deadline was sent"


def test_a_deadline_goes_out_as_what_is_left_of_it_and_a_passed_one_is_refused() -> None:
    """A frame carries what is left of its deadline; a passed one must not go out as a fresh budget (1 ms, or more)."""
    now = time.monotonic()
    assert 1 <= expires_ms(now + 2.0) <= 2000
    assert expires_ms(now + 1e9) == 0xFFFFFFFF
    with pytest.raises(TimeoutError, match="passed"):
        expires_ms(now - 0.001)
    assert stamp(peer_pb2.DataWrite(), now + 2.0, clocked=False).deadline_monotonic_s == 0  # another clock is not ours
    assert stamp(peer_pb2.DataRead(), now + 2.0, clocked=True).deadline_monotonic_s == now + 2.0


def test_a_frame_read_past_its_deadline_on_this_hosts_clock_is_dropped(peer: PeerProcess, rng: np.random.Generator) -> None:
    """A frame's budget counts from when the owner reads it: one that waited (its sender stopped after building it) got
    its whole budget again, and a stopped executor's chunks landed after migrate had timed out. A peer on this host also
    sends the deadline itself, and the owner takes the earlier: a frame read past it is dropped (TimeoutError, nothing
    written) though its budget is not spent; one read before it lands."""
    remote = peer.register(1 << 16, fill=POISON)
    stale_bytes, fresh_bytes = rng.integers(0, 256, 4096, dtype=np.uint8), rng.integers(0, 256, 4096, dtype=np.uint8)
    stream = data_connection(peer, remote)
    try:
        stale = _write_of(stream, remote, 0, 4096)
        stale.write.transfer_id, stale.write.expires_ms, stale.write.deadline_monotonic_s = "stale", 10_000, time.monotonic() - 0.05
        stream.send(stale, [memoryview(stale_bytes)], time.monotonic() + 5)
        with pytest.raises(TimeoutError, match="past its deadline"):
            raise_for_reply(stream.recv(time.monotonic() + 5).reply)
        fresh = _write_of(stream, remote, 8192, 4096)
        fresh.write.transfer_id, fresh.write.expires_ms, fresh.write.deadline_monotonic_s = "fresh", 10_000, time.monotonic() + 10
        stream.send(fresh, [memoryview(fresh_bytes)], time.monotonic() + 5)
        raise_for_reply(stream.recv(time.monotonic() + 5).reply)
    finally:
        stream.close()
    expected = np.full(1 << 16, POISON, np.uint8)
    expected[8192:12288] = fresh_bytes
    assert peer.contents(remote.id) == expected.tobytes()
