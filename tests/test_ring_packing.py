"""Slot packing of the staged ring under hypothesis: ranges straddling slots, odd sizes and slots, unaligned
offsets, the last byte of a buffer. First the packing itself, then every byte through a real owner's shared
ring with host memory (the ring protocol and the owner's scatter out of slots run end to end; with CUDA memory
the same chunks become one kernel launch per slot, tests/gpu/test_cuda_staged.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import hmc.transport._staged as staged
from hmc.agent import Agent
from hmc.config import Config, PathPolicy
from hmc.testing import PeerProcess
from hmc.transport._ranges import RangeList, end_to_end
from hmc.transport._pinned import Pending, SlotCopier
from hmc.transport._staged_shm import ShmStaging

POISON = 0xA5
SLOT = 4099
"""An odd slot size: no range boundary lines up with a slot boundary by accident."""


@st.composite
def scattered(draw: st.DrawFn, max_size: int = 5 * SLOT + 7) -> tuple[int, int, RangeList]:
    """(source size, destination size, ranges): disjoint destination ranges in random order, sources anywhere."""
    dst_size = draw(st.integers(1, max_size))
    src_size = draw(st.integers(1, max_size))
    cuts = sorted(set(draw(st.lists(st.integers(0, dst_size), max_size=40)) + [0, dst_size]))
    blocks = [(a, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]
    blocks = [block for block in blocks if block[1] <= src_size]
    chosen = draw(st.lists(st.sampled_from(blocks), unique=True, min_size=1)) if blocks else []
    if not chosen:
        return src_size, dst_size, RangeList.build([0], [dst_size - 1], [1])  # the last byte alone
    dst = [d for d, _ in chosen]
    lengths = [n for _, n in chosen]
    src = [draw(st.integers(0, src_size - n)) for n in lengths]
    return src_size, dst_size, RangeList.build(src, dst, lengths)


def _stream(data: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> bytes:
    return b"".join(data[o : o + n].tobytes() for o, n in zip(offsets.tolist(), lengths.tolist()))


@settings(max_examples=300, deadline=None)
@given(case=scattered(), slot=st.integers(1, 3 * SLOT))
def test_packing_fills_every_slot_but_the_last_and_keeps_every_byte(case: tuple[int, int, RangeList], slot: int) -> None:
    src_size, dst_size, ranges = case
    chunks = ranges.packed(slot)
    totals = [chunk.total for chunk in chunks]
    assert sum(totals) == ranges.total
    assert all(total == slot for total in totals[:-1]) and 0 < totals[-1] <= slot
    assert all(int(chunk.lengths.min()) > 0 for chunk in chunks)
    for chunk in chunks:  # a slot's layout: its ranges end to end
        assert np.array_equal(end_to_end(chunk.lengths), np.concatenate(([0], np.cumsum(chunk.lengths)[:-1])))
    rng = np.random.default_rng(src_size * 31 + dst_size)
    src, dst = rng.integers(0, 256, src_size, np.uint8), rng.integers(0, 256, dst_size, np.uint8)
    joined = RangeList(*(np.concatenate([getattr(c, f) for c in chunks]) for f in ("src", "dst", "lengths")))
    assert _stream(src, joined.src, joined.lengths) == _stream(src, ranges.src, ranges.lengths)
    assert _stream(dst, joined.dst, joined.lengths) == _stream(dst, ranges.dst, ranges.lengths)


@settings(max_examples=200, deadline=None)
@given(per_slot=st.integers(1, 9), block=st.integers(1, 64), count=st.integers(2, 200), seed=st.integers(0, 2**32 - 1))
def test_blocks_that_divide_the_slot_are_cut_between_blocks(per_slot: int, block: int, count: int, seed: int) -> None:
    """KV blocks in random order, `per_slot` of them filling a slot exactly: no block is split, every slot holds
    the next `per_slot` blocks in the given order (the path that finds the cuts without looking at every range)."""
    rng = np.random.default_rng(seed)
    src = rng.permutation(count).astype(np.int64) * block
    dst = rng.permutation(count).astype(np.int64) * block
    chunks = RangeList.build(src, dst, block).packed(per_slot * block)
    assert len(chunks) == -(-count // per_slot)
    for index, chunk in enumerate(chunks):
        rows = slice(index * per_slot, (index + 1) * per_slot)
        assert chunk.src.tolist() == src[rows].tolist() and chunk.dst.tolist() == dst[rows].tolist()
        assert chunk.lengths.tolist() == [block] * len(src[rows])
    assert chunks[-1].src.tolist() == chunks[len(chunks) - 1].src.tolist() and [c.total for c in chunks[:]] == [c.total for c in chunks]
    with pytest.raises(IndexError):
        chunks[len(chunks)]


@settings(max_examples=200, deadline=None)
@given(
    block=st.sampled_from([1, 3, 64, 4096, 16384]), count=st.integers(9, 300), slot_blocks=st.integers(1, 40), extra=st.integers(0, 2),
    read=st.booleans(), seed=st.integers(0, 2**32 - 1),
)
def test_checked_kv_blocks_are_cut_by_counting_as_the_general_cut_would(
    block: int, count: int, slot_blocks: int, extra: int, read: bool, seed: int
) -> None:
    """Once the checks' C pass found blocks of one length (every transfer's list is checked before it is packed), a
    slot that holds whole blocks is cut by counting alone; a READ's swapped list keeps those facts. The chunks are
    the general cut's, row for row; a slot that does not hold whole blocks (`extra`) takes the general cut."""
    from hmc.transport._ranges import _Facts

    assert _Facts._library() is not None, "setup.py did not build hmc.transport._ranges_c"
    rng = np.random.default_rng(seed)
    src = rng.permutation(count).astype(np.int64) * block
    dst = rng.permutation(count).astype(np.int64) * block
    checked = RangeList.build(src, dst, block)
    checked.check(count * block, count * block)  # the agent's checks: the C pass runs, its facts stay with the list
    checked.check_disjoint_dst()
    plain = RangeList.build(src, dst, block)
    plain.__dict__["_facts"] = None  # as where the C pass was not built
    if read:
        checked, plain = checked.swapped(), plain.swapped()
        assert checked.__dict__.get("_facts") is not None, "the swapped list lost the facts"
    slot = slot_blocks * block + extra
    fast, general = checked.packed(slot), plain.packed(slot)
    assert len(fast) == len(general)
    for a, b in zip(fast, general):
        assert a.src.tolist() == b.src.tolist() and a.dst.tolist() == b.dst.tolist() and a.lengths.tolist() == b.lengths.tolist()


def test_packing_drops_empty_ranges_and_refuses_a_bad_slot() -> None:
    ranges = RangeList.build([0, 5, 9], [0, 5, 9], [0, 4, 0])
    assert [(c.src.tolist(), c.lengths.tolist()) for c in ranges.packed(3)] == [([5], [3]), ([8], [1])]
    assert len(RangeList.build([0], [0], [0]).packed(8)) == 0
    from hmc.errors import ArgumentError

    for slot in (0, -4):
        with pytest.raises(ArgumentError):
            ranges.packed(slot)


@pytest.fixture(scope="module")
def ring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, PeerProcess]]:
    """An agent whose staged path puts host memory through an 8-slot ring of odd `SLOT`-byte slots, and a real
    owner process."""
    config = Config(socket=str(Path(tmp_path_factory.mktemp("ring")) / "no-hmcd.sock"), timeout_s=10.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(staged, "_HOST_KINDS", ())
        patch.setitem(ShmStaging.__init__.__kwdefaults__, "slot_bytes", SLOT)
        with PeerProcess(config) as peer, Agent(config.replace(policy=PathPolicy(allow=("staged",))), daemon=False) as agent:
            assert agent._transports["staged"]._shm._slot_bytes == SLOT  # the odd slots are the ones in use
            yield agent, peer


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=scattered())
@example(case=(5 * SLOT + 7, 5 * SLOT + 7, RangeList.build([1], [0], [5 * SLOT + 6])))  # up to the last byte, unaligned
@example(case=(SLOT + 1, 3 * SLOT, RangeList.build([SLOT, 0], [3 * SLOT - 1, SLOT - 1], [1, SLOT + 1])))  # straddles, last byte
def test_every_byte_through_the_ring_both_ways(ring: tuple[Agent, PeerProcess], case: tuple[int, int, RangeList]) -> None:
    agent, peer = ring
    src_size, dst_size, ranges = case
    rng = np.random.default_rng(src_size * 131 + dst_size + len(ranges))
    data = rng.integers(0, 256, src_size, np.uint8)
    remote = peer.register(dst_size, fill=POISON)
    src = agent.register(data)
    try:
        handle = agent.write(src, remote, ranges.src, ranges.dst, ranges.lengths)
        handle.wait()
        assert handle.path == "staged" and handle.bytes_done == ranges.total
        expected = np.full(dst_size, POISON, np.uint8)
        for s, d, n in zip(ranges.src.tolist(), ranges.dst.tolist(), ranges.lengths.tolist()):
            expected[d : d + n] = data[s : s + n]
        assert peer.contents(remote.id) == expected.tobytes()

        # read the same remote ranges back into a poisoned buffer, laid end to end from byte 1 (shifted, unaligned)
        local = 1 + end_to_end(ranges.lengths)
        out = agent.register(np.full(ranges.total + 2, POISON ^ 0xFF, np.uint8))
        try:
            agent.read(out, remote, ranges.dst, local, ranges.lengths).wait()
            wanted = np.full(ranges.total + 2, POISON ^ 0xFF, np.uint8)
            for at, d, n in zip(local.tolist(), ranges.dst.tolist(), ranges.lengths.tolist()):
                wanted[at : at + n] = expected[d : d + n]
            assert np.array_equal(out.numpy(), wanted)
        finally:
            agent.unregister(out)
    finally:
        agent.unregister(src)
        peer.unregister(remote.id)


class _Late:
    """A copy that says it is still running for its first `looks` looks, as a GPU copy does (host memory's copy is
    done on the spot): the initiator then takes the replies that arrive meanwhile and queues more copies first."""

    def __init__(self, copy: Pending, looks: int) -> None:
        self.copy, self.looks = copy, looks

    def done(self) -> bool:
        self.looks -= 1
        return self.looks < 0 and self.copy.done()

    def __call__(self, deadline: float) -> None:
        self.copy(deadline)


@pytest.mark.parametrize("looks", [1, 40])
def test_replies_taken_while_a_copy_is_waited_for_keep_every_byte_in_order(
    ring: tuple[Agent, PeerProcess], looks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 slots' worth of ranges through the 8-slot ring while every copy is slow to finish: replies come first,
    freed slots are refilled before older copies are handed off (WRITE) or waited for (READ)."""
    agent, peer = ring
    start = SlotCopier.start
    monkeypatch.setattr(SlotCopier, "start", lambda self, *a, **k: _Late(start(self, *a, **k), looks))
    rng = np.random.default_rng(looks)
    size = 20 * SLOT + 11
    data = rng.integers(0, 256, size, np.uint8)
    blocks = rng.permutation(size // 97)[: size // 97 - 3].astype(np.int64) * 97  # many short ranges
    remote = peer.register(size, fill=POISON)
    src = agent.register(data)
    back = agent.register(np.full(size, POISON ^ 0xFF, np.uint8))
    try:
        agent.write(src, remote, blocks, blocks[::-1].copy(), 97).wait()
        expected = np.full(size, POISON, np.uint8)
        for s, d in zip(blocks.tolist(), blocks[::-1].tolist()):
            expected[d : d + 97] = data[s : s + 97]
        assert peer.contents(remote.id) == expected.tobytes()
        agent.read(back, remote, blocks, blocks, 97).wait()
        wanted = np.full(size, POISON ^ 0xFF, np.uint8)
        for b in blocks.tolist():
            wanted[b : b + 97] = expected[b : b + 97]
        assert np.array_equal(back.numpy(), wanted)
    finally:
        agent.unregister(src)
        agent.unregister(back)
        peer.unregister(remote.id)


def test_many_short_ranges_travel_in_pairs_of_slots_only_where_this_end_queues_its_batches_in_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """One 16 MiB-style slot per chunk where this end queues a slot's batch in one C call (CUDA, or HIP where its
    runtime library loads; the other end is taken to have its helper too); pairs of slots for short ranges (the KV
    pattern) where this end's GPU runtime has no helper. Long ranges, host memory here, and the TCP ring (whose
    owner's bounce slots hold one) keep one slot per chunk."""
    from types import SimpleNamespace

    import hmc.memory
    from hmc.memory import DeviceKind
    from hmc.transport import _gpu_batch
    from hmc.transport._staged_tcp_ring import TcpRingStaging
    from hmc.v1 import common_pb2

    def request(count: int, length: int, local: DeviceKind, remote: int) -> Any:
        ranges = RangeList.build(np.arange(count) * length, np.arange(count) * length, length)
        return SimpleNamespace(ranges=ranges, local=SimpleNamespace(region=SimpleNamespace(device=SimpleNamespace(kind=local))), remote=SimpleNamespace(device=SimpleNamespace(kind=remote)))

    runtimes = {DeviceKind.CUDA: SimpleNamespace(name="CUDA"), DeviceKind.HIP: SimpleNamespace(name="HIP", libraries=("libamdhip64.so",))}
    monkeypatch.setattr(hmc.memory, "backend_for", lambda device: SimpleNamespace(runtime=runtimes[device.kind]))
    helpers: dict[str, Any] = {}
    monkeypatch.setattr(_gpu_batch, "helper_for", lambda runtime: helpers.get(runtime.name))
    cuda, hip, host = DeviceKind.CUDA, DeviceKind.HIP, DeviceKind.HOST
    remote_cuda, remote_hip = common_pb2.DEVICE_KIND_CUDA, common_pb2.DEVICE_KIND_HIP
    ring = ShmStaging(lambda *_: None, slots=8, slot_bytes=SLOT)  # type: ignore[arg-type]
    tcp = TcpRingStaging(lambda *_: None, slots=8, slot_bytes=SLOT)  # type: ignore[arg-type]
    try:
        helpers.update(CUDA=object(), HIP=object())  # both helpers built and their libraries loaded
        for local, remote in ((cuda, remote_cuda), (host, remote_cuda), (cuda, remote_hip), (hip, remote_cuda), (hip, remote_hip)):
            assert ring._layout(request(64, 64, local, remote)) == (SLOT, 8), (local, remote)
        helpers.pop("HIP")  # no HIP runtime library here: this HIP end queues its batches in steps
        assert ring._layout(request(64, 64, hip, remote_cuda)) == (2 * SLOT, 4)
        assert ring._layout(request(64, 64, cuda, remote_hip)) == (SLOT, 8)  # the other end's helper is its own
        assert ring._layout(request(1, 5 << 20, hip, remote_cuda)) == (SLOT, 8)  # long ranges
        assert tcp._layout(request(64, 64, hip, remote_cuda)) == (SLOT, 8)
        helpers.clear()  # nothing built here: CUDA batches go in steps too
        assert ring._layout(request(64, 64, cuda, remote_cuda)) == (2 * SLOT, 4)
        assert ring._layout(request(64, 64, host, remote_cuda)) == (SLOT, 8)
    finally:
        ring.close()
        tcp.close()
