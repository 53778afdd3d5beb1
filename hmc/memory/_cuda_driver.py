"""The CUDA driver as the CUDA backend uses it: result checking, primary contexts, streams, events.

`check` is the backend's one translation boundary: every CUresult other than
CUDA_SUCCESS becomes `hmc.errors.DeviceError` there, named with cuGetErrorName.

Contexts are the devices' primary contexts, the ones the CUDA runtime, PyTorch and
CuPy use, so memory and streams are shared with them. Each is retained on first
use and kept for the life of the process. `Contexts.use()` pushes one for the
length of a call and pops it afterwards, so a caller's current device (for example
`torch.cuda.current_device()`) is never changed behind its back.

Concurrency: `Contexts` is thread-safe. A `CudaStream` or `CudaEvent` may be used
from any thread; operations enqueued on one stream from several threads run in the
order the enqueue calls happened to be made.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator
from typing import Any

from hmc.errors import DeviceError
from hmc.memory._base import Device, Owned, Stream
from hmc.memory._gpu import PeerLinks

try:
    from cuda.bindings import driver
except ImportError:  # cuda-python is not installed: the CUDA backend is absent
    driver = None

__all__ = ["Contexts", "CudaEvent", "CudaRuntime", "CudaStream", "check", "driver", "pointer_ordinal"]


def check(result: tuple[Any, ...]) -> Any:
    """The outputs of a cuda.bindings call: None, one value, or a tuple of them.

    Raises DeviceError when the call's CUresult is not CUDA_SUCCESS.
    """
    status = result[0]
    if status != driver.CUresult.CUDA_SUCCESS:
        name_status, name = driver.cuGetErrorName(status)
        label = name.decode() if name_status == driver.CUresult.CUDA_SUCCESS else f"CUresult {int(status)}"
        raise DeviceError(f"CUDA driver call failed: {label}")
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


@functools.cache
def _libcuda_pointer_attribute() -> Any:
    function = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute
    function.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64)
    function.restype = ctypes.c_int
    return function


def pointer_ordinal(address: int) -> int:
    """The ordinal of the device a device pointer's memory was allocated on (a context must be current).

    Asked of libcuda directly: cuda.bindings 13.x reads CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    back from the wrong field and answers 0 for every device (NVIDIA/cuda-python#2928).
    """
    ordinal = ctypes.c_int(-1)
    attribute = int(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
    check((driver.CUresult(_libcuda_pointer_attribute()(ctypes.byref(ordinal), attribute, address)),))
    return ordinal.value


class _Pushed:
    """`Contexts.use()`'s block: a push on entry, a pop on exit (a class, not a generator: it sits on every copy's path)."""

    __slots__ = ("_context",)

    def __init__(self, context: Any) -> None:
        self._context = context

    def __enter__(self) -> None:
        check(driver.cuCtxPushCurrent(self._context))

    def __exit__(self, *exc: object) -> None:
        check(driver.cuCtxPopCurrent())


class Contexts(PeerLinks):
    """The devices' primary contexts, retained on first use, and the peer links enabled so far."""

    def __init__(self) -> None:
        super().__init__()
        # _context_lock guards _contexts: two threads reaching a device first retain it once.
        self._context_lock = threading.Lock()
        self._contexts: dict[int, Any] = {}

    def context(self, ordinal: int) -> Any:
        """The primary context of device `ordinal` (a CUcontext)."""
        with self._context_lock:
            context = self._contexts.get(ordinal)
            if context is None:
                device = check(driver.cuDeviceGet(ordinal))
                context = check(driver.cuDevicePrimaryCtxRetain(device))
                self._contexts[ordinal] = context
            return context

    def use(self, ordinal: int) -> _Pushed:
        """Make device `ordinal`'s primary context current for the block, then restore the caller's."""
        context = self._contexts.get(ordinal)  # a plain read first: retained contexts never change
        return _Pushed(context if context is not None else self.context(ordinal))

    @contextlib.contextmanager
    def use_any(self) -> Iterator[None]:
        """Keep the caller's current context if it has one, else use device 0's primary context."""
        if int(check(driver.cuCtxGetCurrent())) != 0:
            yield
        else:
            with self.use(0):
                yield

    def _link(self, ordinal: int, peer: int) -> None:
        peer_context = self.context(peer)
        with self.use(ordinal):
            status = driver.cuCtxEnablePeerAccess(peer_context, 0)[0]
        if status != driver.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
            check((status,))


class CudaEvent(Owned):
    """A marker in a stream: poll it with query() or wait with synchronize()."""

    def __init__(self, contexts: Contexts, device: Device) -> None:
        self.device = device
        self._contexts = contexts
        with contexts.use(device.index):
            self._event = check(driver.cuEventCreate(int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)))

    @property
    def handle(self) -> int:
        """The native CUevent handle."""
        return int(self._event)

    def record(self, stream: CudaStream) -> None:
        """Mark the point, in `stream`, after everything enqueued so far."""
        with self._contexts.use(self.device.index):
            check(driver.cuEventRecord(self._event, stream.handle))

    def query(self) -> bool:
        """True once all work before the recorded point has finished."""
        with self._contexts.use(self.device.index):
            status = driver.cuEventQuery(self._event)[0]
        if status == driver.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check((status,))
        return True

    def synchronize(self) -> None:
        """Block until all work before the recorded point has finished."""
        with self._contexts.use(self.device.index):
            check(driver.cuEventSynchronize(self._event))

    def _destroy(self) -> None:
        with self._contexts.use(self.device.index):
            check(driver.cuEventDestroy(self._event))


class CudaStream(Stream, Owned):
    """A non-blocking stream in one device's primary context."""

    def __init__(self, contexts: Contexts, device: Device) -> None:
        self.device = device
        self._contexts = contexts
        with contexts.use(device.index):
            self._stream = check(driver.cuStreamCreate(int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)))

    @property
    def handle(self) -> int:
        """The native CUstream handle."""
        return int(self._stream)

    @property
    def native(self) -> Any:
        """The cuda.bindings CUstream object (driver calls take it without converting an int)."""
        return self._stream

    def synchronize(self) -> None:
        with self._contexts.use(self.device.index):
            check(driver.cuStreamSynchronize(self._stream))

    def query(self) -> bool:
        """True once everything enqueued so far has finished."""
        with self._contexts.use(self.device.index):
            status = driver.cuStreamQuery(self._stream)[0]
        if status == driver.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check((status,))
        return True

    def record_event(self) -> CudaEvent:
        """A new event marking the current end of this stream (close it when done)."""
        event = CudaEvent(self._contexts, self.device)
        event.record(self)
        return event

    def wait_event(self, event: CudaEvent) -> None:
        """Make later work on this stream wait for `event` (which may be on another device's stream)."""
        with self._contexts.use(self.device.index):
            check(driver.cuStreamWaitEvent(self._stream, event.handle, 0))

    def _destroy(self) -> None:
        with self._contexts.use(self.device.index):
            check(driver.cuStreamDestroy(self._stream))


class CudaRuntime:
    """`hmc.memory._gpu.Runtime` on the CUDA driver: device scopes are primary contexts (`Contexts`)."""

    name = "CUDA"

    def __init__(self, contexts: Contexts) -> None:
        self._contexts = contexts
        self.ok = driver.CUresult.CUDA_SUCCESS
        self.not_ready = driver.CUresult.CUDA_ERROR_NOT_READY
        self.memcpy_async = driver.cuMemcpyAsync  # (dst, src, nbytes, stream): the driver's own, no wrapper on the hot path
        self.stream_query = driver.cuStreamQuery
        self.event_query = driver.cuEventQuery
        self._flags = int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self._ids: dict[int, int] = {}
        """Primary context handles by ordinal (retained contexts never change)."""

    @staticmethod
    def check(result: tuple[Any, ...]) -> Any:
        return check(result)

    def use(self, ordinal: int) -> _Pushed:
        return self._contexts.use(ordinal)

    def is_current(self, ordinal: int) -> bool:
        return int(driver.cuCtxGetCurrent()[1]) == self.context_handle(ordinal)

    def c_target(self, ordinal: int) -> int:
        return self.context_handle(ordinal)

    def context_handle(self, ordinal: int) -> int:
        """Device `ordinal`'s primary context as an integer handle (for C code that makes it current itself)."""
        known = self._ids.get(ordinal)
        if known is None:
            known = self._ids[ordinal] = int(self._contexts.context(ordinal))
        return known

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        check(driver.cuStreamWaitEvent(stream, event, 0))

    def event_create(self) -> Any:
        return check(driver.cuEventCreate(self._flags))

    def event_record(self, event: Any, stream: Any) -> None:
        check(driver.cuEventRecord(event, stream))

    def event_destroy(self, event: Any) -> None:
        check(driver.cuEventDestroy(event))

    @staticmethod
    def mapped_pointer(address: int) -> int:
        try:
            return int(check(driver.cuMemHostGetDevicePointer(address, 0)))
        except DeviceError:
            return address

    def register_host(self, address: int, size: int) -> int:
        flags = driver.CU_MEMHOSTREGISTER_PORTABLE | driver.CU_MEMHOSTREGISTER_DEVICEMAP
        with self._contexts.use_any():
            check(driver.cuMemHostRegister(address, size, flags))
            return self.mapped_pointer(address)  # never raises: the registration stands, whoever asked undoes it

    def unregister_host(self, address: int) -> None:
        with self._contexts.use_any():
            check(driver.cuMemHostUnregister(address))

    @staticmethod
    def load_kernel(device: Device, source: str, name: str) -> Any:
        from hmc.memory._cuda_rtc import load_kernel

        return load_kernel(device, source, name)
