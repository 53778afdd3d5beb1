"""The staged path's shared pinned ring (device memory between processes of one host), exercised with host memory.

Without a GPU the ring is plain shared memory and the copies are memmoves; the initiator here is made to treat
every request as device memory so the ring protocol (slot hand-offs, reuse, owner checks) runs end to end
against a real owner process. tests/gpu/test_cuda_staged.py runs it with CUDA memory.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import os
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from staged_support import (
    POISON,
    data_connection,
    grown,
    scattered_read_every_byte,
    write_read_every_byte,
)

import hmc.agent._agent as agent_module
import hmc.transport._staged as staged
from hmc.agent import Agent
from hmc.config import Config, PathPolicy
from hmc.errors import (
    AccessDeniedError,
    DeviceError,
    HMCError,
    OutOfRangeError,
    ProtocolError,
)
from hmc.testing import PeerProcess
from hmc.transport import _staged_owner
from hmc.transport._pinned import _ABANDONED, PinnedMapping, SlotCopier, StuckCopy
from hmc.transport._staged_owner import OwnerSegments
from hmc.transport._staged_rings import _ring_dir
from hmc.transport._staged_shm import SLOT_BYTES, SMALL_BYTES, ShmStaging, _Link
from hmc.transport._wire import FrameStream, error_reply, raise_for_reply
from hmc.v1 import common_pb2, peer_pb2

STAGED = PathPolicy(allow=("staged",))


@pytest.fixture
def ring_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staged, "_HOST_KINDS", ())


@pytest.mark.usefixtures("ring_only")
def test_ring_write_and_read_every_byte(config: Config, peer: PeerProcess, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every byte both ways through a ring that wraps; each transfer marks its last chunk (and only that one) `last`."""
    size = (200 << 20) + 3  # 13 chunks for eight 16 MiB slots: the ring wraps
    remote = peer.register(size, fill=POISON)
    before = set(glob.glob("/dev/shm/hmc-staged-*"))
    handed: list[tuple[str, bool]] = []
    hand_off = ShmStaging._hand_off

    def recorded(self: Any, link: Any, stream: Any, message: Any, *args: Any) -> None:
        handed.append((type(message).__name__, message.last))
        hand_off(self, link, stream, message, *args)

    monkeypatch.setattr(ShmStaging, "_hand_off", recorded)
    with Agent(config.replace(policy=STAGED), daemon=False) as a:
        src, out, expected = write_read_every_byte(a, remote, size, rng)
        assert peer.contents(remote.id) == expected.tobytes()
        last = [False] * 12 + [True]
        assert handed == [("DataWrite", x) for x in last] + [("DataRead", x) for x in last]
        scattered_read_every_byte(a, out, remote, expected, rng)
        with pytest.raises(OutOfRangeError):
            a.write(src, grown(remote), 0, size, 16).wait()
        a.write(src, remote, 0, 0, 16).wait()  # the ring still works after a refusal
    assert set(glob.glob("/dev/shm/hmc-staged-*")) <= before, "the ring outlived the agent"


class _Replies:
    """A stand-in data connection recording the owner's replies: (request id, error code)."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []

    def send(self, frame: peer_pb2.PeerFrame, deadline: float | None = None) -> None:
        self.sent.append((frame.request_id, frame.reply.error.code))

    def send_serialized(self, body: bytes) -> None:
        self.send(peer_pb2.PeerFrame.FromString(body))


def test_owner_queues_copies_and_replies_in_frame_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot copy still running holds back the replies behind it; the buffer is released once its copy finished."""
    gates = [threading.Event(), threading.Event()]

    def start(self: Any, region: Any, offsets: Any, lengths: Any, slot: Any, at: int, *, to_slot: bool, deadline: float) -> Any:
        gate = gates[at]
        return lambda deadline: gate.wait(5.0)

    monkeypatch.setattr(SlotCopier, "start", start)
    stream = _Replies()
    owner = OwnerSegments(stream)  # type: ignore[arg-type]
    released: list[int] = []
    big = SMALL_BYTES + 1  # queued for the completion thread, not answered on the spot
    owner.start(1, None, [0], [big], None, 0, total=big, to_slot=False, release=lambda: released.append(1))  # type: ignore[arg-type]
    owner.start(2, None, [0], [big], None, 1, total=big, to_slot=False, release=lambda: released.append(2))  # type: ignore[arg-type]
    owner.reply(3, error_reply(AccessDeniedError("refused")))
    assert stream.sent == [] and released == []
    gates[1].set()  # the second copy finishing first changes nothing: replies keep frame order
    gates[0].set()
    owner.drain()
    assert [request_id for request_id, _ in stream.sent] == [1, 2, 3]
    assert stream.sent[0][1] == 0 and stream.sent[2][1] != 0
    assert released == [1, 2]
    owner.reply(4, error_reply(AccessDeniedError("refused")))  # nothing queued: sent at once
    assert stream.sent[-1][0] == 4
    owner.close()


def test_owner_answers_a_small_copy_on_the_reading_thread_unless_copies_are_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small chunk, or a transfer's last, with nothing queued before it is waited for and answered by the caller's
    thread (no hand-off); behind a queued copy it waits its turn, so replies keep frame order."""
    gate = threading.Event()
    waited_on: list[str] = []

    def start(self: Any, region: Any, offsets: Any, lengths: Any, slot: Any, at: int, *, to_slot: bool, deadline: float) -> Any:
        def wait(deadline: float) -> None:
            if at == 1:
                gate.wait(5.0)
            waited_on.append(threading.current_thread().name)

        return wait

    monkeypatch.setattr(SlotCopier, "start", start)
    stream = _Replies()
    owner = OwnerSegments(stream)  # type: ignore[arg-type]
    released: list[int] = []
    owner.start(1, None, [0], [4096], None, 0, total=4096, to_slot=False, release=lambda: released.append(1))  # type: ignore[arg-type]
    assert stream.sent == [(1, 0)] and released == [1]  # answered before start() returned
    assert waited_on == [threading.current_thread().name]
    big = SMALL_BYTES + 1
    owner.start(2, None, [0], [big], None, 1, total=big, to_slot=False, release=lambda: released.append(2))  # type: ignore[arg-type]
    owner.start(3, None, [0], [4096], None, 0, total=4096, to_slot=False, release=lambda: released.append(3))  # type: ignore[arg-type]
    assert stream.sent == [(1, 0)]  # 3 waits behind 2
    gate.set()
    owner.drain()
    assert [request_id for request_id, _ in stream.sent] == [1, 2, 3] and released == [1, 2, 3]
    assert waited_on[1:] == ["hmc-staged-shm-owner"] * 2
    # a transfer's last chunk (nothing of it follows) is answered here whatever its size, unless copies are queued
    owner.start(4, None, [0], [big], None, 0, total=big, to_slot=False, release=lambda: released.append(4), last=True)  # type: ignore[arg-type]
    assert stream.sent[-1] == (4, 0) and released[-1] == 4 and waited_on[-1] == threading.current_thread().name
    gate.clear()
    owner.start(5, None, [0], [big], None, 1, total=big, to_slot=False, release=lambda: released.append(5))  # type: ignore[arg-type]
    owner.start(6, None, [0], [big], None, 0, total=big, to_slot=False, release=lambda: released.append(6), last=True)  # type: ignore[arg-type]
    assert stream.sent[-1] == (4, 0)  # 6 waits behind 5
    gate.set()
    owner.drain()
    assert [request_id for request_id, _ in stream.sent][-2:] == [5, 6] and waited_on[-2:] == ["hmc-staged-shm-owner"] * 2
    owner.close()


class _Ring:
    """A stand-in mapped ring: records whether the owner unpinned and unmapped it, or kept it for good."""

    size = 8 * SLOT_BYTES

    def __init__(self) -> None:
        self.closed = self.abandoned = False

    def close(self) -> None:
        self.closed = True

    def abandon(self) -> None:
        self.abandoned = True


def _owner_whose_copies_at_0_fail(
    monkeypatch: pytest.MonkeyPatch, error: Exception, failing: threading.Event
) -> tuple[_Replies, OwnerSegments, _Ring, list[tuple[int, bool]]]:
    """An owner with one ring mapped, whose copies at slot offset 0 fail with `error` when waited for (once `failing`
    is set), those at 1 run behind them on their stream (a wait whose deadline passed says StuckCopy: one look, not
    done) and the others finished; and the copies waited for: (offset, whether it was only a look)."""
    waited: list[tuple[int, bool]] = []

    def start(self: Any, region: Any, offsets: Any, lengths: Any, slot: Any, at: int, *, to_slot: bool, deadline: float) -> Any:
        def wait(deadline: float) -> None:
            look = deadline <= time.monotonic()
            waited.append((at, look))
            if at == 0:
                failing.wait(5.0)
                raise error
            if at == 1 and look:
                raise StuckCopy("a staging copy did not finish before the deadline")

        return wait

    monkeypatch.setattr(SlotCopier, "start", start)
    stream = _Replies()
    owner = OwnerSegments(stream)  # type: ignore[arg-type]
    ring = _Ring()
    owner._mappings["ring"] = ring  # type: ignore[assignment]  # a ring it mapped
    return stream, owner, ring, waited


@pytest.mark.parametrize("queued", [True, False], ids=["queued", "on-the-reading-thread"])
def test_a_stuck_copy_keeps_what_it_touches_and_fails_the_copies_behind_it_at_once(monkeypatch: pytest.MonkeyPatch, queued: bool) -> None:
    """A copy past its bound may still run (a hung GPU): its chunk is answered TIMEOUT, but its buffer stays held and
    its rings pinned; a copy queued behind it on the stream fails at once (one look), not after a bound of its own,
    and keeps its buffer too, while one that finished (another stream's) is answered and let go of; the connection
    then takes no new copy (refused, nothing held)."""
    stuck = StuckCopy("a staging copy did not finish before the deadline")  # what the copier's wait says at its bound
    failing = threading.Event()  # queued: the first copy's wait ends once all three were handed over
    stream, owner, ring, waited = _owner_whose_copies_at_0_fail(monkeypatch, stuck, failing)
    if not queued:
        failing.set()
    released: list[int] = []
    size = SMALL_BYTES + 1 if queued else 4096  # a big one goes to the completion thread; a small one is answered here
    owner.start(1, None, [0], [size], None, 0, total=size, to_slot=False, release=lambda: released.append(1))  # type: ignore[arg-type]
    if queued:
        owner.start(2, None, [0], [size], None, 1, total=size, to_slot=False, release=lambda: released.append(2))  # type: ignore[arg-type]
        owner.start(4, None, [0], [size], None, 2, total=size, to_slot=False, release=lambda: released.append(4))  # type: ignore[arg-type]
        failing.set()
    owner.drain()
    timeout = int(common_pb2.ERROR_CODE_TIMEOUT)
    assert stream.sent == ([(1, timeout), (2, timeout), (4, 0)] if queued else [(1, timeout)])
    assert waited == ([(0, False), (1, True), (2, True)] if queued else [(0, False)])  # after the stuck one: looks
    assert released == ([4] if queued else [])  # only the copy that finished let go of its buffer
    owner.start(3, None, [0], [4096], None, 1, total=4096, to_slot=False, release=lambda: released.append(3))  # type: ignore[arg-type]
    assert stream.sent[-1] == (3, int(common_pb2.ERROR_CODE_DEVICE)) and released[-1] == 3 and len(waited) == (3 if queued else 1)
    owner.close()
    assert ring.abandoned and not ring.closed


def test_a_ring_dropped_while_its_connection_is_stuck_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replacing or evicting a ring (`_unmap`) once a copy is stuck keeps it too, as closing the connection does."""
    failing = threading.Event()
    failing.set()
    stream, owner, ring, _ = _owner_whose_copies_at_0_fail(monkeypatch, StuckCopy("stuck"), failing)
    owner.start(1, None, [0], [4096], None, 0, total=4096, to_slot=False, release=lambda: None)  # type: ignore[arg-type]
    owner._unmap("ring")
    assert ring.abandoned and not ring.closed and "ring" not in owner._mappings
    owner.close()


@pytest.mark.parametrize("ending", ["unmap", "close"])
def test_copies_still_queued_past_the_owners_bounds_keep_the_ring(monkeypatch: pytest.MonkeyPatch, ending: str) -> None:
    """A drain (before a ring is replaced) or a close that times out with a copy still queued cannot know that copy
    will not run: the ring is kept for good, and at close the copier is left as it is, not freed."""
    monkeypatch.setattr(_staged_owner, "_OWNER_COPY_S", 0.05)
    monkeypatch.setattr(_staged_owner, "_JOIN_S", 0.05)
    failing = threading.Event()  # the queued copy's wait ends only once the test is over
    stream, owner, ring, _ = _owner_whose_copies_at_0_fail(monkeypatch, DeviceError("late"), failing)
    closed: list[bool] = []
    monkeypatch.setattr(SlotCopier, "close", lambda self: closed.append(True))
    owner.start(1, None, [0], [SMALL_BYTES + 1], None, 0, total=SMALL_BYTES + 1, to_slot=False, release=lambda: None)  # type: ignore[arg-type]
    try:
        if ending == "unmap":
            with pytest.raises(TimeoutError):
                owner._unmap("ring")
            assert "ring" not in owner._mappings
        else:
            owner.close()
            assert closed == []
        assert ring.abandoned and not ring.closed
    finally:
        failing.set()
    owner.close()


@pytest.mark.usefixtures("ring_only")
def test_a_copy_stuck_on_the_owner_fails_its_write_keeps_its_buffer_and_the_pair_moves_on(
    make_agent: Callable[..., Agent], rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end between two agents over their sockets, host memory through the ring, the owner's first copy made
    to say what a hung GPU's says at its bound (StuckCopy): the write fails TIMEOUT with nothing landed, the
    owner's `unregister` raises DeviceError (a copy may still land: keep the memory), and the next write, to
    another buffer, goes through a fresh ring and connection (tests/gpu/test_cuda_staged_stuck.py: a real hang)."""
    start = SlotCopier.start
    stuck: list[bool] = []

    def stuck_once(self: SlotCopier, region: Any, offsets: Any, lengths: Any, slot: Any, at: int, *, to_slot: bool, deadline: float) -> Any:
        if to_slot or stuck:  # the initiator's copies, and the owner's after its first
            return start(self, region, offsets, lengths, slot, at, to_slot=to_slot, deadline=deadline)
        stuck.append(True)

        def never(deadline: float) -> None:
            raise StuckCopy("a staging copy did not finish before the deadline")

        return never

    monkeypatch.setattr(SlotCopier, "start", stuck_once)
    monkeypatch.setattr(agent_module, "_UNREGISTER_GRACE_S", 0.5)
    owner, initiator = make_agent(STAGED.allow, timeout_s=0.5), make_agent(STAGED.allow)
    size = (1 << 20) + 3
    data = rng.integers(0, 256, size, dtype=np.uint8)
    source = initiator.register(data.copy())
    target = owner.register(np.full(size, POISON, np.uint8))
    with pytest.raises(TimeoutError):
        initiator.write(source, target.descriptor, 0, 0, size, timeout=10.0).wait()
    assert stuck and np.all(target.numpy() == POISON)
    with pytest.raises(DeviceError, match="still run"):
        owner.unregister(target)
    fresh = owner.register(np.full(size, POISON, np.uint8))
    initiator.write(source, fresh.descriptor, 0, 0, size, timeout=10.0).wait()
    assert np.array_equal(fresh.numpy(), data)


def test_a_failed_copy_that_is_not_stuck_lets_go_of_its_buffer_and_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """The contrast: a copy that failed (it will not run) releases its buffer, and the ring is unmapped at close."""
    failing = threading.Event()
    failing.set()
    stream, owner, ring, waited = _owner_whose_copies_at_0_fail(monkeypatch, DeviceError("the copy failed"), failing)
    released: list[int] = []
    for request_id in (1, 2):
        owner.start(request_id, None, [0], [SMALL_BYTES + 1], None, 0, total=SMALL_BYTES + 1, to_slot=False, release=lambda i=request_id: released.append(i))  # type: ignore[arg-type,misc]
    owner.drain()
    device = int(common_pb2.ERROR_CODE_DEVICE)
    assert stream.sent == [(1, device), (2, device)] and released == [1, 2] and waited == [(0, False), (0, False)]
    owner.close()
    assert ring.closed and not ring.abandoned


@pytest.mark.parametrize("stuck", [True, False])
def test_the_initiator_abandons_a_ring_a_stuck_copy_may_touch_and_closes_any_other(tmp_path: Any, stuck: bool) -> None:
    """After a failed transfer the initiator drops its ring (its file goes, a new ring is made next time); one a stuck
    GPU copy may still touch is kept mapped and pinned for good: collected, its addresses would come back while
    still registered with the GPU runtime, and a new ring mapped there would fail to register."""
    link, ring = _Link(), _Ring()
    link.ring = ring  # type: ignore[assignment]
    link.name = str(tmp_path / "ring")
    open(link.name, "wb").close()
    link.stuck = stuck
    link.drop()
    assert (ring.abandoned, ring.closed) == (stuck, not stuck)
    assert link.ring is None and not link.stuck and not os.path.exists(tmp_path / "ring")


def test_an_abandoned_mapping_is_never_collected() -> None:
    mapping = PinnedMapping(None, 1 << 16, create=True)
    mapping.abandon()
    kept = weakref.ref(mapping)
    del mapping
    gc.collect()
    assert kept() is not None and kept() in _ABANDONED


@pytest.mark.usefixtures("ring_only")
def test_small_single_ranges_take_the_ring_fast_path_every_byte(config: Config, peer: PeerProcess, rng: np.random.Generator) -> None:
    """After one transfer the pair's single ranges of up to one slot run on the caller's thread through slot 0 (the
    agent's inline route): odd sizes, unaligned offsets, the last byte, a whole slot, both directions; a refusal still
    arrives typed."""
    size = SLOT_BYTES + (SMALL_BYTES * 2) + 5
    remote = peer.register(size, fill=POISON)
    with Agent(config.replace(policy=STAGED), daemon=False) as a:
        data = rng.integers(0, 256, size, dtype=np.uint8)
        src = a.register(data)
        out = a.register(np.full(size, POISON ^ 0xFF, np.uint8))
        a.write(src, remote, 0, 0, 1).wait()
        assert src.inline_routes[remote.id].max_bytes == SLOT_BYTES  # the fast path was learned, up to one slot
        expected = np.full(size, POISON, np.uint8)
        expected[0] = data[0]
        ranges = ((1, 7, size - 1), (4093, 1, 3), (SMALL_BYTES, 5, size - SMALL_BYTES), (65536, 11, 4099), (SLOT_BYTES, 13, size - SLOT_BYTES), ((3 << 20) + 7, 3, 17))
        for length, src_at, dst_at in ranges:
            handle = a.write(src, remote, src_at, dst_at, length)
            assert handle.path == "staged" and handle.bytes_done == length
            expected[dst_at : dst_at + length] = data[src_at : src_at + length]
        assert peer.contents(remote.id) == expected.tobytes()
        a.read(out, remote, 0, 0, 1).wait()
        wanted = np.full(size, POISON ^ 0xFF, np.uint8)
        wanted[0] = expected[0]
        for length, remote_at, local_at in ((4093, size - 4093, 2), (SMALL_BYTES, 9, size - SMALL_BYTES - 1), (SLOT_BYTES, 1, size - SLOT_BYTES - 3)):
            a.read(out, remote, remote_at, local_at, length).wait()
            wanted[local_at : local_at + length] = expected[remote_at : remote_at + length]
        assert remote.id in out.inline_routes and np.array_equal(out.numpy(), wanted)
        with pytest.raises(OutOfRangeError):
            a.write(src, grown(remote), 0, size, 1).wait()  # past the owner's buffer: refused by the owner
        assert peer.contents(remote.id) == expected.tobytes(), "a refused write changed the buffer"
        a.write(src, remote, 3, 3, 64).wait()  # the ring works after the refusal
        expected[3:67] = data[3:67]
        assert peer.contents(remote.id) == expected.tobytes()


@pytest.mark.usefixtures("ring_only")
def test_the_ring_fast_path_fails_typed_when_the_owner_dies(config: Config, make_peer: Any) -> None:
    doomed = make_peer()
    remote = doomed.register(1 << 16, fill=POISON)
    with Agent(config.replace(policy=STAGED, timeout_s=5.0), daemon=False) as a:
        src = a.register(np.arange(1 << 16, dtype=np.uint64).view(np.uint8)[: 1 << 16].copy())
        a.write(src, remote, 0, 0, 4096).wait()
        assert remote.id in src.inline_routes
        doomed.kill()
        handle = a.write(src, remote, 0, 0, 4096)
        with pytest.raises(HMCError):
            handle.wait()
        assert not src.inline_routes  # the failed route is forgotten: the next call takes the slow path again


@pytest.mark.usefixtures("ring_only")
@pytest.mark.parametrize("mailbox", [True, False], ids=["mailbox", "socket"])
def test_a_one_slot_range_fails_typed_and_at_once_when_its_owner_dies_mid_copy(
    config: Config, make_peer: Any, monkeypatch: pytest.MonkeyPatch, mailbox: bool
) -> None:
    """A range of a whole slot on the caller's thread, its owner frozen and then killed: the write fails typed when
    the owner dies, not at its deadline (30 s), through the mailbox or (where there is none) the socket."""
    monkeypatch.setattr(ShmStaging, "_MAILBOX", mailbox)
    doomed = make_peer()
    remote = doomed.register(SLOT_BYTES, fill=POISON)
    with Agent(config.replace(policy=STAGED, timeout_s=30.0), daemon=False) as a:
        src = a.register(np.full(SLOT_BYTES, 7, np.uint8))
        a.write(src, remote, 0, 0, 4096).wait()
        assert src.inline_routes[remote.id].max_bytes == SLOT_BYTES
        failed: list[BaseException] = []

        def write() -> None:
            try:
                a.write(src, remote, 0, 0, SLOT_BYTES).wait()
            except HMCError as exc:
                failed.append(exc)

        writer = threading.Thread(target=write)
        with doomed.stalled():
            writer.start()
            doomed.kill()
        writer.join(10.0)
        assert not writer.is_alive() and len(failed) == 1, "the write waited for its deadline, not for its owner's end"


@contextlib.contextmanager
def _hostile_ring(size: int) -> Iterator[tuple[str, int]]:
    """A ring file an initiator of this host made (its path, and its descriptor, to resize it), removed afterwards."""
    path = os.path.join(_ring_dir(max(size, 1)), f"hmc-staged-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        yield path, fd
    finally:
        os.close(fd)
        os.unlink(path)


def _raw_slot_write(peer: PeerProcess, remote: Any) -> tuple[FrameStream, Callable[[str, int, int], peer_pb2.PeerFrame]]:
    """A raw data connection to the peer agent and what makes a DataWrite of 4096 bytes through a named ring's slot 0."""
    stream = data_connection(peer, remote)

    def frame(segment: str, segment_bytes: int, length: int = 4096) -> peer_pb2.PeerFrame:
        ranges = common_pb2.RangeList(dst_offsets=struct.pack("<q", 0), lengths=struct.pack("<q", length))
        shm = peer_pb2.ShmSlot(segment=segment, segment_bytes=segment_bytes, offset=0)
        proof = stream.proof(remote.access_key, remote.registry_epoch)
        return peer_pb2.PeerFrame(write=peer_pb2.DataWrite(buffer_id=remote.id, key_proof=proof, ranges=ranges, shm=shm))

    return stream, frame


def test_an_empty_ring_file_is_refused_typed(peer: PeerProcess) -> None:
    """A slot naming an empty ring file with a size of 0 (nothing to move): a ProtocolError reply, not an uncaught
    error in the owner's connection thread."""
    remote = peer.register(1 << 16, fill=POISON)
    with _hostile_ring(0) as (path, _):
        stream, frame = _raw_slot_write(peer, remote)
        try:
            stream.send(frame(path, 0, 0), deadline=time.monotonic() + 5)
            with pytest.raises(ProtocolError):
                raise_for_reply(stream.recv(time.monotonic() + 5).reply)
        finally:
            stream.close()
    assert peer.contents(remote.id) == bytes([POISON]) * (1 << 16)


@pytest.mark.parametrize("kind", ["another user's", "symlink", "fifo", "shorter than announced"])
def test_a_ring_the_owner_must_not_map_is_refused_typed(peer: PeerProcess, kind: str) -> None:
    """A slot naming a ring file of another user (which that user could shrink under the owner's mapping: SIGBUS), a
    symbolic link or a FIFO with a ring's name, or a ring shorter than its frame says: a ProtocolError reply, nothing
    written, the owner alive."""
    remote = peer.register(1 << 16, fill=POISON)
    with _hostile_ring(1 << 20) as (path, fd):
        named, announced = path, 1 << 20
        if kind == "shorter than announced":
            announced = 1 << 40
        elif kind == "another user's":
            if os.geteuid() != 0:
                pytest.skip("giving a file to another user needs root")
            os.fchown(fd, 65534, 65534)
        elif kind == "symlink":
            named = path[:-32] + uuid.uuid4().hex  # another ring's name
            os.symlink(path, named)
        else:
            named = path[:-32] + uuid.uuid4().hex
            os.mkfifo(named, 0o600)
        stream, frame = _raw_slot_write(peer, remote)
        try:
            stream.send(frame(named, announced), deadline=time.monotonic() + 5)
            with pytest.raises(ProtocolError, match="regular file of this user|cannot map|smaller than announced"):
                raise_for_reply(stream.recv(time.monotonic() + 5).reply)
        finally:
            stream.close()
            if named != path:
                os.unlink(named)
    assert peer.contents(remote.id) == bytes([POISON]) * (1 << 16)


@pytest.mark.xfail(strict=True, reason="a ring of the owner's own user may shrink under its mapping: SIGBUS kills it (same-user peers are trusted that far)")
def test_an_initiator_shrinking_its_ring_under_the_owner_does_not_kill_it(peer: PeerProcess) -> None:
    """A hostile (or buggy) initiator of this host and user names its ring, lets the owner map it, then truncates the
    file and names a slot again: the owner's copy touches pages past the file's end. Another user's ring is refused
    (above); a process of the owner's own user could as well send it SIGKILL."""
    remote = peer.register(1 << 16, fill=POISON)
    with _hostile_ring(1 << 20) as (path, fd):
        stream, frame = _raw_slot_write(peer, remote)
        try:
            stream.send(frame(path, 1 << 20), deadline=time.monotonic() + 5)
            raise_for_reply(stream.recv(time.monotonic() + 5).reply)  # mapped, copied
            os.ftruncate(fd, 0)
            stream.send(frame(path, 1 << 20), deadline=time.monotonic() + 5)
            with contextlib.suppress(HMCError):
                stream.recv(time.monotonic() + 5)
        finally:
            stream.close()
    peer.contents(remote.id)  # the owner still answers


def test_the_fused_slot_batch_helper_is_built_and_stands_aside_without_a_cuda_driver() -> None:
    """setup.py compiles `hmc.transport._gpu_batch_c` (cffi, no CUDA needed); without a CUDA driver `library()` is None
    and slot batches are queued from Python. tests/gpu/test_cuda_slot_batches.py runs the helper on a GPU."""
    import ctypes.util

    from hmc.transport import _gpu_batch, _gpu_batch_c  # type: ignore[attr-defined]

    assert callable(_gpu_batch_c.lib.hmc_batch_run)
    if ctypes.util.find_library("cuda"):
        pytest.skip("a CUDA driver is installed here")
    assert _gpu_batch.library() is None


@pytest.mark.parametrize(
    "status, queued, outcome",
    [(0, 1, True), (600, 1, False), (600, 0, DeviceError), (1, 0, DeviceError), (700, 1, DeviceError)],
    ids=["landed", "still running", "not queued", "refused", "failed while polled"],
)
def test_the_helpers_single_copy_answers_landed_running_or_a_device_error(status: int, queued: int, outcome: object) -> None:
    """`Helper.copy_now` reads the C call's status, whose bit 30 says the copy was queued: 0 landed; NOT_READY after
    queueing, poll on; any other answer (NOT_READY with nothing queued included) a DeviceError, never a silent
    success."""
    from hmc.transport import _gpu_batch, _gpu_batch_c  # type: ignore[attr-defined]

    class Lib:
        hmc_batch_run = None

        @staticmethod
        def hmc_copy_now(context: int, dst: int, src: int, length: int, stream: int, polls: int) -> int:
            return status | (queued << 30 if status else 0)

    helper = _gpu_batch.Helper(_gpu_batch_c.ffi, Lib())
    if outcome is DeviceError:
        with pytest.raises(DeviceError, match=rf"CUresult {status} \(a copy, {'queued' if queued else 'not queued'}\)"):
            helper.copy_now(1, 2, 3, 4096, 5, 256)
    else:
        assert helper.copy_now(1, 2, 3, 4096, 5, 256) is outcome
