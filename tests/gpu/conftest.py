"""GPU tests run only where the CUDA backend finds a device; elsewhere they are skipped with the reason."""

from __future__ import annotations

import functools

import pytest

from hmc import memory
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    reason = _cuda_absent_reason() if cuda_items else None
    if reason is not None:
        for item in cuda_items:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def cuda_backend() -> CudaBackend:
    backend = memory.backend_for(DeviceKind.CUDA)
    assert isinstance(backend, CudaBackend)
    return backend


@pytest.fixture
def cuda0() -> Device:
    return memory.get_device("cuda:0")
