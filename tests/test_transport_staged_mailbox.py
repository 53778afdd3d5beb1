"""The shared ring's mailbox (`hmc.transport._staged_mailbox`): small staged requests and replies through shared
memory while the owner polls, against a real owner process, with host memory standing in for device memory
(as in test_transport_staged_shm.py); tests/gpu/test_cuda_staged.py runs it with CUDA memory.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hmc.transport._staged as staged
from hmc.agent import Agent
from hmc.config import Config, PathPolicy
from hmc.errors import AccessDeniedError, BrokenResourceError, BufferWithdrawnError, OutOfRangeError, ProtocolError, TimeoutError
from hmc.testing import PeerProcess
from hmc.transport._staged_mailbox import MAILBOX_BYTES, SUPPORTED, Mailbox, SmallRequest, decode_request, encode_request, token_of
from hmc.transport._staged_shm import ShmStaging, reply_of
from hmc.transport._wire import error_reply
from hmc.v1 import peer_pb2
from staged_support import POISON

pytestmark = pytest.mark.skipif(not SUPPORTED, reason="the mailbox needs x86-64's store ordering")
STAGED = PathPolicy(allow=("staged",))
SIZE = 1 << 20


@pytest.fixture
def ring_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staged, "_HOST_KINDS", ())


@pytest.fixture
def posts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sequence numbers of the requests this process posted to a mailbox (not sent on the socket)."""
    seen: list[int] = []
    post = Mailbox.post

    def counted(self: Mailbox, frame: bytes, stream: Any, deadline: float) -> int:
        seq = post(self, frame, stream, deadline)
        seen.append(seq)
        return seq

    monkeypatch.setattr(Mailbox, "post", counted)
    return seen


def _link(agent: Agent) -> Any:
    """The agent's one shared-ring link (to the one peer it has written to)."""
    shm: ShmStaging = agent._transports["staged"]._shm  # type: ignore[attr-defined]
    (link,) = shm._links.values()
    return link


def _owner_asleep(link: Any) -> None:
    """Wait (bounded) until the owner stopped polling the link's mailbox: the next request rings its doorbell."""
    until = time.monotonic() + 10.0
    while link.mailbox.owner_awake():
        assert time.monotonic() < until, "the owner never stopped polling its mailbox"


@pytest.fixture
def pair(config: Config, peer: PeerProcess, ring_only: None) -> Iterator[tuple[Agent, PeerProcess, Any]]:
    remote = peer.register(SIZE, fill=POISON)
    with Agent(config.replace(policy=STAGED), daemon=False) as agent:
        yield agent, peer, remote


def test_small_writes_and_reads_through_the_mailbox_move_every_byte(pair: tuple[Agent, PeerProcess, Any], posts: list[int], rng: np.random.Generator) -> None:
    agent, peer, remote = pair
    src = rng.integers(1, 256, SIZE, dtype=np.uint8)
    local = agent.register(src)
    expected = np.full(SIZE, POISON, np.uint8)
    for index in range(300):  # back to back: the owner still polls when the next one comes
        length = int(rng.integers(1, 8192))
        at = int(rng.integers(0, SIZE - length))
        agent.write(local, remote, at, at, length).wait()
        expected[at : at + length] = src[at : at + length]
    assert posts, "no request went through the mailbox"
    assert peer.contents(remote.id) == expected.tobytes()
    out = np.full(SIZE, 0x3C, np.uint8)
    mine = agent.register(out)
    before = len(posts)
    for start in range(0, SIZE, 4096):
        agent.read(mine, remote, start, start, 4096).wait()
    assert len(posts) > before, "no read went through the mailbox"
    assert np.array_equal(out, expected)


def test_a_request_waits_for_the_doorbell_when_the_owner_sleeps(pair: tuple[Agent, PeerProcess, Any], posts: list[int], rng: np.random.Generator) -> None:
    agent, peer, remote = pair
    src = rng.integers(1, 256, SIZE, dtype=np.uint8)
    local = agent.register(src)
    agent.write(local, remote, 0, 0, 16).wait()  # over the socket: the owner maps the ring and its mailbox
    link = _link(agent)
    for at in range(4096, 4096 * 5, 4096):
        _owner_asleep(link)
        before = len(posts)
        agent.write(local, remote, at, at, 4096).wait()
        assert len(posts) == before + 1
    assert peer.contents(remote.id)[4096 : 4096 * 5] == src[4096 : 4096 * 5].tobytes()


def test_a_refusal_comes_back_typed_through_the_mailbox_and_writes_nothing(pair: tuple[Agent, PeerProcess, Any], posts: list[int]) -> None:
    agent, peer, remote = pair
    readonly = peer.register(SIZE, fill=POISON)
    shm: ShmStaging = agent._transports["staged"]._shm  # type: ignore[attr-defined]
    local = agent.register(np.full(SIZE, 0x77, np.uint8))
    good, refused = shm.inline(local, remote, 10.0), shm.inline(local, readonly, 10.0)
    peer.unregister(readonly.id)  # withdrawn: the owner refuses what comes for it
    for _ in range(3):  # a refusal drops the connection: each try starts over the socket
        good.write(0, 0, 16)
        before = len(posts)
        with pytest.raises(BufferWithdrawnError):
            refused.write(8192, 8192, 4096)
        assert len(posts) == before + 1
    assert peer.contents(remote.id)[16:] == bytes([POISON]) * (SIZE - 16)


def _deleted_rings() -> set[str]:
    """Ring files this process still maps although they were unlinked (a dropped ring not let go of)."""
    with open("/proc/self/maps") as maps:
        return {line.split()[-2] for line in maps if "hmc-staged-" in line and "(deleted)" in line}


def test_a_refused_request_lets_go_of_its_ring_while_its_error_lives(pair: tuple[Agent, PeerProcess, Any], posts: list[int]) -> None:
    """A refusal drops the ring; the error, kept by a handle, must not keep the dropped ring mapped."""
    agent, peer, remote = pair
    withdrawn = peer.register(SIZE, fill=POISON)
    shm: ShmStaging = agent._transports["staged"]._shm  # type: ignore[attr-defined]
    local = agent.register(np.full(SIZE, 0x77, np.uint8))
    good, refused = shm.inline(local, remote, 10.0), shm.inline(local, withdrawn, 10.0)
    peer.unregister(withdrawn.id)
    before = _deleted_rings()
    kept = []
    for _ in range(3):
        good.write(0, 0, 16)
        with pytest.raises(BufferWithdrawnError) as error:
            refused.write(8192, 8192, 4096)
        kept.append(error.value)
    assert len(posts) >= 3 and _deleted_rings() <= before, "a dropped ring stays mapped while its error lives"


def test_an_owner_without_the_mailbox_gets_every_request_over_the_socket(config: Config, ring_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner that never attaches the page (another release, or SUPPORTED false there) is never posted to."""
    import hmc.transport._staged_owner as owner_side

    monkeypatch.setattr(owner_side, "SUPPORTED", False)  # the owner side only: both agents live in this process
    with Agent(config.replace(policy=STAGED), daemon=False) as owner, Agent(config.replace(policy=STAGED), daemon=False) as initiator:
        data = np.arange(SIZE, dtype=np.uint32).view(np.uint8)[:SIZE].copy()
        target = np.full(SIZE, POISON, np.uint8)
        remote = owner.register(target).descriptor
        local = initiator.register(data)
        for at in range(0, 64 * 4096, 4096):
            initiator.write(local, remote, at, at, 4096).wait()
        assert np.array_equal(target[: 64 * 4096], data[: 64 * 4096])


def test_the_owner_dying_fails_a_mailbox_request_with_a_typed_error(pair: tuple[Agent, PeerProcess, Any], posts: list[int]) -> None:
    agent, peer, remote = pair
    local = agent.register(np.full(SIZE, 0x5A, np.uint8))
    agent.write(local, remote, 0, 0, 16).wait()
    peer.kill()  # its flag may still say it polls: the request fails when the connection ends, not at the deadline
    before = len(posts)
    with pytest.raises(BrokenResourceError):
        agent.write(local, remote, 0, 0, 16).wait()
    assert len(posts) == before + 1


def test_a_malformed_mailbox_request_ends_that_connection_only(pair: tuple[Agent, PeerProcess, Any], rng: np.random.Generator) -> None:
    agent, peer, remote = pair
    src = rng.integers(1, 256, SIZE, dtype=np.uint8)
    local = agent.register(src)
    agent.write(local, remote, 0, 0, 16).wait()
    link = _link(agent)
    with link.lock:  # as a hostile initiator would: garbage where a request frame belongs
        deadline = time.monotonic() + 10.0
        seq = link.mailbox.post(b"\xff" * 64, link.stream, deadline)
        with pytest.raises((ProtocolError, BrokenResourceError)):  # the owner ends the connection, saying why
            link.mailbox.answer(seq, link.stream, deadline)
        link.drop()
    agent.write(local, remote, 4096, 4096, 4096).wait()  # a new connection and ring serve the next one
    assert peer.contents(remote.id)[4096:8192] == src[4096:8192].tobytes()


def test_hostile_records_are_refused_typed_and_write_nothing(pair: tuple[Agent, PeerProcess, Any], rng: np.random.Generator) -> None:
    """Records a hostile initiator could post: a range past the buffer (also by an offset near 2^64), a wrong key
    proof, a write into a read-only buffer get their typed refusal and land nothing; a range longer than the ring's
    slots ends that connection. The next request works."""
    agent, peer, remote = pair
    readonly = peer.register(SIZE, fill=POISON, readonly=True)
    src = rng.integers(1, 256, SIZE, dtype=np.uint8)
    local = agent.register(src)
    agent.write(local, remote, 0, 0, 16).wait()  # over the socket: the owner attaches the mailbox
    link = _link(agent)
    proof = link.stream.proof(remote.access_key, remote.registry_epoch)
    refused = [
        (encode_request(True, remote.id, proof, SIZE - 10, 4096), OutOfRangeError),
        (encode_request(True, remote.id, proof, (1 << 64) - 1, 1), OutOfRangeError),
        (encode_request(False, remote.id, proof, SIZE, 1), OutOfRangeError),
        (encode_request(True, remote.id, bytes(len(proof)), 0, 4096), AccessDeniedError),
        (encode_request(True, readonly.id, link.stream.proof(readonly.access_key, readonly.registry_epoch), 0, 4096), AccessDeniedError),
    ]
    with link.lock:
        for record, error in refused:
            deadline = time.monotonic() + 10.0
            with pytest.raises(error):
                link.mailbox.answer(link.mailbox.post(record, link.stream, deadline), link.stream, deadline)
        deadline = time.monotonic() + 10.0
        seq = link.mailbox.post(encode_request(True, remote.id, proof, 0, 1 << 30), link.stream, deadline)
        with pytest.raises((ProtocolError, BrokenResourceError)):  # past the ring's slots: the owner ends the connection
            link.mailbox.answer(seq, link.stream, deadline)
        link.drop()
    expected = bytes(src[:16]) + bytes([POISON]) * (SIZE - 16)
    assert peer.contents(remote.id) == expected and peer.contents(readonly.id) == bytes([POISON]) * SIZE
    agent.write(local, remote, 4096, 4096, 4096).wait()  # a new connection and ring serve the next one
    assert peer.contents(remote.id)[4096:8192] == src[4096:8192].tobytes()


def test_a_doorbell_for_a_mailbox_never_named_ends_the_connection(pair: tuple[Agent, PeerProcess, Any]) -> None:
    agent, _, remote = pair
    agent.write(agent.register(np.full(SIZE, 0x11, np.uint8)), remote, 0, 0, 16).wait()
    shm: ShmStaging = agent._transports["staged"]._shm  # type: ignore[attr-defined]
    link = _link(agent)
    with link.lock:
        link.drop_stream()
        deadline = time.monotonic() + 10.0
        shm._prepare(link, remote, deadline)  # a new connection: the owner has no mailbox for it yet
        link.stream.send(peer_pb2.PeerFrame(posted=peer_pb2.Posted(seq=1)), deadline=deadline)
        with pytest.raises((ProtocolError, BrokenResourceError)):
            reply_of(link.stream, deadline)
        link.drop()


# -- the mailbox page itself, both ends in this process ---------------------------------


def test_request_records_round_trip_and_malformed_ones_are_refused() -> None:
    for request in (SmallRequest(True, "buffer-\u00e9", b"p" * 16, 0, 1), SmallRequest(False, "", b"", (1 << 64) - 1, (1 << 64) - 1)):
        assert decode_request(encode_request(*request)) == request
    good = encode_request(True, "b1", b"p" * 16, 7, 4096)
    malformed = [
        b"", good[:17],  # shorter than the head
        good + b"x", good[:-1],  # lengths that do not add up
        b"\x02" + good[1:],  # neither write nor read
        encode_request(True, "b1", b"p" * 16, 7, 0),  # nothing to move
        encode_request(True, "b1", b"p" * 16, 7, 1)[:-2] + b"\xff\xfe",  # a buffer id that is not UTF-8
    ]
    for record in malformed:
        with pytest.raises(ProtocolError):
            decode_request(record)


def _page() -> tuple[Mailbox, Mailbox]:
    page = memoryview(bytearray(MAILBOX_BYTES))
    return Mailbox(page), Mailbox(page)


class _Quiet:
    """A connection on which nothing arrives (the mailbox's reply is all there is); records doorbells."""

    peer = "quiet"
    nonce = b"\x07\x00\x00\x00" + bytes(12)

    def __init__(self) -> None:
        self.rung: list[int] = []

    def readable(self) -> bool:
        return False

    def send(self, frame: peer_pb2.PeerFrame, deadline: float | None = None) -> None:
        self.rung.append(frame.posted.seq)


def test_the_page_is_attached_only_by_the_connection_it_was_offered_to() -> None:
    initiator, owner = _page()
    initiator.offer(7)
    assert not owner.attach(8) and not initiator.ready(7)  # another connection (another peer naming this ring)
    assert owner.attach(7) and initiator.ready(7) and not initiator.ready(8)
    initiator.offer(9)  # a new connection: nothing is posted until its owner attaches the page too
    assert not initiator.ready(9)


def test_a_posted_request_is_taken_once_by_its_connection_only() -> None:
    initiator, owner = _page()
    quiet = _Quiet()
    seq = initiator.post(b"request", quiet, time.monotonic() + 10.0)  # type: ignore[arg-type]
    assert quiet.rung == [seq]  # nobody polls: the doorbell rang
    assert owner.take(8) is None  # another connection's request
    assert owner.take(token_of(quiet)) == (seq, b"request")  # type: ignore[arg-type]
    assert owner.take(token_of(quiet)) is None  # taken once
    owner.awake(True)
    initiator.post(b"next", quiet, time.monotonic() + 10.0)  # type: ignore[arg-type]
    assert quiet.rung == [seq]  # the owner polls: no doorbell
    with pytest.raises(ProtocolError):
        initiator.post(b"x" * MAILBOX_BYTES, quiet, time.monotonic() + 10.0)  # type: ignore[arg-type]


def test_replies_reach_the_waiting_initiator_done_or_typed() -> None:
    initiator, owner = _page()
    quiet = _Quiet()
    token = token_of(quiet)  # type: ignore[arg-type]
    seq = initiator.post(b"a", quiet, time.monotonic() + 10.0)  # type: ignore[arg-type]
    threading.Thread(target=lambda: owner.replier(owner.take(token)[0])(peer_pb2.PeerReply())).start()  # type: ignore[index]
    initiator.answer(seq, quiet, time.monotonic() + 10.0)  # type: ignore[arg-type]
    seq = initiator.post(b"b", quiet, time.monotonic() + 10.0)  # type: ignore[arg-type]
    owner.replier(owner.take(token)[0])(error_reply(AccessDeniedError("read-only " * 1000)))  # type: ignore[index]
    with pytest.raises(AccessDeniedError):
        initiator.answer(seq, quiet, time.monotonic() + 10.0)  # type: ignore[arg-type]


def test_an_unanswered_request_times_out_at_its_deadline() -> None:
    initiator, _ = _page()
    quiet = _Quiet()
    seq = initiator.post(b"a", quiet, time.monotonic() + 10.0)  # type: ignore[arg-type]
    with pytest.raises(TimeoutError):
        initiator.answer(seq, quiet, time.monotonic() + 0.01)  # type: ignore[arg-type]


def test_a_mailbox_named_anew_waits_for_the_copies_that_answer_in_the_old_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A queued copy taken from mailbox A answers in A. A frame naming mailbox B closed A at once, and the copy's reply
    then hit a released view: ValueError killed the completion thread, so later copies were never answered and the
    buffer stayed in use for good. The owner now drains its queue first. (In-process owner over a real socket pair;
    the mailbox request is queued behind a chunk of a longer transfer, whose copy, a GPU copy in flight, is a stand-in
    that finishes once the owner has moved on to B.)"""
    import contextlib
    import secrets
    import socket
    import struct

    from hmc import memory
    from hmc.agent._buffers import BufferTable, ConnBuffer
    from hmc.transport import _pinned, _staged_owner
    from hmc.transport._pinned import PinnedMapping
    from hmc.transport._staged_serve import DataConnections
    from hmc.transport._wire import FrameStream
    from hmc.v1 import common_pb2

    if not SUPPORTED:
        pytest.skip("no mailbox on this architecture")
    died: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(f"{args.thread.name}: {args.exc_value!r}"))
    queued, moved_on = threading.Event(), threading.Event()
    start = _pinned.SlotCopier.start

    def held_start(self: Any, *args: Any, **kwargs: Any) -> Any:  # the mailbox request's copy runs until the owner moved on
        wait = start(self, *args, **kwargs)
        if queued.is_set() or int(sum(args[2])) != 512 << 10:
            return wait
        queued.set()
        return lambda deadline: moved_on.wait(max(deadline - time.monotonic(), 0.0)) and wait(deadline)

    for name in ("drain", "_forget_mailbox"):  # whichever the owner does first once B is named
        original = getattr(_staged_owner.OwnerSegments, name)

        def marked(self: Any, *args: Any, _original: Any = original) -> Any:
            if queued.is_set():
                moved_on.set()
            return _original(self, *args)

        monkeypatch.setattr(_staged_owner.OwnerSegments, name, marked)
    monkeypatch.setattr(_pinned.SlotCopier, "start", held_start)

    data = np.full(1 << 20, POISON, np.uint8)
    region = memory.register(data)
    descriptor = common_pb2.BufferDescriptor(id="buf", access_key=secrets.token_bytes(32), size=region.size)
    table = BufferTable()
    table.add(ConnBuffer(region, descriptor))
    a, b = socket.socketpair()
    owner, initiator = FrameStream(a, "initiator"), FrameStream(b, "owner")
    owner.nonce = initiator.nonce = secrets.token_bytes(16)
    def serve() -> None:  # as the agent's server does: a connection's end is an hmc error
        with contextlib.suppress(BrokenResourceError):
            DataConnections(table, 10.0).serve(owner)

    server = threading.Thread(target=serve, name="hmc-peer-conn", daemon=True)
    server.start()
    slots = 1 << 20
    size = slots + 2 * MAILBOX_BYTES
    path = f"/dev/shm/hmc-staged-{secrets.token_hex(16)}"
    ring = PinnedMapping(path, size, create=True)
    box_a, box_b = Mailbox(ring.view(slots, MAILBOX_BYTES)), Mailbox(ring.view(slots + MAILBOX_BYTES, MAILBOX_BYTES))
    token, proof = token_of(initiator), initiator.proof(descriptor.access_key)
    box_a.offer(token)
    box_b.offer(token)

    def write_naming(mailbox: int, length: int = 16) -> peer_pb2.PeerFrame:
        ranges = common_pb2.RangeList(dst_offsets=struct.pack("<q", 0), lengths=struct.pack("<q", length))
        shm = peer_pb2.ShmSlot(segment=path, segment_bytes=size, offset=0, mailbox=mailbox)
        return peer_pb2.PeerFrame(request_id=1, write=peer_pb2.DataWrite(buffer_id="buf", key_proof=proof, ranges=ranges, shm=shm))

    try:
        # names A (the owner attaches it) with a chunk of a longer transfer: its copy is queued (and held)
        initiator.send(write_naming(slots, 512 << 10), deadline=time.monotonic() + 5)
        assert queued.wait(5) and box_a.ready(token)
        seq = box_a.post(encode_request(True, "buf", proof, 0, 16), initiator, time.monotonic() + 5)  # queued behind it
        initiator.send(write_naming(slots + MAILBOX_BYTES), deadline=time.monotonic() + 5)  # names B
        # the held chunk's reply (on the socket, before the mailbox's: a mailbox wait takes anything on the socket
        # for the owner's end), then the mailbox request's in A, then the frame naming B's, sent once both went out
        assert not initiator.recv(time.monotonic() + 10).reply.HasField("error")
        box_a.answer(seq, initiator, time.monotonic() + 10)  # answered in A, done
        assert not initiator.recv(time.monotonic() + 10).reply.HasField("error")
    finally:
        initiator.close()
        server.join(30)
        owner.close()
        ring.close()
        os.unlink(path)
    assert died == [] and not server.is_alive()
    assert table.wait_unused("buf", time.monotonic() + 5)
