"""The staged ring's slot batches on a real GPU (`hmc.transport._pinned.SlotCopier`): ranges of device memory gathered
into a pinned slot and scattered out of it, through the fused C call (`hmc.transport._gpu_batch`) and through the
steps queued from Python (HIP's and CuPy's way), random bytes, poisoned destinations, every byte compared: many short
ranges, ranges cut into pieces, odd lengths and unaligned offsets, a slot at an odd position, the buffer's last byte.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from hmc import memory
from hmc.errors import DeviceError
from hmc.transport import _gpu_batch
from hmc.transport import _gpu_copy as gpu_copy
from hmc.transport._pinned import PinnedMapping, SlotCopier

from ._support import POISON, assert_bytes_equal, disjoint_offsets, random_bytes

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

SIZE = (48 << 20) + 13
AT = 4096 + 7
"""Where in the pinned mapping the slot starts (not aligned)."""


CASES = {
    "kv 64 KiB": lambda rng: np.full(256, 65536, np.int64),
    "kv 16 KiB": lambda rng: np.full(1024, 16384, np.int64),
    "odd lengths": lambda rng: rng.integers(1, 70000, 300).astype(np.int64),
    "pieces": lambda rng: np.array([(1 << 20) + 3, 5, (3 << 20) + 1, 262145, 7, 262144], np.int64),
}


@pytest.fixture(params=["fused", "steps"])
def fused_calls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Which of the lane's batches went through the fused call (True) or fell back (False); the "steps" run makes every
    batch fall back, with no helper at all (every call made from Python)."""
    if request.param == "fused":
        assert _gpu_batch.library() is not None, "the fused batch helper was not built at install, or does not load"
    else:
        monkeypatch.setattr(_gpu_batch, "library", lambda: None)
    calls: list[bool] = []
    fused = gpu_copy.Lane.fused

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = fused(self, *args, **kwargs) if request.param == "fused" else None
        calls.append(result is not None)
        return result

    monkeypatch.setattr(gpu_copy.Lane, "fused", counted)
    yield calls
    if request.param == "fused":
        assert calls and all(calls), "a batch fell back to the Python steps although the fused helper is there"


@pytest.mark.parametrize("case", CASES)
def test_slot_batches_gather_and_scatter_every_byte(case: str, fused_calls: list[bool]) -> None:
    rng = np.random.default_rng(len(case))
    lengths = CASES[case](rng)
    data = random_bytes(SIZE, 11)
    source, target = memory.allocate(SIZE, "cuda:0"), memory.allocate(SIZE, "cuda:0")
    ring = PinnedMapping(None, AT + (48 << 20), create=True)
    copier = SlotCopier()
    try:
        memory.copy(source, data)
        memory.fill(target, POISON)
        np.frombuffer(ring.view(0, ring.size), np.uint8)[:] = POISON
        src, dst = disjoint_offsets(rng, lengths, SIZE), disjoint_offsets(rng, lengths, SIZE)
        deadline = time.monotonic() + 30.0
        copier.start(source, src, lengths, ring, AT, to_slot=True, deadline=deadline)(deadline)
        packed = _packed(data, src, lengths)
        slot = np.frombuffer(ring.view(0, ring.size), np.uint8)
        assert_bytes_equal(slot[AT : AT + packed.size], packed, f"{case}: gathered")
        assert (slot[:AT] == POISON).all() and (slot[AT + packed.size :] == POISON).all(), f"{case}: written outside the slot"
        copier.start(target, dst, lengths, ring, AT, to_slot=False, deadline=deadline)(deadline)
        expected = np.full(SIZE, POISON, np.uint8)
        position = 0
        for d, n in zip(dst.tolist(), lengths.tolist()):
            expected[d : d + n] = packed[position : position + n]
            position += n
        landed = np.empty(SIZE, np.uint8)
        memory.copy(landed, target)
        assert_bytes_equal(landed, expected, f"{case}: scattered")
    finally:
        copier.close()
        ring.close()
        memory.free(source)
        memory.free(target)


@contextlib.contextmanager
def _gather_into_slot(monkeypatch: pytest.MonkeyPatch, seed: int, run: Callable[..., bool]) -> Iterator[tuple[np.ndarray, Any, PinnedMapping, SlotCopier]]:
    """A device source of random bytes, a pinned ring and a copier, with the fused helper's `run` replaced by
    `run(original, self, *args, **kwargs)`: (the data, the source, the ring, the copier); freed on exit."""
    helper = _gpu_batch.library()
    assert helper is not None, "the fused batch helper was not built at install, or does not load"
    original = type(helper).run
    monkeypatch.setattr(type(helper), "run", lambda self, *args, **kwargs: run(original, self, *args, **kwargs))
    data = random_bytes(SIZE, seed)
    source = memory.allocate(SIZE, "cuda:0")
    ring = PinnedMapping(None, AT + (8 << 20), create=True)
    copier = SlotCopier()
    try:
        memory.copy(source, data)
        yield data, source, ring, copier
    finally:
        copier.close()
        ring.close()
        memory.free(source)


def _packed(data: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The source ranges laid end to end, as a gather leaves them in its slot."""
    return np.concatenate([data[s : s + n] for s, n in zip(src.tolist(), lengths.tolist())])


def test_a_failing_fused_batch_fails_typed_and_the_next_one_moves_every_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver call failing inside the C call is a DeviceError for that batch (its scratch slot fenced); the copier
    goes on with the next batch, through the fused call again."""
    rng = np.random.default_rng(3)
    lengths = np.full(64, 65536, np.int64)
    failures = iter([True])

    def failing(original: Callable[..., bool], self: Any, *args: Any, **kwargs: Any) -> bool:
        if next(failures, False):
            raise DeviceError("CUDA driver call failed: CUresult 999 (injected)")
        return bool(original(self, *args, **kwargs))

    with _gather_into_slot(monkeypatch, 12, failing) as (data, source, ring, copier):
        src = disjoint_offsets(rng, lengths, SIZE)
        deadline = time.monotonic() + 30.0
        with pytest.raises(DeviceError):
            copier.start(source, src, lengths, ring, AT, to_slot=True, deadline=deadline)
        np.frombuffer(ring.view(0, ring.size), np.uint8)[:] = POISON
        copier.start(source, src, lengths, ring, AT, to_slot=True, deadline=deadline)(deadline)
        packed = _packed(data, src, lengths)
        assert_bytes_equal(np.frombuffer(ring.view(AT, packed.size), np.uint8), packed, "after a failed batch")


def test_a_batch_whose_range_table_is_still_read_waits_for_it_then_moves_every_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C call queues nothing while the launch that last read its range table runs (it answers NOT_READY): the
    lane waits for that launch, calls again, and every byte lands."""
    rng = np.random.default_rng(5)
    lengths = np.full(96, 16384, np.int64)
    answers: list[bool] = []

    def busy_once(original: Callable[..., bool], self: Any, *args: Any, **kwargs: Any) -> bool:
        if not answers:  # as the C call answers while the table's last launch runs: nothing queued
            answers.append(False)
            return False
        answers.append(bool(original(self, *args, **kwargs)))
        return answers[-1]

    with _gather_into_slot(monkeypatch, 13, busy_once) as (data, source, ring, copier):
        src = disjoint_offsets(rng, lengths, SIZE)
        np.frombuffer(ring.view(0, ring.size), np.uint8)[:] = POISON
        deadline = time.monotonic() + 30.0
        copier.start(source, src, lengths, ring, AT, to_slot=True, deadline=deadline)(deadline)
        assert answers == [False, True]
        packed = _packed(data, src, lengths)
        assert_bytes_equal(np.frombuffer(ring.view(AT, packed.size), np.uint8), packed, "after a busy table")
        assert_bytes_equal(np.frombuffer(ring.view(AT + packed.size, 4096), np.uint8), np.full(4096, POISON, np.uint8), "past the batch")
