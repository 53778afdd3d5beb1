"""The Memory API on host memory: allocate, register, copy, fill, view, free."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

import hmc.memory as memory
from hmc.errors import ArgumentError, ClosedResourceError, DeviceError, OutOfRangeError, UnsupportedError
from hmc.memory import DeviceKind, MemoryKind


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_host_device_is_always_present() -> None:
    names = [d.name for d in memory.devices()]
    assert names[0] == "host"
    host = memory.get_device("host")
    assert host.kind is DeviceKind.HOST and host.total_memory > 0
    with pytest.raises(ArgumentError, match="no device"):
        memory.get_device("cuda:99")


def test_absent_backends_are_not_errors() -> None:
    present = {d.kind for d in memory.devices()}
    if DeviceKind.HIP not in present:
        with pytest.raises(UnsupportedError):
            memory.backend_for(DeviceKind.HIP)


@pytest.mark.parametrize("size", [1, 4095, 1 << 20])
def test_allocate_copy_fill_free(size: int) -> None:
    data = random_bytes(size)
    with memory.allocate(size) as region:
        assert region.kind is MemoryKind.HOST and region.size == size
        memory.fill(region, 0xA5)
        assert (region.numpy() == 0xA5).all()
        memory.copy(region, data)
        out = np.full(size, 0x5A, dtype=np.uint8)
        memory.copy(out, region)
        assert np.array_equal(out, data)
    assert region.freed
    region.free()
    with pytest.raises(ClosedResourceError):
        region.numpy()


def test_pinned_host_allocation() -> None:
    try:
        region = memory.allocate(1 << 16, pinned=True)
    except Exception as exc:  # mlock may be limited by RLIMIT_MEMLOCK
        pytest.skip(f"mlock not permitted here: {exc}")
    with region:
        assert region.kind is MemoryKind.HOST_PINNED


def test_register_buffer_protocol_objects() -> None:
    array = random_bytes(1000).reshape(10, 100)
    region = memory.register(array)
    assert region.address == array.ctypes.data and region.size == 1000
    assert np.array_equal(region.numpy(), array.ravel())
    scratch = bytearray(b"x" * 64)
    assert memory.register(scratch).size == 64
    with mmap.mmap(-1, 4096) as mapping:
        assert memory.register(mapping).size == 4096
    assert memory.register(b"readonly").readonly


def test_register_dlpack_cpu_object() -> None:
    class Producer:
        def __init__(self, array: np.ndarray) -> None:
            self.array = array

        def __dlpack__(self, **kwargs: object) -> object:
            return self.array.__dlpack__(**kwargs)

        def __dlpack_device__(self) -> tuple[int, int]:
            return (1, 0)

    array = random_bytes(256).view(np.int32)
    region = memory.register(Producer(array))
    assert region.address == array.ctypes.data and region.size == 256


def test_register_rejects_strided_and_foreign_objects() -> None:
    with pytest.raises(ArgumentError, match="contiguous"):
        memory.register(np.zeros((10, 10), np.uint8)[:, ::2])
    with pytest.raises(ArgumentError, match="cannot register"):
        memory.register(object())


def test_cuda_array_interface_without_cuda_is_unsupported() -> None:
    class FakeDeviceArray:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0x1000, False), "version": 3}

    if DeviceKind.CUDA in {d.kind for d in memory.devices()}:
        pytest.skip("CUDA present: covered by tests/gpu")
    with pytest.raises(UnsupportedError):
        memory.register(FakeDeviceArray())


def test_views_and_bounds() -> None:
    data = random_bytes(100)
    region = memory.register(data)
    sub = memory.view(region, 10, 20)
    assert np.array_equal(sub.numpy(), data[10:30])
    with pytest.raises(OutOfRangeError):
        memory.view(region, 90, 20)
    poisoned = np.full(100, 7, np.uint8)
    with pytest.raises(OutOfRangeError):
        memory.copy(poisoned, data, 50, dst_offset=60)
    assert (poisoned == 7).all()
    with pytest.raises(ArgumentError, match="read-only"):
        memory.copy(b"immutable", data, 4)
    with pytest.raises(ArgumentError, match="byte"):
        memory.fill(poisoned, 256)


class _Claims:
    """A GPU backend that knows one pointer (or none: it refuses like a runtime that never allocated it)."""

    def __init__(self, device: memory.Device | None) -> None:
        self._device = device

    def devices(self) -> list[memory.Device]:
        return [self._device] if self._device is not None else []

    def resolve_pointer(self, address: int) -> tuple[memory.Device, MemoryKind]:
        if self._device is None:
            raise DeviceError("CUDA driver call failed: CUDA_ERROR_INVALID_VALUE")
        return self._device, MemoryKind.DEVICE


class _DeviceMemory:
    __cuda_array_interface__ = {"shape": (16,), "typestr": "|u1", "data": (0x7F0000001000, False), "version": 3}


def test_a_pointer_cuda_does_not_know_is_asked_of_hip(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a node with NVIDIA and AMD GPUs a torch-on-ROCm tensor (device 'cuda') registers as HIP memory."""
    hip0 = memory.Device("hip:0", DeviceKind.HIP, 0, memory.Vendor.AMD, memory.Vendor.AMD)
    monkeypatch.setattr(memory, "_backends", lambda: {DeviceKind.CUDA: _Claims(None), DeviceKind.HIP: _Claims(hip0)})
    assert memory.register(_DeviceMemory()).device is hip0
    monkeypatch.setattr(memory, "_backends", lambda: {DeviceKind.CUDA: _Claims(None), DeviceKind.HIP: _Claims(None)})
    with pytest.raises(ArgumentError, match="no GPU backend knows"):
        memory.register(_DeviceMemory())


_CAPSULE_NAME = b"dltensor"  # PyCapsule_New keeps the pointer: the name must outlive the capsules


class _DLManaged(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
        ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
        ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
        ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
    ]


class _RocmTensor:
    """A DLPack producer of a kDLROCM tensor (what torch on ROCm hands out), built by hand with ctypes."""

    def __init__(self, data: int, shape: tuple[int, ...], bits: int, strides: tuple[int, ...] | None = None, byte_offset: int = 0) -> None:
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._strides = (ctypes.c_int64 * len(shape))(*strides) if strides else None
        self._managed = _DLManaged(data, 10, 0, len(shape), 2, bits, 1, self._shape, self._strides, byte_offset, None, None)

    def __dlpack_device__(self) -> tuple[int, int]:
        return 10, 0

    def __dlpack__(self, **kwargs: object) -> object:
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
        return new(ctypes.addressof(self._managed), _CAPSULE_NAME, None)


def test_a_dlpack_rocm_tensor_registers_as_hip_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    hip0 = memory.Device("hip:0", DeviceKind.HIP, 0, memory.Vendor.AMD, memory.Vendor.AMD)
    asked: list[int] = []

    class Hip(_Claims):
        def resolve_pointer(self, address: int) -> tuple[memory.Device, MemoryKind]:
            asked.append(address)
            return super().resolve_pointer(address)

    monkeypatch.setattr(memory, "_backends", lambda: {DeviceKind.HIP: Hip(hip0)})
    tensor = _RocmTensor(0x7F0000100000, (4, 8, 16), 16, byte_offset=256)
    region = memory.register(tensor)
    assert (region.device, region.address, region.size, region.kind) == (hip0, 0x7F0000100100, 4 * 8 * 16 * 2, MemoryKind.DEVICE)
    assert asked == [0x7F0000100100] and region.owner[0] is tensor  # with the capsule, which keeps the tensor alive
    with pytest.raises(ArgumentError, match="C-contiguous"):
        memory.register(_RocmTensor(0x7F0000100000, (4, 8), 32, strides=(1, 4)))
    with pytest.raises(ArgumentError, match="byte-addressable"):
        memory.register(_RocmTensor(0x7F0000100000, (4, 8), 4))


class _Refusing:
    """A DLPack producer that refuses to export (as torch does for a tensor that requires grad)."""

    def __dlpack_device__(self) -> tuple[int, int]:
        return 10, 0

    def __dlpack__(self, **kwargs: object) -> object:
        raise RuntimeError("Can't export tensors that require gradient")


def test_a_refused_dlpack_export_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_backends", lambda: {})
    with pytest.raises(ArgumentError, match="cannot read the DLPack tensor"):
        memory.register(_Refusing())


def test_a_backend_failing_during_discovery_is_absent_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """A runtime that fails in a way its probe did not foresee leaves its family out; host memory still works."""

    def broken() -> tuple[None, str]:
        raise DeviceError("HIP call failed: hipErrorNotSupported")

    monkeypatch.setattr(memory, "_load_hip", broken)
    memory._discovery.cache_clear()
    try:
        assert "hipErrorNotSupported" in memory.absent_backends()["hip"]
        assert memory.get_device("host").kind is DeviceKind.HOST
    finally:
        memory._discovery.cache_clear()
