"""Copy-lane calls on CUDA and HIP GPUs in one C call each (`_gpu_batch_build`) instead of a dozen runtime calls
through cuda-python or hip-python and numpy's range table writes: the staged ring's fused slot batch (a gather or
scatter and its copy-engine copy), and a single copy waited for (the ipc path's, ucx's and the ring's single ranges).

`helper_for(runtime)` is the helper for a GPU runtime's lanes: `library()` on CUDA, `hip_library(names)` on HIP (the
HIP runtime library the runtime names: libamdhip64 on ROCm, the HIP-on-CUDA runtime's C module in a process on that
stand-in). It is None where the helper was not built (no C compiler at install) or the runtime's library does not
load: the copy lane then makes the same calls from Python (`_gpu_copy.Lane`), as it does with CuPy's kernels.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from hmc.errors import DeviceError

__all__ = ["Helper", "helper_for", "hip_library", "library"]

_QUEUED = 1 << 30
"""Set in a single copy's status once the copy was queued (`hmc_copy_now`)."""


class Helper:
    """The loaded helper for one runtime: `run()` queues a slot batch, `copy_now()` one copy, each on a GPU given as
    `context`: CUDA's context handle, or HIP's device ordinal (made current for the call)."""

    NOT_READY = 600
    """CUDA_ERROR_NOT_READY and hipErrorNotReady: the range table's last reader still runs (nothing queued), or a copy
    still runs."""
    RUNNING = _QUEUED | NOT_READY
    """A single copy's status while it runs: NOT_READY with the copy queued."""

    def __init__(self, ffi: Any, lib: Any, *, hip_runtime: int = 0) -> None:
        """`hip_runtime`: the table of calls `hmc_hip_load` made for one HIP runtime library (0: CUDA's driver)."""
        self._ffi = ffi
        if hip_runtime:
            self._run: Any = functools.partial(lib.hmc_hip_batch_run, hip_runtime)
            self._copy_now: Any = functools.partial(lib.hmc_hip_copy_now, hip_runtime)
        else:
            self._run, self._copy_now = lib.hmc_batch_run, lib.hmc_copy_now
        self._failed = "HIP runtime call failed: hipError_t" if hip_runtime else "CUDA driver call failed: CUresult"

    def run(
        self, context: int, function: int, block: int, *, gather: bool, kernel_stream: int, copy_stream: int,
        events: tuple[int, int, int, int, int], table: np.ndarray, table_device: int,
        src: np.ndarray, src_base: int, dst: np.ndarray, dst_base: int, lengths: np.ndarray,
        copy_dst: int, copy_src: int, whole: int,
    ) -> bool:
        """Queue a slot batch in `context` (made current for the call only): True once queued, False when the range
        table is still read by its last launch (nothing queued: wait for its event, then call again); DeviceError
        when a driver call fails (the steps before it stay queued).

        `events`: (wait or 0, join, table, end, freed) handles; the int64 arrays are contiguous, `table` holds at
        least 3 x len(lengths) rows."""
        buffer, step = self._ffi.from_buffer, self._ffi.new("int *")
        status = self._run(
            context, function, block, int(gather), kernel_stream, copy_stream, *events,
            buffer("int64_t[]", table), table_device, lengths.size,
            buffer("int64_t[]", src), src_base, buffer("int64_t[]", dst), dst_base, buffer("int64_t[]", lengths),
            copy_dst, copy_src, whole, step,
        )
        if status == self.NOT_READY and not step[0]:
            return False
        if status:
            raise DeviceError(f"{self._failed} {status} (a fused staging batch, after {step[0]} steps)")
        return True

    def copy_now(self, context: int, dst: int, src: int, length: int, stream: int, polls: int) -> bool:
        """One copy queued on `stream` in `context` and the stream looked at up to `polls` times: True once it
        finished, False while it runs (poll on); DeviceError when the copy or a look at the stream failed."""
        status = self._copy_now(context, dst, src, length, stream, polls)
        if status == 0:
            return True
        if status == self.RUNNING:
            return False
        queued = bool(status & _QUEUED)
        raise DeviceError(f"{self._failed} {status & ~_QUEUED} (a copy, {'queued' if queued else 'not queued'})")


def helper_for(runtime: Any) -> Helper | None:
    """The helper for the lanes of `runtime` (a GPU backend's: CUDA's driver or HIP's runtime), or None."""
    if runtime.name == "CUDA":
        return library()
    return hip_library(tuple(getattr(runtime, "libraries", ())))


@functools.cache
def library() -> Helper | None:
    """The CUDA helper with the driver's entry points resolved, or None (not built, or no CUDA driver here)."""
    try:
        from hmc.transport import _gpu_batch_c  # type: ignore[attr-defined]
    except ImportError:
        return None
    if _gpu_batch_c.lib.hmc_batch_load() != 0:
        return None
    return Helper(_gpu_batch_c.ffi, _gpu_batch_c.lib)


@functools.cache
def hip_library(names: tuple[str, ...]) -> Helper | None:
    """The HIP helper with the entry points of the first of `names` (paths or sonames of a HIP runtime library) that
    loads and has them all, or None (not built, none loads). Each library's calls are a table of their own."""
    try:
        from hmc.transport import _gpu_batch_c  # type: ignore[attr-defined]
    except ImportError:
        return None
    for name in names:
        if runtime := int(_gpu_batch_c.lib.hmc_hip_load(name.encode())):
            return Helper(_gpu_batch_c.ffi, _gpu_batch_c.lib, hip_runtime=runtime)
    return None
