"""The UCP binding of the `ucx` path: a cffi module in API mode, compiled at install against the UCX of the
`libucx-cu13` wheel (its headers and libraries; setup.py compiles what `binding()` declares).

Why our own (docs/decisions.md): ucxx exposes no one-sided RMA to Python, ucx-py has no CUDA 13 build, and
a batch of ranges must be posted below Python. The C helpers here are the only code that loops over ranges:

- `hmc_post_batch`: one `ucp_put_nbx`/`ucp_get_nbx` per range, requests released at once (an operation
  released in flight still completes; a flush then says when all have);
- `hmc_wait`, `hmc_flush_worker`, `hmc_flush_ep`, `hmc_ep_close`: progress the worker until the request
  completes or a deadline passes (never without one). UCX cancels no RMA, flush or send: after a timeout
  the operations go on, and memory they touch must stay until the worker is destroyed. No call goes from C
  into Python anywhere.

The module is `hmc.transport._ucx_c`; `hmc.transport._ucx_lib` loads it (after the wheel's libraries).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["CDEF", "SOURCE", "binding"]

CDEF = r"""
typedef enum { UCS_OK, UCS_INPROGRESS, UCS_ERR_NO_ELEM, UCS_ERR_NO_MEMORY, UCS_ERR_TIMED_OUT, UCS_ERR_CANCELED,
               UCS_ERR_UNREACHABLE, UCS_ERR_NO_RESOURCE, UCS_ERR_CONNECTION_RESET, UCS_ERR_ENDPOINT_TIMEOUT, UCS_ERR_BUSY, UCS_ERR_IO_ERROR, UCS_ERR_NOT_CONNECTED,
               ... } ucs_status_t;
typedef void *ucs_status_ptr_t;
typedef struct ucp_context *ucp_context_h;
typedef struct ucp_worker *ucp_worker_h;
typedef struct ucp_ep *ucp_ep_h;
typedef struct ucp_mem *ucp_mem_h;
typedef struct ucp_rkey *ucp_rkey_h;
typedef struct ucp_address ucp_address_t;
typedef struct ucp_config ucp_config_t;

typedef struct { uint64_t field_mask; uint64_t features; int mt_workers_shared; ...; } ucp_params_t;
typedef struct { uint64_t field_mask; int thread_mode; ...; } ucp_worker_params_t;
typedef struct { uint64_t field_mask; const ucp_address_t *address; int err_mode; ...; } ucp_ep_params_t;
typedef struct { uint64_t field_mask; void *address; size_t length; unsigned flags; int memory_type; ...; } ucp_mem_map_params_t;

#define UCP_PARAM_FIELD_FEATURES ...
#define UCP_PARAM_FIELD_MT_WORKERS_SHARED ...
#define UCP_FEATURE_RMA ...
#define UCP_FEATURE_WAKEUP ...
#define UCP_WORKER_PARAM_FIELD_THREAD_MODE ...
#define UCS_THREAD_MODE_SINGLE ...
#define UCS_THREAD_MODE_SERIALIZED ...
#define UCS_THREAD_MODE_MULTI ...
#define UCP_EP_PARAM_FIELD_REMOTE_ADDRESS ...
#define UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE ...
#define UCP_ERR_HANDLING_MODE_NONE ...
#define UCP_MEM_MAP_PARAM_FIELD_ADDRESS ...
#define UCP_MEM_MAP_PARAM_FIELD_LENGTH ...
#define UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE ...
#define UCS_MEMORY_TYPE_HOST ...
#define UCS_MEMORY_TYPE_CUDA ...
#define UCS_MEMORY_TYPE_ROCM ...

ucs_status_t ucp_init(const ucp_params_t *, const ucp_config_t *, ucp_context_h *);
void ucp_cleanup(ucp_context_h);
void ucp_get_version(unsigned *, unsigned *, unsigned *);
ucs_status_t ucp_worker_create(ucp_context_h, const ucp_worker_params_t *, ucp_worker_h *);
void ucp_worker_destroy(ucp_worker_h);
ucs_status_t ucp_worker_get_address(ucp_worker_h, ucp_address_t **, size_t *);
void ucp_worker_release_address(ucp_worker_h, ucp_address_t *);
unsigned ucp_worker_progress(ucp_worker_h);
ucs_status_t ucp_ep_create(ucp_worker_h, const ucp_ep_params_t *, ucp_ep_h *);
ucs_status_t ucp_mem_map(ucp_context_h, const ucp_mem_map_params_t *, ucp_mem_h *);
ucs_status_t ucp_mem_unmap(ucp_context_h, ucp_mem_h);
ucs_status_t ucp_rkey_pack(ucp_context_h, ucp_mem_h, void **, size_t *);
void ucp_rkey_buffer_release(void *);
ucs_status_t ucp_ep_rkey_unpack(ucp_ep_h, const void *, ucp_rkey_h *);
void ucp_rkey_destroy(ucp_rkey_h);
ucs_status_t ucp_rkey_ptr(ucp_rkey_h, uint64_t, void **);
const char *ucs_status_string(ucs_status_t);
ucs_status_t ucp_config_read(const char *, const char *, ucp_config_t **);
ucs_status_t ucp_config_modify(ucp_config_t *, const char *, const char *);
void ucp_config_release(ucp_config_t *);
ucs_status_t ucp_worker_get_efd(ucp_worker_h, int *);
ucs_status_t ucp_worker_arm(ucp_worker_h);

int hmc_post_batch(ucp_ep_h ep, int is_get, size_t n, const uint64_t *local, const uint64_t *remote, const uint64_t *lengths,
                   ucp_rkey_h rkey, ucp_mem_h memh, size_t *posted);
int hmc_flush_worker(ucp_worker_h worker, double timeout_s);
int hmc_rma_wait(ucp_worker_h worker, ucp_ep_h ep, int is_get, size_t n, const uint64_t *local, const uint64_t *remote,
                 const uint64_t *lengths, ucp_rkey_h rkey, ucp_mem_h memh, double timeout_s);
int hmc_flush_ep(ucp_worker_h worker, ucp_ep_h ep, double timeout_s);
void *hmc_flush_ep_start(ucp_ep_h ep);
int hmc_request_status(void *request);
void hmc_request_free(void *request);
unsigned hmc_progress(ucp_worker_h worker, unsigned rounds);
int hmc_spin(ucp_worker_h worker, void **requests, size_t n, int *wake_fd, double spin_s);
uint64_t hmc_memory_types(ucp_context_h context);
int hmc_ep_close(ucp_worker_h worker, ucp_ep_h ep, double timeout_s);
"""

SOURCE = r"""
#include <ucp/api/ucp.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <time.h>

static double hmc_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int hmc_post_batch(ucp_ep_h ep, int is_get, size_t n, const uint64_t *local, const uint64_t *remote, const uint64_t *lengths,
                   ucp_rkey_h rkey, ucp_mem_h memh, size_t *posted) {
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    if (memh != NULL) {
        param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
        param.memh = memh;
    }
    for (size_t i = 0; i < n; i++) {
        ucs_status_ptr_t request = is_get
            ? ucp_get_nbx(ep, (void *)(uintptr_t)local[i], lengths[i], remote[i], rkey, &param)
            : ucp_put_nbx(ep, (const void *)(uintptr_t)local[i], lengths[i], remote[i], rkey, &param);
        if (UCS_PTR_IS_ERR(request)) {
            *posted = i;
            return UCS_PTR_STATUS(request);
        }
        if (request != NULL)
            ucp_request_free(request);
    }
    *posted = n;
    return UCS_OK;
}

/* Progress until `request` completes or the deadline passes; the request is released either way. A request
 * that timed out still runs: what it reads or writes may land later, until the worker is destroyed. */
static int hmc_wait(ucp_worker_h worker, ucs_status_ptr_t request, double timeout_s) {
    if (request == NULL)
        return UCS_OK;
    if (UCS_PTR_IS_ERR(request))
        return UCS_PTR_STATUS(request);
    double deadline = hmc_now() + timeout_s;
    ucs_status_t status;
    while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS) {
        ucp_worker_progress(worker);
        if (!(hmc_now() <= deadline)) {  /* a NaN deadline ends it too */
            ucp_request_free(request);  /* released when it completes; UCX cancels no RMA, flush or send */
            return UCS_ERR_TIMED_OUT;
        }
    }
    ucp_request_free(request);
    return status;
}

/* A batch of puts or gets, then a flush of their endpoint, waited for on the calling thread (no thread hop: small
 * transfers, and device memory, whose copies end within microseconds). */
int hmc_rma_wait(ucp_worker_h worker, ucp_ep_h ep, int is_get, size_t n, const uint64_t *local, const uint64_t *remote,
                 const uint64_t *lengths, ucp_rkey_h rkey, ucp_mem_h memh, double timeout_s) {
    double deadline = hmc_now() + timeout_s;
    size_t posted;
    int status = hmc_post_batch(ep, is_get, n, local, remote, lengths, rkey, memh, &posted);
    if (status != UCS_OK)
        return status;
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    status = hmc_wait(worker, ucp_ep_flush_nbx(ep, &param), deadline - hmc_now());
    if (status != UCS_OK)
        return status;
    /* A put into a dead process can complete without an error of its own (cma fails the endpoint afterwards,
     * from the worker's progress): one more round and flush makes that failure this call's. */
    ucp_worker_progress(worker);
    return hmc_wait(worker, ucp_ep_flush_nbx(ep, &param), deadline - hmc_now());
}

int hmc_flush_worker(ucp_worker_h worker, double timeout_s) {
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    return hmc_wait(worker, ucp_worker_flush_nbx(worker, &param), timeout_s);
}

int hmc_flush_ep(ucp_worker_h worker, ucp_ep_h ep, double timeout_s) {
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    return hmc_wait(worker, ucp_ep_flush_nbx(ep, &param), timeout_s);
}

/* A flush of `ep` that the caller polls (`hmc_request_status`) and releases (`hmc_request_free`): NULL when
 * everything had completed already, an error pointer when it could not start. */
void *hmc_flush_ep_start(ucp_ep_h ep) {
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    return ucp_ep_flush_nbx(ep, &param);
}

int hmc_request_status(void *request) {
    if (request == NULL)
        return UCS_OK;
    if (UCS_PTR_IS_ERR(request))
        return UCS_PTR_STATUS(request);
    return ucp_request_check_status(request);
}

/* Release a request (one still running completes on its own: UCX cancels no RMA, flush or send). */
void hmc_request_free(void *request) {
    if (request != NULL && !UCS_PTR_IS_ERR(request))
        ucp_request_free(request);
}

/* Progress until a round finds nothing to do, at most `rounds` rounds; the events handled. */
unsigned hmc_progress(ucp_worker_h worker, unsigned rounds) {
    unsigned total = 0, got;
    for (unsigned i = 0; i < rounds && (got = ucp_worker_progress(worker)) != 0; i++)
        total += got;
    return total;
}

/* Progress for up to `spin_s` (the GIL released: Python threads do not fight over it while one waits here), ending
 * early once one of `requests` has ended (its index) or `*wake_fd`'s eventfd has a count (-2); -1 when neither. */
int hmc_spin(ucp_worker_h worker, void **requests, size_t n, int *wake_fd, double spin_s) {
    double until = hmc_now() + spin_s;
    struct pollfd wake = { .fd = *wake_fd, .events = POLLIN };
    unsigned round = 0;
    do {
        ucp_worker_progress(worker);
        for (size_t i = 0; i < n; i++)
            if (requests[i] == NULL || UCS_PTR_IS_ERR(requests[i]) || ucp_request_check_status(requests[i]) != UCS_INPROGRESS)
                return (int)i;
        if ((++round & 63) == 0 && poll(&wake, 1, 0) > 0)
            return -2;
    } while (hmc_now() < until);
    return -1;
}

/* The memory types this context can register (bits of ucs_memory_type_t). */
uint64_t hmc_memory_types(ucp_context_h context) {
    ucp_context_attr_t attr;
    memset(&attr, 0, sizeof(attr));
    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    if (ucp_context_query(context, &attr) != UCS_OK)
        return 0;
    return attr.memory_types;
}

/* Flush and close (UCX refuses a forced close without peer error handling: a close that times out goes on
 * in the background, until the worker is destroyed). */
int hmc_ep_close(ucp_worker_h worker, ucp_ep_h ep, double timeout_s) {
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    return hmc_wait(worker, ucp_ep_close_nbx(ep, &param), timeout_s);
}
"""


def binding() -> Any:
    """`hmc.transport._ucx_c`, declared for cffi against the libucx wheel; setup.py compiles it (`build_binding`)."""
    import cffi
    import libucx

    ucx = Path(libucx.__file__).parent
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        "hmc.transport._ucx_c",
        SOURCE,
        include_dirs=[str(ucx / "include")],
        library_dirs=[str(ucx / "lib")],
        libraries=["ucp", "ucs"],
        extra_compile_args=["-O2"],
    )
    return ffi
