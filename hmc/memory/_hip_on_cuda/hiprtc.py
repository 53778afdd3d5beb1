"""hip-python's `hiprtc` module, the subset HMC's HIP backend calls, over NVRTC (see the package).

hiprtc compiles for the current device when no architecture is given; so does this one (sm_XX of the
current CUDA device), and its code is a CUBIN that `hip.hipModuleLoadData` loads. A program is handed
around as hip-python's is: by value, except to hiprtcDestroyProgram, which (a `hiprtcProgram*` in C)
takes `program.createRef()`; given the program itself it refuses, as ROCm would misbehave.
"""

from __future__ import annotations

import enum
from typing import Any

try:
    from cuda.bindings import driver as _cu
    from cuda.bindings import nvrtc as _nvrtc
except ImportError:  # importable without it, as `hip` is
    _cu = _nvrtc = None


class hiprtcResult(enum.IntEnum):
    HIPRTC_SUCCESS = 0
    HIPRTC_ERROR_OUT_OF_MEMORY = 1
    HIPRTC_ERROR_PROGRAM_CREATION_FAILURE = 2
    HIPRTC_ERROR_INVALID_INPUT = 3
    HIPRTC_ERROR_INVALID_PROGRAM = 4
    HIPRTC_ERROR_INVALID_OPTION = 5
    HIPRTC_ERROR_COMPILATION = 6
    HIPRTC_ERROR_BUILTIN_OPERATION_FAILURE = 7
    HIPRTC_ERROR_INTERNAL_ERROR = 11


def _status(result: Any) -> hiprtcResult:
    code = int(result)  # NVRTC numbers its results as hiprtc does
    return hiprtcResult(code) if code in hiprtcResult._value2member_map_ else hiprtcResult.HIPRTC_ERROR_INTERNAL_ERROR


def _current_arch() -> bytes:
    device = int(_cu.cuCtxGetDevice()[1])
    attribute = _cu.CUdevice_attribute
    major = int(_cu.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)[1])
    minor = int(_cu.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)[1])
    return f"--gpu-architecture=sm_{major}{minor}".encode()


class _hiprtcProgram:
    """A program handle (an NVRTC program inside)."""

    def __init__(self, native: Any) -> None:
        self.native = native

    def createRef(self) -> _Reference:
        return _Reference(self)


class _Reference:
    """`hiprtcProgram*`: what hiprtcDestroyProgram takes."""

    def __init__(self, program: _hiprtcProgram) -> None:
        self.program = program


hiprtcProgram = _hiprtcProgram


def hiprtcCreateProgram(src: bytes, name: bytes, numHeaders: int, headers: Any, includeNames: Any) -> tuple[hiprtcResult, Any]:
    status, program = _nvrtc.nvrtcCreateProgram(src, name, numHeaders, list(headers or []), list(includeNames or []))
    return _status(status), (_hiprtcProgram(program) if int(status) == 0 else None)


def hiprtcCompileProgram(prog: Any, numOptions: int, options: Any) -> tuple[hiprtcResult]:
    given = [bytes(option) for option in (options or [])][:numOptions]
    if not any(option.startswith((b"--offload-arch", b"--gpu-architecture", b"-arch")) for option in given):
        given.append(_current_arch())
    return (_status(_nvrtc.nvrtcCompileProgram(prog.native, len(given), given)[0]),)


def hiprtcGetCodeSize(prog: Any) -> tuple[hiprtcResult, Any]:
    status, size = _nvrtc.nvrtcGetCUBINSize(prog.native)
    return _status(status), int(size)


def _copied_out(nvrtc_call: Any, prog: Any, into: Any) -> tuple[hiprtcResult]:
    """An NVRTC call that fills a bytes object of `into`'s size, its bytes then copied into `into` (hiprtc fills it)."""
    view = memoryview(into).cast("B")
    filled = b" " * view.nbytes
    status = _status(nvrtc_call(prog.native, filled)[0])
    view[:] = filled
    return (status,)


def hiprtcGetCode(prog: Any, code: Any) -> tuple[hiprtcResult]:
    return _copied_out(_nvrtc.nvrtcGetCUBIN, prog, code)


def hiprtcGetProgramLogSize(prog: Any) -> tuple[hiprtcResult, Any]:
    status, size = _nvrtc.nvrtcGetProgramLogSize(prog.native)
    return _status(status), int(size)


def hiprtcGetProgramLog(prog: Any, log: Any) -> tuple[hiprtcResult]:
    return _copied_out(_nvrtc.nvrtcGetProgramLog, prog, log)


def hiprtcDestroyProgram(prog: Any) -> tuple[hiprtcResult]:
    if not isinstance(prog, _Reference):
        return (hiprtcResult.HIPRTC_ERROR_INVALID_INPUT,)
    return (_status(_nvrtc.nvrtcDestroyProgram(prog.program.native)[0]),)
