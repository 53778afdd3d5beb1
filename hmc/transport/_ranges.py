"""Range lists: batches of (src_offset, dst_offset, length) as int64 numpy arrays.

Never one Python object per range: validation, coalescing and chunking are
vectorised. Wire form is `hmc.v1.RangeList` (three little-endian int64 arrays).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from hmc.errors import ArgumentError, OutOfRangeError, ProtocolError
from hmc.v1 import common_pb2

__all__ = ["RangeList", "iovec_rows"]

_I64 = np.dtype("<i8")
_SMALL = 8
"""Up to this many ranges, checks run on Python ints: a numpy call costs more than the whole loop."""


def _check_few(offsets: list[int], lengths: list[int], size: int, name: str) -> None:
    for index, (offset, length) in enumerate(zip(offsets, lengths)):
        if offset < 0 or length < 0:
            raise OutOfRangeError("negative offset or length in range list")
        if offset + length > size:
            raise OutOfRangeError(f"{name} range #{index} [{offset}, {offset + length}) exceeds buffer of {size} bytes")


def _as_i64(values: Any, name: str) -> np.ndarray:
    if isinstance(values, (int, np.integer)):
        return np.array([int(values)], dtype=_I64)
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise ArgumentError(f"{name} must be integers") from exc
    if array.ndim != 1:
        array = array.reshape(-1)
    if array.size and array.dtype.kind not in "iu":
        raise ArgumentError(f"{name} must be integers, got {array.dtype}")
    if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
        raise OutOfRangeError(f"{name} overflows int64")
    return np.ascontiguousarray(array, dtype=_I64)


@dataclasses.dataclass(frozen=True)
class RangeList:
    """Parallel arrays of source offsets, destination offsets and lengths (bytes)."""

    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray

    @classmethod
    def build(cls, src_offsets: Any, dst_offsets: Any, lengths: Any) -> RangeList:
        """Normalise user input (ints, lists, arrays); a scalar length applies to every range."""
        src = _as_i64(src_offsets, "src_offsets")
        dst = _as_i64(dst_offsets, "dst_offsets")
        lens = _as_i64(lengths, "lengths")
        if lens.size == 1 and src.size > 1:
            lens = np.full(src.size, lens[0], dtype=_I64)
        if not src.size == dst.size == lens.size:
            raise ArgumentError(f"range arrays differ in length: {src.size} src, {dst.size} dst, {lens.size} lengths")
        return cls(src, dst, lens)

    @classmethod
    def single(cls, src_offset: int, dst_offset: int, length: int) -> RangeList:
        return cls(np.array([src_offset], _I64), np.array([dst_offset], _I64), np.array([length], _I64))

    def __len__(self) -> int:
        return int(self.lengths.size)

    @functools.cached_property
    def total(self) -> int:
        return int(self.lengths.sum()) if self.lengths.size else 0

    def check(self, src_size: int, dst_size: int) -> None:
        """Raise OutOfRangeError unless every range lies inside both buffers."""
        if not self.lengths.size:
            return
        if self.lengths.size <= _SMALL:
            _check_few(self.src.tolist(), self.lengths.tolist(), src_size, "source")
            _check_few(self.dst.tolist(), self.lengths.tolist(), dst_size, "destination")
            return
        if int(self.lengths.min()) < 0 or int(self.src.min()) < 0 or int(self.dst.min()) < 0:
            raise OutOfRangeError("negative offset or length in range list")
        longest = int(self.lengths.max())  # reductions only (no temporaries) settle the common, valid case
        if int(self.src.max()) + longest <= src_size and int(self.dst.max()) + longest <= dst_size:
            return
        for name, offsets, size in (("source", self.src, src_size), ("destination", self.dst, dst_size)):
            ends = offsets + self.lengths
            if (ends < offsets).any():
                raise OutOfRangeError(f"{name} range overflows")
            worst = int(np.argmax(ends))
            if int(ends[worst]) > size:
                raise OutOfRangeError(
                    f"{name} range #{worst} [{int(offsets[worst])}, {int(ends[worst])}) exceeds buffer of {size} bytes"
                )

    def check_dst(self, dst_size: int) -> None:
        """Receiver-side check of destination ranges only."""
        if not self.lengths.size:
            return
        if self.lengths.size <= _SMALL:
            _check_few(self.dst.tolist(), self.lengths.tolist(), dst_size, "destination")
            return
        if int(self.lengths.min()) < 0 or int(self.dst.min()) < 0:
            raise OutOfRangeError("negative offset or length in range list")
        ends = self.dst + self.lengths
        if (ends < self.dst).any() or int(ends.max()) > dst_size:
            raise OutOfRangeError(f"destination range exceeds buffer of {dst_size} bytes")

    def swapped(self) -> RangeList:
        """Source and destination exchanged (a READ seen from the data's owner)."""
        return RangeList(self.dst, self.src, self.lengths)

    def coalesced(self) -> RangeList:
        """Merge ranges that are adjacent on both sides (in the given order); drop empty ones."""
        if self.lengths.size and int(self.lengths.min()) > 0:
            src, dst, lens = self.src, self.dst, self.lengths
        else:
            keep = self.lengths > 0
            src, dst, lens = self.src[keep], self.dst[keep], self.lengths[keep]
        if src.size < 2:
            return RangeList(src, dst, lens)
        joins = src[:-1] + lens[:-1] == src[1:]
        if not joins.any():  # nothing adjacent on the source side (scattered KV blocks): no need to look at dst
            return RangeList(src, dst, lens)
        joins &= dst[:-1] + lens[:-1] == dst[1:]
        if not joins.any():
            return RangeList(src, dst, lens)
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        ends = np.concatenate((starts[1:], [src.size]))
        cumulative = np.concatenate(([0], np.cumsum(lens)))
        return RangeList(src[starts], dst[starts], cumulative[ends] - cumulative[starts])

    def chunks(self, chunk_bytes: int) -> list[RangeList]:
        """Split into pieces of about `chunk_bytes` each, cutting long ranges, order kept."""
        if chunk_bytes <= 0:
            raise ArgumentError("chunk size must be positive")
        if self.total <= chunk_bytes:
            return [self]
        pieces = np.maximum((self.lengths + chunk_bytes - 1) // chunk_bytes, 1)
        if int(pieces.max()) > 1:
            index = np.repeat(np.arange(self.lengths.size), pieces)
            first = np.concatenate(([0], np.cumsum(pieces)[:-1]))
            within = np.arange(index.size) - np.repeat(first, pieces)
            shift = within * chunk_bytes
            lens = np.minimum(self.lengths[index] - shift, chunk_bytes)
            flat = RangeList(self.src[index] + shift, self.dst[index] + shift, lens)
        else:
            flat = self
        ends = np.cumsum(flat.lengths)
        bounds = np.searchsorted(ends, np.arange(chunk_bytes, int(ends[-1]), chunk_bytes), side="left") + 1
        out = []
        for part in np.split(np.arange(flat.lengths.size), np.unique(bounds[bounds < flat.lengths.size])):
            if part.size:
                out.append(RangeList(flat.src[part], flat.dst[part], flat.lengths[part]))
        return out

    def to_proto(self) -> common_pb2.RangeList:
        return common_pb2.RangeList(src_offsets=self.src.tobytes(), dst_offsets=self.dst.tobytes(), lengths=self.lengths.tobytes())

    @classmethod
    def from_proto(cls, message: common_pb2.RangeList) -> RangeList:
        """Decode and validate the wire form (ProtocolError on malformed arrays)."""
        arrays = []
        for name in ("src_offsets", "dst_offsets", "lengths"):
            raw = getattr(message, name)
            if len(raw) % 8:
                raise ProtocolError(f"range list field {name} is not a whole number of int64")
            arrays.append(np.frombuffer(raw, dtype=_I64))
        if not arrays[0].size == arrays[1].size == arrays[2].size:
            if arrays[0].size == 0 and arrays[1].size == arrays[2].size:
                arrays[0] = np.zeros_like(arrays[1])
            elif arrays[1].size == 0 and arrays[0].size == arrays[2].size:
                arrays[1] = np.zeros_like(arrays[0])
            else:
                raise ProtocolError("range list arrays differ in length")
        return cls(*arrays)


def iovec_rows(addresses: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The iovec table (uint64 address, length rows) of a byte stream, consecutive entries that touch merged into one.

    The kernel takes such a table for cross-memory attach and vmsplice, and pins
    pages per entry: fewer entries, fewer page walks. Two sides of one copy need
    not have matching entries, only the same bytes.
    """
    if addresses.size > 1:
        touch = addresses[:-1] + lengths[:-1] == addresses[1:]
        if touch.any():
            starts = np.flatnonzero(np.concatenate(([True], ~touch)))
            ends = np.concatenate(([0], np.cumsum(lengths)))
            addresses, lengths = addresses[starts], ends[np.append(starts[1:], addresses.size)] - ends[starts]
    rows = np.empty((addresses.size, 2), np.uint64)
    rows[:, 0] = addresses
    rows[:, 1] = lengths
    return rows
