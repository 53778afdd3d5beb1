"""Range lists under hypothesis: coalescing and chunking never change which bytes move; wire decoding never crashes."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hmc.errors import OutOfRangeError, ProtocolError
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
