"""Range lists: batches of (src_offset, dst_offset, length) as int64 numpy arrays; the timeout check.

Never one Python object per range: validation, coalescing and chunking are
vectorised. Wire form is `hmc.v1.RangeList` (three little-endian int64 arrays).
A long list's common case (in bounds, KV blocks disjoint, nothing to coalesce)
is settled by one C pass (`_Facts`, `hmc.transport._ranges_build`) where it was
built; anything else, and every error, goes the numpy way, which names the range.

What a caller may pass (`RangeList.build`, the API boundary of every transfer):
a Python or numpy integer, or a one-dimensional integer array or sequence. Bools,
floats, strings, objects and arrays of two or more dimensions are refused with
ArgumentError (nothing is flattened); values beyond int64 with OutOfRangeError.
Negative values pass `build` and are refused by the bounds checks (OutOfRangeError).
A transfer's timeout goes through `check_timeout` at the same boundary. `build`
copies arrays it is given: what was checked is what moves, and a caller may
refill its arrays as soon as the call returns (a prepared transfer included).

Concurrency: a RangeList is immutable; any thread may use it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any, overload

import numpy as np

from hmc.errors import ArgumentError, OutOfRangeError, ProtocolError
from hmc.v1 import common_pb2

__all__ = ["MAX_NOTIFY_BYTES", "MAX_TIMEOUT_S", "MAX_TRANSFER_ID", "RangeList", "check_notify", "check_timeout", "end_to_end", "iovec_rows", "past_notify_bounds"]

_I64 = np.dtype("<i8")
_I64_MAX = int(np.iinfo(np.int64).max)
_I64_MIN = int(np.iinfo(np.int64).min)
_SMALL = 8
"""Up to this many ranges, checks run on Python ints: a numpy call costs more than the whole loop."""
_SLOTS_PER_RANGE = 64
"""The overlap check of equal-length blocks: up to this many grid slots per range, a map of the grid (a bit a slot in
C, a byte in numpy); beyond, the C pass keeps a set of the slots taken, and numpy sorts."""


class _Facts:
    """What one C pass (`hmc_range_facts`) learns of a long list; None from `of()` where the module was not built, or
    the arrays are not contiguous and aligned."""

    __slots__ = ("disjoint", "dst_end", "joins", "max_length", "min_length", "src_end", "total", "valid")

    def __init__(self, out: Any) -> None:
        self.valid = not out.negative and not out.overflow
        """No offset or length below 0 and no end past int64: the other facts hold."""
        self.src_end, self.dst_end, self.total = int(out.src_end), int(out.dst_end), int(out.total)
        self.min_length, self.max_length = int(out.min_length), int(out.max_length)
        self.joins = bool(out.joins)
        self.disjoint = bool(out.grid and out.disjoint == 1)
        """KV blocks of one grid, no two the same: the destination ranges share no byte."""

    def swapped(self) -> _Facts:
        """The facts of the list with its sides exchanged: extents swap; whether the new destinations are disjoint
        is not known (False: `_dst_overlap` looks itself)."""
        facts = copy.copy(self)
        facts.src_end, facts.dst_end, facts.disjoint = self.dst_end, self.src_end, False
        return facts

    @staticmethod
    @functools.cache
    def _library() -> tuple[Any, Any] | None:
        try:
            from hmc.transport import _ranges_c  # type: ignore[attr-defined]
        except ImportError:
            return None
        return _ranges_c.ffi, _ranges_c.lib

    @classmethod
    def of(cls, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> _Facts | None:
        library = cls._library()
        if library is None or not src.size == dst.size == lengths.size or not all(
            a.ndim == 1 and a.flags.c_contiguous and a.flags.aligned and a.dtype == _I64 for a in (src, dst, lengths)
        ):
            return None
        ffi, lib = library
        out = ffi.new("hmc_range_facts_t *")
        if lib.hmc_range_facts(ffi.from_buffer("int64_t[]", src), ffi.from_buffer("int64_t[]", dst), ffi.from_buffer("int64_t[]", lengths),
                               lengths.size, _SLOTS_PER_RANGE, out) != 0:  # fmt: skip
            return None
        return cls(out)


MAX_TIMEOUT_S = 1e6
"""The longest timeout a transfer or a wait takes (11.6 days): deadlines stay exact, computable numbers."""
MAX_NOTIFY_BYTES = 1 << 20
"""The largest notification a transfer may carry: owners refuse larger ones, so a peer cannot fill their memory
with one (what they hold undrained in all is bounded by `Config.notify_inbox_bytes`)."""
MAX_TRANSFER_ID = 256
"""The longest transfer id a notification or an hmcd submit carries (an agent's: 12 hex digits and a count; hmcd's:
32 hex digits): owners keep recent ids to deliver each notification once."""


def check_timeout(timeout: object, name: str = "timeout") -> float:
    """`timeout` in seconds as a float: a real number (not a bool), finite, > 0 and at most MAX_TIMEOUT_S.

    ArgumentError otherwise, so a NaN, an infinity or a string never reaches a deadline.
    """
    if type(timeout) is not float and type(timeout) is not int and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)):
        raise ArgumentError(f"{name} must be a number of seconds, got {type(timeout).__name__}")
    try:
        seconds = float(timeout)  # type: ignore[arg-type]
    except OverflowError:  # an int beyond any float
        seconds = math.inf
    if not 0.0 < seconds <= MAX_TIMEOUT_S:  # NaN fails this too
        raise ArgumentError(f"{name} must be finite, > 0 and at most {MAX_TIMEOUT_S:g} s, got {timeout!r}")
    return seconds


def check_notify(notify: object) -> bytes | None:
    """A transfer's notification: None or bytes-like of at most MAX_NOTIFY_BYTES (as bytes); ArgumentError otherwise
    (a str is not encoded here; an oversized one is refused before it is copied)."""
    if notify is None:
        return None
    if not isinstance(notify, (bytes, bytearray, memoryview)):
        raise ArgumentError(f"notify must be bytes, got {type(notify).__name__}")
    size = memoryview(notify).nbytes
    if size > MAX_NOTIFY_BYTES:
        raise ArgumentError(f"notify of {size} bytes exceeds the {MAX_NOTIFY_BYTES} a notification may carry")
    return bytes(notify)


def past_notify_bounds(payload: bytes, transfer_id: str) -> str:
    """What a notification that reached an owner or hmcd (past a sender's `check_notify`) has beyond its bounds, or ""
    when nothing: each refuses it with its own error."""
    if len(payload) <= MAX_NOTIFY_BYTES and len(transfer_id) <= MAX_TRANSFER_ID:
        return ""
    return (
        f"a notification of {len(payload)} bytes (at most {MAX_NOTIFY_BYTES}) for a transfer id of"
        f" {len(transfer_id)} characters (at most {MAX_TRANSFER_ID})"
    )


def _check_few(offsets: list[int], lengths: list[int], size: int, name: str) -> None:
    for index, (offset, length) in enumerate(zip(offsets, lengths)):
        if offset < 0 or length < 0:
            raise OutOfRangeError("negative offset or length in range list")
        if offset + length > size:
            raise OutOfRangeError(f"{name} range #{index} [{offset}, {offset + length}) exceeds buffer of {size} bytes")


def _scalar(value: int, name: str) -> np.ndarray:
    if not _I64_MIN <= value <= _I64_MAX:
        raise OutOfRangeError(f"{name} value {value} does not fit int64")
    return np.array([value], dtype=_I64)


def _as_i64(values: Any, name: str) -> np.ndarray:
    """`values` as a 1-D int64 array (a scalar as one element); ArgumentError or OutOfRangeError for anything else."""
    if type(values) is int:
        return _scalar(values, name)
    if isinstance(values, (bool, np.bool_)):
        raise ArgumentError(f"{name} must be integers, got a bool")
    if isinstance(values, (int, np.integer)):
        return _scalar(int(values), name)
    try:
        array = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as exc:  # ragged nesting, objects numpy cannot read
        raise ArgumentError(f"{name} must be an integer or a 1-D sequence of integers") from exc
    if array.ndim > 1:
        raise ArgumentError(f"{name} must be one-dimensional, got shape {array.shape}")
    if not array.size:  # numpy reads [] as float64: an empty batch is fine whatever its dtype
        return np.empty(0, _I64)
    kind = array.dtype.kind
    if kind == "O":  # Python ints beyond what numpy holds, or anything else (a Python loop: rare input)
        items = array.reshape(-1).tolist()
        if not all(type(item) is int for item in items):
            raise ArgumentError(f"{name} must be integers, got {sorted({type(item).__name__ for item in items} - {'int'})}")
        if not all(_I64_MIN <= item <= _I64_MAX for item in items):
            raise OutOfRangeError(f"{name} values do not fit int64")
        return np.array(items, dtype=_I64)
    if kind not in "iu":
        raise ArgumentError(f"{name} must be integers, got {'bools' if kind == 'b' else array.dtype}")
    if kind == "u" and array.dtype.itemsize == 8 and int(array.max()) > _I64_MAX:
        raise OutOfRangeError(f"{name} values do not fit int64")
    if isinstance(values, (list, tuple)):  # numpy made this array: nobody else holds it
        return np.ascontiguousarray(array.reshape(-1), dtype=_I64)  # a 0-d array is a scalar: one element
    return np.array(array.reshape(-1), dtype=_I64, copy=True)  # the caller's memory (an array, a view, a tensor...): a copy


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
        if self.lengths.size > _SMALL:
            facts = self._facts
            if facts is not None and facts.valid:
                return facts.total
        return int(self.lengths.sum()) if self.lengths.size else 0

    @functools.cached_property
    def _facts(self) -> _Facts | None:
        """The one C pass over a long list (None: not built, or a short list)."""
        return _Facts.of(self.src, self.dst, self.lengths) if self.lengths.size > _SMALL else None

    def _learnt(self) -> _Facts | None:
        """The C pass's facts where they were learnt already (by the checks), else None: no pass for this."""
        return self.__dict__.get("_facts")

    def check(self, src_size: int, dst_size: int) -> None:
        """Raise OutOfRangeError unless every range lies inside both buffers."""
        if not self.lengths.size:
            return
        if self.lengths.size <= _SMALL:
            _check_few(self.src.tolist(), self.lengths.tolist(), src_size, "source")
            _check_few(self.dst.tolist(), self.lengths.tolist(), dst_size, "destination")
            return
        facts = self._facts
        if facts is not None and facts.valid and facts.src_end <= src_size and facts.dst_end <= dst_size:
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

    def check_disjoint_dst(self) -> None:
        """Raise ArgumentError when two destination ranges share a byte; call after `check` (bounds hold).

        Which of two overlapping pieces lands last depends on the path, its chunks and
        its threads, so the bytes would differ from run to run: such a batch is refused
        before anything moves. Source ranges may overlap. The verdict is cached with the
        list, as a prepared transfer posts the same list again and again.
        """
        if self.dst.size < 2:  # the usual single range: no cached_property (its lock costs ~0.7 us on 3.11)
            return
        overlap = self._dst_overlap
        if overlap is not None:
            i, j = overlap
            spans = [f"#{k} [{int(self.dst[k])}, {int(self.dst[k]) + int(self.lengths[k])})" for k in (i, j)]
            raise ArgumentError(f"destination ranges {spans[0]} and {spans[1]} overlap: the bytes landing there would depend on order")

    @functools.cached_property
    def _dst_overlap(self) -> tuple[int, int] | None:
        """Indices of two destination ranges that share a byte, or None when all are disjoint."""
        starts, lengths = self.dst, self.lengths
        if starts.size <= _SMALL:
            spans = sorted((d, d + n, i) for i, (d, n) in enumerate(zip(starts.tolist(), lengths.tolist())) if n > 0)
            for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
                if end > start:
                    return min(i, j), max(i, j)
            return None
        facts = self._facts  # where the C pass ran, it looked at the block grid already
        if facts.disjoint if facts is not None and facts.valid else _disjoint_blocks(starts, lengths):
            return None  # equal-length blocks in any order (KV blocks, increasing or not): no sort
        ends = starts + lengths
        if (ends[:-1] <= starts[1:]).all():
            return None  # increasing: no sort
        if int(lengths.min()) > 0:
            order = np.argsort(starts)
        else:  # an empty range touches no byte, even inside another range
            index = np.flatnonzero(lengths)
            order = index[np.argsort(starts[index])]
        bad = np.flatnonzero(ends[order[:-1]] > starts[order[1:]])
        if not bad.size:
            return None
        i, j = int(order[bad[0]]), int(order[bad[0] + 1])
        return min(i, j), max(i, j)

    def swapped(self) -> RangeList:
        """Source and destination exchanged (a READ seen from the data's owner), with the C pass's facts when it ran."""
        out = RangeList(self.dst, self.src, self.lengths)
        facts = self._learnt()
        if facts is not None:
            out.__dict__["_facts"] = facts.swapped()
        return out

    def coalesced(self) -> RangeList:
        """Merge ranges that are adjacent on both sides (in the given order); drop empty ones."""
        facts = self._facts
        if facts is not None and facts.valid and facts.min_length > 0 and not facts.joins:
            return self  # scattered KV blocks: nothing to merge or drop
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

    def chunks(self, chunk_bytes: int, max_ranges: int | None = None) -> list[RangeList]:
        """Split into pieces of about `chunk_bytes` each (and at most `max_ranges` ranges each), cutting long ranges,
        order kept."""
        if chunk_bytes <= 0 or (max_ranges is not None and max_ranges <= 0):
            raise ArgumentError("chunk size and range count must be positive")
        if self.total <= chunk_bytes and (max_ranges is None or len(self) <= max_ranges):
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
        if max_ranges is not None:
            bounds = np.concatenate((bounds, np.arange(max_ranges, flat.lengths.size, max_ranges)))
        out = []
        for part in np.split(np.arange(flat.lengths.size), np.unique(bounds[bounds < flat.lengths.size])):
            if part.size:
                out.append(RangeList(flat.src[part], flat.dst[part], flat.lengths[part]))
        return out

    def packed(self, slot_bytes: int) -> Sequence[RangeList]:
        """The ranges laid end to end and cut at every multiple of `slot_bytes`: every slot but the last is full.

        A staging ring's chunks: range i of a slot sits at the slot's offset `end_to_end(lengths)[i]`. Ranges
        that straddle a slot boundary are split there (vectorized: no Python loop per range); empty ones go.
        Each chunk is made when asked for (`Packed`): a transfer's first copy starts without waiting for the
        chunks of its last slots (1 GiB cut into 64 slots all at once took 0.2-0.6 ms). KV blocks of one length
        that divides the slot, as the checks' C pass found them, are cut by counting alone: no numpy call before
        a transfer's first copy (its passes took 66-140 us there on 2x H200, run cold after a sleep).
        """
        if slot_bytes <= 0:
            raise ArgumentError("slot size must be positive")
        if self.lengths.size == 1:  # the small transfer's single range: no arrays to build
            length = int(self.lengths[0])
            if 0 < length <= slot_bytes:
                return [self]
        facts = self._learnt()  # from the checks: KV blocks of one length that divides the slot
        if facts is not None and facts.valid and 0 < facts.min_length == facts.max_length and not slot_bytes % facts.min_length:
            count, per_slot = int(self.lengths.size), slot_bytes // facts.min_length  # cut every per_slot blocks: no pass
            return Packed(self.src, self.dst, self.lengths, [*range(0, count, per_slot), count])
        if self.lengths.size and int(self.lengths.min()) > 0:
            src, dst, lens = self.src, self.dst, self.lengths
        else:
            keep = self.lengths > 0
            src, dst, lens = self.src[keep], self.dst[keep], self.lengths[keep]
        if not lens.size:
            return []
        ends = np.cumsum(lens)
        if lens.size > 1:
            boundaries = np.arange(slot_bytes, int(ends[-1]), slot_bytes)
            last = np.searchsorted(ends, boundaries)  # the range holding each boundary's last byte before it
            if (ends[last] == boundaries).all():  # no range straddles a boundary (KV blocks that divide the slot)
                return Packed(src, dst, lens, [0, *(last + 1).tolist(), int(lens.size)])
        starts = ends - lens
        first_slot, last_slot = starts // slot_bytes, (ends - 1) // slot_bytes
        if lens.size == 1 or int((last_slot - first_slot).max()) > 0:  # some range straddles: cut at the boundaries
            counts = last_slot - first_slot + 1
            index = np.repeat(np.arange(lens.size), counts)
            within = np.arange(index.size) - np.repeat(np.cumsum(counts) - counts, counts)
            slot = first_slot[index] + within
            piece_start = np.maximum(starts[index], slot * slot_bytes)
            piece_end = np.minimum(ends[index], (slot + 1) * slot_bytes)
            shift = piece_start - starts[index]
            src, dst, lens = src[index] + shift, dst[index] + shift, piece_end - piece_start
            first_slot = slot
        cuts = np.flatnonzero(np.diff(first_slot)) + 1
        return Packed(src, dst, lens, [0, *cuts.tolist(), int(lens.size)])

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


class Packed(Sequence[RangeList]):
    """A range list cut into ring slots (`RangeList.packed`): chunk i is rows `bounds[i]:bounds[i + 1]` of the cut
    arrays, made (as views) when asked for."""

    __slots__ = ("_bounds", "_dst", "_lengths", "_src")

    def __init__(self, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, bounds: list[int]) -> None:
        self._src, self._dst, self._lengths, self._bounds = src, dst, lengths, bounds

    def __len__(self) -> int:
        return len(self._bounds) - 1

    @overload
    def __getitem__(self, index: int) -> RangeList: ...
    @overload
    def __getitem__(self, index: slice) -> list[RangeList]: ...

    def __getitem__(self, index: int | slice) -> RangeList | list[RangeList]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        count = len(self)
        if not -count <= index < count:
            raise IndexError("chunk index out of range")
        index %= count
        start, end = self._bounds[index], self._bounds[index + 1]
        return RangeList(self._src[start:end], self._dst[start:end], self._lengths[start:end])


def _disjoint_blocks(starts: np.ndarray, lengths: np.ndarray) -> bool:
    """True when the ranges are blocks of one grid (one length L, starts equal modulo L) and no two coincide.

    KV blocks in any order: O(n) with one byte per grid slot, no sort. Blocks of one
    grid either coincide or share no byte. False (sort instead) for anything else, or
    when the grid would have many more slots than there are ranges.
    """
    length = int(lengths[0])
    if length <= 0 or not (lengths == length).all():
        return False
    if length & (length - 1):
        slots, phase = np.divmod(starts, length)
        if (phase != phase[0]).any():
            return False
    else:  # a power of two, as KV blocks are: one phase when the starts' OR and AND agree on the low bits; a shift
        mask = length - 1
        phase = int(starts[0]) & mask
        if int(np.bitwise_or.reduce(starts)) & mask != phase or (phase and int(np.bitwise_and.reduce(starts)) & mask != phase):
            return False
        slots = starts >> (length.bit_length() - 1)
    span = int(slots.max()) + 1
    if span > _SLOTS_PER_RANGE * starts.size:
        return False
    taken = np.zeros(span, np.bool_)
    taken[slots] = True
    return int(np.count_nonzero(taken)) == starts.size


def end_to_end(lengths: np.ndarray) -> np.ndarray:
    """Where each range starts when ranges of these lengths are laid end to end (a staging slot's layout)."""
    return np.cumsum(lengths) - lengths


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
