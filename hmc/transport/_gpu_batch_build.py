"""Copy-lane calls for CUDA GPUs that cost one C call instead of a dozen through cuda-python and numpy: the staged
ring's fused slot batch, and a single copy waited for. A cffi module in API mode, compiled at install (setup.py
compiles what `binding()` declares); no CUDA headers or libraries are needed to build it: the driver (libcuda.so.1)
is opened at run time, by the process that already loaded it.

Why (docs/decisions.md, "Staged slot batches in one C call"): a ring slot's gather (or scatter) and its copy were
about 20 driver calls through cuda-python plus numpy's table writes: on one H100, 110-135 us of CPU a batch on the
initiator and 185-235 us on the owner, the process that owns the KV cache (an inference engine, whose threads
share its GIL). One call takes 75-95 and 100-175 us (what is left is Python around it).

- `hmc_batch_load`: resolve the driver entry points (dlopen of libcuda.so.1, dlsym); 0 when all are there.
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
  0 once it finished, CUDA_ERROR_NOT_READY while it runs (the caller polls on, bounded), or the failing CUresult
  (`*step` 0: the copy was not queued). A 4 KiB copy's whole way below the caller, without the GIL.

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
int hmc_copy_now(uint64_t context, uint64_t dst, uint64_t src, uint64_t length, uint64_t stream, unsigned polls, int *step);
"""

SOURCE = r"""
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUfunction;

static CUresult (*copy_async)(uint64_t, uint64_t, size_t, CUstream);
static CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **);
static CUresult (*record)(CUevent, CUstream);
static CUresult (*wait_for)(CUstream, CUevent, unsigned);
static CUresult (*query)(CUevent);
static CUresult (*stream_query)(CUstream);
static CUresult (*push)(void *);
static CUresult (*pop)(void **);

int hmc_batch_load(void) {
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (driver == NULL) driver = dlopen("libcuda.so.1", RTLD_NOW);
    if (driver == NULL) return -1;
    copy_async = (CUresult (*)(uint64_t, uint64_t, size_t, CUstream))dlsym(driver, "cuMemcpyAsync");
    launch = (CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **))dlsym(driver, "cuLaunchKernel");
    record = (CUresult (*)(CUevent, CUstream))dlsym(driver, "cuEventRecord");
    wait_for = (CUresult (*)(CUstream, CUevent, unsigned))dlsym(driver, "cuStreamWaitEvent");
    query = (CUresult (*)(CUevent))dlsym(driver, "cuEventQuery");
    stream_query = (CUresult (*)(CUstream))dlsym(driver, "cuStreamQuery");
    push = (CUresult (*)(void *))dlsym(driver, "cuCtxPushCurrent_v2");
    pop = (CUresult (*)(void **))dlsym(driver, "cuCtxPopCurrent_v2");
    if (!copy_async || !launch || !record || !wait_for || !query || !stream_query || !push || !pop) return -2;
    return 0;
}

static void write_table(int64_t *table, uint64_t rows, const int64_t *src, int64_t src_base, const int64_t *dst, int64_t dst_base,
                        const int64_t *lengths) {
    for (uint64_t i = 0; i < rows; ++i) {
        table[i] = src[i] + src_base;
        table[rows + i] = dst[i] + dst_base;
        table[2 * rows + i] = lengths[i];
    }
}

static CUresult launch_on(uint64_t function, unsigned block, CUstream stream, uint64_t table_read, uint64_t rows) {
    uint64_t columns[3] = {table_read, table_read + 8 * rows, table_read + 16 * rows};
    void *arguments[3] = {&columns[0], &columns[1], &columns[2]};
    return launch((CUfunction)(uintptr_t)function, (unsigned)rows, 1, 1, block, 1, 1, 0, stream, arguments, NULL);
}

#define STEP(call) do { CUresult status_ = (call); if (status_ != 0) return status_; ++*step; } while (0)

static int batch(int gather, uint64_t function, unsigned block, CUstream kernels, CUstream copies,
                 uint64_t wait_event, uint64_t join_event, uint64_t table_event, uint64_t end_event, uint64_t freed_event,
                 int64_t *table, uint64_t table_device, uint64_t rows,
                 const int64_t *src, int64_t src_base, const int64_t *dst, int64_t dst_base, const int64_t *lengths,
                 uint64_t copy_dst, uint64_t copy_src, uint64_t whole, int *step) {
    CUstream last = gather ? copies : kernels;
    CUresult status = query((CUevent)(uintptr_t)table_event);  /* the table's last reader still runs: nothing queued */
    if (status != 0) return status;
    if (wait_event) STEP(wait_for(gather ? kernels : copies, (CUevent)(uintptr_t)wait_event, 0));
    if (gather) {
        write_table(table, rows, src, src_base, dst, dst_base, lengths);
        STEP(launch_on(function, block, kernels, table_device, rows));
        STEP(record((CUevent)(uintptr_t)table_event, kernels));
        STEP(record((CUevent)(uintptr_t)join_event, kernels));
        STEP(wait_for(copies, (CUevent)(uintptr_t)join_event, 0));
        STEP(copy_async(copy_dst, copy_src, (size_t)whole, copies));
    } else {
        STEP(copy_async(copy_dst, copy_src, (size_t)whole, copies));
        STEP(record((CUevent)(uintptr_t)join_event, copies));
        STEP(wait_for(kernels, (CUevent)(uintptr_t)join_event, 0));
        write_table(table, rows, src, src_base, dst, dst_base, lengths);
        STEP(launch_on(function, block, kernels, table_device, rows));
        STEP(record((CUevent)(uintptr_t)table_event, kernels));
    }
    STEP(record((CUevent)(uintptr_t)end_event, last));
    STEP(record((CUevent)(uintptr_t)freed_event, last));
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
    status = batch(gather, function, block, (CUstream)(uintptr_t)kernel_stream, (CUstream)(uintptr_t)copy_stream,
                   wait_event, join_event, table_event, end_event, freed_event, table, table_device, rows,
                   src, src_base, dst, dst_base, lengths, copy_dst, copy_src, whole, step);
    CUresult popped = pop(&previous);
    return status != 0 ? status : popped;  /* a failed pop shows once nothing of the call still runs */
}

int hmc_copy_now(uint64_t context, uint64_t dst, uint64_t src, uint64_t length, uint64_t stream, unsigned polls, int *step) {
    void *previous = NULL;
    *step = 0;
    CUresult status = push((void *)(uintptr_t)context);
    if (status != 0) return status;
    status = copy_async(dst, src, (size_t)length, (CUstream)(uintptr_t)stream);
    if (status == 0) {
        *step = 1;
        status = 600;  /* CUDA_ERROR_NOT_READY */
        for (unsigned i = 0; i < polls && status == 600; ++i) status = stream_query((CUstream)(uintptr_t)stream);
    }
    CUresult popped = pop(&previous);
    return status != 0 ? status : popped;  /* a failed pop shows once nothing of the call still runs */
}
"""


def binding() -> Any:
    """`hmc.transport._gpu_batch_c`, declared for cffi; setup.py compiles it (`build_binding`)."""
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source("hmc.transport._gpu_batch_c", SOURCE, libraries=["dl"], extra_compile_args=["-O2"])
    return ffi
