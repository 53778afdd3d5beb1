"""Fused staging batches on CUDA GPUs: a ring slot's gather (or scatter) and its copy-engine copy, queued by one C
call (`_gpu_batch_build`) instead of about 20 driver calls through cuda-python and numpy's range table writes.

`library()` is None where the helper was not built (no C compiler at install) or no CUDA driver loads: the copy
lane then queues the same steps from Python (`_gpu_copy.Lane`), as it does on HIP GPUs and with CuPy's kernels.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from hmc.errors import DeviceError

__all__ = ["Fused", "library"]


class Fused:
    """The loaded helper: `run()` queues one slot batch (see `_gpu_batch_build`'s `hmc_batch_run`)."""

    def __init__(self, ffi: Any, lib: Any) -> None:
        self._ffi = ffi
        self._run = lib.hmc_batch_run

    def run(
        self, function: int, block: int, *, gather: bool, kernel_stream: int, copy_stream: int,
        events: tuple[int, int, int, int, int], table: np.ndarray, table_device: int,
        src: np.ndarray, src_base: int, dst: np.ndarray, dst_base: int, lengths: np.ndarray,
        copy_dst: int, copy_src: int, whole: int,
    ) -> None:
        """Queue the batch (the GPU's context current); DeviceError when a driver call fails (the steps before it stay
        queued).

        `events`: (wait or 0, join, table, end, freed) handles; the int64 arrays are contiguous, `table` holds at
        least 3 x len(lengths) rows."""
        cast, step = self._ffi.cast, self._ffi.new("int *")
        status = self._run(
            function, block, int(gather), kernel_stream, copy_stream, *events,
            cast("int64_t *", table.ctypes.data), table_device, lengths.size,
            cast("int64_t *", src.ctypes.data), src_base, cast("int64_t *", dst.ctypes.data), dst_base, cast("int64_t *", lengths.ctypes.data),
            copy_dst, copy_src, whole, step,
        )
        if status:
            raise DeviceError(f"CUDA driver call failed: CUresult {status} (a fused staging batch, after {step[0]} steps)")


@functools.cache
def library() -> Fused | None:
    """The helper with the driver's entry points resolved, or None (not built, or no CUDA driver here)."""
    try:
        from hmc.transport import _gpu_batch_c  # type: ignore[attr-defined]
    except ImportError:
        return None
    if _gpu_batch_c.lib.hmc_batch_load() != 0:
        return None
    return Fused(_gpu_batch_c.ffi, _gpu_batch_c.lib)
