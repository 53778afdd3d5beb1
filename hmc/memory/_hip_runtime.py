"""HIP as the HIP backend uses it: the runtime module, result checking, current-device scopes, streams, events.

The runtime is hip-python's `hip` module (ROCm 6.x and 7.x; `pip install 'hmc[hip]'`), or, in a process
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
import threading
from typing import Any

from hmc.errors import DeviceError
from hmc.memory._base import Device, Owned, Stream
from hmc.memory._hip_on_cuda import SWITCH, enabled

__all__ = ["ON_CUDA", "Devices", "HipEvent", "HipStream", "check", "hip", "missing"]

ON_CUDA = enabled()
"""Whether this process runs its HIP backend on the HIP-on-CUDA runtime (NVIDIA hardware)."""

try:
    if ON_CUDA:
        importlib.import_module("cuda.bindings.driver")  # what the HIP-on-CUDA runtime runs on
        from hmc.memory._hip_on_cuda import hip
    else:
        from hip import hip
except ImportError as exc:  # hip-python (or, switched, cuda-python) is not installed: the HIP backend is absent
    hip = None
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


class Devices:
    """Current-device scopes and the peer links enabled so far."""

    def __init__(self) -> None:
        self._peer_lock = threading.Lock()  # guards _peers, serialises hipDeviceEnablePeerAccess
        self._peers: set[tuple[int, int]] = set()

    @staticmethod
    def use(ordinal: int) -> _Current:
        """Make device `ordinal` current for the block, then restore the caller's."""
        return _Current(ordinal)

    def enable_peer_access(self, ordinal: int, peer: int) -> None:
        """Let device `ordinal` reach `peer`'s memory directly (XGMI or PCIe P2P); idempotent."""
        with self._peer_lock:
            if (ordinal, peer) in self._peers:
                return
            with self.use(ordinal):
                status = hip.hipDeviceEnablePeerAccess(peer, 0)[0]
            if status != hip.hipError_t.hipErrorPeerAccessAlreadyEnabled:
                check((status,))
            self._peers.add((ordinal, peer))


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
