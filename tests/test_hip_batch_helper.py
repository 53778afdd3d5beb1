"""The copy lanes' C helper on HIP's runtime API (`hmc.transport._gpu_batch`: `hmc_hip_load`, `hmc_hip_batch_run`,
`hmc_hip_copy_now`), run on the CPU against a fake HIP runtime library compiled here: its hipMemcpyAsync copies host
memory, its hipModuleLaunchKernel does what the copy kernel does with the range table it is given, and every call is
logged. So the helper's own work is checked byte for byte: the library opened by path, the device made current and
the caller's given back, the table written, the steps of a gather and a scatter in order, a failing step reported
with how far it got, two libraries each called through its own table. The CUDA helper runs once against a fake
CUDA driver too, in a process of its own (its library is found by soname). With real GPUs (the HIP-on-CUDA runtime's `_runtime_c`), tests/gpu/test_hip_on_cuda_staged.py.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
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
static int fail_launch = 0, not_ready_table = 0, busy_polls = 0, fail_set = 0, sets = 0;

static void note(const char *line) {
    size_t n = strlen(line);
    if (used + n + 2 < sizeof log_) { memcpy(log_ + used, line, n); used += n; log_[used++] = ';'; log_[used] = 0; }
}

const char *fake_log(void) { return log_; }
void fake_reset(int device, int launch_fails, int table_busy, int polls_busy, int set_fails) {
    used = 0; log_[0] = 0; current = device; fail_launch = launch_fails; not_ready_table = table_busy; busy_polls = polls_busy;
    fail_set = set_fails; sets = 0;  /* set_fails: 1 every hipSetDevice fails, 2 all but the first (giving the caller's back) */
}
int fake_current(void) { return current; }

EXPORT int hipGetDevice(int *device) { *device = current; note("get"); return 0; }
#ifndef WITHOUT_SET_DEVICE
EXPORT int hipSetDevice(int device) {
    char s[32]; snprintf(s, sizeof s, "set %d", device); note(s);
    if (fail_set == 1 || (fail_set == 2 && sets > 0)) return 101;  /* hipErrorInvalidDevice */
    ++sets;
    current = device; return 0;
}
#endif
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
EXPORT int hipStreamQuery(void *stream) { (void)stream; note("poll"); return busy_polls-- > 0 ? 600 : 0; }
"""

KERNELS, COPIES = 11, 12
"""Stream handles the fake sees (ints: the helper passes them through)."""
WAIT, JOIN, TABLE, END, FREED = 21, 22, 23, 24, 25
FUNCTION = 31


def _compile(where: Path, name: str, *macros: str) -> tuple[Any, Any, Path]:
    """The fake HIP runtime compiled as its own library `name` (its own state): (its ffi, its lib, its file)."""
    import cffi

    builder = cffi.FFI()
    builder.cdef("const char *fake_log(void); void fake_reset(int, int, int, int, int); int fake_current(void);")
    builder.set_source(name, FAKE, define_macros=[(macro, "1") for macro in macros])
    path = Path(builder.compile(tmpdir=str(where), verbose=False))
    return builder, builder.dlopen(str(path)), path  # the same file the helper opens: one copy of its state


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Any, Any, Path]]]:
    """Two fake HIP runtime libraries ("a", "b") and one that lacks hipSetDevice ("partial")."""
    where = tmp_path_factory.mktemp("fake-hip")
    yield {"a": _compile(where, "fake_hip_a"), "b": _compile(where, "fake_hip_b"), "partial": _compile(where, "fake_hip_partial", "WITHOUT_SET_DEVICE")}
    _gpu_batch.hip_library.cache_clear()


@pytest.fixture
def fake_runtime(fakes: dict[str, tuple[Any, Any, Path]], tmp_path: Path) -> tuple[Any, Any, Any]:
    """(fake "a"'s ffi, its lib, the HIP helper opened from its file by path, after a name that does not load)."""
    builder, lib, path = fakes["a"]
    helper = _gpu_batch.hip_library((str(tmp_path / "no-such-library.so"), str(path)))
    assert helper is not None, "the HIP helper did not open the fake runtime by path"
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
    lib.fake_reset(0, 0, 0, 0, 0)
    assert helper.copy_now(3, _address(dst), _address(src), 4099, COPIES, 8) is True
    assert np.array_equal(dst, src)
    assert _log(builder, lib) == ["get", "set 3", f"copy kind=4 stream={COPIES}", "poll", "set 0"]
    assert lib.fake_current() == 0
    lib.fake_reset(3, 0, 0, 0, 0)  # already current: nothing to switch
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
    lib.fake_reset(1, 0, 0, 0, 0)
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
    lib.fake_reset(0, 0, 1, 0, 0)  # the table's last launch still runs
    assert helper.run(0, FUNCTION, 128, **args) is False
    assert _log(builder, lib) == ["get", f"query {TABLE}"] and (slot == 0xA5).all()
    lib.fake_reset(1, 1, 0, 0, 0)  # the launch fails: nothing was queued before it (no scratch to wait for)
    with pytest.raises(DeviceError, match=r"HIP runtime call failed: hipError_t 98 \(a fused staging batch, after 0 steps\)"):
        helper.run(0, FUNCTION, 128, **args)
    assert _log(builder, lib)[-1] == "set 1" and lib.fake_current() == 1 and (slot == 0xA5).all()


def test_each_hip_runtime_library_keeps_its_own_calls_and_one_that_fails_to_load_breaks_none(
    fakes: dict[str, tuple[Any, Any, Path]],
) -> None:
    """Two HIP runtime libraries in one process: each helper calls its own (a table of calls per library); a library
    that lacks an entry point gives no helper and leaves the loaded ones working."""
    (builder_a, lib_a, path_a), (builder_b, lib_b, path_b), (_, _, partial) = fakes["a"], fakes["b"], fakes["partial"]
    helper_a, helper_b = _gpu_batch.hip_library((str(path_a),)), _gpu_batch.hip_library((str(path_b),))
    assert helper_a is not None and helper_b is not None
    src, dst = np.arange(64, dtype=np.uint8), np.full(64, 0xA5, np.uint8)
    for lib in (lib_a, lib_b):
        lib.fake_reset(0, 0, 0, 0, 0)
    assert helper_b.copy_now(0, _address(dst), _address(src), 64, COPIES, 1) and np.array_equal(dst, src)
    assert helper_a.copy_now(0, _address(dst), _address(src) + 1, 63, COPIES, 1)
    assert _log(builder_a, lib_a) == ["get", f"copy kind=4 stream={COPIES}", "poll"]
    assert _log(builder_b, lib_b) == ["get", f"copy kind=4 stream={COPIES}", "poll"]
    assert _gpu_batch.hip_library((str(partial),)) is None  # no hipSetDevice
    lib_a.fake_reset(0, 0, 0, 0, 0)
    assert helper_a.copy_now(2, _address(dst), _address(src), 64, COPIES, 1)  # still its own calls, all of them
    assert _log(builder_a, lib_a) == ["get", "set 2", f"copy kind=4 stream={COPIES}", "poll", "set 0"]


def test_a_copy_still_running_says_so_and_a_device_that_cannot_be_made_current_queues_nothing(fake_runtime: tuple[Any, Any, Any]) -> None:
    builder, lib, helper = fake_runtime
    src, dst = np.arange(100, dtype=np.uint8), np.full(100, 0xA5, np.uint8)
    lib.fake_reset(0, 0, 0, 3, 0)  # the stream says "not ready" to its first three looks
    assert helper.copy_now(3, _address(dst), _address(src), 100, COPIES, 2) is False  # queued, still running: poll on
    assert _log(builder, lib) == ["get", "set 3", f"copy kind=4 stream={COPIES}", "poll", "poll", "set 0"] and lib.fake_current() == 0
    dst.fill(0xA5)
    lib.fake_reset(0, 0, 0, 0, 1)  # hipSetDevice fails: nothing is queued, the caller's device stays
    with pytest.raises(DeviceError, match=r"hipError_t 101 \(a copy, not queued\)"):
        helper.copy_now(3, _address(dst), _address(src), 100, COPIES, 2)
    assert (dst == 0xA5).all() and _log(builder, lib) == ["get", "set 3"] and lib.fake_current() == 0
    table = np.zeros(3, np.int64)
    one = np.array([0], np.int64)
    with pytest.raises(DeviceError, match=r"hipError_t 101 \(a fused staging batch, after 0 steps\)"):
        helper.run(
            3, FUNCTION, 128, gather=True, kernel_stream=KERNELS, copy_stream=COPIES, events=(WAIT, JOIN, TABLE, END, FREED), table=table,
            table_device=_address(table), src=one, src_base=_address(src), dst=one, dst_base=_address(dst), lengths=np.array([10], np.int64),
            copy_dst=_address(dst), copy_src=_address(src), whole=10,
        )
    assert (dst == 0xA5).all() and _log(builder, lib) == ["get", "set 3", "get", "set 3"]
    lib.fake_reset(0, 0, 0, 0, 2)  # the copy lands, but the caller's device cannot be given back: that is the call's error
    with pytest.raises(DeviceError, match=r"hipError_t 101 \(a copy, queued\)"):
        helper.copy_now(3, _address(dst), _address(src), 100, COPIES, 2)
    assert np.array_equal(dst, src) and _log(builder, lib) == ["get", "set 3", f"copy kind=4 stream={COPIES}", "poll", "set 0"]


FAKE_CUDA = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static char log_[4096];
static size_t used = 0;

static void note(const char *line) {
    size_t n = strlen(line);
    if (used + n + 2 < sizeof log_) { memcpy(log_ + used, line, n); used += n; log_[used++] = ';'; log_[used] = 0; }
}
const char *fake_log(void) { return log_; }
int cuCtxPushCurrent_v2(void *context) { char s[32]; snprintf(s, sizeof s, "push %lu", (unsigned long)(uintptr_t)context); note(s); return 0; }
int cuCtxPopCurrent_v2(void **context) { note("pop"); *context = 0; return 0; }
int cuMemcpyAsync(uint64_t dst, uint64_t src, size_t n, void *stream) {
    char s[48]; snprintf(s, sizeof s, "copy stream=%lu", (unsigned long)(uintptr_t)stream); note(s);
    memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n); return 0;
}
int cuLaunchKernel(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g, unsigned h, void *s, void **p, void **x) {
    (void)f; (void)a; (void)b; (void)c; (void)d; (void)e; (void)g; (void)h; (void)s; (void)p; (void)x; note("launch"); return 0;
}
int cuEventRecord(void *event, void *stream) { (void)event; (void)stream; note("record"); return 0; }
int cuStreamWaitEvent(void *stream, void *event, unsigned flags) { (void)stream; (void)event; (void)flags; note("wait"); return 0; }
int cuEventQuery(void *event) { (void)event; note("query"); return 0; }
int cuStreamQuery(void *stream) { (void)stream; note("poll"); return 0; }
static uintptr_t current_context = 0;  /* a device's primary context is 1000 + its ordinal; two devices */
int cuInit(unsigned flags) { (void)flags; return 0; }
int cuCtxGetCurrent(void **context) { *context = (void *)current_context; return 0; }
int cuCtxSetCurrent(void *context) { char s[32]; snprintf(s, sizeof s, "current %lu", (unsigned long)(uintptr_t)context); note(s); current_context = (uintptr_t)context; return 0; }
int cuCtxGetDevice(int *device) { if (!current_context) return 201; *device = (int)(current_context - 1000); return 0; }
int cuDeviceGet(int *device, int ordinal) { if (ordinal < 0 || ordinal > 1) return 101; *device = ordinal; return 0; }
int cuDevicePrimaryCtxRetain(void **context, int device) {
    char s[32]; snprintf(s, sizeof s, "retain %d", device); note(s); *context = (void *)(uintptr_t)(1000 + device); return 0;
}
"""

_BOTH = """
import ctypes, json, sys
import numpy as np
from hmc.transport import _gpu_batch
cuda_log = ctypes.CDLL("libcuda.so.1").fake_log
cuda_log.restype = ctypes.c_char_p
hip = ctypes.CDLL(sys.argv[1])
hip.fake_log.restype = ctypes.c_char_p
hip.fake_reset(0, 0, 0, 0, 0)
cuda = _gpu_batch.library()
assert cuda is not None, "the CUDA helper did not load the fake driver"
assert _gpu_batch.hip_library((sys.argv[1],)) is not None
src, dst = np.arange(256, dtype=np.uint8), np.full(256, 0xA5, np.uint8)
done = cuda.copy_now(77, dst.ctypes.data, src.ctypes.data, 256, 5, 4)
print(json.dumps({"done": done, "landed": bool((dst == src).all()), "cuda": cuda_log().decode(), "hip": hip.fake_log().decode()}))
"""


_SHIM = """
import ctypes, json
from hmc.memory._hip_on_cuda import _runtime_c, library_path
hip = ctypes.CDLL(_runtime_c.__file__)
log = ctypes.CDLL("libcuda.so.1").fake_log
log.restype = ctypes.c_char_p
device = ctypes.c_int(-7)
report = {"path": library_path() == _runtime_c.__file__}
report["bad"] = [hip.hipSetDevice(n) for n in (-1, 64, 2**31 - 1, 5)]
report["first"] = [hip.hipGetDevice(ctypes.byref(device)), device.value]
report["set"] = [hip.hipSetDevice(1), hip.hipSetDevice(0), hip.hipSetDevice(1), hip.hipGetDevice(ctypes.byref(device)), device.value]
src, dst = ctypes.create_string_buffer(bytes(range(64))), ctypes.create_string_buffer(b"\\xa5" * 64)
report["copy"] = [hip.hipMemcpyAsync(ctypes.c_uint64(ctypes.addressof(dst)), ctypes.c_uint64(ctypes.addressof(src)), ctypes.c_size_t(64), 4, ctypes.c_void_p(9)), dst.raw == src.raw]
report["log"] = log().decode()
print(json.dumps(report))
"""


def _fake_driver(tmp_path: Path) -> dict[str, str]:
    """A fake CUDA driver compiled as libcuda.so.1, and the environment of a process that finds it by soname."""
    import cffi

    builder = cffi.FFI()
    builder.cdef("const char *fake_log(void);")
    builder.set_source("fake_cuda_driver", FAKE_CUDA)
    driver = tmp_path / "driver"
    driver.mkdir()
    shutil.copy(builder.compile(tmpdir=str(tmp_path), verbose=False), driver / "libcuda.so.1")
    return {**os.environ, "LD_LIBRARY_PATH": f"{driver}{os.pathsep}{os.environ.get('LD_LIBRARY_PATH', '')}"}


def test_the_hip_on_cuda_runtime_library_refuses_bad_devices_and_makes_primary_contexts_current(tmp_path: Path) -> None:
    """The HIP-on-CUDA runtime's C entry points over a fake CUDA driver: a negative, huge or absent device is
    hipErrorInvalidDevice (101) and leaves the current context alone; without a current context hipGetDevice makes
    device 0's current, as HIP does; each device's primary context is retained once; a copy lands."""
    done = subprocess.run([sys.executable, "-c", _SHIM], check=False, env=_fake_driver(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["path"] and report["bad"] == [101, 101, 101, 101]
    assert report["first"] == [0, 0] and report["set"] == [0, 0, 0, 0, 1] and report["copy"] == [0, True]
    assert report["log"] == "retain 0;current 1000;retain 1;current 1001;current 1000;current 1001;copy stream=9;"


def test_the_cuda_helper_keeps_the_drivers_calls_once_a_hip_runtime_library_is_loaded(
    fakes: dict[str, tuple[Any, Any, Path]], tmp_path: Path,
) -> None:
    """In a process whose CUDA driver is a fake (libcuda.so.1 on LD_LIBRARY_PATH), a copy through the CUDA helper after
    a HIP runtime library was loaded runs in its context on the driver's calls, and none of HIP's."""
    done = subprocess.run([sys.executable, "-c", _BOTH, str(fakes["b"][2])], check=False, env=_fake_driver(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"done": True, "landed": True, "cuda": "push 77;copy stream=5;poll;pop;", "hip": ""}


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


def test_a_runtime_gets_the_helper_of_its_own_family(fakes: dict[str, tuple[Any, Any, Path]]) -> None:
    """`helper_for`: CUDA's driver gets the CUDA helper (None without a driver); a HIP runtime the helper of the first
    library it names that loads, or None when it names none."""
    from types import SimpleNamespace

    builder, lib, path = fakes["a"]
    assert _gpu_batch.helper_for(SimpleNamespace(name="CUDA")) is _gpu_batch.library()
    assert _gpu_batch.helper_for(SimpleNamespace(name="HIP")) is None
    helper = _gpu_batch.helper_for(SimpleNamespace(name="HIP", libraries=("/nonexistent/libamdhip64.so", str(path))))
    assert helper is not None
    src, dst = np.arange(32, dtype=np.uint8), np.full(32, 0xA5, np.uint8)
    lib.fake_reset(0, 0, 0, 0, 0)
    assert helper.copy_now(0, _address(dst), _address(src), 32, COPIES, 1) and np.array_equal(dst, src)
    assert _log(builder, lib) == ["get", f"copy kind=4 stream={COPIES}", "poll"]
