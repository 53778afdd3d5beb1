"""The HIP-on-CUDA runtime's C library: the HIP runtime entry points a C caller of HMC opens (the copy lanes' helper,
`hmc.transport._gpu_batch`), over the CUDA driver. A cffi module in API mode compiled at install, as HMC's other C
modules are; no CUDA headers needed: libcuda.so.1 is opened when the library loads.

On a ROCm host that helper opens libamdhip64.so; in a process on the HIP-on-CUDA runtime (`hmc.memory._hip_on_cuda`)
it opens this module's file instead (`library_path()`), so the helper's HIP code runs on NVIDIA GPUs as the Python
stand-in's calls do. What it offers is what the helper calls, with HIP's signatures and semantics:

- hipMemcpyAsync (any kind: unified addressing), hipModuleLaunchKernel, hipEventRecord, hipStreamWaitEvent,
  hipEventQuery, hipStreamQuery: their CUDA driver counterparts, handles passed through (the stand-in's streams,
  events and functions are CUDA ones), statuses returned as CUDA's (0 success and 600 not ready, as HIP's);
- hipGetDevice: the current context's device, device 0 made current first where no context is (HIP initialises
  implicitly, as the Python stand-in does); hipSetDevice: the device's primary context made current (retained once).

Nothing here was run on AMD hardware; the module exists so that the C path of HMC's HIP backend is exercised.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CDEF", "SOURCE", "binding"]

CDEF = r"""
int hmc_hip_on_cuda_ready(void);
"""

SOURCE = r"""
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef void *CUcontext;

static CUresult (*copy_async)(uint64_t, uint64_t, size_t, void *);
static CUresult (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
static CUresult (*record)(void *, void *);
static CUresult (*wait_for)(void *, void *, unsigned);
static CUresult (*event_query)(void *);
static CUresult (*stream_query)(void *);
static CUresult (*get_current)(CUcontext *);
static CUresult (*set_current)(CUcontext);
static CUresult (*context_device)(int *);
static CUresult (*device_get)(int *, int);
static CUresult (*retain)(CUcontext *, int);
static CUresult (*init)(unsigned);

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int loaded = 0;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static CUcontext primary[64];

static void load(void) {
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (driver == NULL) driver = dlopen("libcuda.so.1", RTLD_NOW);
    if (driver == NULL) return;
    copy_async = (CUresult (*)(uint64_t, uint64_t, size_t, void *))dlsym(driver, "cuMemcpyAsync");
    launch = (CUresult (*)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **))dlsym(driver, "cuLaunchKernel");
    record = (CUresult (*)(void *, void *))dlsym(driver, "cuEventRecord");
    wait_for = (CUresult (*)(void *, void *, unsigned))dlsym(driver, "cuStreamWaitEvent");
    event_query = (CUresult (*)(void *))dlsym(driver, "cuEventQuery");
    stream_query = (CUresult (*)(void *))dlsym(driver, "cuStreamQuery");
    get_current = (CUresult (*)(CUcontext *))dlsym(driver, "cuCtxGetCurrent");
    set_current = (CUresult (*)(CUcontext))dlsym(driver, "cuCtxSetCurrent");
    context_device = (CUresult (*)(int *))dlsym(driver, "cuCtxGetDevice");
    device_get = (CUresult (*)(int *, int))dlsym(driver, "cuDeviceGet");
    retain = (CUresult (*)(CUcontext *, int))dlsym(driver, "cuDevicePrimaryCtxRetain_v2");
    if (retain == NULL) retain = (CUresult (*)(CUcontext *, int))dlsym(driver, "cuDevicePrimaryCtxRetain");
    init = (CUresult (*)(unsigned))dlsym(driver, "cuInit");
    loaded = copy_async && launch && record && wait_for && event_query && stream_query && get_current && set_current
             && context_device && device_get && retain && init && init(0) == 0;
}

/* 0 once the CUDA driver's entry points are there (hipErrorNotInitialized, 3, from every call otherwise). */
int hmc_hip_on_cuda_ready(void) {
    pthread_once(&once, load);
    return loaded ? 0 : 3;
}

#define READY() do { if (hmc_hip_on_cuda_ready() != 0) return 3; } while (0)

EXPORT CUresult hipMemcpyAsync(uint64_t dst, uint64_t src, size_t bytes, int kind, void *stream) {
    (void)kind;  /* unified addressing: the driver tells the memory apart */
    READY();
    return copy_async(dst, src, bytes, stream);
}

EXPORT CUresult hipModuleLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                      unsigned shared, void *stream, void **params, void **extra) {
    READY();
    return launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
}

EXPORT CUresult hipEventRecord(void *event, void *stream) { READY(); return record(event, stream); }
EXPORT CUresult hipStreamWaitEvent(void *stream, void *event, unsigned flags) { READY(); return wait_for(stream, event, flags); }
EXPORT CUresult hipEventQuery(void *event) { READY(); return event_query(event); }
EXPORT CUresult hipStreamQuery(void *stream) { READY(); return stream_query(stream); }

EXPORT CUresult hipSetDevice(int ordinal) {
    READY();
    if (ordinal < 0 || ordinal >= 64) return 101;  /* hipErrorInvalidDevice */
    pthread_mutex_lock(&lock);
    CUresult status = 0;
    if (primary[ordinal] == NULL) {
        int device = 0;
        status = device_get(&device, ordinal);
        CUcontext context = NULL;
        if (status == 0) status = retain(&context, device);
        if (status == 0) primary[ordinal] = context;
    }
    CUcontext context = primary[ordinal];
    pthread_mutex_unlock(&lock);
    if (status != 0) return 101;
    return set_current(context);
}

EXPORT CUresult hipGetDevice(int *ordinal) {
    READY();
    CUcontext current = NULL;
    CUresult status = get_current(&current);
    if (status != 0) return status;
    if (current == NULL) {  /* HIP's device 0 until one is set */
        status = hipSetDevice(0);
        if (status != 0) return status;
    }
    return context_device(ordinal);
}
"""


def binding() -> Any:
    """`hmc.memory._hip_on_cuda._runtime_c`, declared for cffi; setup.py compiles it."""
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source("hmc.memory._hip_on_cuda._runtime_c", SOURCE, libraries=["dl", "pthread"], extra_compile_args=["-O2"])
    return ffi
