"""The ipc path (cross-memory attach) between real processes."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from hmc.agent import Agent
from hmc.config import Config
from hmc.errors import ArgumentError
from hmc.testing import PeerProcess, TransportPair, check_transport
from hmc.transport._base import TransferOp, TransferRequest
from hmc.transport._ipc import IpcTransport, _copy_few, _copy_iovecs, _remote_order, _Running
from hmc.transport._ranges import iovec_rows
from hmc.transport._ranges import RangeList
from hmc.transport._wire import IOV_MAX

POISON = 0xA5


def test_ipc_conforms(config: Config, make_peer: Callable[..., PeerProcess]) -> None:
    @contextlib.contextmanager
    def pair() -> Iterator[TransportPair]:
        peer = make_peer(("ipc",))
        with Agent(config, daemon=False) as a:
            yield TransportPair(a, peer, "ipc", stalled=peer.stalled)

    check_transport(pair)


def test_peer_process_writes_and_reads_our_buffer(agent: Agent, peer: PeerProcess, rng: np.random.Generator) -> None:
    mine = agent.register(np.full((1 << 20) + 3, POISON, np.uint8))
    theirs = peer.register(1 << 20)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    peer.fill(theirs.id, data.tobytes())
    assert peer.transfer("write", theirs.id, mine.descriptor, [0, 5000], [3, 9000], 4000, notify=b"from-peer") == "ipc"
    expected = np.full(mine.size, POISON, np.uint8)
    expected[3:4003], expected[9000:13000] = data[:4000], data[5000:9000]
    assert np.array_equal(mine.numpy(), expected)
    [note] = agent.notifications(5.0)
    assert note.payload == b"from-peer" and note.sender_agent == peer.info.id and note.buffer_id == mine.id
    mine.numpy()[:] = rng.integers(0, 256, mine.size, dtype=np.uint8)
    assert peer.transfer("read", theirs.id, mine.descriptor, 0, 0, 1 << 20) == "ipc"
    assert peer.contents(theirs.id) == mine.numpy()[: 1 << 20].tobytes()


def test_more_ranges_than_iov_max_and_threaded_large_copies(agent: Agent, peer: PeerProcess, rng: np.random.Generator) -> None:
    size = 32 << 20
    remote = peer.register(size, fill=POISON)
    src = agent.register(rng.integers(0, 256, size, dtype=np.uint8))
    count = 3 * IOV_MAX + 17
    dst = np.sort(rng.choice(size // 4096, count, replace=False)) * 4096
    lengths = rng.integers(1, 4097, count)
    offsets = rng.integers(0, size - 4096, count)
    handle = agent.write(src, remote, offsets, dst, lengths)
    handle.wait()
    expected = np.full(size, POISON, np.uint8)
    for s, d, n in zip(offsets.tolist(), dst.tolist(), lengths.tolist()):
        expected[d : d + n] = src.numpy()[s : s + n]
    assert np.array_equal(np.frombuffer(peer.contents(remote.id), np.uint8), expected)
    handle = agent.write(src, remote, 0, 0, size)
    handle.wait()
    assert any(t.name.startswith("hmc-ipc") for t in threading.enumerate())
    assert peer.contents(remote.id) == src.numpy().tobytes()


class _Done:
    cancelled = False

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def set_running(self) -> None: ...

    def add_bytes(self, nbytes: int) -> None: ...

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error


def _rows(iov: int | bytes, count: int) -> list[list[int]]:
    """(address, length) rows of an iovec array passed as an address (numpy path) or packed bytes (few-ranges path)."""
    if isinstance(iov, bytes):
        return np.frombuffer(iov, np.uint64).reshape(count, 2).tolist()
    return np.ctypeslib.as_array((ctypes.c_uint64 * (2 * count)).from_address(iov)).reshape(count, 2).tolist()


@pytest.mark.parametrize("budget", [2999, 7000, 16001])
@pytest.mark.parametrize("few", [False, True])
def test_partial_transfers_resume_mid_iovec(rng: np.random.Generator, few: bool, budget: int) -> None:
    """The kernel may stop after any byte count; the copy loop must resume exactly there."""
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, np.uint8)
    ranges = RangeList.build([0, 10000, 30000], [5, 20000, 40000], [7000, 9000, 12000])
    calls = []

    def stingy(pid: int, local: int | bytes, count: int, remote: int | bytes, _: int, flags: int) -> int:
        rows_l, rows_r = _rows(local, count), _rows(remote, count)
        calls.append(count)
        moved = 0
        for (la, n), (ra, _) in zip(rows_l, rows_r):
            step = min(n, budget - moved)
            ctypes.memmove(ra, la, step)
            moved += step
            if moved == budget:
                break
        return moved

    local = np.empty((3, 2), np.uint64)
    remote = np.empty((3, 2), np.uint64)
    local[:, 0] = ranges.src.astype(np.uint64) + np.uint64(src.ctypes.data)
    remote[:, 0] = ranges.dst.astype(np.uint64) + np.uint64(dst.ctypes.data)
    local[:, 1] = remote[:, 1] = ranges.lengths
    request = TransferRequest("t", TransferOp.WRITE, None, None, ranges, float("inf"), _Done())  # type: ignore[arg-type]
    if few:
        assert _copy_few(stingy, 0, local[:, 0].tolist(), remote[:, 0].tolist(), ranges.lengths.tolist(), request, _Running())
    else:
        assert _copy_iovecs(stingy, 0, local, remote, request, _Running())
    assert len(calls) == -(-ranges.total // budget)
    expected = np.zeros_like(dst)
    for s, d, n in zip(ranges.src.tolist(), ranges.dst.tolist(), ranges.lengths.tolist()):
        expected[d : d + n] = src[s : s + n]
    assert np.array_equal(dst, expected)


def _kernel(budget: int, calls: list[tuple[int, int]]) -> Callable[..., int]:
    """process_vm_writev within this process: each side's iovecs a byte stream, at most `budget` bytes per call."""

    def call(pid: int, local: int, local_count: int, remote: int, remote_count: int, flags: int) -> int:
        assert 0 < local_count <= IOV_MAX and 0 < remote_count <= IOV_MAX
        calls.append((local_count, remote_count))
        sources = [(a, n) for a, n in _rows(local, local_count)]
        moved = 0
        for address, length in _rows(remote, remote_count):
            while length and moved < budget:
                a, n = sources[0]
                step = min(n, length, budget - moved)
                ctypes.memmove(address, a, step)
                address, length, moved = address + step, length - step, moved + step
                sources[0] = (a + step, n - step)
                if sources[0][1] == 0:
                    sources.pop(0)
        return moved

    return call


@pytest.mark.parametrize("budget", [1 << 40, 3 * 4096 + 7, 777_777])
def test_sides_with_different_entry_counts_copy_the_same_bytes(rng: np.random.Generator, budget: int) -> None:
    """Scattered local ranges into remote ranges that merge into a few runs; more entries than IOV_MAX on the local side."""
    block, count = 4096, 2 * IOV_MAX + 5
    src = rng.integers(0, 256, block * count * 2, dtype=np.uint8)
    dst = np.zeros(block * count + 3 * block, np.uint8)
    src_offsets = rng.permutation(2 * count)[:count].astype(np.int64) * block
    dst_offsets = np.arange(count, dtype=np.int64) * block
    dst_offsets[count // 2 :] += 3 * block  # two remote runs, and a gap
    lengths = np.full(count, block, np.int64)
    local = iovec_rows(src_offsets + src.ctypes.data, lengths)
    remote = iovec_rows(dst_offsets + dst.ctypes.data, lengths)
    assert 2 * IOV_MAX < len(local) <= count and len(remote) == 2  # (random neighbours on the local side merge too)
    calls: list[tuple[int, int]] = []
    request = TransferRequest("t", TransferOp.WRITE, None, None, RangeList.build(0, 0, 1), float("inf"), _Done())  # type: ignore[arg-type]
    assert _copy_iovecs(_kernel(budget, calls), 0, local, remote, request, _Running())
    assert len(calls) >= -(-count // IOV_MAX)
    expected = np.zeros_like(dst)
    for s, d in zip(src_offsets.tolist(), dst_offsets.tolist()):
        expected[d : d + block] = src[s : s + block]
    assert np.array_equal(dst, expected)
    assert iovec_rows(dst_offsets, lengths).tolist() == [[0, block * (count // 2)], [(count // 2 + 3) * block, block * (count - count // 2)]]


def test_remote_order_sorts_and_overlapping_destinations_never_reach_it() -> None:
    ranges = RangeList.build([0, 100, 200], [300, 0, 150], [50, 50, 50])
    write = _remote_order(ranges, TransferOp.WRITE)
    assert write is not None and write.dst.tolist() == [0, 150, 300] and write.src.tolist() == [100, 200, 0]
    read = _remote_order(ranges, TransferOp.READ)  # remote = src, already sorted; local destinations (dst) disjoint
    assert read is not None and read.src.tolist() == [0, 100, 200]
    # Overlapping destinations are the agent's to refuse, before a transport sees them (the check moved there):
    with pytest.raises(ArgumentError):
        RangeList.build([0, 100], [60, 0], [50, 70]).check_disjoint_dst()  # [0,70) meets [60,110)
    with pytest.raises(ArgumentError):
        RangeList.build([100, 0], [0, 40], [50, 50]).check_disjoint_dst()  # local [0,50) meets [40,90)
    RangeList.build([100, 0], [0, 50], [50, 50]).check_disjoint_dst()  # touching is fine
    assert _remote_order(RangeList.build([100, 0], [0, 50], [50, 50]), TransferOp.READ) is not None


@pytest.mark.parametrize("op", ["write", "read"])
def test_many_range_batches_land_in_any_order_and_overlapping_destinations_are_refused(
    agent: Agent, peer: PeerProcess, rng: np.random.Generator, op: str
) -> None:
    """Large many-range batches are reordered and split across threads; overlapping destinations are refused before a byte moves."""
    size, block, count = 8 << 20, 64 << 10, 80  # 5 MiB per batch: the threaded path
    theirs = peer.register(size, fill=POISON)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    mine = agent.register(data.copy())
    if op == "read":
        peer.fill(theirs.id, data.tobytes())
    sources = rng.permutation(size // block)[:count].astype(np.int64) * block
    overlapping = (np.arange(count, dtype=np.int64) % 7) * 1000  # every destination overlaps others
    disjoint = rng.permutation(size // block)[:count].astype(np.int64) * block
    for destinations in (overlapping, disjoint):
        expected = np.full(size, POISON, np.uint8)
        if destinations is disjoint:
            for s, d in zip(sources.tolist(), destinations.tolist()):
                expected[d : d + block] = data[s : s + block]
        with contextlib.nullcontext() if destinations is disjoint else pytest.raises(ArgumentError, match="overlap"):
            if op == "write":
                peer.poison(theirs.id, POISON)
                agent.write(mine, theirs, sources, destinations, block).wait()
            else:
                mine.numpy()[:] = POISON
                agent.read(mine, theirs, sources, destinations, block).wait()
        landed = np.frombuffer(peer.contents(theirs.id), np.uint8) if op == "write" else mine.numpy()
        assert np.array_equal(landed, expected)


def test_unavailable_cma_is_left_out_and_negotiation_falls_back_to_the_next_path(
    config: Config, peer: PeerProcess, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(IpcTransport, "unavailable_reason", lambda self: "process_vm_writev unavailable: EPERM")
    with Agent(config, daemon=False) as a:
        assert "ipc" not in [t.path for t in a.info.transports]
        remote = peer.register(1 << 16, fill=POISON)
        src = a.register(rng.integers(0, 256, 1 << 16, dtype=np.uint8))
        choice = a.path_to(src, remote)
        expected = "ucx" if "ucx" in [t.path for t in a.info.transports] else "staged"  # ucx where its binding is built
        assert choice.path.value == expected
        assert dict((p.value, r) for p, r in choice.rejected)["ipc"].endswith("has no ipc transport: host memory: process_vm_writev unavailable: EPERM")
        handle = a.write(src, remote, 0, 0, 1 << 16)
        handle.wait()
        assert handle.path == expected and peer.contents(remote.id) == src.numpy().tobytes()
