"""Kernels compiled at run time for CUDA GPUs: NVRTC (`cuda.bindings.nvrtc`) to a CUBIN loaded with the driver,
else CuPy's compiler where NVRTC is missing or fails; None where neither works (callers then fall back).

Images are compiled once per process, source and GPU architecture.

Concurrency: thread-safe (the cache is functools'); a loaded kernel is used under its caller's locks.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from hmc.errors import DeviceError
from hmc.memory._base import Device
from hmc.memory._cuda_driver import check, driver
from hmc.memory._gpu import argument_pointers

__all__ = ["load_kernel"]

_log = logging.getLogger(__name__)


@functools.cache
def _cubin(source: str, name: str, arch: int) -> bytes | None:
    """CUBIN of `source` for sm_<arch> through NVRTC; None where NVRTC is missing or fails."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return None
    try:
        return _nvrtc_cubin(nvrtc, source, name, arch)
    except Exception as exc:  # noqa: BLE001 - a missing libnvrtc raises the loader's own error types
        _log.info("NVRTC cannot build %s for sm_%d: %s", name, arch, exc)
        return None


def _nvrtc_cubin(nvrtc: Any, source: str, name: str, arch: int) -> bytes:
    def ok(result: tuple[Any, ...]) -> Any:
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise DeviceError(f"NVRTC call failed: {nvrtc.nvrtcGetErrorString(result[0])[1].decode()}")
        return result[1] if len(result) > 1 else None

    program = ok(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []))
    try:
        options = [f"--gpu-architecture=sm_{arch}".encode(), b"--std=c++17"]
        if nvrtc.nvrtcCompileProgram(program, len(options), options)[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            log = b" " * ok(nvrtc.nvrtcGetProgramLogSize(program))
            ok(nvrtc.nvrtcGetProgramLog(program, log))
            raise DeviceError(f"NVRTC could not compile {name}: {log.decode(errors='replace').strip()}")
        image = b" " * ok(nvrtc.nvrtcGetCUBINSize(program))
        ok(nvrtc.nvrtcGetCUBIN(program, image))
        return image
    finally:
        nvrtc.nvrtcDestroyProgram(program)


class _ModuleKernel:
    """A kernel loaded from a CUBIN into one device's primary context (current when called)."""

    kind = "nvrtc"

    def __init__(self, image: bytes, name: str) -> None:
        self._image = np.frombuffer(image, np.uint8)
        self._module = check(driver.cuModuleLoadData(self._image.ctypes.data))
        self._function = check(driver.cuModuleGetFunction(self._module, name.encode()))
        self.handle = int(self._function)

    def launch(self, grid: int, block: int, arguments: Sequence[int], stream: Any) -> None:
        values, pointers = argument_pointers(arguments)
        check(driver.cuLaunchKernel(self._function, grid, 1, 1, block, 1, 1, 0, stream, pointers.ctypes.data, 0))

    def close(self) -> None:
        check(driver.cuModuleUnload(self._module))


class _CupyKernel:
    """A kernel compiled and launched through CuPy (when NVRTC through cuda.bindings is unavailable)."""

    kind = "cupy"
    handle = 0

    def __init__(self, ordinal: int, source: str, name: str) -> None:
        import cupy

        self._cupy = cupy
        self._ordinal = ordinal
        self._kernel = cupy.RawKernel(source, name, options=("--std=c++17",))
        with cupy.cuda.Device(ordinal):
            self._kernel.compile()

    def launch(self, grid: int, block: int, arguments: Sequence[int], stream: Any) -> None:
        cupy = self._cupy
        with cupy.cuda.Device(self._ordinal):
            self._kernel((grid,), (block,), tuple(np.uint64(a) for a in arguments), stream=cupy.cuda.ExternalStream(int(stream)))

    def close(self) -> None:
        return None


def load_kernel(device: Device, source: str, name: str) -> _ModuleKernel | _CupyKernel | None:
    """`name` from `source` for `device` (its context current), or None."""
    handle = check(driver.cuDeviceGet(device.index))
    attribute = driver.CUdevice_attribute
    major = int(check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle)))
    minor = int(check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle)))
    image = _cubin(source, name, major * 10 + minor)
    if image is not None:
        try:
            return _ModuleKernel(image, name)
        except DeviceError as exc:
            _log.info("%s built by NVRTC does not load on %s: %s", name, device.name, exc)
    try:
        return _CupyKernel(device.index, source, name)
    except Exception as exc:  # noqa: BLE001 - CuPy missing or its compiler failing: the caller falls back
        _log.warning("no %s kernel on %s (NVRTC and CuPy both failed: %s)", name, device.name, exc)
        return None
