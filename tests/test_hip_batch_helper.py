"""The copy lanes' C helper on HIP's runtime API (`hmc.transport._gpu_batch`: `hmc_hip_load`, `hmc_hip_batch_run`,
`hmc_hip_copy_now`), run on the CPU against a fake HIP runtime library compiled here: its hipMemcpyAsync copies host
memory, its hipModuleLaunchKernel does what the copy kernel does with the range table it is given, and every call is
logged. So the helper's own work is checked byte for byte: the library opened by path, the device made current and
the caller's given back, the table written, the steps of a gather and a scatter in order, a failing step reported
with how far it got. With real GPUs (the HIP-on-CUDA runtime's `_runtime_c`), tests/gpu/test_hip_on_cuda_staged.py.
"""

from __future__ import annotations

import ctypes.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hmc.errors import DeviceError
from hmc.transport import _gpu_batch

FAKE = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

static int current = 0;
static char log_[8192];
static size_t used = 0;
static int fail_launch = 0, not_ready_table = 0;

static void note(const char *line) {
    size_t n = strlen(line);
    if (used + n + 2 < sizeof log_) { memcpy(log_ + used, line, n); used += n; log_[used++] = ';'; log_[used] = 0; }
}

const char *fake_log(void) { return log_; }
void fake_reset(int device, int launch_fails, int table_busy) {
    used = 0; log_[0] = 0; current = device; fail_launch = launch_fails; not_ready_table = table_busy;
}
int fake_current(void) { return current; }

EXPORT int hipGetDevice(int *device) { *device = current; note("get"); return 0; }
EXPORT int hipSetDevice(int device) { char s[32]; snprintf(s, sizeof s, "set %d", device); note(s); current = device; return 0; }
EXPORT int hipMemcpyAsync(uint64_t dst, uint64_t src, size_t n, int kind, void *stream) {
    char s[64]; snprintf(s, sizeof s, "copy kind=%d stream=%lu", kind, (unsigned long)(uintptr_t)stream); note(s);
    memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return 0;
}
EXPORT int hipModuleLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                 unsigned shared, void *stream, void **params, void **extra) {
    char s[96];
    snprintf(s, sizeof s, "launch f=%lu grid=%u block=%u stream=%lu", (unsigned long)(uintptr_t)f, gx, bx, (unsigned long)(uintptr_t)stream);
    note(s);
    (void)gy; (void)gz; (void)by; (void)bz; (void)shared; (void)extra;
    if (fail_launch) return 98;  /* hipErrorInvalidDeviceFunction */
    const int64_t *srcs = *(const int64_t **)params[0], *dsts = *(const int64_t **)params[1], *lengths = *(const int64_t **)params[2];
    for (unsigned i = 0; i < gx; ++i) memcpy((void *)(uintptr_t)dsts[i], (const void *)(uintptr_t)srcs[i], (size_t)lengths[i]);
    return 0;
}
EXPORT int hipEventRecord(void *event, void *stream) {
    char s[64]; snprintf(s, sizeof s, "record %lu on %lu", (unsigned long)(uintptr_t)event, (unsigned long)(uintptr_t)stream); note(s); return 0;
}
EXPORT int hipStreamWaitEvent(void *stream, void *event, unsigned flags) {
    char s[64]; snprintf(s, sizeof s, "wait %lu for %lu", (unsigned long)(uintptr_t)stream, (unsigned long)(uintptr_t)event); note(s);
    (void)flags; return 0;
}
EXPORT int hipEventQuery(void *event) {
    char s[32]; snprintf(s, sizeof s, "query %lu", (unsigned long)(uintptr_t)event); note(s); return not_ready_table ? 600 : 0;
}
EXPORT int hipStreamQuery(void *stream) { (void)stream; note("poll"); return 0; }
"""

KERNELS, COPIES = 11, 12
"""Stream handles the fake sees (ints: the helper passes them through)."""
WAIT, JOIN, TABLE, END, FREED = 21, 22, 23, 24, 25
FUNCTION = 31


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Any, Path]]:
    """(the fake's ffi, its lib, the HIP helper opened from the fake's file by path, that file)."""
    import cffi

    builder = cffi.FFI()
    builder.cdef("const char *fake_log(void); void fake_reset(int device, int launch_fails, int table_busy); int fake_current(void);")
    builder.set_source("fake_hip_runtime", FAKE)
    where = tmp_path_factory.mktemp("fake-hip")
    path = Path(builder.compile(tmpdir=str(where), verbose=False))
    lib = builder.dlopen(str(path))  # the same file the helper opens: one copy of its state
    helper = _gpu_batch.hip_library((str(where / "no-such-library.so"), str(path)))
    assert helper is not None, "the HIP helper did not open the fake runtime by path"
    yield builder, lib, helper, path
    _gpu_batch.hip_library.cache_clear()


@pytest.fixture
def fake_runtime(fake: tuple[Any, Any, Any, Path]) -> tuple[Any, Any, Any]:
    """The fake, its entry points (re)loaded into the helper: the helper keeps one HIP runtime's at a time."""
    from hmc.transport import _gpu_batch_c  # type: ignore[attr-defined]

    builder, lib, helper, path = fake
    assert _gpu_batch_c.lib.hmc_hip_load(str(path).encode()) == 0
    return builder, lib, helper


def _log(builder: Any, lib: Any) -> list[str]:
    return [step for step in builder.string(lib.fake_log()).decode().split(";") if step]


def _address(array: np.ndarray) -> int:
    return int(array.ctypes.data)


def test_no_hip_runtime_library_no_helper() -> None:
    assert _gpu_batch.hip_library(("/nonexistent/libamdhip64.so",)) is None
    assert _gpu_batch.hip_library(()) is None


def test_a_single_copy_runs_on_its_device_and_gives_the_callers_back(fake_runtime: tuple[Any, Any, Any]) -> None:
    builder, lib, helper = fake_runtime
    rng = np.random.default_rng(5)
    src, dst = rng.integers(0, 256, 4099, np.uint8), np.full(4099, 0xA5, np.uint8)
    lib.fake_reset(0, 0, 0)
    assert helper.copy_now(3, _address(dst), _address(src), 4099, COPIES, 8) is True
    assert np.array_equal(dst, src)
    assert _log(builder, lib) == ["get", "set 3", f"copy kind=4 stream={COPIES}", "poll", "set 0"]
    assert lib.fake_current() == 0
    lib.fake_reset(3, 0, 0)  # already current: nothing to switch
    dst.fill(0xA5)
    assert helper.copy_now(3, _address(dst), _address(src) + 1, 4098, COPIES, 8) is True
    assert np.array_equal(dst[:4098], src[1:]) and dst[4098] == 0xA5
    assert _log(builder, lib) == ["get", f"copy kind=4 stream={COPIES}", "poll"]


def _ranges(rng: np.random.Generator, size: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = rng.integers(1, 3000, count).astype(np.int64)
    starts = np.sort(rng.choice(size // 4096, count, replace=False)).astype(np.int64) * 4096
    rng.shuffle(starts)
    return starts, lengths


@pytest.mark.parametrize("gather", [True, False], ids=["gather", "scatter"])
def test_a_slot_batch_moves_every_byte_in_its_steps_on_its_device(fake_runtime: tuple[Any, Any, Any], gather: bool) -> None:
    """A gather (kernel into scratch, then the copy to the slot) and a scatter (the copy from the slot, then the kernel
    out of scratch): random ranges, poisoned destinations, every byte compared; the steps in order, the scratch's
    last use waited for by the stream that goes first, the device given back."""
    builder, lib, helper = fake_runtime
    rng = np.random.default_rng(7 if gather else 8)
    size = 1 << 22
    buffer = rng.integers(0, 256, size, np.uint8)
    offsets, lengths = _ranges(rng, size, 300)
    positions = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    whole = int(lengths.sum())
    scratch, slot = np.full(whole, 0xA5, np.uint8), np.full(whole + 64, 0xA5, np.uint8)
    table = np.zeros(3 * offsets.size, np.int64)
    packed = np.concatenate([buffer[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist())])
    lib.fake_reset(1, 0, 0)
    if gather:
        target = buffer.copy()
        done = helper.run(
            2, FUNCTION, 128, gather=True, kernel_stream=KERNELS, copy_stream=COPIES, events=(WAIT, JOIN, TABLE, END, FREED),
            table=table, table_device=_address(table), src=offsets, src_base=_address(buffer), dst=positions, dst_base=_address(scratch),
            lengths=lengths, copy_dst=_address(slot) + 64, copy_src=_address(scratch), whole=whole,
        )
        assert done and np.array_equal(slot[64:], packed) and (slot[:64] == 0xA5).all()
        assert np.array_equal(buffer, target), "a gather wrote its source"
        steps = [f"wait {KERNELS} for {WAIT}", f"launch f={FUNCTION} grid={offsets.size} block=128 stream={KERNELS}", f"record {TABLE} on {KERNELS}",
                 f"record {JOIN} on {KERNELS}", f"wait {COPIES} for {JOIN}", f"copy kind=4 stream={COPIES}", f"record {END} on {COPIES}", f"record {FREED} on {COPIES}"]
    else:
        slot[64:] = packed
        target = np.full(size, 0xA5, np.uint8)
        done = helper.run(
            2, FUNCTION, 128, gather=False, kernel_stream=KERNELS, copy_stream=COPIES, events=(WAIT, JOIN, TABLE, END, FREED),
            table=table, table_device=_address(table), src=positions, src_base=_address(scratch), dst=offsets, dst_base=_address(target),
            lengths=lengths, copy_dst=_address(scratch), copy_src=_address(slot) + 64, whole=whole,
        )
        expected = np.full(size, 0xA5, np.uint8)
        for o, n, p in zip(offsets.tolist(), lengths.tolist(), positions.tolist()):
            expected[o : o + n] = packed[p : p + n]
        assert done and np.array_equal(target, expected)
        steps = [f"wait {COPIES} for {WAIT}", f"copy kind=4 stream={COPIES}", f"record {JOIN} on {COPIES}", f"wait {KERNELS} for {JOIN}",
                 f"launch f={FUNCTION} grid={offsets.size} block=128 stream={KERNELS}", f"record {TABLE} on {KERNELS}",
                 f"record {END} on {KERNELS}", f"record {FREED} on {KERNELS}"]
    assert _log(builder, lib) == ["get", "set 2", f"query {TABLE}", *steps, "set 1"]
    assert lib.fake_current() == 1


def test_a_busy_table_queues_nothing_and_a_failing_step_says_how_far_it_got(fake_runtime: tuple[Any, Any, Any]) -> None:
    builder, lib, helper = fake_runtime
    offsets, lengths = np.array([0, 4096], np.int64), np.array([10, 20], np.int64)
    positions = np.array([0, 10], np.int64)
    buffer, scratch, slot = np.zeros(8192, np.uint8), np.zeros(30, np.uint8), np.full(30, 0xA5, np.uint8)
    table = np.zeros(6, np.int64)
    args: dict[str, Any] = {
        "gather": True, "kernel_stream": KERNELS, "copy_stream": COPIES, "events": (0, JOIN, TABLE, END, FREED), "table": table,
        "table_device": _address(table), "src": offsets, "src_base": _address(buffer), "dst": positions, "dst_base": _address(scratch),
        "lengths": lengths, "copy_dst": _address(slot), "copy_src": _address(scratch), "whole": 30,
    }
    lib.fake_reset(0, 0, 1)  # the table's last launch still runs
    assert helper.run(0, FUNCTION, 128, **args) is False
    assert _log(builder, lib) == ["get", f"query {TABLE}"] and (slot == 0xA5).all()
    lib.fake_reset(1, 1, 0)  # the launch fails: nothing was queued before it (no scratch to wait for)
    with pytest.raises(DeviceError, match=r"HIP runtime call failed: hipError_t 98 \(a fused staging batch, after 0 steps\)"):
        helper.run(0, FUNCTION, 128, **args)
    assert _log(builder, lib)[-1] == "set 1" and lib.fake_current() == 1 and (slot == 0xA5).all()


def test_the_cuda_helper_is_unchanged_by_the_hip_one() -> None:
    """Loading a HIP runtime library leaves the CUDA helper's entry points alone (two tables of calls)."""
    from hmc.transport import _gpu_batch_c  # type: ignore[attr-defined]

    assert callable(_gpu_batch_c.lib.hmc_batch_run) and callable(_gpu_batch_c.lib.hmc_hip_batch_run)
    if ctypes.util.find_library("cuda") is None:
        assert _gpu_batch.library() is None


def test_the_hip_on_cuda_runtime_library_offers_every_entry_point_and_refuses_without_a_cuda_driver() -> None:
    """setup.py compiles the HIP-on-CUDA runtime's C module (`_runtime_build`, no CUDA needed to build it): the helper
    finds every HIP entry point it calls in it; without a CUDA driver each says hipErrorNotInitialized (3) and the
    runtime names no library, so HIP batches are queued from Python (tests/gpu runs the library on a GPU)."""
    from hmc.memory._hip_on_cuda import _runtime_c, library_path  # type: ignore[attr-defined]

    if ctypes.util.find_library("cuda"):
        pytest.skip("a CUDA driver is installed here")
    assert _runtime_c.lib.hmc_hip_on_cuda_ready() == 3
    assert library_path() == ""
    helper = _gpu_batch.hip_library((str(_runtime_c.__file__),))
    assert helper is not None, "an entry point the helper calls is missing from the HIP-on-CUDA runtime library"
    try:
        with pytest.raises(DeviceError, match=r"hipError_t 3 \(a copy, not queued\)"):
            helper.copy_now(0, 1, 2, 3, 4, 1)
    finally:
        _gpu_batch.hip_library.cache_clear()
