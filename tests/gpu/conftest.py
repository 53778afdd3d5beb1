"""GPU tests run only where the CUDA backend finds a device (`cuda`), and enough of them (`multi_gpu(n, reason=...)`); elsewhere
they are skipped with the reason.

One GPU is a whole machine for every cross-process path: the peer process owns its device memory on `peer_device`, cuda:1
where two GPUs are visible and cuda:0 (the same GPU as this process, another process) where one is. Only what needs two
physical GPUs (peer copy between devices, memory on a second device) is marked `multi_gpu(2, reason=...)`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest

from hmc import memory
from hmc.agent import Agent
from hmc.config import Config
from hmc.errors import UnsupportedError
from hmc.memory import Device, DeviceKind
from hmc.memory._cuda import CudaBackend


@functools.cache
def _cuda_absent_reason() -> str | None:
    try:
        memory.backend_for(DeviceKind.CUDA)
    except UnsupportedError as exc:
        return f"CUDA backend unavailable: {exc}"
    return None


@functools.cache
def _cuda_device_count() -> int:
    try:
        return len(memory.backend_for(DeviceKind.CUDA).devices())
    except UnsupportedError:
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    reason = _cuda_absent_reason() if cuda_items else None
    if reason is not None:
        for item in cuda_items:
            item.add_marker(pytest.mark.skip(reason=reason))
    for item in items:  # multi_gpu(n, reason=why): skipped where fewer than n CUDA devices are visible
        marker = item.get_closest_marker("multi_gpu")
        if marker is not None:
            needed = int(marker.args[0]) if marker.args else 2
            why = f" ({marker.kwargs['reason']})" if "reason" in marker.kwargs else ""
            if _cuda_device_count() < needed:
                item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPUs{why}, {_cuda_device_count()} visible"))


@pytest.fixture
def cuda_backend() -> CudaBackend:
    backend = memory.backend_for(DeviceKind.CUDA)
    assert isinstance(backend, CudaBackend)
    return backend


@pytest.fixture
def cuda0() -> Device:
    return memory.get_device("cuda:0")


@pytest.fixture(scope="session")
def peer_device() -> str:
    """The GPU a peer process's buffers live on: cuda:1 beside this process's cuda:0, or cuda:0 (in another process) on one GPU."""
    return "cuda:1" if _cuda_device_count() > 1 else "cuda:0"


@pytest.fixture(scope="module")
def gpu_agent(gpu_config: Config) -> Iterator[Agent]:
    """An Agent without a daemon, on the test module's own `gpu_config` (each module defines one)."""
    with Agent(gpu_config, daemon=False) as agent:
        yield agent
