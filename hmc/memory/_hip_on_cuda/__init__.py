"""The HIP-on-CUDA runtime: the part of hip-python's API that HMC's HIP backend calls, over cuda.bindings.

No AMD GPU exists where HMC is developed and tested, so the HIP backend (`hmc.memory._hip`) runs on
NVIDIA GPUs through this stand-in for hip-python's `hip` and `hiprtc` modules: hipMalloc over cuMemAlloc,
hipIpcGetMemHandle over cuIpcGetMemHandle, hiprtc over NVRTC, with hip-python's function and argument
names, return tuples and enum values (tests/test_hip_on_cuda_api.py checks them against the installed
hip-python). It is never chosen implicitly: a process runs on it only when `HMC_HIP_ON_CUDA=1` is set
before HMC discovers its devices (`SWITCH`). Such a process is an "AMD" process: its GPUs are `hip:N`
devices served by the HIP backend, and the CUDA backend is left out, as on a ROCm host. What runs is
HMC's real HIP backend code; what it runs on is CUDA. Results say so ("hip_on_cuda"): nothing here was
run on AMD hardware. The copy lanes' C helper opens HIP's runtime library by its entry points
(`hmc.transport._gpu_batch`); here that library is `_runtime_c` (`_runtime_build`), the same entry points in C
over the CUDA driver, compiled at install.
"""

from __future__ import annotations

import os

__all__ = ["SWITCH", "enabled", "library_path"]

SWITCH = "HMC_HIP_ON_CUDA"
"""The environment variable that puts a process on this runtime (1: on; children inherit it)."""


def enabled() -> bool:
    """Whether this process was asked to run its HIP backend on the HIP-on-CUDA runtime."""
    return os.environ.get(SWITCH, "") == "1"


def library_path() -> str:
    """The file of this runtime's C entry points (`_runtime_build`: what a C caller opens where ROCm has
    libamdhip64), where it was built and the CUDA driver loads; else ""."""
    try:
        from hmc.memory._hip_on_cuda import _runtime_c  # type: ignore[attr-defined]
    except ImportError:
        return ""
    return str(_runtime_c.__file__) if _runtime_c.lib.hmc_hip_on_cuda_ready() == 0 else ""
