"""A CUDA copy lane's batches and single copies on a real GPU (`hmc.transport._gpu_copy.Lane`), through the compiled
helper's one C call each (`hmc.transport._gpu_batch`: `launch`, `copy_now`) and through the calls made from Python
(CuPy's and HIP's way, and every build without a C compiler): random bytes, poisoned destinations, every byte
compared; many short ranges, ranges cut into pieces, odd lengths and unaligned offsets, the buffer's last byte; a
range table still read, and a failing driver call.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hmc import memory
from hmc.transport import _gpu_batch
from hmc.transport._gpu_copy import Lane

from ._support import POISON, assert_bytes_equal, disjoint_offsets, random_bytes, scatter

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

SIZE = (24 << 20) + 13


CASES = {
    "kv 16 KiB": lambda rng: np.full(1024, 16384, np.int64),
    "odd lengths": lambda rng: rng.integers(1, 70000, 300).astype(np.int64),
    "pieces": lambda rng: np.array([(1 << 20) + 3, 5, (3 << 20) + 1, 262145, 7, 262144], np.int64),
    "launched in three parts": lambda rng: rng.integers(1, 1500, 9300).astype(np.int64),
    "parts after cutting": lambda rng: np.concatenate((rng.integers(1, 600, 2043), [(1 << 20) + 5, 3])).astype(np.int64),
}


@pytest.fixture(params=["c", "python"])
def helper(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> _gpu_batch.Helper | None:
    """The compiled helper ("c": it must be there), or none ("python": the lane makes every call from Python); set
    before the lane is made, which binds its single copy then."""
    if request.param == "python":
        monkeypatch.setattr(_gpu_batch, "library", lambda: None)
        return None
    found = _gpu_batch.library()
    assert found is not None, "the batch helper was not built at install, or does not load"
    return found


@contextlib.contextmanager
def _lane_and_buffers(seed: int) -> Iterator[tuple[Lane, np.ndarray, Any, Any]]:
    """A lane on cuda:0, a device source of random bytes and a poisoned device target: (lane, data, source, target)."""
    device = memory.get_device("cuda:0")
    lane = Lane(memory.backend_for(device), device)  # type: ignore[arg-type]
    data = random_bytes(SIZE, seed)
    source, target = memory.allocate(SIZE, "cuda:0"), memory.allocate(SIZE, "cuda:0")
    try:
        memory.copy(source, data)
        memory.fill(target, POISON)
        yield lane, data, source, target
    finally:
        lane.close(time.monotonic() + 30.0)
        memory.free(source)
        memory.free(target)


def _landed(target: Any) -> np.ndarray:
    out = np.empty(SIZE, np.uint8)
    memory.copy(out, target)
    return out


@pytest.mark.parametrize("case", CASES)
def test_a_batch_moves_every_byte_and_nothing_else(case: str) -> None:
    rng = np.random.default_rng(len(case))
    lengths = CASES[case](rng)
    src, dst = disjoint_offsets(rng, lengths, SIZE), disjoint_offsets(rng, lengths, SIZE)
    with _lane_and_buffers(21) as (lane, data, source, target):
        deadline = time.monotonic() + 30.0
        event = lane.enqueue(src, source.address, dst, target.address, lengths, deadline, record=True)
        assert lane.event_wait(event, deadline)
        lane.release_event(event)
        assert lane.kernel_kind in ("nvrtc", "cupy")
        assert_bytes_equal(_landed(target), scatter(np.full(SIZE, POISON, np.uint8), data, src, dst, lengths), case)


def test_batches_in_a_row_reuse_their_tables_and_land_in_order() -> None:
    """More batches than the lane has range tables, queued without waiting: each table is rewritten only once its last
    reader is done, and the last batch writing a byte wins."""
    rng = np.random.default_rng(9)
    lengths = np.full(512, 4096 + 3, np.int64)
    with _lane_and_buffers(22) as (lane, data, source, target):
        expected = np.full(SIZE, POISON, np.uint8)
        deadline = time.monotonic() + 30.0
        for _ in range(20):
            src, dst = disjoint_offsets(rng, lengths, SIZE), disjoint_offsets(rng, lengths, SIZE)
            lane.enqueue(src, source.address, dst, target.address, lengths, deadline)
            scatter(expected, data, src, dst, lengths)
        assert lane.wait_idle(deadline)
        assert_bytes_equal(_landed(target), expected, "after 20 batches")


@pytest.mark.parametrize("length, dst_at, src_at", [(1, 0, 0), (4095, 7, 3), (4096, SIZE - 4096, 1), ((3 << 20) + 13, 17, 4091)])
def test_a_single_copy_lands_at_once(length: int, dst_at: int, src_at: int, helper: _gpu_batch.Helper | None) -> None:
    with _lane_and_buffers(23) as (lane, data, source, target):
        assert lane.copy_now(target.address + dst_at, source.address + src_at, length, time.monotonic() + 30.0)
        expected = np.full(SIZE, POISON, np.uint8)
        expected[dst_at : dst_at + length] = data[src_at : src_at + length]
        assert_bytes_equal(_landed(target), expected, f"{length} bytes")
