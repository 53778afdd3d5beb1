"""Range lists under hypothesis: coalescing and chunking never change which bytes move; wire decoding never crashes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmc.errors import ArgumentError, OutOfRangeError, ProtocolError
from hmc.transport._ranges import RangeList
from hmc.v1 import common_pb2

SPACE = 4096

ranges_st = st.lists(
    st.tuples(st.integers(0, SPACE - 1), st.integers(0, SPACE - 1), st.integers(0, 300)),
    max_size=60,
).map(lambda rows: [(s, d, min(n, SPACE - s, SPACE - d)) for s, d, n in rows])


def _with_runs(rows: list[tuple[int, int, int]], split: list[int]) -> RangeList:
    """Cut some ranges into adjacent pieces, so coalescing has something to merge."""
    out = []
    for (s, d, n), cut in zip(rows, split + [0] * len(rows)):
        cut = min(cut, n)
        out += [(s, d, cut), (s + cut, d + cut, n - cut)] if 0 < cut < n else [(s, d, n)]
    columns = np.array(out, dtype=np.int64).reshape(-1, 3).T
    return RangeList.build(columns[0], columns[1], columns[2])


def _apply(ranges: RangeList, src: np.ndarray) -> np.ndarray:
    dst = np.zeros_like(src)
    for s, d, n in zip(ranges.src.tolist(), ranges.dst.tolist(), ranges.lengths.tolist()):
        dst[d : d + n] = src[s : s + n]
    return dst


def _byte_map(ranges: RangeList) -> list[tuple[int, int]]:
    return [(s + i, d + i) for s, d, n in zip(ranges.src.tolist(), ranges.dst.tolist(), ranges.lengths.tolist()) for i in range(n)]


@settings(max_examples=200, deadline=None)
@given(ranges_st, st.lists(st.integers(0, 300), max_size=60))
def test_coalescing_preserves_the_bytes_moved(rows: list[tuple[int, int, int]], split: list[int]) -> None:
    ranges = _with_runs(rows, split)
    merged = ranges.coalesced()
    src = np.random.default_rng(len(rows)).integers(1, 256, SPACE, dtype=np.uint8)
    assert merged.total == ranges.total
    assert len(merged) <= len(ranges)
    assert (merged.lengths > 0).all()
    assert np.array_equal(_apply(merged, src), _apply(ranges, src))


@settings(max_examples=200, deadline=None)
@given(ranges_st, st.integers(1, 700))
def test_chunks_cover_exactly_in_order(rows: list[tuple[int, int, int]], chunk_bytes: int) -> None:
    ranges = _with_runs(rows, []).coalesced()
    chunks = ranges.chunks(chunk_bytes)
    pieces = [p for c in chunks for p in _byte_map(c)]
    assert pieces == _byte_map(ranges)
    assert sum(c.total for c in chunks) == ranges.total
    if len(chunks) > 1:  # "about" chunk_bytes: no piece is longer, no chunk reaches twice that
        assert all(len(c) and int(c.lengths.max()) <= chunk_bytes and c.total < 2 * chunk_bytes for c in chunks)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=96), st.binary(max_size=96), st.binary(max_size=96), st.integers(0, 1 << 20), st.integers(0, 1 << 20))
def test_wire_ranges_decode_or_raise_protocol_error(src: bytes, dst: bytes, lengths: bytes, src_size: int, dst_size: int) -> None:
    message = common_pb2.RangeList(src_offsets=src, dst_offsets=dst, lengths=lengths)
    try:
        ranges = RangeList.from_proto(common_pb2.RangeList.FromString(message.SerializeToString()))
    except ProtocolError:
        return
    assert ranges.src.size == ranges.dst.size == ranges.lengths.size
    try:
        ranges.check(src_size, dst_size)
    except OutOfRangeError:
        return
    assert ranges.total <= min(src_size, dst_size) * max(len(ranges), 1)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_descriptor_decoding_of_random_bytes_never_crashes(raw: bytes) -> None:
    from google.protobuf.message import DecodeError

    try:
        descriptor = common_pb2.BufferDescriptor.FromString(raw)
    except DecodeError:
        return
    RangeList.build(0, 0, 0).check(int(descriptor.size), int(descriptor.size))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(-5, 5000), st.integers(-5, 5000), st.integers(-5, 3000)), min_size=1, max_size=20), st.integers(0, 6000), st.integers(0, 6000))
def test_bounds_checks_agree_with_a_plain_oracle(rows: list[tuple[int, int, int]], src_size: int, dst_size: int) -> None:
    """Short lists are checked on Python ints, long ones vectorised: both must refuse exactly the bad lists."""
    ranges = RangeList.build(*(np.array(column, np.int64) for column in zip(*rows)))
    bad_src = any(s < 0 or n < 0 or s + n > src_size for s, _, n in rows)
    bad_dst = any(d < 0 or n < 0 or d + n > dst_size for _, d, n in rows)
    try:
        ranges.check(src_size, dst_size)
        refused = False
    except OutOfRangeError:
        refused = True
    assert refused == (bad_src or bad_dst)
    try:
        ranges.check_dst(dst_size)
        refused = False
    except OutOfRangeError:
        refused = True
    assert refused == bad_dst


_INT64 = st.integers(-(2**63), 2**63 - 1)
_ANY_INT = st.one_of(_INT64, st.integers(-(2**80), 2**80))
_DTYPES = st.sampled_from([np.int8, np.int32, np.int64, np.uint8, np.uint32, np.uint64, np.float32, np.float64, np.bool_, np.complex64, np.str_, object])
_INPUTS = st.one_of(
    _ANY_INT,
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(_ANY_INT, max_size=6),
    st.lists(st.one_of(_ANY_INT, st.booleans(), st.floats(), st.none()), max_size=6),
    st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=3), max_size=3),  # 2-D or ragged
    st.tuples(_DTYPES, st.sampled_from([(), (0,), (3,), (2, 2), (1, 3), (0, 2)])).map(lambda t: np.ones(t[1], dtype=t[0])),
    st.builds(lambda v: np.uint64(v), st.integers(0, 2**64 - 1)),
    st.builds(lambda v: np.array(v, np.uint64), st.lists(st.integers(0, 2**64 - 1), max_size=4)),
)


@settings(max_examples=500, deadline=None)
@given(_INPUTS, _INPUTS, _INPUTS)
def test_build_returns_int64_arrays_or_raises_argument_error(src: object, dst: object, lengths: object) -> None:
    """Whatever a caller passes, build() gives three equal 1-D int64 arrays or a typed error, never a builtin one."""
    try:
        ranges = RangeList.build(src, dst, lengths)
    except ArgumentError:  # OutOfRangeError included
        return
    for array in (ranges.src, ranges.dst, ranges.lengths):
        assert array.dtype == np.int64 and array.ndim == 1 and array.flags.c_contiguous
    assert ranges.src.size == ranges.dst.size == ranges.lengths.size
    for given_, built in ((src, ranges.src), (dst, ranges.dst)):  # nothing flattened, nothing made of bools, floats or text
        assert given_ is not None and not isinstance(given_, (bool, np.bool_, float, str, bytes))
        assert np.ndim(given_) <= 1
        assert np.asarray(given_, dtype=object).reshape(-1).tolist() == built.tolist() or np.size(given_) == 0


@pytest.mark.parametrize(
    ("values", "error"),
    [
        (True, ArgumentError),
        (np.bool_(True), ArgumentError),
        (np.array([True]), ArgumentError),
        (np.array([[1]]), ArgumentError),  # one element: flattening it would have "worked"
        (np.ones((1, 1, 1), np.int64), ArgumentError),
        (np.array([1.0]), ArgumentError),
        (1.0, ArgumentError),
        (None, ArgumentError),
        ("12", ArgumentError),
        ([[1], [1, 2]], ArgumentError),
        (2**70, OutOfRangeError),
        (-(2**70), OutOfRangeError),
        ([1, 2**70], OutOfRangeError),
        (np.array([2**63], np.uint64), OutOfRangeError),
        (np.uint64(2**63), OutOfRangeError),
    ],
    ids=repr,
)
def test_build_refuses_what_is_not_a_1d_integer_array(values: object, error: type[ArgumentError]) -> None:
    for position in range(3):
        args: list[object] = [0, 0, 1]
        args[position] = values
        with pytest.raises(error):
            RangeList.build(*args)


def test_build_takes_scalars_lists_and_1d_arrays_of_any_integer_type() -> None:
    ranges = RangeList.build(np.array([1, 2], np.uint8), [3, 4], np.int32(5))
    assert ranges.src.tolist() == [1, 2] and ranges.dst.tolist() == [3, 4] and ranges.lengths.tolist() == [5, 5]
    assert RangeList.build(np.array(7), 2**63 - 1, np.array([0], np.uint64)).src.tolist() == [7]  # a 0-d array is a scalar
    assert len(RangeList.build([], [], [])) == 0  # numpy reads [] as float64: an empty batch is still fine
    assert RangeList.build(np.array([1, 2], dtype=object), [3, 2**63 - 1], 1).src.tolist() == [1, 2]  # object arrays of ints that fit


def _overlaps(rows: list[tuple[int, int]]) -> bool:
    spans = [(d, d + n) for d, n in rows if n > 0]
    return any(max(a, c) < min(b, e) for i, (a, b) in enumerate(spans) for c, e in spans[i + 1 :])


_BLOCKS = st.tuples(st.integers(1, 64), st.integers(0, 63), st.lists(st.integers(0, 40), min_size=2, max_size=40)).map(
    lambda t: [(phase + slot * t[0], t[0]) for phase, slot in ((t[1] % t[0], s) for s in t[2])]
)
"""Equal-length blocks on one grid, in any order (the KV case the overlap check serves without sorting)."""


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 40)), max_size=40), _BLOCKS, _BLOCKS.map(sorted)))
def test_destination_overlap_is_refused_exactly_when_two_ranges_share_a_byte(rows: list[tuple[int, int]]) -> None:
    """Short lists are checked on Python ints, long ones vectorised (sorted, block grid, or sorting): all agree with a plain oracle."""
    dst = np.array([d for d, _ in rows], np.int64)
    lengths = np.array([n for _, n in rows], np.int64)
    ranges = RangeList.build(dst[::-1].copy(), dst, lengths)  # sources overlap freely: never refused for that
    try:
        ranges.check_disjoint_dst()
        refused = False
    except ArgumentError as exc:
        refused = True
        assert "overlap" in str(exc)
    assert refused == _overlaps(rows)


@pytest.mark.parametrize("max_ranges", [1, 7, 1000])
def test_chunks_bound_the_range_count_too(max_ranges: int) -> None:
    rng = np.random.default_rng(max_ranges)
    lengths = rng.integers(1, 300, 2500)
    starts = np.concatenate(([0], np.cumsum(lengths + 1)[:-1]))  # gaps: nothing coalesces
    ranges = RangeList.build(starts, starts[::-1].copy(), lengths)
    pieces = ranges.chunks(4096, max_ranges)
    assert all(len(piece) <= max_ranges and piece.total <= 4096 + 300 for piece in pieces)
    joined = [np.concatenate([getattr(piece, name) for piece in pieces]) for name in ("src", "dst", "lengths")]
    assert np.array_equal(joined[2].sum(), lengths.sum()) and len(joined[0]) >= len(ranges)
    with pytest.raises(ArgumentError):
        ranges.chunks(4096, 0)


def _outcome(call: Any) -> type[BaseException] | None:
    try:
        call()
    except (ArgumentError, OutOfRangeError) as exc:
        return type(exc)
    return None


_EXTREME = st.one_of(st.integers(-3, 5000), st.sampled_from([2**62, 2**63 - 1, 2**63 - 4096, -(2**63), 1 << 40]))
_LONG_BLOCKS = st.tuples(
    st.sampled_from([1, 3, 7, 48, 64, 4096, 16384]), st.integers(0, 63), st.lists(st.integers(0, 1200), min_size=9, max_size=60), st.booleans()
).map(lambda t: [(t[1] % t[0] + slot * t[0] * (1000 if t[3] and i == 0 else 1), t[0]) for i, slot in enumerate(t[2])])
"""Long lists of equal-length blocks on one grid: duplicates, non-powers of two, and now and then one block so far off
that the grid has too many slots per range for a map of it (the C pass keeps a set of the slots taken instead)."""


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.lists(st.tuples(_EXTREME, _EXTREME, _EXTREME), min_size=9, max_size=40),
        _LONG_BLOCKS.map(lambda rows: [(5 * i, d, n) for i, (d, n) in enumerate(rows)]),
        _LONG_BLOCKS.map(lambda rows: [(d, d, n) for d, n in sorted(rows)]),  # adjacent on both sides: coalescing has work
    ),
    st.sampled_from([0, 6000, 1 << 30, 2**63 - 1]),
    st.sampled_from([0, 6000, 1 << 30, 2**63 - 1]),
)
def test_the_one_c_pass_and_numpy_alone_agree_on_every_long_list(rows: list[tuple[int, int, int]], src_size: int, dst_size: int) -> None:
    """A long list is settled by one C pass where `hmc.transport._ranges_c` was built (it is in CI), else by numpy:
    the bounds check, the overlap check, coalescing and the total come out the same either way, and as a plain oracle
    says, with offsets and lengths at int64's ends."""
    from hmc.transport._ranges import _Facts

    assert _Facts._library() is not None, "setup.py did not build hmc.transport._ranges_c"
    columns = [np.array(column, np.int64) for column in zip(*rows)]
    fast, plain = RangeList(*columns), RangeList(*(c.copy() for c in columns))
    plain.__dict__["_facts"] = None  # as where the module was not built
    assert fast._facts is not None
    bad = any(s < 0 or d < 0 or n < 0 or s + n > src_size or d + n > dst_size for s, d, n in rows)
    assert _outcome(lambda: fast.check(src_size, dst_size)) == _outcome(lambda: plain.check(src_size, dst_size)) == (OutOfRangeError if bad else None)
    if bad:
        return
    overlap = _overlaps([(d, n) for _, d, n in rows])
    assert _outcome(fast.check_disjoint_dst) == _outcome(plain.check_disjoint_dst) == (ArgumentError if overlap else None)
    if overlap:  # refused: such a list never moves (and its total may exceed int64: only disjoint ranges in bounds cannot)
        return
    assert fast.total == plain.total == sum(n for _, _, n in rows)
    merged, expected = fast.coalesced(), plain.coalesced()
    for a, b in ((merged.src, expected.src), (merged.dst, expected.dst), (merged.lengths, expected.lengths)):
        assert a.tolist() == b.tolist()


@pytest.mark.parametrize("length", [16384, 12288])
def test_kv_blocks_scattered_over_a_far_larger_cache_are_checked_without_a_sort(length: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of 16384 KV blocks out of a cache of 2^30 (a grid far too large to map): the C pass settles the overlap
    check with a set of the slots taken, no sort (0.6 ms on the CI VM); a block taken twice is still refused, both
    ranges named."""
    from hmc.transport._ranges import _Facts

    assert _Facts._library() is not None, "setup.py did not build hmc.transport._ranges_c"
    rng = np.random.default_rng(3)
    slots = rng.choice(1 << 30, 16384, replace=False).astype(np.int64)
    src, dst, lengths = rng.permutation(16384).astype(np.int64) * length, slots * length + 5 * length, np.full(16384, length, np.int64)

    def no_sort(*args: object, **kwargs: object) -> None:
        raise AssertionError("the overlap check sorted")

    with monkeypatch.context() as patched:
        patched.setattr(np, "argsort", no_sort)
        ranges = RangeList.build(src, dst, lengths)
        ranges.check(1 << 30, 1 << 62)
        ranges.check_disjoint_dst()
    assert ranges._facts is not None and ranges._facts.disjoint
    taken_twice = dst.copy()
    taken_twice[16000] = taken_twice[7]
    with pytest.raises(ArgumentError, match=r"#7 .* and #16000 .* overlap"):
        RangeList.build(src, taken_twice, lengths).check_disjoint_dst()


def test_slots_chosen_to_collide_in_the_c_pass_set_fall_back_to_numpy_and_are_still_checked() -> None:
    """A peer's ranges whose grid slots all hash to one entry of the C pass's set (2048 of them, a table of 4096):
    past its probe budget the set gives up (no quadratic probing) and numpy checks the list, which is accepted, and
    refused with one block taken twice."""
    from hmc.transport._ranges import _Facts

    assert _Facts._library() is not None, "setup.py did not build hmc.transport._ranges_c"
    count, bits, multiplier = 2048, 12, np.uint64(0x9E3779B97F4A7C15)  # the set's table: 2^12 entries for 2048 slots
    found: list[np.ndarray] = []
    start = 1
    while sum(part.size for part in found) < count:
        keys = np.arange(start, start + (1 << 22), dtype=np.uint64)  # a slot s is kept as s + 1
        found.append(keys[(keys * multiplier) >> np.uint64(64 - bits) == 0])
        start += 1 << 22
    slots = (np.concatenate(found)[:count].astype(np.int64) - 1)
    length = 4096
    src, dst, lengths = np.arange(count, dtype=np.int64) * length, slots * length, np.full(count, length, np.int64)
    assert _Facts.of(src, dst, lengths) is None
    ranges = RangeList.build(src, dst, lengths)
    ranges.check(1 << 40, 1 << 40)
    ranges.check_disjoint_dst()
    taken_twice = dst.copy()
    taken_twice[-1] = taken_twice[100]
    with pytest.raises(ArgumentError, match=r"#100 .* and #2047 .* overlap"):
        RangeList.build(src, taken_twice, lengths).check_disjoint_dst()


def test_build_copies_the_callers_arrays_so_what_was_checked_is_what_moves() -> None:
    """An int64 array (or a view of one) given to `build` is copied: the caller may refill it at once, and a check
    made before stays true of the list."""
    base = np.arange(40, dtype=np.int64) * 4096
    dst = base[::2]  # a view
    ranges = RangeList.build(base[:20], dst, np.full(20, 4096, np.int64))
    ranges.check(1 << 20, 1 << 20)
    base[:] = 1 << 40
    ranges.check(1 << 20, 1 << 20)
    assert ranges.src.tolist() == (np.arange(20) * 4096).tolist() and ranges.dst.tolist() == (np.arange(0, 40, 2) * 4096).tolist()
    assert not np.shares_memory(ranges.src, base) and not np.shares_memory(ranges.dst, base)


def test_a_hand_built_list_of_unequal_arrays_is_never_read_past_its_shortest() -> None:
    """`RangeList` itself (not `build`, which refuses them) takes arrays of unequal sizes: the one-pass check stands
    aside for them instead of reading past the shortest array (or crashing the process)."""
    from hmc.transport._ranges import _Facts

    ranges = RangeList(np.zeros(9, np.int64), np.zeros(9, np.int64), np.ones(1 << 16, np.int64))
    assert _Facts.of(ranges.src, ranges.dst, ranges.lengths) is None
    assert ranges._facts is None and ranges.total == 1 << 16
    with pytest.raises(ArgumentError, match="differ in length"):
        RangeList.build(ranges.src, ranges.dst, ranges.lengths)


def test_build_copies_what_an_objects___array___hands_over() -> None:
    """An object whose `__array__` returns an array it keeps (a container, a dataframe column) is copied too: its
    later writes change nothing of the list."""

    class Holder:
        def __init__(self, array: np.ndarray) -> None:
            self.array = array

        def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
            return self.array

    held = Holder(np.arange(16, dtype=np.int64) * 4096)
    ranges = RangeList.build(np.arange(16, dtype=np.int64) * 4096, held, 4096)
    ranges.check(1 << 20, 1 << 20)
    held.array[-1] = 1 << 40
    ranges.check(1 << 20, 1 << 20)
    assert int(ranges.dst[-1]) == 15 * 4096 and not np.shares_memory(ranges.dst, held.array)


def test_a_swapped_list_keeps_the_c_pass_facts_with_its_sides_exchanged_and_still_finds_overlaps() -> None:
    """A READ's ranges seen from the owner (`swapped`) keep the facts the checks learnt (no second pass): extents
    exchanged, the total kept; whether the new destinations (the old sources, which may overlap) are disjoint is
    looked at afresh."""
    src = np.array([0, 64, 64, *range(192, 192 + 64 * 9, 64)], np.int64)  # two sources the same: allowed
    dst = np.arange(src.size, dtype=np.int64) * 64 + 4096
    ranges = RangeList.build(src, dst, 64)
    ranges.check(1 << 20, 1 << 20)
    ranges.check_disjoint_dst()
    facts = ranges.__dict__["_facts"]
    assert facts is not None and facts.disjoint
    swapped = ranges.swapped()
    moved = swapped.__dict__["_facts"]
    assert (moved.src_end, moved.dst_end, moved.total) == (facts.dst_end, facts.src_end, facts.total)
    swapped.check(1 << 20, 1 << 20)
    with pytest.raises(ArgumentError, match="overlap"):
        swapped.check_disjoint_dst()
    with pytest.raises(OutOfRangeError):
        swapped.check(1 << 20, int(src.max()))  # the swapped extents bound the swapped sides

