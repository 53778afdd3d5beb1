"""What the CUDA and HIP backends share: their devices, argument checks, peer links and IPC mappings, and the
runtime calls transports make on either (`Runtime`).

A `GpuBackend` knows its devices (`kind:N`), checks that a device is one of them and an allocation's size,
picks the device that runs a stream-less copy, links two of its GPUs for peer copies on first use, counts
the IPC handles it opened, and checks that a stream is one of its own. The runtime calls (allocation,
copies, exports) are the subclass's.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from hmc.errors import ArgumentError
from hmc.memory._base import Device, DeviceKind, MemoryBackend, MemoryKind, MemoryRegion, Stream
from hmc.memory._host import HOST_DEVICE
from hmc.memory._ipc_mappings import IpcMappings

__all__ = ["GpuBackend", "Kernel", "PeerLinks", "Runtime", "argument_pointers"]


class Kernel(Protocol):
    """A kernel compiled and loaded for one GPU; `kind` names the compiler ("nvrtc", "cupy", "hiprtc")."""

    kind: str
    handle: int
    """The loaded function (CUDA's CUfunction, HIP's hipFunction_t) a C caller may launch itself on its GPU
    (`hmc.transport._gpu_batch`); 0 where launches go through this object only (CuPy)."""

    def launch(self, grid: int, block: int, arguments: Sequence[int], stream: Any) -> None:
        """Queue `grid` blocks of `block` threads on `stream`, the kernel's arguments 64-bit values (pointers)."""

    def close(self) -> None: ...


class Runtime(Protocol):
    """The calls transports make on a GPU runtime (the CUDA driver, the HIP runtime), so one copy lane serves both.

    The polling calls (`memcpy_async`, `stream_query`, `event_query`) return the runtime's result tuple, status
    first, unchecked: hot paths compare it with `ok` and `not_ready` themselves. The others raise DeviceError.
    """

    name: str
    ok: Any
    not_ready: Any

    def c_target(self, ordinal: int) -> int:
        """What a C caller passes to run on GPU `ordinal`: CUDA's primary context handle (pushed for the call), HIP's
        device ordinal (made current for the call)."""

    def check(self, result: tuple[Any, ...]) -> Any:
        """The outputs of a call's result tuple; DeviceError unless its status is `ok`."""

    def use(self, ordinal: int) -> AbstractContextManager[Any]:
        """Make GPU `ordinal` current on this thread for a block, then restore the caller's."""

    def is_current(self, ordinal: int) -> bool:
        """Whether GPU `ordinal` is current on this thread already (a block of `use` can be skipped)."""

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: Any) -> tuple[Any, ...]: ...

    def stream_query(self, stream: Any) -> tuple[Any, ...]: ...

    def stream_wait_event(self, stream: Any, event: Any) -> None: ...

    def event_create(self) -> Any: ...

    def event_record(self, event: Any, stream: Any) -> None: ...

    def event_query(self, event: Any) -> tuple[Any, ...]: ...

    def event_destroy(self, event: Any) -> None: ...

    def mapped_pointer(self, address: int) -> int:
        """Where the current GPU reaches page-locked host memory at `address` (the address itself, where equal)."""

    def register_host(self, address: int, size: int) -> int:
        """Page-lock and map host memory for every GPU; returns the pointer GPUs use (once registered, it does not
        raise: the caller owns the registration and undoes it)."""

    def unregister_host(self, address: int) -> None: ...

    def load_kernel(self, device: Device, source: str, name: str) -> Kernel | None:
        """`name` from `source` compiled at run time for `device` (current) and loaded, or None where that fails."""


def argument_pointers(arguments: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """A launch's 64-bit argument values and the array of pointers to them (keep both alive through the launch)."""
    values = np.array(arguments, np.uint64)
    return values, values.ctypes.data + 8 * np.arange(len(values), dtype=np.uint64)


class PeerLinks(abc.ABC):
    """The peer links enabled so far (each once, under one lock): the runtime's call is `_link`."""

    def __init__(self) -> None:
        self._peer_lock = threading.Lock()  # guards _peers, serialises the runtime's enable calls
        self._peers: set[tuple[int, int]] = set()

    def enable_peer_access(self, ordinal: int, peer: int) -> None:
        """Let GPU `ordinal` reach GPU `peer`'s memory directly (NVLink, XGMI or PCIe P2P); idempotent."""
        with self._peer_lock:
            if (ordinal, peer) not in self._peers:
                self._link(ordinal, peer)
                self._peers.add((ordinal, peer))

    @abc.abstractmethod
    def _link(self, ordinal: int, peer: int) -> None:
        """Enable the link in the runtime (a link it reports enabled already is no error)."""


class GpuBackend(MemoryBackend):
    """A device family of GPUs; subclasses set `kind` and `_stream_type` and pass their peer links and IPC mappings."""

    _stream_type: type[Stream]

    def __init__(self, devices: list[Device], peers: PeerLinks, ipc: IpcMappings, runtime: Runtime) -> None:
        self._devices = devices
        self._peers = peers
        self._ipc = ipc
        self.runtime = runtime
        """The runtime's calls, for transports that drive these GPUs themselves."""

    def devices(self) -> list[Device]:
        return list(self._devices)

    def allocate(self, device: Device, size: int, *, pinned: bool = False) -> MemoryRegion:
        """Device memory on one of this family's GPUs; on the host device, `pinned=True` gives page-locked host
        memory (see allocate_pinned_host)."""
        if size <= 0:
            raise ArgumentError(f"allocation size must be positive, got {size}")
        if device.kind is DeviceKind.HOST:
            if not pinned:
                raise ArgumentError("pageable host memory comes from the host backend")
            return self.allocate_pinned_host(size)
        address, release = self._malloc(self._ordinal(device), size)
        return MemoryRegion(device=device, address=address, size=size, kind=MemoryKind.DEVICE, release=release)

    def allocate_pinned_host(self, size: int) -> MemoryRegion:
        """Page-locked host memory that every GPU can DMA from at full speed (staging rings)."""
        if size <= 0:
            raise ArgumentError(f"allocation size must be positive, got {size}")
        address, release = self._malloc_host(size)
        return MemoryRegion(device=HOST_DEVICE, address=address, size=size, kind=MemoryKind.HOST_PINNED, release=release)

    @abc.abstractmethod
    def _malloc(self, ordinal: int, size: int) -> tuple[int, Callable[[], None]]:
        """`size` bytes on GPU `ordinal`: (address, the call that frees them)."""

    @abc.abstractmethod
    def _malloc_host(self, size: int) -> tuple[int, Callable[[], None]]:
        """`size` bytes of portable page-locked host memory: (address, the call that frees them)."""

    def enable_peer_access(self, ordinal: int, peer: int) -> None:
        """Let GPU `ordinal` reach GPU `peer`'s memory directly; idempotent."""
        self._peers.enable_peer_access(ordinal, peer)

    def open_ipc(self, handle: Any, device: Device, size: int) -> MemoryRegion:
        """Map `size` bytes another process exported (a CudaIpcHandle or HipIpcHandle), for use by the GPU `device`.

        Open it on the GPU whose kernels will touch it: the memory may live on another GPU (the runtime then
        enables peer access for the mapping), but a mapping made on one GPU is not reachable from kernels on
        the others. Each exported allocation is mapped once per process and device however often it is
        opened; free the region (or close_ipc) to drop this user, and the last one unmaps it.
        """
        return self._ipc.open(handle, self._devices[self._ordinal(device)], size)

    def close_ipc(self, region: MemoryRegion) -> None:
        """Drop a region returned by open_ipc (the same as region.free()); idempotent."""
        region.free()

    def ipc_mappings(self) -> int:
        """How many exported allocations this process has mapped through open_ipc now."""
        return self._ipc.open_count()

    def _ordinal(self, device: Device) -> int:
        if device.kind is not self.kind or not 0 <= device.index < len(self._devices):
            raise ArgumentError(f"{device.name} is not a {self.kind.value.upper()} device of this host")
        return device.index

    def _ordinal_for(self, dst: MemoryRegion, src: MemoryRegion) -> int:
        """The device that runs a stream-less copy: dst's GPU, else src's, else the first."""
        for region in (dst, src):
            if region.device.kind is self.kind:
                return self._ordinal(region.device)
        return 0

    def _link_peers(self, a: Device, b: Device) -> None:
        if a.kind is self.kind and b.kind is self.kind and a.index != b.index and b.name in a.peer_devices:
            self._peers.enable_peer_access(a.index, b.index)
            self._peers.enable_peer_access(b.index, a.index)

    def _own_stream(self, stream: Stream | None) -> Any:
        """`stream` when it is None or one of this backend's streams; ArgumentError otherwise."""
        if stream is None or isinstance(stream, self._stream_type):
            return stream
        raise ArgumentError(f"{self.kind.value.upper()} copies need a {self._stream_type.__name__}, got {type(stream).__name__}")
