"""Normalise foreign memory objects into a `MemoryRegion` at the entry point.

Accepted: a `MemoryRegion`; objects with `__cuda_array_interface__` (CUDA tensors,
CuPy arrays, torch-on-ROCm tensors, which call themselves CUDA); DLPack producers on
the CPU (torch CPU tensors) and on GPUs (kDLCUDA, kDLROCM: the tensor is read from the
capsule, the device from the backends); anything with the buffer protocol (numpy
arrays, bytearray, mmap). Memory must be contiguous.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ctypes

import numpy as np

from hmc.errors import ArgumentError, UnsupportedError
from hmc.memory._base import Device, MemoryKind, MemoryRegion
from hmc.memory._host import HOST_DEVICE

__all__ = ["as_region"]

# DLPack device types (dlpack.h).
_DL_CPU = 1
_DL_CUDA = 2
_DL_CUDA_HOST = 3
_DL_ROCM = 10
_DL_ROCM_HOST = 11
_DL_DEVICES = frozenset({_DL_CUDA, _DL_ROCM})


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)

DeviceResolver = Callable[[int], tuple[Device, MemoryKind]]


def _from_cuda_array_interface(obj: Any, resolve_device: DeviceResolver | None) -> MemoryRegion:
    cai = obj.__cuda_array_interface__
    shape = tuple(cai["shape"])
    itemsize = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    if strides is not None and strides != _contiguous_strides(shape, itemsize):
        raise ArgumentError("device memory must be C-contiguous to be registered")
    address, readonly = cai["data"]
    size = int(np.prod(shape, dtype=np.int64)) * itemsize
    if resolve_device is None:
        raise UnsupportedError("object exposes __cuda_array_interface__ but no CUDA backend is available")
    device, kind = resolve_device(address)
    return MemoryRegion(device=device, address=int(address), size=size, kind=kind, owner=obj, readonly=bool(readonly))


def _from_dlpack_device(obj: Any, resolve_device: DeviceResolver | None) -> MemoryRegion:
    """GPU memory behind a DLPack producer: its tensor read from the capsule (kept, unconsumed, with `obj` as the
    region's owner: its deleter runs when the region goes), its device from the backends (a kDLROCM tensor is HIP
    memory, whatever it calls itself)."""
    try:
        capsule = obj.__dlpack__()
        tensor = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))  # DLManagedTensor starts with its DLTensor
    except Exception as exc:  # noqa: BLE001 - producers raise what they like (torch: RuntimeError for a tensor needing grad)
        raise ArgumentError(f"cannot read the DLPack tensor of {type(obj).__name__}: {exc}") from exc
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    itemsize = tensor.dtype.bits * tensor.dtype.lanes // 8
    if itemsize <= 0 or tensor.dtype.bits % 8:
        raise ArgumentError(f"DLPack dtype of {tensor.dtype.bits} bits is not byte-addressable")
    if tensor.strides and tuple(tensor.strides[i] for i in range(tensor.ndim)) != tuple(s // itemsize for s in _contiguous_strides(shape, itemsize)):
        raise ArgumentError("device memory must be C-contiguous to be registered")
    address = int(tensor.data or 0) + int(tensor.byte_offset)
    size = int(np.prod(shape, dtype=np.int64)) * itemsize
    if resolve_device is None:
        raise UnsupportedError("a DLPack GPU tensor was given but no GPU backend is available")
    device, kind = resolve_device(address)
    return MemoryRegion(device=device, address=address, size=size, kind=kind, owner=(obj, capsule))  # the capsule keeps the tensor alive


def _contiguous_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides: list[int] = []
    step = itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def _from_host_array(array: np.ndarray, owner: Any) -> MemoryRegion:
    if not array.flags.c_contiguous:
        raise ArgumentError("host memory must be C-contiguous to be registered")
    return MemoryRegion(
        device=HOST_DEVICE,
        address=int(array.ctypes.data),
        size=int(array.nbytes),
        kind=MemoryKind.HOST,
        owner=owner,
        readonly=not array.flags.writeable,
    )


def as_region(obj: Any, resolve_device: DeviceResolver | None = None) -> MemoryRegion:
    """The `MemoryRegion` behind `obj`; `resolve_device` maps a device pointer to its device."""
    if isinstance(obj, MemoryRegion):
        return obj
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cuda_array_interface(obj, resolve_device)
    if hasattr(obj, "__dlpack_device__"):
        device_type, _ = obj.__dlpack_device__()
        if device_type in _DL_DEVICES:
            return _from_dlpack_device(obj, resolve_device)
        if device_type not in (_DL_CPU, _DL_CUDA_HOST, _DL_ROCM_HOST):
            raise UnsupportedError(f"DLPack device type {device_type} is not supported by this build")
        return _from_host_array(np.from_dlpack(obj), owner=obj)
    try:
        view = memoryview(obj)
    except TypeError as exc:
        raise ArgumentError(f"cannot register {type(obj).__name__}: no buffer protocol, DLPack or CUDA array interface") from exc
    if not view.c_contiguous:
        raise ArgumentError("host memory must be C-contiguous to be registered")
    array = np.frombuffer(view.cast("B"), dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
    if not view.readonly:
        array.flags.writeable = True
    return _from_host_array(array, owner=obj)
