"""Normalise foreign memory objects into a `MemoryRegion` at the entry point.

Accepted: a `MemoryRegion`; objects with `__cuda_array_interface__` (CUDA tensors,
CuPy arrays); DLPack producers on the CPU (torch CPU tensors); anything with the
buffer protocol (numpy arrays, bytearray, mmap). Memory must be contiguous.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hmc.errors import ArgumentError, UnsupportedError
from hmc.memory._base import Device, MemoryKind, MemoryRegion
from hmc.memory._host import HOST_DEVICE

__all__ = ["as_region"]

# DLPack device types (dlpack.h).
_DL_CPU = 1
_DL_CUDA_HOST = 3

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
        if device_type not in (_DL_CPU, _DL_CUDA_HOST):
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
