"""HIP as the HIP backend uses it: the runtime module, result checking, current-device scopes, streams, events.

The runtime is hip-python's `hip` and `hiprtc` modules (ROCm 6.x and 7.x; `pip install 'hmc[hip]'`), or, in a process
switched to it (`HMC_HIP_ON_CUDA=1`, see `hmc.memory._hip_on_cuda`), the HIP-on-CUDA runtime, which has
the same API over the CUDA driver. `check` is the backend's one translation boundary: every hipError_t
other than hipSuccess becomes `hmc.errors.DeviceError`, named with hipGetErrorName.

HIP's current device belongs to the calling thread. `Devices.use()` makes a device current for the
length of a call and gives the caller's back afterwards, so a caller's current device (for example
`torch.cuda.current_device()` under ROCm) is never changed behind its back.

Concurrency: `Devices` is thread-safe. A `HipStream` or `HipEvent` may be used from any thread.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from hmc.errors import DeviceError
from hmc.memory._base import Device, Owned, Stream
from hmc.memory._gpu import PeerLinks, argument_pointers
from hmc.memory._hip_on_cuda import SWITCH, enabled, library_path

__all__ = ["ON_CUDA", "Devices", "HipEvent", "HipRuntime", "HipStream", "check", "hip", "missing"]

_log = logging.getLogger(__name__)

ON_CUDA = enabled()
"""Whether this process runs its HIP backend on the HIP-on-CUDA runtime (NVIDIA hardware)."""
_ROCM_LIBRARIES = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6")
"""Where ROCm's HIP runtime is found (hip-python has loaded one of them already: the unversioned name needs ROCm's
development files)."""

try:
    if ON_CUDA:
        importlib.import_module("cuda.bindings.driver")  # what the HIP-on-CUDA runtime runs on
        from hmc.memory._hip_on_cuda import hip, hiprtc
    else:
        from hip import hip, hiprtc
except ImportError as exc:  # hip-python (or, switched, cuda-python) is not installed: the HIP backend is absent
    hip = hiprtc = None
    missing = f"{SWITCH}=1 but cuda-python is not installed ({exc})" if ON_CUDA else "hip-python is not installed (pip install 'hmc[hip]')"
else:
    missing = ""


def check(result: tuple[Any, ...]) -> Any:
    """The outputs of a hip call: None, one value, or a tuple of them; DeviceError unless it returned hipSuccess."""
    status = result[0]
    if status != hip.hipError_t.hipSuccess:
        raise DeviceError(f"HIP call failed: {error_name(status)}")
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def error_name(status: Any) -> str:
    name = hip.hipGetErrorName(status)
    raw = name[1] if isinstance(name, tuple) else name
    return bytes(raw).split(b"\0", 1)[0].decode() if raw else f"hipError_t {int(status)}"


class _Current:
    """`Devices.use()`'s block: the device made current on entry, the caller's restored on exit."""

    __slots__ = ("_ordinal", "_previous")

    def __init__(self, ordinal: int) -> None:
        self._ordinal = ordinal
        self._previous = -1

    def __enter__(self) -> None:
        previous = int(check(hip.hipGetDevice()))
        if previous != self._ordinal:
            check(hip.hipSetDevice(self._ordinal))
            self._previous = previous

    def __exit__(self, *exc: object) -> None:
        if self._previous >= 0:
            check(hip.hipSetDevice(self._previous))
            self._previous = -1


class Devices(PeerLinks):
    """Current-device scopes and the peer links enabled so far."""

    @staticmethod
    def use(ordinal: int) -> _Current:
        """Make device `ordinal` current for the block, then restore the caller's."""
        return _Current(ordinal)

    def _link(self, ordinal: int, peer: int) -> None:
        with self.use(ordinal):
            status = hip.hipDeviceEnablePeerAccess(peer, 0)[0]
        if status != hip.hipError_t.hipErrorPeerAccessAlreadyEnabled:
            check((status,))


class HipEvent(Owned):
    """A marker in a stream: poll it with query() or wait with synchronize()."""

    def __init__(self, devices: Devices, device: Device) -> None:
        self.device = device
        self._devices = devices
        with devices.use(device.index):
            self._event = check(hip.hipEventCreateWithFlags(hip.hipEventDisableTiming))

    @property
    def native(self) -> Any:
        return self._event

    def record(self, stream: HipStream) -> None:
        """Mark the point, in `stream`, after everything enqueued so far."""
        with self._devices.use(self.device.index):
            check(hip.hipEventRecord(self._event, stream.native))

    def query(self) -> bool:
        """True once all work before the recorded point has finished."""
        status = hip.hipEventQuery(self._event)[0]
        if status == hip.hipError_t.hipErrorNotReady:
            return False
        check((status,))
        return True

    def synchronize(self) -> None:
        check(hip.hipEventSynchronize(self._event))

    def _destroy(self) -> None:
        check(hip.hipEventDestroy(self._event))


class HipStream(Stream, Owned):
    """A non-blocking stream on one device."""

    def __init__(self, devices: Devices, device: Device) -> None:
        self.device = device
        self._devices = devices
        with devices.use(device.index):
            self._stream = check(hip.hipStreamCreateWithFlags(hip.hipStreamNonBlocking))

    @property
    def handle(self) -> int:
        """The native hipStream_t, as an int."""
        return int(self._stream)

    @property
    def native(self) -> Any:
        """The runtime's stream object (hip calls take it as is)."""
        return self._stream

    def synchronize(self) -> None:
        check(hip.hipStreamSynchronize(self._stream))

    def query(self) -> bool:
        """True once everything enqueued so far has finished."""
        status = hip.hipStreamQuery(self._stream)[0]
        if status == hip.hipError_t.hipErrorNotReady:
            return False
        check((status,))
        return True

    def record_event(self) -> HipEvent:
        """A new event marking the current end of this stream (close it when done)."""
        event = HipEvent(self._devices, self.device)
        event.record(self)
        return event

    def wait_event(self, event: HipEvent) -> None:
        """Make later work on this stream wait for `event`."""
        check(hip.hipStreamWaitEvent(self._stream, event.native, 0))

    def _destroy(self) -> None:
        check(hip.hipStreamDestroy(self._stream))


class HipRuntime:
    """`hmc.memory._gpu.Runtime` on the HIP runtime: device scopes are current devices (`Devices`), kernels come
    from hiprtc (compiled for the current device) loaded as code objects."""

    name = "HIP"

    def __init__(self, devices: Devices) -> None:
        self._devices = devices
        self.libraries = tuple(name for name in ((library_path(),) if ON_CUDA else _ROCM_LIBRARIES) if name)
        """The HIP runtime libraries the copy lanes' C helper may open, the first that loads (`hmc.transport._gpu_batch`;
        CUDA's helper opens the driver itself)."""
        self.ok = hip.hipError_t.hipSuccess
        self.not_ready = hip.hipError_t.hipErrorNotReady
        copy, kind = hip.hipMemcpyAsync, hip.hipMemcpyKind.hipMemcpyDefault

        def memcpy_async(dst: int, src: int, nbytes: int, stream: Any) -> tuple[Any, ...]:
            return copy(dst, src, nbytes, kind, stream)

        self.memcpy_async = memcpy_async
        self.stream_query = hip.hipStreamQuery
        self.event_query = hip.hipEventQuery

    @staticmethod
    def check(result: tuple[Any, ...]) -> Any:
        return check(result)

    def use(self, ordinal: int) -> _Current:
        return self._devices.use(ordinal)

    @staticmethod
    def is_current(ordinal: int) -> bool:
        return int(check(hip.hipGetDevice())) == ordinal

    @staticmethod
    def c_target(ordinal: int) -> int:
        return ordinal

    @staticmethod
    def stream_wait_event(stream: Any, event: Any) -> None:
        check(hip.hipStreamWaitEvent(stream, event, 0))

    @staticmethod
    def event_create() -> Any:
        return check(hip.hipEventCreateWithFlags(hip.hipEventDisableTiming))

    @staticmethod
    def event_record(event: Any, stream: Any) -> None:
        check(hip.hipEventRecord(event, stream))

    @staticmethod
    def event_destroy(event: Any) -> None:
        check(hip.hipEventDestroy(event))

    @staticmethod
    def mapped_pointer(address: int) -> int:
        try:
            return int(check(hip.hipHostGetDevicePointer(address, 0)))
        except DeviceError:
            return address

    def register_host(self, address: int, size: int) -> int:
        check(hip.hipHostRegister(address, size, hip.hipHostRegisterPortable | hip.hipHostRegisterMapped))
        return self.mapped_pointer(address)

    @staticmethod
    def unregister_host(address: int) -> None:
        check(hip.hipHostUnregister(address))

    @staticmethod
    def load_kernel(device: Device, source: str, name: str) -> _HipKernel | None:
        try:
            return _HipKernel(_code_object(source, name), name)
        except (DeviceError, RuntimeError) as exc:  # RuntimeError: hip-python could not load libhiprtc
            _log.warning("no %s kernel on %s (hiprtc: %s)", name, device.name, exc)
            return None


def _code_object(source: str, name: str) -> bytes:
    """`source` compiled by hiprtc for the current device."""

    def ok(result: tuple[Any, ...]) -> Any:
        if result[0] != hiprtc.hiprtcResult.HIPRTC_SUCCESS:
            raise DeviceError(f"hiprtc call failed: {hiprtc.hiprtcResult(int(result[0])).name}")
        return result[1] if len(result) > 1 else None

    program = ok(hiprtc.hiprtcCreateProgram(source.encode(), f"{name}.hip".encode(), 0, [], []))
    try:
        options = [b"-std=c++17"]
        if hiprtc.hiprtcCompileProgram(program, len(options), options)[0] != hiprtc.hiprtcResult.HIPRTC_SUCCESS:
            log = bytearray(int(ok(hiprtc.hiprtcGetProgramLogSize(program))))
            ok(hiprtc.hiprtcGetProgramLog(program, log))
            raise DeviceError(f"hiprtc could not compile {name}: {bytes(log).decode(errors='replace').strip()}")
        code = bytearray(int(ok(hiprtc.hiprtcGetCodeSize(program))))
        ok(hiprtc.hiprtcGetCode(program, code))
        return bytes(code)
    finally:  # hiprtcDestroyProgram takes hiprtcProgram*: a reference to the handle, not the handle
        ok(hiprtc.hiprtcDestroyProgram(program.createRef()))


class _HipKernel:
    """A kernel loaded from a code object on the current device."""

    kind = "hiprtc"

    def __init__(self, image: bytes, name: str) -> None:
        self._image = np.frombuffer(image, np.uint8)
        self._module = check(hip.hipModuleLoadData(self._image.ctypes.data))
        self._function = check(hip.hipModuleGetFunction(self._module, name.encode()))
        self.handle = int(self._function)

    def launch(self, grid: int, block: int, arguments: Sequence[int], stream: Any) -> None:
        values, pointers = argument_pointers(arguments)
        check(hip.hipModuleLaunchKernel(self._function, grid, 1, 1, block, 1, 1, 0, stream, int(pointers.ctypes.data), None))

    def close(self) -> None:
        check(hip.hipModuleUnload(self._module))
