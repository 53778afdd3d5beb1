"""Where each KV block lives in memory, and the batched byte ranges that move a list of blocks.

vLLM hands the worker one tensor per attention layer. Whatever the backend, a block of a layer is
one or more equally long contiguous runs ("segments"): one per layer on CPU (K and V side by side
per token), two per layer (K plane, V plane) for backends that split them. A layout is the list of
segments, each (buffer, offset of block 0, stride between blocks), plus the bytes of one run; the
buffers are the distinct allocations behind the layer views, each registered once as a ConnBuffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hmc.errors import ArgumentError


@dataclass(frozen=True)
class KVLayout:
    """Segments of every block: `segments[i] = (buffer index, byte offset of block 0, byte stride)`."""

    segments: tuple[tuple[int, int, int], ...]
    block_bytes: int
    num_blocks: int

    def to_wire(self) -> dict[str, Any]:
        return {"segments": [list(s) for s in self.segments], "block_bytes": self.block_bytes, "num_blocks": self.num_blocks}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> KVLayout:
        return cls(tuple((int(b), int(o), int(s)) for b, o, s in data["segments"]), int(data["block_bytes"]), int(data["num_blocks"]))

    def check_blocks(self, block_ids: np.ndarray) -> None:
        """ArgumentError unless every block id exists in this layout."""
        if block_ids.size and (int(block_ids.min()) < 0 or int(block_ids.max()) >= self.num_blocks):
            raise ArgumentError(f"block ids outside 0..{self.num_blocks - 1}: {block_ids.min()}..{block_ids.max()}")


def storages(kv_caches: Mapping[str, Any]) -> list[Any]:
    """The distinct allocations behind the layer tensors, as flat uint8 tensors, in first-seen order."""
    import torch

    flat: dict[int, Any] = {}
    for tensor in kv_caches.values():
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in flat:
            flat[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))
    return list(flat.values())


def describe(kv_caches: Mapping[str, Any], buffers: Sequence[Any], num_blocks: int) -> KVLayout:
    """The layout of `kv_caches` (layer name -> tensor) over `buffers` (from `storages`)."""
    bases = [b.data_ptr() for b in buffers]
    segments: list[tuple[int, int, int]] = []
    run_bytes: set[int] = set()
    for name, tensor in kv_caches.items():
        shape, strides, size = tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size()
        if num_blocks not in shape:
            raise ArgumentError(f"layer {name}: no dimension of {shape} has the {num_blocks} blocks")
        dim = shape.index(num_blocks)
        inner = int(np.prod(shape[dim + 1 :], dtype=np.int64))
        if not tensor[(0,) * dim].select(0, 0).is_contiguous():
            raise ArgumentError(f"layer {name}: a block is not contiguous (shape {shape}, strides {strides})")
        buffer = bases.index(tensor.untyped_storage().data_ptr())
        start = tensor.data_ptr() - bases[buffer]
        for outer in np.ndindex(*shape[:dim]):
            offset = start + sum(i * s for i, s in zip(outer, strides[:dim], strict=True)) * size
            segments.append((buffer, offset, strides[dim] * size))
        run_bytes.add(inner * size)
    if len(run_bytes) != 1:
        raise ArgumentError(f"layers disagree on the bytes of a block: {sorted(run_bytes)}")
    return KVLayout(tuple(segments), run_bytes.pop(), num_blocks)


def block_ranges(src: KVLayout, dst: KVLayout, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Ranges copying `src_blocks` of `src` onto `dst_blocks` of `dst`, grouped by (src buffer, dst buffer).

    One numpy batch per buffer pair (all layers, all blocks): the agent coalesces adjacent runs.
    """
    if len(src.segments) != len(dst.segments) or src.block_bytes != dst.block_bytes:
        raise ArgumentError(
            f"KV layouts differ: {len(src.segments)} segments of {src.block_bytes} B here, {len(dst.segments)} of {dst.block_bytes} B at the peer"
        )
    s_ids = np.asarray(src_blocks, dtype=np.int64)
    d_ids = np.asarray(dst_blocks, dtype=np.int64)
    if s_ids.size != d_ids.size:
        raise ArgumentError(f"{s_ids.size} source blocks for {d_ids.size} destination blocks")
    src.check_blocks(s_ids)
    dst.check_blocks(d_ids)
    groups: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}
    for (sb, so, ss), (db, do, ds) in zip(src.segments, dst.segments, strict=True):
        groups.setdefault((sb, db), []).append((so + s_ids * ss, do + d_ids * ds))
    out: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for pair, parts in groups.items():
        s_off = np.concatenate([p[0] for p in parts])
        d_off = np.concatenate([p[1] for p in parts])
        out[pair] = (s_off, d_off, np.full(s_off.size, src.block_bytes, dtype=np.int64))
    return out
