"""The HIP-on-CUDA test runtime (hip-python's API over the CUDA driver), for tests that run HMC's HIP backend
on NVIDIA GPUs: set `SWITCH` (HMC_HIP_ON_CUDA=1) in a process's environment before it discovers devices.
It lives in `hmc.memory._hip_on_cuda` (`hmc demo` starts such a process too); this is its name for tests."""

from hmc.memory._hip_on_cuda import SWITCH, enabled, hip

__all__ = ["SWITCH", "enabled", "hip"]
