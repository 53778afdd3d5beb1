"""The `pinned-ring` baseline: staged's pinned ring with the CPU taken out of its hand-off.

One process. Ranges of `w.nbytes` go from the source GPU into a ring of staged's
geometry (`RING_SLOTS` slots of `SLOT_BYTES`, page-locked with cuMemHostRegister as
staged's ring is) and out of it into the destination GPU, chunk i through slot
i % RING_SLOTS, each direction on its own stream. Slot hand-offs are stream memory
operations on words in the registered memory (`cuStreamWriteValue32` after a chunk's
copy, `cuStreamWaitValue32` before the other side's): every copy of the transfer is
queued up front and no CPU runs between slots. So a row is what a ring of this
geometry can reach on this machine's links (its fill and drain, a copy's cost per
slot, both directions at once), with nothing of HMC's hand-off in it: the ceiling
for `staged`, against which `pinned-both` and `pinned-across` (one copy each way,
no ring) leave out the ring's own cost.

Concurrency: runs on the thread of the child that owns the tensors.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import Any

import numpy as np

from _gpu.harness import gpu_row, measure_row, poison, verify
from hmc.bench._timing import Row, Timing
from hmc.bench._workloads import Workload, make_ranges
from hmc.transport._staged_shm import SLOT_BYTES

__all__ = ["RING_SLOTS", "pinned_ring"]

RING_SLOTS = 8
"""Slots of staged's shared ring (`ShmStaging`'s default)."""


class _Ring:
    """The registered ring and its words (ready[k], then free[k]), mapped for the GPUs."""

    def __init__(self, cu: Any, check: Callable[[Any], Any]) -> None:
        self.cu, self.check = cu, check
        self.size = RING_SLOTS * SLOT_BYTES
        self.memory = mmap.mmap(-1, self.size + mmap.PAGESIZE)
        self.host = np.frombuffer(self.memory, dtype=np.uint8).ctypes.data
        self.words = np.frombuffer(self.memory, dtype=np.uint32, count=2 * RING_SLOTS, offset=self.size)
        flags = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP
        check(cu.cuMemHostRegister(self.host, self.size + mmap.PAGESIZE, flags))
        self.device = int(check(cu.cuMemHostGetDevicePointer(self.host, 0)))

    def ready(self, slot: int) -> int:
        return self.device + self.size + 4 * slot

    def free(self, slot: int) -> int:
        return self.device + self.size + 4 * (RING_SLOTS + slot)

    def close(self) -> None:
        self.check(self.cu.cuMemHostUnregister(self.host))
        del self.words
        self.memory.close()


def pinned_ring(t: Any, w: Workload, timing: Timing) -> Row:
    """`w.nbytes` from `t.src0` to `t.dst1` through the ring, the hand-off on the GPUs; every byte compared."""
    from cuda.bindings import driver as cu

    from hmc.memory._cuda_driver import check

    torch, n = t.torch, w.nbytes
    gpus = [check(cu.cuDeviceGet(d.index or 0)) for d in (t.d0, t.d1)]
    out_ctx, in_ctx = (check(cu.cuDevicePrimaryCtxRetain(g)) for g in gpus)  # torch's contexts: the runtime's primary ones
    ring = _Ring(cu, check)
    try:
        out_stream, in_stream = torch.cuda.Stream(t.d0), torch.cuda.Stream(t.d1)
        out_h, in_h = cu.CUstream(out_stream.cuda_stream), cu.CUstream(in_stream.cuda_stream)
        geq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        barrier = cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        src, dst = t.src0.data_ptr(), t.dst1.data_ptr()
        chunks = [(at, min(SLOT_BYTES, n - at)) for at in range(0, n, SLOT_BYTES)]

        def step() -> None:
            # Each wait's value is queued before the wait (a chunk's ready write before its H2D side's wait, a slot's
            # free write before the D2H side's wait RING_SLOTS chunks later): a step cut short leaves none unmet.
            ring.words[:] = 0  # both streams are idle between steps
            for i, (at, size) in enumerate(chunks):
                slot, turn = i % RING_SLOTS, i // RING_SLOTS + 1
                host = ring.host + slot * SLOT_BYTES
                check(cu.cuCtxSetCurrent(out_ctx))
                if turn > 1:
                    check(cu.cuStreamWaitValue32(out_h, ring.free(slot), turn - 1, geq))
                check(cu.cuMemcpyDtoHAsync(host, src + at, size, out_h))
                check(cu.cuStreamWriteValue32(out_h, ring.ready(slot), turn, barrier))
                check(cu.cuCtxSetCurrent(in_ctx))
                check(cu.cuStreamWaitValue32(in_h, ring.ready(slot), turn, geq))
                check(cu.cuMemcpyHtoDAsync(dst + at, host, size, in_h))
                check(cu.cuStreamWriteValue32(in_h, ring.free(slot), turn, barrier))
            check(cu.cuCtxSetCurrent(out_ctx))  # the source GPU's, as torch left it
            in_stream.synchronize()
            out_stream.synchronize()

        poison(t.dst1, w.total_size)
        t.sync()
        times = measure_row(step, timing, w)
        ok = verify(t.dst1, t.expected1, w, *make_ranges(w)[:2])
    finally:
        t.sync()
        ring.close()
        for g in gpus:
            check(cu.cuDevicePrimaryCtxRelease(g))
    detail = (f"{t.d0} -> a pinned ring of {RING_SLOTS} x {SLOT_BYTES >> 20} MiB -> {t.d1}, one stream each way, the hand-off "
              "by cuStreamWriteValue32 / cuStreamWaitValue32 on words in the ring (no CPU between slots)")
    return gpu_row("pinned-ring", "cuda", w, times, ok, detail)
