"""Copy-lane calls for CUDA and HIP GPUs that cost one C call instead of a dozen through cuda-python (hip-python) and
numpy: the staged ring's fused slot batch, and a single copy waited for. A cffi module in API mode, compiled at
install (setup.py compiles what `binding()` declares); no CUDA or ROCm headers or libraries are needed to build it:
the CUDA driver (libcuda.so.1) and the HIP runtime (libamdhip64.so, or the library a HIP runtime names) are opened
at run time, by the process that already loaded them.

Why (docs/decisions.md, "Staged slot batches in one C call"): a ring slot's gather (or scatter) and its copy were
about 20 driver calls through cuda-python plus numpy's table writes: on one H100, 110-135 us of CPU a batch on the
initiator and 185-235 us on the owner, the process that owns the KV cache (an inference engine, whose threads
share its GIL). One call takes 75-95 and 100-175 us (what is left is Python around it).

- `hmc_batch_load`: resolve the driver entry points (dlopen of libcuda.so.1, dlsym); 0 when all are there. Once,
  under a lock: the table is published whole, and only when every entry point is there.
- `hmc_batch_run`: one slot batch, in `context` (pushed, and popped before returning, so the calling thread's
  current context is untouched). First it looks at `table_event`: while the launch that last read the range
  table runs, it returns CUDA_ERROR_NOT_READY with nothing queued (`*step` 0; the caller waits, bounded, and
  calls again). Then, gather (`gather` = 1): wait for `wait_event` on the kernel stream (the scratch slot's last use), write the
  range table (sources and destinations with their bases added, lengths), launch the copy kernel on it, record
  `table_event` (the table may be rewritten once it completed), make the copy stream wait for the kernel
  (`join_event`), copy `whole` bytes scratch -> slot, record `end_event` and `freed_event` there.
  scatter (`gather` = 0): the copy first (on the copy stream, after `wait_event`), then the kernel (after the
  copy), both events recorded on the kernel stream.
  Returns 0, or the first failing CUresult with `*step` saying how many steps had been queued (the caller fences
  the scratch slot then, as after any failure halfway).
- `hmc_copy_now`: one memcpyAsync on `stream`, in `context`, then up to `polls` looks at the stream; returns
  0 once it finished, else a status with `HMC_QUEUED` (bit 30) set once the copy was queued:
  HMC_QUEUED | CUDA_ERROR_NOT_READY while it runs (the caller polls on, bounded), or the failing CUresult (bit 30
  clear: the copy was not queued). A 4 KiB copy's whole way below the caller, without the GIL; the status is the
  return value, not an out-parameter, so the caller allocates nothing per copy (0.2-0.5 us a call on 2x H200).
- `hmc_hip_load(library)`, `hmc_hip_batch_run`, `hmc_hip_copy_now`: the same on HIP's runtime API, opened from
  `library` (a path or a soname). The load returns that library's own table of calls (0 when it does not load or
  lacks one), which the other two take first: two HIP runtime libraries in one process never share one, and one
  that failed to load leaves the others' alone. Where CUDA takes a context to push, HIP takes a device to make
  current (and the caller's current device back before returning). hipErrorNotReady is 600 as CUDA_ERROR_NOT_READY is, and
  success 0 on both; copies are hipMemcpyAsync with hipMemcpyDefault (unified addressing, as HMC requires).

The module is `hmc.transport._gpu_batch_c`; `hmc.transport._gpu_batch` loads it. It never calls into Python and
never waits: every wait stays with the caller, bounded by its deadline.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CDEF", "SOURCE", "binding"]

CDEF = r"""
int hmc_batch_load(void);
int hmc_batch_run(uint64_t context, uint64_t function, unsigned block, int gather,
                  uint64_t kernel_stream, uint64_t copy_stream,
                  uint64_t wait_event, uint64_t join_event, uint64_t table_event, uint64_t end_event, uint64_t freed_event,
                  int64_t *table, uint64_t table_device, uint64_t rows,
                  const int64_t *src, int64_t src_base, const int64_t *dst, int64_t dst_base, const int64_t *lengths,
                  uint64_t copy_dst, uint64_t copy_src, uint64_t whole, int *step);
int hmc_copy_now(uint64_t context, uint64_t dst, uint64_t src, uint64_t length, uint64_t stream, unsigned polls);
uint64_t hmc_hip_load(const char *library);
int hmc_hip_batch_run(uint64_t runtime, int device, uint64_t function, unsigned block, int gather,
                      uint64_t kernel_stream, uint64_t copy_stream,
                      uint64_t wait_event, uint64_t join_event, uint64_t table_event, uint64_t end_event, uint64_t freed_event,
                      int64_t *table, uint64_t table_device, uint64_t rows,
                      const int64_t *src, int64_t src_base, const int64_t *dst, int64_t dst_base, const int64_t *lengths,
                      uint64_t copy_dst, uint64_t copy_src, uint64_t whole, int *step);
int hmc_hip_copy_now(uint64_t runtime, int device, uint64_t dst, uint64_t src, uint64_t length, uint64_t stream, unsigned polls);
"""

SOURCE = r"""
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

typedef int CUresult;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUfunction;

/* The calls a batch makes, on either runtime (CUresult and hipError_t: 0 success, 600 not ready). `copy` is
   hipMemcpyAsync's signature; its kind (hipMemcpyDefault) means nothing to CUDA's, which `cuda_copy` calls. */
typedef struct {
    CUresult (*copy)(uint64_t, uint64_t, size_t, int, CUstream);
    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **);
    CUresult (*record)(CUevent, CUstream);
    CUresult (*wait_for)(CUstream, CUevent, unsigned);
    CUresult (*query)(CUevent);
    CUresult (*stream_query)(CUstream);
} api_t;

static api_t cuda;
static CUresult (*cu_memcpy_async)(uint64_t, uint64_t, size_t, CUstream);
static CUresult (*push)(void *);
static CUresult (*pop)(void **);
static int cuda_loaded;
static pthread_mutex_t cuda_lock = PTHREAD_MUTEX_INITIALIZER;

static CUresult cuda_copy(uint64_t dst, uint64_t src, size_t length, int kind, CUstream stream) {
    (void)kind;
    return cu_memcpy_async(dst, src, length, stream);
}

/* The driver's entry points into locals, published only when all are there. */
static int resolve_cuda(void) {
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (driver == NULL) driver = dlopen("libcuda.so.1", RTLD_NOW);
    if (driver == NULL) return -1;
    api_t api;
    CUresult (*memcpy_async)(uint64_t, uint64_t, size_t, CUstream) = (CUresult (*)(uint64_t, uint64_t, size_t, CUstream))dlsym(driver, "cuMemcpyAsync");
    api.copy = cuda_copy;
    api.launch = (CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **))dlsym(driver, "cuLaunchKernel");
    api.record = (CUresult (*)(CUevent, CUstream))dlsym(driver, "cuEventRecord");
    api.wait_for = (CUresult (*)(CUstream, CUevent, unsigned))dlsym(driver, "cuStreamWaitEvent");
    api.query = (CUresult (*)(CUevent))dlsym(driver, "cuEventQuery");
    api.stream_query = (CUresult (*)(CUstream))dlsym(driver, "cuStreamQuery");
    CUresult (*pusher)(void *) = (CUresult (*)(void *))dlsym(driver, "cuCtxPushCurrent_v2");
    CUresult (*popper)(void **) = (CUresult (*)(void **))dlsym(driver, "cuCtxPopCurrent_v2");
    if (!memcpy_async || !api.launch || !api.record || !api.wait_for || !api.query || !api.stream_query || !pusher || !popper) {
        dlclose(driver);
        return -2;
    }
    cuda = api;
    cu_memcpy_async = memcpy_async;
    push = pusher;
    pop = popper;
    cuda_loaded = 1;
    return 0;
}

int hmc_batch_load(void) {
    pthread_mutex_lock(&cuda_lock);
    int status = cuda_loaded ? 0 : resolve_cuda();
    pthread_mutex_unlock(&cuda_lock);
    return status;
}

static void write_table(int64_t *table, uint64_t rows, const int64_t *src, int64_t src_base, const int64_t *dst, int64_t dst_base,
                        const int64_t *lengths) {
    for (uint64_t i = 0; i < rows; ++i) {
        table[i] = src[i] + src_base;
        table[rows + i] = dst[i] + dst_base;
        table[2 * rows + i] = lengths[i];
    }
}

static CUresult launch_on(const api_t *api, uint64_t function, unsigned block, CUstream stream, uint64_t table_read, uint64_t rows) {
    uint64_t columns[3] = {table_read, table_read + 8 * rows, table_read + 16 * rows};
    void *arguments[3] = {&columns[0], &columns[1], &columns[2]};
    return api->launch((CUfunction)(uintptr_t)function, (unsigned)rows, 1, 1, block, 1, 1, 0, stream, arguments, NULL);
}

#define MEMCPY_DEFAULT 4  /* hipMemcpyDefault: unified addressing, as HMC requires */
#define STEP(call) do { CUresult status_ = (call); if (status_ != 0) return status_; ++*step; } while (0)

static int batch(const api_t *api, int gather, uint64_t function, unsigned block, CUstream kernels, CUstream copies,
                 uint64_t wait_event, uint64_t join_event, uint64_t table_event, uint64_t end_event, uint64_t freed_event,
                 int64_t *table, uint64_t table_device, uint64_t rows,
                 const int64_t *src, int64_t src_base, const int64_t *dst, int64_t dst_base, const int64_t *lengths,
                 uint64_t copy_dst, uint64_t copy_src, uint64_t whole, int *step) {
    CUstream last = gather ? copies : kernels;
    CUresult status = api->query((CUevent)(uintptr_t)table_event);  /* the table's last reader still runs: nothing queued */
    if (status != 0) return status;
    if (wait_event) STEP(api->wait_for(gather ? kernels : copies, (CUevent)(uintptr_t)wait_event, 0));
    if (gather) {
        write_table(table, rows, src, src_base, dst, dst_base, lengths);
        STEP(launch_on(api, function, block, kernels, table_device, rows));
        STEP(api->record((CUevent)(uintptr_t)table_event, kernels));
        STEP(api->record((CUevent)(uintptr_t)join_event, kernels));
        STEP(api->wait_for(copies, (CUevent)(uintptr_t)join_event, 0));
        STEP(api->copy(copy_dst, copy_src, (size_t)whole, MEMCPY_DEFAULT, copies));
    } else {
        STEP(api->copy(copy_dst, copy_src, (size_t)whole, MEMCPY_DEFAULT, copies));
        STEP(api->record((CUevent)(uintptr_t)join_event, copies));
        STEP(api->wait_for(kernels, (CUevent)(uintptr_t)join_event, 0));
        write_table(table, rows, src, src_base, dst, dst_base, lengths);
        STEP(launch_on(api, function, block, kernels, table_device, rows));
        STEP(api->record((CUevent)(uintptr_t)table_event, kernels));
    }
    STEP(api->record((CUevent)(uintptr_t)end_event, last));
    STEP(api->record((CUevent)(uintptr_t)freed_event, last));
    return 0;
}

int hmc_batch_run(uint64_t context, uint64_t function, unsigned block, int gather,
                  uint64_t kernel_stream, uint64_t copy_stream,
                  uint64_t wait_event, uint64_t join_event, uint64_t table_event, uint64_t end_event, uint64_t freed_event,
                  int64_t *table, uint64_t table_device, uint64_t rows,
                  const int64_t *src, int64_t src_base, const int64_t *dst, int64_t dst_base, const int64_t *lengths,
                  uint64_t copy_dst, uint64_t copy_src, uint64_t whole, int *step) {
    void *previous = NULL;
    *step = 0;
    CUresult status = push((void *)(uintptr_t)context);
    if (status != 0) return status;
    status = batch(&cuda, gather, function, block, (CUstream)(uintptr_t)kernel_stream, (CUstream)(uintptr_t)copy_stream,
                   wait_event, join_event, table_event, end_event, freed_event, table, table_device, rows,
                   src, src_base, dst, dst_base, lengths, copy_dst, copy_src, whole, step);
    CUresult popped = pop(&previous);
    return status != 0 ? status : popped;  /* a failed pop shows once nothing of the call still runs */
}

/* One copy queued on `stream`, then up to `polls` looks at it: 0 landed, 600 still running (`*step` 1), else the
   failing call's status (`*step` 0: nothing queued). */
static CUresult copied(const api_t *api, uint64_t dst, uint64_t src, uint64_t length, uint64_t stream, unsigned polls, int *step) {
    CUresult status = api->copy(dst, src, (size_t)length, MEMCPY_DEFAULT, (CUstream)(uintptr_t)stream);
    if (status != 0) return status;
    *step = 1;
    status = 600;  /* not ready */
    for (unsigned i = 0; i < polls && status == 600; ++i) status = api->stream_query((CUstream)(uintptr_t)stream);
    return status;
}

#define HMC_QUEUED (1 << 30)

/* A single copy's answer: 0, or `status` with HMC_QUEUED set when the copy had been queued (`step`). */
static int copy_status(CUresult status, int step) {
    return status == 0 ? 0 : (int)status | (step ? HMC_QUEUED : 0);
}

int hmc_copy_now(uint64_t context, uint64_t dst, uint64_t src, uint64_t length, uint64_t stream, unsigned polls) {
    void *previous = NULL;
    int step = 0;
    CUresult status = push((void *)(uintptr_t)context);
    if (status != 0) return copy_status(status, 0);
    status = copied(&cuda, dst, src, length, stream, polls, &step);
    CUresult popped = pop(&previous);
    return copy_status(status != 0 ? status : popped, step);  /* a failed pop shows once nothing of the call still runs */
}

/* HIP: the runtime API's calls, opened from the library a HIP runtime names, one table per library; a device made
   current per call. */

typedef struct {
    api_t api;
    CUresult (*get_device)(int *);
    CUresult (*set_device)(int);
} hip_t;

uint64_t hmc_hip_load(const char *library) {
    void *runtime = dlopen(library, RTLD_NOW | RTLD_NOLOAD);
    if (runtime == NULL) runtime = dlopen(library, RTLD_NOW);
    if (runtime == NULL) return 0;
    hip_t table;
    table.api.copy = (CUresult (*)(uint64_t, uint64_t, size_t, int, CUstream))dlsym(runtime, "hipMemcpyAsync");
    table.api.launch = (CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **))dlsym(runtime, "hipModuleLaunchKernel");
    table.api.record = (CUresult (*)(CUevent, CUstream))dlsym(runtime, "hipEventRecord");
    table.api.wait_for = (CUresult (*)(CUstream, CUevent, unsigned))dlsym(runtime, "hipStreamWaitEvent");
    table.api.query = (CUresult (*)(CUevent))dlsym(runtime, "hipEventQuery");
    table.api.stream_query = (CUresult (*)(CUstream))dlsym(runtime, "hipStreamQuery");
    table.get_device = (CUresult (*)(int *))dlsym(runtime, "hipGetDevice");
    table.set_device = (CUresult (*)(int))dlsym(runtime, "hipSetDevice");
    hip_t *kept = NULL;
    if (table.api.copy && table.api.launch && table.api.record && table.api.wait_for && table.api.query && table.api.stream_query
        && table.get_device && table.set_device)
        kept = malloc(sizeof *kept);
    if (kept == NULL) {
        dlclose(runtime);
        return 0;
    }
    *kept = table;  /* kept, with its library, for the life of the process */
    return (uint64_t)(uintptr_t)kept;
}

/* Make `device` current; `*previous` is the caller's (-1: nothing to give back). */
static CUresult enter_device(const hip_t *hip, int device, int *previous) {
    *previous = -1;
    int current = -1;
    CUresult status = hip->get_device(&current);
    if (status != 0) return status;
    if (current == device) return 0;
    status = hip->set_device(device);
    if (status == 0) *previous = current;
    return status;
}

int hmc_hip_batch_run(uint64_t runtime, int device, uint64_t function, unsigned block, int gather,
                      uint64_t kernel_stream, uint64_t copy_stream,
                      uint64_t wait_event, uint64_t join_event, uint64_t table_event, uint64_t end_event, uint64_t freed_event,
                      int64_t *table, uint64_t table_device, uint64_t rows,
                      const int64_t *src, int64_t src_base, const int64_t *dst, int64_t dst_base, const int64_t *lengths,
                      uint64_t copy_dst, uint64_t copy_src, uint64_t whole, int *step) {
    const hip_t *hip = (const hip_t *)(uintptr_t)runtime;
    int previous = -1;
    *step = 0;
    CUresult status = enter_device(hip, device, &previous);
    if (status != 0) return status;
    status = batch(&hip->api, gather, function, block, (CUstream)(uintptr_t)kernel_stream, (CUstream)(uintptr_t)copy_stream,
                   wait_event, join_event, table_event, end_event, freed_event, table, table_device, rows,
                   src, src_base, dst, dst_base, lengths, copy_dst, copy_src, whole, step);
    CUresult back = previous >= 0 ? hip->set_device(previous) : 0;
    return status != 0 ? status : back;
}

int hmc_hip_copy_now(uint64_t runtime, int device, uint64_t dst, uint64_t src, uint64_t length, uint64_t stream, unsigned polls) {
    const hip_t *hip = (const hip_t *)(uintptr_t)runtime;
    int previous = -1, step = 0;
    CUresult status = enter_device(hip, device, &previous);
    if (status != 0) return copy_status(status, 0);
    status = copied(&hip->api, dst, src, length, stream, polls, &step);
    CUresult back = previous >= 0 ? hip->set_device(previous) : 0;
    return copy_status(status != 0 ? status : back, step);
}
"""


def binding() -> Any:
    """`hmc.transport._gpu_batch_c`, declared for cffi; setup.py compiles it (`build_binding`)."""
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source("hmc.transport._gpu_batch_c", SOURCE, libraries=["dl", "pthread"], extra_compile_args=["-O2"])
    return ffi
