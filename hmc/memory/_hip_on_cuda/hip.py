"""hip-python's `hip` module, the subset HMC's HIP backend calls, over the CUDA driver (see the package).

Same names, argument names, enum values and return tuples as hip-python: `(hipError_t, outputs...)`.
Pointers come back as ints and streams, events and handles as cuda.bindings objects (hip-python's
own wrapper types are accepted back by it as these are here). HIP's per-thread current device is a
current primary context, device 0's until `hipSetDevice` says otherwise, as HIP initialises implicitly.
"""

from __future__ import annotations

import ctypes
import enum
import threading
from typing import Any

from hmc.errors import DeviceError
from hmc.memory._cuda_driver import pointer_ordinal

try:
    from cuda.bindings import driver as _cu
except ImportError:  # importable without it (the API check runs where no CUDA is); `_hip_runtime` refuses to use it then
    _cu = None



class hipError_t(enum.IntEnum):
    hipSuccess = 0
    hipErrorInvalidValue = 1
    hipErrorOutOfMemory = 2
    hipErrorNotInitialized = 3
    hipErrorDeinitialized = 4
    hipErrorInvalidConfiguration = 9
    hipErrorInvalidDevicePointer = 17
    hipErrorInsufficientDriver = 35
    hipErrorNoDevice = 100
    hipErrorInvalidDevice = 101
    hipErrorInvalidImage = 200
    hipErrorInvalidContext = 201
    hipErrorMapFailed = 205
    hipErrorAlreadyMapped = 208
    hipErrorPeerAccessUnsupported = 217
    hipErrorInvalidKernelFile = 218
    hipErrorSharedObjectInitFailed = 303
    hipErrorOperatingSystem = 304
    hipErrorInvalidHandle = 400
    hipErrorNotFound = 500
    hipErrorNotReady = 600
    hipErrorIllegalAddress = 700
    hipErrorLaunchOutOfResources = 701
    hipErrorPeerAccessAlreadyEnabled = 704
    hipErrorPeerAccessNotEnabled = 705
    hipErrorContextIsDestroyed = 709
    hipErrorAssert = 710
    hipErrorHostMemoryAlreadyRegistered = 712
    hipErrorHostMemoryNotRegistered = 713
    hipErrorLaunchFailure = 719
    hipErrorNotSupported = 801
    hipErrorUnknown = 999


class hipMemcpyKind(enum.IntEnum):
    hipMemcpyHostToHost = 0
    hipMemcpyHostToDevice = 1
    hipMemcpyDeviceToHost = 2
    hipMemcpyDeviceToDevice = 3
    hipMemcpyDefault = 4


class hipMemoryType(enum.IntEnum):
    hipMemoryTypeUnregistered = 0
    hipMemoryTypeHost = 1
    hipMemoryTypeDevice = 2


class hipMemRangeHandleType(enum.IntEnum):
    hipMemRangeHandleTypeDmaBufFd = 1


hipHostMallocPortable = 1
hipHostMallocMapped = 2
hipHostRegisterPortable = 1
hipHostRegisterMapped = 2
hipStreamNonBlocking = 1
hipEventDisableTiming = 2
hipIpcMemLazyEnablePeerAccess = 1


class _Struct:
    """A C struct of `_SIZE` bytes, as hip-python's struct wrappers present one (address, size, fromObj)."""

    _SIZE = 0

    def __init__(self) -> None:
        self._buffer = (ctypes.c_char * self._SIZE)()

    def as_c_void_p(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(ctypes.addressof(self._buffer))

    def c_sizeof(self) -> int:
        return self._SIZE

    @classmethod
    def fromObj(cls, pyobj: Any) -> Any:
        """The struct from bytes-like `pyobj` (or `pyobj` itself when it is one)."""
        if isinstance(pyobj, cls):
            return pyobj
        struct = cls()
        raw = bytes(memoryview(pyobj).cast("B"))
        if len(raw) != cls._SIZE:
            raise ValueError(f"{cls.__name__} is {cls._SIZE} bytes, not {len(raw)}")
        ctypes.memmove(struct._buffer, raw, cls._SIZE)
        return struct

    def _raw(self) -> bytes:
        return bytes(self._buffer)


class hipUUID_t(_Struct):
    _SIZE = 16


hipUUID = hipUUID_t


class hipIpcMemHandle_st(_Struct):
    _SIZE = 64


hipIpcMemHandle_t = hipIpcMemHandle_st


class hipPointerAttribute_t:
    """What hipPointerGetAttributes fills in."""

    def __init__(self) -> None:
        self.type = hipMemoryType.hipMemoryTypeUnregistered
        self.device = 0
        self.devicePointer = 0
        self.hostPointer = 0


_lock = threading.Lock()
_primary: dict[int, Any] = {}
_started = False


def _status(result: Any) -> hipError_t:
    code = int(result)
    return hipError_t(code) if code in hipError_t._value2member_map_ else hipError_t.hipErrorUnknown


def _start() -> hipError_t:
    """cuInit once (HIP initialises implicitly)."""
    global _started
    if not _started:
        status = _status(_cu.cuInit(0)[0])
        if status is not hipError_t.hipSuccess:
            return status
        _started = True
    return hipError_t.hipSuccess


def _context(ordinal: int) -> Any:
    with _lock:
        context = _primary.get(ordinal)
        if context is None:
            status, device = _cu.cuDeviceGet(ordinal)
            if int(status):
                return None
            status, context = _cu.cuDevicePrimaryCtxRetain(device)
            if int(status):
                return None
            _primary[ordinal] = context
        return context


def _ready() -> hipError_t:
    """Initialised, with a current device on this thread (device 0 unless set)."""
    status = _start()
    if status is not hipError_t.hipSuccess:
        return status
    if int(_cu.cuCtxGetCurrent()[1]) == 0:
        context = _context(0)
        if context is None:
            return hipError_t.hipErrorNoDevice
        return _status(_cu.cuCtxSetCurrent(context)[0])
    return hipError_t.hipSuccess


def _call(result: tuple[Any, ...]) -> tuple[Any, ...]:
    """A cuda.bindings result as hip-python returns it: the status as hipError_t, outputs None on failure."""
    status = _status(result[0])
    if status is not hipError_t.hipSuccess:
        return (status,) + (None,) * (len(result) - 1)
    return (status, *result[1:])


def _then(result: tuple[Any, ...], convert: Any) -> tuple[Any, Any]:
    status, value = _call(result)
    return status, (None if value is None else convert(value))


def hipInit(flags: int) -> tuple[hipError_t]:
    return (_start(),)


def hipGetDeviceCount() -> tuple[hipError_t, Any]:
    status = _start()
    if status is not hipError_t.hipSuccess:
        return status, None
    return _then(_cu.cuDeviceGetCount(), int)


def hipGetDevice() -> tuple[hipError_t, Any]:
    status = _ready()
    if status is not hipError_t.hipSuccess:
        return status, None
    return _then(_cu.cuCtxGetDevice(), int)


def hipSetDevice(deviceId: int) -> tuple[hipError_t]:
    status, count = hipGetDeviceCount()
    if status is not hipError_t.hipSuccess:
        return (status,)
    if not 0 <= deviceId < count:
        return (hipError_t.hipErrorInvalidDevice,)
    context = _context(deviceId)
    if context is None:
        return (hipError_t.hipErrorInvalidDevice,)
    return (_status(_cu.cuCtxSetCurrent(context)[0]),)


def _device(ordinal: int) -> tuple[hipError_t, Any]:
    status = _start()
    if status is not hipError_t.hipSuccess:
        return status, None
    return _call(_cu.cuDeviceGet(ordinal))


def hipDeviceGetName(len: int, device: int) -> tuple[hipError_t, Any]:
    status, handle = _device(device)
    return (status, None) if handle is None else _call(_cu.cuDeviceGetName(len, handle))


def hipDeviceGetPCIBusId(len: int, device: int) -> tuple[hipError_t, Any]:
    status, handle = _device(device)
    return (status, None) if handle is None else _call(_cu.cuDeviceGetPCIBusId(len, handle))


def hipDeviceGetUuid(device: int) -> tuple[hipError_t, Any]:
    status, handle = _device(device)
    if handle is None:
        return status, None
    return _then(_cu.cuDeviceGetUuid(handle), lambda uuid: hipUUID_t.fromObj(bytes(uuid.bytes)))


def hipDeviceTotalMem(device: int) -> tuple[hipError_t, Any]:
    status, handle = _device(device)
    return (status, None) if handle is None else _then(_cu.cuDeviceTotalMem(handle), int)


def hipDeviceCanAccessPeer(deviceId: int, peerDeviceId: int) -> tuple[hipError_t, Any]:
    status, handle = _device(deviceId)
    peer_status, peer = _device(peerDeviceId)
    if handle is None or peer is None:
        return (status if handle is None else peer_status), None
    return _then(_cu.cuDeviceCanAccessPeer(handle, peer), int)


def hipDeviceEnablePeerAccess(peerDeviceId: int, flags: int) -> tuple[hipError_t]:
    status = _ready()
    context = _context(peerDeviceId) if status is hipError_t.hipSuccess else None
    if context is None:
        return (status if status is not hipError_t.hipSuccess else hipError_t.hipErrorInvalidDevice,)
    return (_status(_cu.cuCtxEnablePeerAccess(context, flags)[0]),)


def hipMalloc(size: int) -> tuple[hipError_t, Any]:
    status = _ready()
    if status is not hipError_t.hipSuccess:
        return status, None
    if size == 0:
        return hipError_t.hipSuccess, 0
    return _then(_cu.cuMemAlloc(size), int)


def hipFree(ptr: int) -> tuple[hipError_t]:
    status = _ready()
    if status is not hipError_t.hipSuccess or not ptr:
        return (status,)
    return (_status(_cu.cuMemFree(ptr)[0]),)


def hipHostMalloc(size: int, flags: int) -> tuple[hipError_t, Any]:
    status = _ready()
    if status is not hipError_t.hipSuccess:
        return status, None
    return _then(_cu.cuMemHostAlloc(size, flags & (hipHostMallocPortable | hipHostMallocMapped)), int)


def hipHostFree(ptr: int) -> tuple[hipError_t]:
    status = _ready()
    return (status,) if status is not hipError_t.hipSuccess else (_status(_cu.cuMemFreeHost(ptr)[0]),)


def hipHostRegister(hostPtr: int, sizeBytes: int, flags: int) -> tuple[hipError_t]:
    status = _ready()
    if status is not hipError_t.hipSuccess:
        return (status,)
    return (_status(_cu.cuMemHostRegister(hostPtr, sizeBytes, flags & (hipHostRegisterPortable | hipHostRegisterMapped))[0]),)


def hipHostUnregister(hostPtr: int) -> tuple[hipError_t]:
    status = _ready()
    return (status,) if status is not hipError_t.hipSuccess else (_status(_cu.cuMemHostUnregister(hostPtr)[0]),)


def hipHostGetDevicePointer(hstPtr: int, flags: int) -> tuple[hipError_t, Any]:
    status = _ready()
    return (status, None) if status is not hipError_t.hipSuccess else _then(_cu.cuMemHostGetDevicePointer(hstPtr, flags), int)


def hipMemcpyAsync(dst: int, src: int, sizeBytes: int, kind: hipMemcpyKind, stream: Any) -> tuple[hipError_t]:
    status = _ready()
    if status is not hipError_t.hipSuccess:
        return (status,)
    return (_status(_cu.cuMemcpyAsync(dst, src, sizeBytes, stream or 0)[0]),)


def hipMemsetD8Async(dest: int, value: int, count: int, stream: Any) -> tuple[hipError_t]:
    status = _ready()
    if status is not hipError_t.hipSuccess:
        return (status,)
    return (_status(_cu.cuMemsetD8Async(dest, value, count, stream or 0)[0]),)


def hipStreamCreateWithFlags(flags: int) -> tuple[hipError_t, Any]:
    status = _ready()
    return (status, None) if status is not hipError_t.hipSuccess else _call(_cu.cuStreamCreate(flags))


def hipStreamDestroy(stream: Any) -> tuple[hipError_t]:
    return (_status(_cu.cuStreamDestroy(stream)[0]),)


def hipStreamSynchronize(stream: Any) -> tuple[hipError_t]:
    return (_status(_cu.cuStreamSynchronize(stream or 0)[0]),)


def hipStreamQuery(stream: Any) -> tuple[hipError_t]:
    return (_status(_cu.cuStreamQuery(stream or 0)[0]),)


def hipStreamWaitEvent(stream: Any, event: Any, flags: int) -> tuple[hipError_t]:
    return (_status(_cu.cuStreamWaitEvent(stream or 0, event, flags)[0]),)


def hipEventCreateWithFlags(flags: int) -> tuple[hipError_t, Any]:
    status = _ready()
    return (status, None) if status is not hipError_t.hipSuccess else _call(_cu.cuEventCreate(flags))


def hipEventRecord(event: Any, stream: Any) -> tuple[hipError_t]:
    return (_status(_cu.cuEventRecord(event, stream or 0)[0]),)


def hipEventQuery(event: Any) -> tuple[hipError_t]:
    return (_status(_cu.cuEventQuery(event)[0]),)


def hipEventSynchronize(event: Any) -> tuple[hipError_t]:
    return (_status(_cu.cuEventSynchronize(event)[0]),)


def hipEventDestroy(event: Any) -> tuple[hipError_t]:
    return (_status(_cu.cuEventDestroy(event)[0]),)


def hipIpcGetMemHandle(devPtr: int) -> tuple[hipError_t, Any]:
    status = _ready()
    if status is not hipError_t.hipSuccess:
        return status, None
    return _then(_cu.cuIpcGetMemHandle(devPtr), lambda handle: hipIpcMemHandle_t.fromObj(bytes(handle.reserved)))


def hipIpcOpenMemHandle(handle: Any, flags: int) -> tuple[hipError_t, Any]:
    status = _ready()
    if status is not hipError_t.hipSuccess:
        return status, None
    native = _cu.CUipcMemHandle()
    native.reserved = hipIpcMemHandle_t.fromObj(handle)._raw()
    return _then(_cu.cuIpcOpenMemHandle(native, flags), int)


def hipIpcCloseMemHandle(devPtr: int) -> tuple[hipError_t]:
    status = _ready()
    return (status,) if status is not hipError_t.hipSuccess else (_status(_cu.cuIpcCloseMemHandle(devPtr)[0]),)


def hipMemGetAddressRange(dptr: int) -> tuple[hipError_t, Any, Any]:
    status = _ready()
    if status is not hipError_t.hipSuccess:
        return status, None, None
    status, base, size = _call(_cu.cuMemGetAddressRange(dptr))
    return (status, None, None) if base is None else (status, int(base), int(size))


def hipMemGetHandleForAddressRange(handle: Any, dptr: int, size: int, handleType: hipMemRangeHandleType, flags: int) -> tuple[hipError_t]:
    """A dma-buf fd for the range, written where `handle` (a ctypes int, or its address) points."""
    status = _ready()
    if status is not hipError_t.hipSuccess:
        return (status,)
    kind = _cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    status, fd = _call(_cu.cuMemGetHandleForAddressRange(dptr, size, kind, flags))
    if fd is not None:
        target = handle if isinstance(handle, int) else ctypes.addressof(handle)
        ctypes.c_int.from_address(target).value = int(fd)
    return (status,)


def hipModuleLoadData(image: Any) -> tuple[hipError_t, Any]:
    status = _ready()
    return (status, None) if status is not hipError_t.hipSuccess else _call(_cu.cuModuleLoadData(image))


def hipModuleGetFunction(module: Any, kname: bytes) -> tuple[hipError_t, Any]:
    return _call(_cu.cuModuleGetFunction(module, kname))


def hipModuleLaunchKernel(
    f: Any, gridDimX: int, gridDimY: int, gridDimZ: int, blockDimX: int, blockDimY: int, blockDimZ: int, sharedMemBytes: int,
    stream: Any, kernelParams: Any, extra: Any,
) -> tuple[hipError_t]:
    result = _cu.cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, stream or 0, kernelParams, extra or 0)
    return (_status(result[0]),)


def hipModuleUnload(module: Any) -> tuple[hipError_t]:
    return (_status(_cu.cuModuleUnload(module)[0]),)


def hipPointerGetAttributes(attributes: hipPointerAttribute_t, ptr: int) -> tuple[hipError_t]:
    """Memory type, device and both addresses of `ptr`; an address CUDA does not know is hipErrorInvalidValue."""
    status = _ready()
    if status is not hipError_t.hipSuccess:
        return (status,)
    status, memory_type = _call(_cu.cuPointerGetAttribute(_cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr))
    if status is not hipError_t.hipSuccess:
        return (status,)
    host = int(memory_type) == int(_cu.CUmemorytype.CU_MEMORYTYPE_HOST)
    if host:  # page-locked host memory: the device current here
        status, ordinal = hipGetDevice()
    else:
        try:
            status, ordinal = hipError_t.hipSuccess, pointer_ordinal(ptr)
        except DeviceError:
            status = hipError_t.hipErrorInvalidValue
    if status is not hipError_t.hipSuccess:
        return (status,)
    attributes.type = hipMemoryType.hipMemoryTypeHost if host else hipMemoryType.hipMemoryTypeDevice
    attributes.device = ordinal
    attributes.devicePointer = ptr
    attributes.hostPointer = ptr if host else 0
    return (hipError_t.hipSuccess,)


def hipGetErrorName(hip_error: Any) -> tuple[hipError_t, bytes]:
    return hipError_t.hipSuccess, _status(hip_error).name.encode()
