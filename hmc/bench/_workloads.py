"""What every system in `hmc bench` moves: workloads, their range lists, and the data.

A `Workload` is `batch_size` ranges of `block_size` bytes inside buffers of
`total_size` bytes. Bulk workloads are one range from offset 0; KV workloads
put their blocks at independent random permutations of the block slots on each
side (a KV cache's blocks are scattered in both the prefill and the decode
instance). Ranges are int64 numpy arrays, built once per workload, the same
for every system (deterministic in the seed).

Concurrency: pure functions and frozen data; any thread.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = [
    "KIND_BULK",
    "KIND_KV",
    "POISON",
    "SEED",
    "Workload",
    "default_workloads",
    "fmt_size",
    "make_ranges",
    "quick_workloads",
    "random_bytes",
]

KiB, MiB = 1 << 10, 1 << 20
POISON = 0xA5
"""Every destination is filled with this byte before each workload."""
SEED = 20240601
KIND_BULK, KIND_KV = "bulk", "kv"


@dataclasses.dataclass(frozen=True)
class Workload:
    """`batch_size` ranges of `block_size` bytes inside `total_size`-byte buffers.

    `random`: source and destination slots are independent random permutations
    of the block-aligned slots; otherwise the ranges are packed from offset 0.
    """

    name: str
    block_size: int
    batch_size: int
    total_size: int
    random: bool

    @property
    def nbytes(self) -> int:
        """Bytes moved per iteration."""
        return self.block_size * self.batch_size

    @property
    def kind(self) -> str:
        return KIND_KV if self.random else KIND_BULK

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "kind": self.kind}


def fmt_size(n: int) -> str:
    """4096 -> '4KiB'; sizes that are not whole units stay in bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def _bulk(size: int) -> Workload:
    return Workload(f"bulk_{fmt_size(size)}", size, 1, size, False)


def _kv(block: int, batch: int, total: int) -> Workload:
    return Workload(f"kv_{batch}x{fmt_size(block)}", block, batch, total, True)


def default_workloads() -> list[Workload]:
    """The issue's workloads: bulk 4 KiB..256 MiB, 4096 x 64 KiB and 16384 x 16 KiB in 256 MiB."""
    sizes = (4 * KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB)
    return [*map(_bulk, sizes), _kv(64 * KiB, 4096, 256 * MiB), _kv(16 * KiB, 16384, 256 * MiB)]


def quick_workloads() -> list[Workload]:
    """A smoke-sized run: bulk 4 KiB..1 MiB and the KV patterns' block sizes in 16 MiB buffers."""
    return [*map(_bulk, (4 * KiB, 64 * KiB, MiB)), _kv(64 * KiB, 256, 16 * MiB), _kv(16 * KiB, 1024, 16 * MiB)]


def make_ranges(workload: Workload, seed: int = SEED) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_offsets, dst_offsets, lengths) as int64 arrays, deterministic in `seed`."""
    w = workload
    slots = w.total_size // w.block_size
    if w.batch_size > slots:
        raise ValueError(f"{w.name}: {w.batch_size} blocks do not fit in {w.total_size} bytes")
    if w.random:
        rng = np.random.default_rng(seed)
        src, dst = rng.permutation(slots)[: w.batch_size], rng.permutation(slots)[: w.batch_size]
    else:
        src = dst = np.arange(w.batch_size)
    block = np.int64(w.block_size)
    return src.astype(np.int64) * block, dst.astype(np.int64) * block, np.full(w.batch_size, w.block_size, np.int64)


def random_bytes(size: int, seed: int) -> np.ndarray:
    """`size` random bytes (never zeros: every moved byte must be visible)."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
