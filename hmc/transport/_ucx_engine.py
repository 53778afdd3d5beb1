"""UCP for the `ucx` path: one context and worker, memory mapped once, endpoints from worker addresses,
batches of ranges posted as puts or gets below Python, completion by flush.

`load()` finds the binding (`hmc.transport._ucx_c`, built at install by `_ucx_build`) after the `libucx`
wheel's libraries (the binding has no rpath: `libucx.load_library()` loads them by soname), or says why it
cannot: UCX not installed, the binding not built. UCX statuses become `hmc.errors` (`check`).

Endpoints are made with UCX's peer error handling off: with it on, UCX refuses shared memory and cma
(measured: "no peer failure handler"), and HMC finds dead peers itself.

Lifetime: a `Context` owns its registrations (mappings), a `Worker` what is made from it (endpoints, remote
keys, inboxes): each refuses use once it or its parent is closed (ClosedResourceError), and `close()` releases
them first. Workers of one context are closed before it. UCX
cancels no put, get, flush or send: after a TimeoutError those go on, so memory they touch must stay until
the worker is closed (destroying it is what ends them).

Concurrency: a `Worker` is single-threaded (UCS_THREAD_MODE_SINGLE): one thread drives it and everything
made from it; every wait in the binding progresses it up to a deadline. A `Context` is made for workers on
several threads (`mt_workers_shared`): registering memory is safe from any thread.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import abc
from typing import Any, TypeVar

import numpy as np

from hmc.errors import ArgumentError, BrokenResourceError, ClosedResourceError, HMCError, TimeoutError, UnavailableError, UnsupportedError
from hmc.transport._ranges import check_timeout

__all__ = ["Context", "Endpoint", "Mapping", "RemoteKey", "Request", "Worker", "check", "load", "tuning", "version"]



_TUNING = {"CUDA_IPC_ENABLE_GET_ZCOPY": "y", "ADAPTIVE_PROGRESS": "n", "MAX_RMA_RAILS": "2"}
"""UCX settings of HMC's contexts, each unless the environment sets it (`UCX_<name>`). Gets from another process's GPU
memory through its IPC mapping, which UCX leaves off by default, serving gets through host memory at under 1 GB/s
instead (one H100: 0.57 GB/s; NIXL 0.47). Every interface polled by progress: with UCX's adaptive progress an
owner's interface, which no endpoint of its own uses, is left to UCX's async thread, woken by every incoming put to
hand it back (2-core VM, UCX over tcp: 4 KiB put + flush p50 51-57 -> 28-30 us, 1 MiB 546-826 -> 434-455 us). A
put or get split over two devices where two reach the peer (UCX's default is one; NIXL's UCX backend sets two): two
NICs of a node, or on the 2-core VM lo and eth0 (UCX over tcp, 1 MiB put + flush 430 -> 180 us, alternated)."""

_SOCKET_TUNING = {"MIN_RMA_CHUNK_SIZE": "64K"}
"""Also on contexts that may move bytes through kernel sockets (not the `rdma` path's, nor a ucx path's restricted to
verbs or shared memory: verbs NICs keep UCX's own split): a put or get is split over two rails only from 128 KiB,
not from 16 KiB (UCX's 8K chunks). Over tcp each piece is a message of its own that both ends' threads handle; the
KV patterns' ranges are 16 and 64 KiB (2-core VM, UCX over tcp, alternated twice: 16384 x 16 KiB 1.23-1.26 ->
1.89-2.01 GB/s, 4096 x 64 KiB 2.68-2.78 -> 3.05-3.09, 1 MiB and 256 MiB unchanged)."""


def tuning(environ: abc.Mapping[str, str], *, sockets: bool = True) -> dict[str, str]:
    """The settings HMC makes on a context (`_TUNING`, and `_SOCKET_TUNING` where `sockets`: UCX may use kernel
    sockets on it): those the environment leaves alone (no `UCX_<name>`)."""
    settings = _TUNING | _SOCKET_TUNING if sockets else _TUNING
    return {name: value for name, value in settings.items() if f"UCX_{name}" not in environ}


_LIBRARIES = ("libucm.so.0", "libucs.so.0", "libuct.so.0", "libucp.so.0")
"""A UCX installation's libraries, in the order they depend on each other."""


_loaded: list[tuple[Any, Any, str]] = []
"""The binding once loaded: (ffi, lib, the UCX directory it runs on ("": the wheel))."""
_load_lock = threading.Lock()


def load(library: str = "") -> tuple[Any, Any]:
    """(ffi, lib) of the UCP binding; UnsupportedError saying why UCX cannot be used in this process.

    `library`: the directory of a UCX installation to use instead of the libucx wheel (a verbs-enabled system
    UCX, e.g. /usr/lib/x86_64-linux-gnu); its libraries are loaded by path before the binding, which finds
    them by soname. One process has one UCX: asking for another after the first load is refused."""
    with _load_lock:
        if not _loaded:
            _loaded.append(_load(library))
        ffi, lib, used = _loaded[0]
    if used != library:
        raise UnsupportedError(f"this process already uses the UCX of {used or 'the libucx wheel'}; it cannot switch to {library or 'the wheel'}")
    return ffi, lib


_LOG_FILE = "UCX_LOG_FILE"
"""Where UCX writes its log: stdout unless set, which would mix it into what the CLI prints there (`--json`); HMC
sets it to stderr where the user has not, before UCX reads its settings (when its libraries load)."""


def _load(library: str) -> tuple[Any, Any, str]:
    os.environ.setdefault(_LOG_FILE, "stderr")
    if library:
        for name in _LIBRARIES:
            try:
                ctypes.CDLL(os.path.join(library, name), mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                raise UnsupportedError(f"the UCX library {name} does not load from {library}: {exc}") from exc
    else:
        try:
            import libucx
        except ImportError:
            raise UnsupportedError("UCX is not installed (pip install 'hmc[ucx]': the libucx-cu13 wheel)") from None
        try:
            libucx.load_library()
        except OSError as exc:
            raise UnsupportedError(f"the UCX libraries of the libucx wheel do not load: {exc}") from exc
    try:
        from hmc.transport import _ucx_c  # type: ignore[attr-defined]
    except ImportError as exc:
        raise UnsupportedError(f"the UCX binding was not built when HMC was installed (it needs cffi, the libucx wheel and a C compiler): {exc}") from exc
    return _ucx_c.ffi, _ucx_c.lib, library


def version() -> str:
    """The version of the UCX the binding runs on (loaded)."""
    ffi, lib, _ = _loaded[0]
    parts = [ffi.new("unsigned *") for _ in range(3)]
    lib.ucp_get_version(*parts)
    return ".".join(str(part[0]) for part in parts)


def check(status: int, what: str) -> None:
    """Raise the `hmc.errors` error for a UCX status (nothing for UCS_OK); the binding is loaded."""
    ffi, lib, _ = _loaded[0]
    if status == lib.UCS_OK:
        return
    text = ffi.string(lib.ucs_status_string(status)).decode(errors="replace")
    message = f"{what}: UCX says {text} ({status})"
    if status == lib.UCS_ERR_TIMED_OUT:
        raise TimeoutError(message)
    if status == lib.UCS_ERR_UNREACHABLE:
        raise UnavailableError(message)
    if status in (lib.UCS_ERR_CANCELED, lib.UCS_ERR_CONNECTION_RESET, lib.UCS_ERR_ENDPOINT_TIMEOUT, lib.UCS_ERR_IO_ERROR, lib.UCS_ERR_NOT_CONNECTED):
        raise BrokenResourceError(message)  # the peer or the link to it failed (cma to a dead process: an I/O error)
    raise HMCError(message)


class _Parent:
    """What UCX objects are made from (a context or a worker): it releases them, in reverse order, first."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._owned: list[_Owned] = []
        self._closed = False
        self._lock = threading.Lock()  # guards _owned: a shared context is used from several threads

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError(f"the UCX {self._what} is closed")

    def _own(self, thing: _O) -> _O:
        with self._lock:
            self._owned.append(thing)
        return thing

    def _disown(self, thing: _Owned) -> None:
        """`thing` was released on its own: not kept until this closes."""
        with self._lock:
            try:
                self._owned.remove(thing)
            except ValueError:  # released by `_release_owned`, which took the list
                pass

    def _release_owned(self) -> None:
        with self._lock:
            owned, self._owned = self._owned, []
        for thing in reversed(owned):
            thing.release()


class Context(_Parent):
    """A UCP context: the transports, the memory registrations and their keys; shared by its workers (each used
    by one thread), so its own calls may come from any thread."""

    def __init__(self, *, wakeup: bool = False, transports: str = "", library: str = "", sockets: bool = True) -> None:
        """`wakeup`: its workers can be slept on (`fd`, `arm`); UCX then uses only transports that signal events.
        `transports`: UCX's transport list (UCX_TLS syntax; empty: UCX_TLS or UCX's choice). `library`: as for
        `load`. `sockets`: UCX may move its bytes through kernel sockets (`tuning`)."""
        super().__init__("context")
        ffi, lib = self._ffi, self._lib = load(library)
        params = ffi.new("ucp_params_t *")
        params.field_mask = lib.UCP_PARAM_FIELD_FEATURES | lib.UCP_PARAM_FIELD_MT_WORKERS_SHARED
        params.features = lib.UCP_FEATURE_RMA | (lib.UCP_FEATURE_WAKEUP if wakeup else 0)
        params.mt_workers_shared = 1
        config = ffi.new("ucp_config_t **")
        check(lib.ucp_config_read(ffi.NULL, ffi.NULL, config), "ucp_config_read")
        context = ffi.new("ucp_context_h *")
        try:
            if transports:
                check(lib.ucp_config_modify(config[0], b"TLS", transports.encode()), f"UCX transports {transports!r}")
            for name, value in tuning(os.environ, sockets=sockets).items():
                lib.ucp_config_modify(config[0], name.encode(), value.encode())  # refused where the module is absent: fine
            check(lib.ucp_init(params, config[0], context), "ucp_init")
        finally:
            lib.ucp_config_release(config[0])
        self._context = context[0]

    def memory_kinds(self) -> frozenset[str]:
        """The memory this context can register: "host", and "cuda" or "rocm" where UCX found their transports."""
        self._check_open()
        mask, lib = int(self._lib.hmc_memory_types(self._context)), self._lib
        named = {"host": lib.UCS_MEMORY_TYPE_HOST, "cuda": lib.UCS_MEMORY_TYPE_CUDA, "rocm": lib.UCS_MEMORY_TYPE_ROCM}
        return frozenset(name for name, bit in named.items() if mask >> bit & 1)

    def map(self, address: int, length: int, memory: str = "host") -> Mapping:
        """Register `length` bytes at `address` (host, or "cuda"/"rocm" device memory) for RMA."""
        self._check_open()
        ffi, lib = self._ffi, self._lib
        kinds = {"host": lib.UCS_MEMORY_TYPE_HOST, "cuda": lib.UCS_MEMORY_TYPE_CUDA, "rocm": lib.UCS_MEMORY_TYPE_ROCM}
        if memory not in kinds:
            raise ArgumentError(f"unknown memory kind {memory!r}; known: {', '.join(kinds)}")
        if address <= 0 or length <= 0:
            raise ArgumentError(f"cannot map {length} bytes at {address:#x}")
        params = ffi.new("ucp_mem_map_params_t *")
        params.field_mask = lib.UCP_MEM_MAP_PARAM_FIELD_ADDRESS | lib.UCP_MEM_MAP_PARAM_FIELD_LENGTH | lib.UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE
        params.address, params.length, params.memory_type = ffi.cast("void *", address), length, kinds[memory]
        handle = ffi.new("ucp_mem_h *")
        check(lib.ucp_mem_map(self._context, params, handle), f"ucp_mem_map of {length} bytes")
        packed, size = ffi.new("void **"), ffi.new("size_t *")
        try:
            check(lib.ucp_rkey_pack(self._context, handle[0], packed, size), "ucp_rkey_pack")
        except HMCError:
            lib.ucp_mem_unmap(self._context, handle[0])
            raise
        rkey = bytes(ffi.buffer(packed[0], size[0]))
        lib.ucp_rkey_buffer_release(packed[0])
        return self._own(Mapping(self, handle[0], address, length, rkey))

    def close(self) -> None:
        """Release its registrations, then the context (its workers are closed first); idempotent."""
        if self._closed:
            return
        self._release_owned()
        self._closed = True
        self._lib.ucp_cleanup(self._context)


class Worker(_Parent):
    """A UCP worker (on its own context unless given one): RMA."""

    def __init__(self, context: Context | None = None, *, serialized: bool = False, wakeup: bool = False, transports: str = "", library: str = "") -> None:
        """`context`: the context to make it on (shared with other workers); None: a context of its own, made
        with `wakeup`, `transports` and `library`, closed with the worker. `serialized`: used by several threads,
        one at a time (the caller serializes); else by one thread only."""
        super().__init__("worker")
        self._own_context = context is None
        self.context = context if context is not None else Context(wakeup=wakeup, transports=transports, library=library)
        self.context._check_open()
        ffi, lib = self._ffi, self._lib = self.context._ffi, self.context._lib
        worker_params = ffi.new("ucp_worker_params_t *")
        worker_params.field_mask = lib.UCP_WORKER_PARAM_FIELD_THREAD_MODE
        worker_params.thread_mode = lib.UCS_THREAD_MODE_SERIALIZED if serialized else lib.UCS_THREAD_MODE_SINGLE
        worker = ffi.new("ucp_worker_h *")
        try:
            check(lib.ucp_worker_create(self.context._context, worker_params, worker), "ucp_worker_create")
        except HMCError:
            if self._own_context:
                self.context.close()
            raise
        self._worker = worker[0]
        self._close_by = float("inf")
        """When `close` gives up flushing endpoints (they then close without waiting)."""
        address, length = ffi.new("ucp_address_t **"), ffi.new("size_t *")
        check(lib.ucp_worker_get_address(self._worker, address, length), "ucp_worker_get_address")
        self.address = bytes(ffi.buffer(address[0], length[0]))
        """What a peer needs to reach this worker (`connect`)."""
        lib.ucp_worker_release_address(self._worker, address[0])

    def progress(self, rounds: int = 1) -> int:
        """Up to `rounds` rounds of progress, ending at the first that finds nothing; the events handled (the
        target of a put over tcp or shared memory must progress)."""
        self._check_open()
        return int(self._lib.hmc_progress(self._worker, rounds))

    def spin(self, requests: list[Request], wake_fd: int, spin_s: float) -> None:
        """Progress for up to `spin_s` with the GIL released, returning early once one of `requests` ended or
        `wake_fd` (an eventfd) is readable."""
        self._check_open()
        ffi = self._ffi
        handles = ffi.new("void *[]", [r._handle if r._handle is not None else ffi.NULL for r in requests] or [ffi.NULL])
        self._lib.hmc_spin(self._worker, handles, len(requests), ffi.new("int *", wake_fd), spin_s)

    def fd(self) -> int:
        """The file descriptor that becomes readable when an armed worker has events (a `wakeup` worker)."""
        self._check_open()
        fd = self._ffi.new("int *")
        check(self._lib.ucp_worker_get_efd(self._worker, fd), "ucp_worker_get_efd")
        return int(fd[0])

    def arm(self) -> bool:
        """Arm the worker's `fd`: True when it may be slept on, False when events are pending (progress first)."""
        self._check_open()
        status = self._lib.ucp_worker_arm(self._worker)
        if status == self._lib.UCS_ERR_BUSY:
            return False
        check(status, "ucp_worker_arm")
        return True

    def map(self, address: int, length: int, memory: str = "host") -> Mapping:
        """`Context.map` on this worker's context."""
        self._check_open()
        return self.context.map(address, length, memory)

    def connect(self, address: bytes) -> Endpoint:
        """An endpoint to the worker whose `address` a peer handed over (peer error handling off)."""
        self._check_open()
        ffi, lib = self._ffi, self._lib
        if not isinstance(address, bytes) or not address:
            raise ArgumentError("a UCX worker address is non-empty bytes")
        keep = ffi.from_buffer(address)
        params = ffi.new("ucp_ep_params_t *")
        params.field_mask = lib.UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | lib.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
        params.address = ffi.cast("const ucp_address_t *", keep)
        params.err_mode = lib.UCP_ERR_HANDLING_MODE_NONE
        endpoint = ffi.new("ucp_ep_h *")
        check(lib.ucp_ep_create(self._worker, params, endpoint), "ucp_ep_create")
        return self._own(Endpoint(self, endpoint[0]))

    def flush(self, timeout_s: float) -> None:
        """Every operation posted on this worker has completed (TimeoutError at the deadline)."""
        self._check_open()
        check(self._lib.hmc_flush_worker(self._worker, check_timeout(timeout_s, "timeout_s")), "flushing the UCX worker")

    def close(self, deadline: float = float("inf")) -> None:
        """Release what was made from the worker (keys, endpoints: each endpoint's flush given up at `deadline`, a
        `time.monotonic()` time, at the latest), then destroy it (ending what UCX still runs), and its own context;
        idempotent."""
        if self._closed:
            return
        self._close_by = deadline
        self._release_owned()
        self._closed = True
        self._lib.ucp_worker_destroy(self._worker)
        if self._own_context:
            self.context.close()


class _Owned:
    """Something made from a context or worker: refuses use once it or its parent is closed; released once."""

    def __init__(self, parent: Any, what: str) -> None:
        self._parent, self._what = parent, what
        self._released = False

    def _check_open(self) -> None:
        if self._released or self._parent._closed:
            raise ClosedResourceError(f"the UCX {self._what} is closed")

    def release(self) -> None:
        if not self._released and not self._parent._closed:
            self._released = True
            self._release()
            self._parent._disown(self)

    def _release(self) -> None:
        raise NotImplementedError


_O = TypeVar("_O", bound=_Owned)


class Mapping(_Owned):
    """Memory registered with a worker: its handle and the packed remote key peers unpack."""

    def __init__(self, context: Context, handle: Any, address: int, length: int, rkey: bytes) -> None:
        super().__init__(context, "mapping")
        self.handle, self.address, self.length, self.rkey = handle, address, length, rkey
        self.users = 0
        """Transfers through it that may still run (the path counts them under its lock; one that UCX may still
        run for good is never uncounted: the mapping then stays until the context closes)."""

    def unmap(self) -> None:
        self.release()

    def _release(self) -> None:
        self._parent._lib.ucp_mem_unmap(self._parent._context, self.handle)


class RemoteKey(_Owned):
    """A peer's packed key, unpacked for one endpoint."""

    def __init__(self, worker: Worker, handle: Any) -> None:
        super().__init__(worker, "remote key")
        self._worker = worker
        self.handle = handle

    def pointer(self, address: int) -> int | None:
        """Where the peer's `address` is mapped into this process, when a transport of this key maps it (`ucp_rkey_ptr`:
        cuda_ipc, between GPUs of one host; the GPU to map it on must be current); None when none does."""
        self._check_open()
        ffi, lib = self._worker._ffi, self._worker._lib
        out = ffi.new("void **")
        if lib.ucp_rkey_ptr(self.handle, address, out) != lib.UCS_OK:
            return None
        return int(ffi.cast("uintptr_t", out[0])) or None

    def destroy(self) -> None:
        self.release()

    def _release(self) -> None:
        self._worker._lib.ucp_rkey_destroy(self.handle)


class Endpoint(_Owned):
    """A connection to one peer worker."""

    def __init__(self, worker: Worker, handle: Any) -> None:
        super().__init__(worker, "endpoint")
        self._worker = worker
        self._handle = handle
        self._close_timeout_s = 1.0

    def unpack(self, rkey: bytes) -> RemoteKey:
        self._check_open()
        worker = self._worker
        if not isinstance(rkey, bytes) or not rkey:
            raise ArgumentError("a packed UCX remote key is non-empty bytes")
        handle = worker._ffi.new("ucp_rkey_h *")
        check(worker._lib.ucp_ep_rkey_unpack(self._handle, rkey, handle), "ucp_ep_rkey_unpack")
        return worker._own(RemoteKey(worker, handle[0]))

    def post(self, op: str, local: Mapping, local_addresses: np.ndarray, remote_addresses: np.ndarray, lengths: np.ndarray, rkey: RemoteKey) -> None:
        """Post every range as one put ("write") or get ("read") in one call; completion comes with `flush`.

        The caller has checked the ranges against both registrations (nothing here bounds them)."""
        self._check_open()
        local._check_open()
        rkey._check_open()
        ffi, lib = self._worker._ffi, self._worker._lib
        if op not in ("write", "read"):
            raise ArgumentError(f"op must be 'write' or 'read', got {op!r}")
        arrays = [np.ascontiguousarray(a, dtype=np.uint64) for a in (local_addresses, remote_addresses, lengths)]
        count = len(arrays[0])
        if any(len(a) != count for a in arrays):
            raise ArgumentError("local addresses, remote addresses and lengths must have one entry per range")
        posted = ffi.new("size_t *")
        pointers = [ffi.cast("const uint64_t *", a.ctypes.data) for a in arrays]
        status = lib.hmc_post_batch(self._handle, 1 if op == "read" else 0, count, *pointers, rkey.handle, local.handle, posted)
        check(status, f"posting range {posted[0]} of {count}")

    def flush(self, timeout_s: float) -> None:
        """Every operation posted on this endpoint has completed (TimeoutError at the deadline)."""
        self._check_open()
        timeout_s = check_timeout(timeout_s, "timeout_s")
        check(self._worker._lib.hmc_flush_ep(self._worker._worker, self._handle, timeout_s), "flushing the UCX endpoint")

    def rma(self, op: str, local: Mapping, local_addresses: Any, remote_addresses: Any, lengths: Any, rkey: RemoteKey, timeout_s: float) -> None:
        """Puts ("write") or gets ("read") of every range, and a flush, waited for on this thread (TimeoutError at the
        deadline, the operations then still in flight). Ranges as ints (one) or arrays; the caller checked them
        against both registrations."""
        self._check_open()
        local._check_open()
        rkey._check_open()
        ffi, lib = self._worker._ffi, self._worker._lib
        if isinstance(lengths, int):
            count, pointers = 1, [ffi.new("uint64_t *", v) for v in (local_addresses, remote_addresses, lengths)]
        else:
            arrays = [np.ascontiguousarray(a, dtype=np.uint64) for a in (local_addresses, remote_addresses, lengths)]
            count, pointers = len(arrays[0]), [ffi.cast("const uint64_t *", a.ctypes.data) for a in arrays]
        status = lib.hmc_rma_wait(self._worker._worker, self._handle, op == "read", count, *pointers, rkey.handle, local.handle, timeout_s)
        check(status, f"{op} of {count} ranges")

    def flush_start(self) -> Request:
        """A flush of every operation posted so far on this endpoint, polled with `Request.done`."""
        self._check_open()
        return Request(self._worker, self._worker._lib.hmc_flush_ep_start(self._handle), "flushing the UCX endpoint")

    def close(self, timeout_s: float = 1.0) -> None:
        """Flush and close within `timeout_s` (after which it goes on in the background); idempotent."""
        self._close_timeout_s = check_timeout(timeout_s, "timeout_s")
        self.release()

    def _release(self) -> None:
        worker = self._worker
        timeout_s = min(self._close_timeout_s, max(1e-6, worker._close_by - time.monotonic()))  # its worker's close is bounded
        worker._lib.hmc_ep_close(worker._worker, self._handle, timeout_s)


class Request:
    """An operation UCX runs in the background (a flush): poll `done`, then `release`."""

    def __init__(self, worker: Worker, handle: Any, what: str) -> None:
        self._worker, self._handle, self._what = worker, handle, what

    def done(self) -> bool:
        """True once it completed; the `hmc.errors` error if it failed (the worker must progress meanwhile)."""
        self._worker._check_open()
        status = self._worker._lib.hmc_request_status(self._handle)
        if status == self._worker._lib.UCS_INPROGRESS:
            return False
        check(status, self._what)
        return True

    def release(self) -> None:
        """Let UCX free it (at once if it completed, else when it does); idempotent."""
        if self._handle is not None and not self._worker._closed:
            self._worker._lib.hmc_request_free(self._handle)
        self._handle = None
