"""The CUDA backend of the Memory API on a real GPU.

Discovery, allocation, copies in every direction (random data, poisoned
destinations, every byte compared, odd sizes, unaligned offsets, ranges touching
the last byte), fill, streams and events, pinned host memory, registration of
PyTorch and CuPy memory, CUDA IPC across processes and dma-buf export.
Skipped with the reason where no CUDA device is present (conftest.py).
"""

from __future__ import annotations

import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from hmc import memory
from hmc.errors import ArgumentError, ClosedResourceError, DeviceError, OutOfRangeError, UnsupportedError
from hmc.memory import Device, DeviceKind, MemoryKind, MemoryRegion, Vendor
from hmc.memory._cuda import CudaBackend
from hmc.v1 import common_pb2

from ._support import HOST_POISON, ODD_CASES, POISON, assert_bytes_equal

pytestmark = pytest.mark.cuda

# (size, dst_offset, src_offset, slack after the destination range; 0 touches the last byte)
CASES = ODD_CASES


def random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def read_back(region: MemoryRegion) -> np.ndarray:
    host = np.full(region.size, HOST_POISON, np.uint8)
    memory.copy(host, region)
    return host


def cuda_devices() -> list[Device]:
    return [device for device in memory.devices() if device.kind is DeviceKind.CUDA]


def test_discovery_fields(cuda_backend: CudaBackend) -> None:
    devices = cuda_backend.devices()
    assert devices == cuda_devices()
    assert [d.name for d in devices] == [f"cuda:{i}" for i in range(len(devices))]
    names = {d.name for d in devices}
    assert len({d.uuid for d in devices}) == len(devices)
    for index, device in enumerate(devices):
        assert device.kind is DeviceKind.CUDA and device.index == index
        assert device.vendor is Vendor.NVIDIA and device.physical_vendor is Vendor.NVIDIA
        assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", device.uuid)
        assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", device.pci_bus_id)
        numa = Path(f"/sys/bus/pci/devices/{device.pci_bus_id}/numa_node")
        assert device.numa_node == (max(int(numa.read_text()), -1) if numa.exists() else -1)
        assert device.total_memory > 1 << 30 and device.model
        assert device.name not in device.peer_devices and set(device.peer_devices) <= names


def test_discovery_matches_torch(cuda_backend: CudaBackend) -> None:
    torch = pytest.importorskip("torch")
    devices = cuda_backend.devices()
    assert torch.cuda.device_count() == len(devices)
    for device in devices:
        props = torch.cuda.get_device_properties(device.index)
        assert (device.model, device.total_memory) == (props.name, props.total_memory)


def test_allocate_resolve_free(cuda_backend: CudaBackend, cuda0: Device) -> None:
    region = memory.allocate(4097, cuda0)
    assert region.kind is MemoryKind.DEVICE and region.device == cuda0 and region.size == 4097 and region.address
    assert cuda_backend.resolve_pointer(region.address) == (cuda0, MemoryKind.DEVICE)
    assert cuda_backend.resolve_pointer(region.address + 4096) == (cuda0, MemoryKind.DEVICE)
    with pytest.raises(UnsupportedError):
        region.numpy()
    region.free()
    region.free()
    assert region.freed
    with pytest.raises(ClosedResourceError):
        memory.copy(np.zeros(1, np.uint8), region, 1)


def test_driver_errors_are_device_errors(cuda0: Device) -> None:
    with pytest.raises(DeviceError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        memory.allocate(1 << 60, cuda0)


def test_bad_arguments(cuda_backend: CudaBackend, cuda0: Device) -> None:
    host = memory.get_device("host")
    with pytest.raises(ArgumentError):
        memory.allocate(0, cuda0)
    with pytest.raises(ArgumentError):
        cuda_backend.allocate(host, 16)
    with pytest.raises(ArgumentError):
        cuda_backend.stream(host)
    with memory.allocate(16, cuda0) as region, pytest.raises(ArgumentError, match="CudaStream"):
        memory.copy(region, np.zeros(16, np.uint8), stream=memory.backend_for(host).stream(host))


@pytest.mark.parametrize(("size", "dst_offset", "src_offset", "slack"), CASES)
def test_host_to_device_to_host(cuda0: Device, size: int, dst_offset: int, src_offset: int, slack: int) -> None:
    data = random_bytes(src_offset + size, seed=size)
    with memory.allocate(dst_offset + size + slack, cuda0) as device_region:
        memory.fill(device_region, POISON)
        memory.copy(device_region, data, size, dst_offset=dst_offset, src_offset=src_offset)
        whole = read_back(device_region)
        part = np.full(size + 11, HOST_POISON, np.uint8)
        memory.copy(part, device_region, size, dst_offset=5, src_offset=dst_offset)
    expected = np.full(dst_offset + size + slack, POISON, np.uint8)
    expected[dst_offset : dst_offset + size] = data[src_offset:]
    assert_bytes_equal(whole, expected)
    expected_part = np.full(size + 11, HOST_POISON, np.uint8)
    expected_part[5 : 5 + size] = data[src_offset:]
    assert_bytes_equal(part, expected_part)


@pytest.mark.parametrize(("size", "dst_offset", "src_offset", "slack"), CASES)
def test_device_to_device(cuda0: Device, size: int, dst_offset: int, src_offset: int, slack: int) -> None:
    data = random_bytes(src_offset + size, seed=size + 1)
    with memory.allocate(src_offset + size, cuda0) as src, memory.allocate(dst_offset + size + slack, cuda0) as dst:
        memory.copy(src, data)
        memory.fill(dst, POISON)
        memory.copy(dst, src, size, dst_offset=dst_offset, src_offset=src_offset)
        whole = read_back(dst)
    expected = np.full(dst.size, POISON, np.uint8)
    expected[dst_offset : dst_offset + size] = data[src_offset:]
    assert_bytes_equal(whole, expected)


@pytest.mark.multi_gpu(2, reason="a peer copy between two devices")
def test_peer_copy_both_directions() -> None:
    devices = cuda_devices()
    size, dst_offset, src_offset = (5 << 20) + 3, 13, 4095
    for source, target in ((devices[0], devices[1]), (devices[1], devices[0])):
        data = random_bytes(src_offset + size, seed=source.index)
        with memory.allocate(src_offset + size, source) as src, memory.allocate(dst_offset + size, target) as dst:
            memory.copy(src, data)
            memory.fill(dst, POISON)
            memory.copy(dst, src, size, dst_offset=dst_offset, src_offset=src_offset)
            expected = np.full(dst.size, POISON, np.uint8)
            expected[dst_offset:] = data[src_offset:]
            assert_bytes_equal(read_back(dst), expected)


@pytest.mark.parametrize("value", [0, 0x11, 0xFF])
def test_fill_a_view(cuda0: Device, value: int) -> None:
    with memory.allocate(10001, cuda0) as region:
        memory.fill(region, POISON)
        memory.fill(region.view(3, 9990), value)
        back = read_back(region)
    expected = np.full(10001, POISON, np.uint8)
    expected[3:9993] = value
    assert_bytes_equal(back, expected)


def test_pinned_host_memory(cuda_backend: CudaBackend) -> None:
    host = memory.get_device("host")
    with cuda_backend.allocate_pinned_host(12345) as pinned, cuda_backend.allocate(host, 77, pinned=True) as other:
        for region in (pinned, other):
            assert region.kind is MemoryKind.HOST_PINNED and region.device == host
            assert cuda_backend.resolve_pointer(region.address) == (host, MemoryKind.HOST_PINNED)
            assert cuda_backend.export_handles(region) == {}
        pinned.numpy()[:] = 7
        assert int(pinned.numpy().sum()) == 7 * 12345


def test_stream_copies_and_events(cuda_backend: CudaBackend, cuda0: Device) -> None:
    size = (1 << 20) + 3
    data = random_bytes(size, seed=3)
    with (
        cuda_backend.allocate_pinned_host(size) as source,
        cuda_backend.allocate_pinned_host(size) as target,
        memory.allocate(size + 1, cuda0) as device_region,
        cuda_backend.stream(cuda0) as first,
        cuda_backend.stream(cuda0) as second,
    ):
        assert first.handle != 0 and first.handle != second.handle
        source.numpy()[:] = data
        target.numpy().fill(HOST_POISON)
        memory.fill(device_region, POISON, stream=first)
        memory.copy(device_region, source, dst_offset=1, stream=first)
        with first.record_event() as copied:
            second.wait_event(copied)
            memory.copy(target, device_region, src_offset=1, stream=second)
            with second.record_event() as done:
                done.synchronize()
                assert done.query() and copied.query() and second.query()
        first.synchronize()
        assert_bytes_equal(target.numpy().copy(), data)
        assert read_back(device_region)[0] == POISON


def test_register_torch_tensor(cuda_backend: CudaBackend, cuda0: Device) -> None:
    torch = pytest.importorskip("torch")
    n = 100003
    tensor = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    region = memory.register(tensor)
    assert (region.device, region.kind, region.size, region.address) == (cuda0, MemoryKind.DEVICE, n, tensor.data_ptr())
    assert_bytes_equal(read_back(region), tensor.cpu().numpy())

    data = random_bytes(1000 + 3, seed=4)
    before = tensor.cpu().numpy()
    memory.copy(tensor, data, 1000, dst_offset=n - 1000, src_offset=3)
    expected = before.copy()
    expected[n - 1000 :] = data[3:]
    assert_bytes_equal(tensor.cpu().numpy(), expected)

    floats = torch.arange(7 * 5, dtype=torch.float32, device="cuda:0").reshape(7, 5)
    torch.cuda.synchronize()
    assert memory.register(floats).size == 7 * 5 * 4
    with pytest.raises(ArgumentError, match="contiguous"):
        memory.register(floats.t())

    whole, tail = cuda_backend.export_handles(region), cuda_backend.export_handles(memory.register(tensor[5:]))
    assert tail["cuda_ipc"].handle == whole["cuda_ipc"].handle
    assert tail["cuda_ipc"].offset == whole["cuda_ipc"].offset + 5


def test_register_cupy_array(cuda0: Device) -> None:
    cupy = pytest.importorskip("cupy")
    data = random_bytes(54321, seed=5)
    with cupy.cuda.Device(0):
        array = cupy.asarray(data)
    region = memory.register(array)
    assert (region.device, region.kind, region.size) == (cuda0, MemoryKind.DEVICE, data.size)
    assert_bytes_equal(read_back(region), data)
    memory.fill(region.view(100, 10), 0)
    expected = data.copy()
    expected[100:110] = 0
    assert_bytes_equal(cupy.asnumpy(array), expected)


def _ipc_child(handle_bytes: bytes, device_name: str, size: int, write_at: int, payload: bytes) -> tuple[bytes, bool, int, int]:
    """In a fresh process: open the handle twice, read it all, write `payload` at `write_at`."""
    handle = common_pb2.CudaIpcHandle.FromString(handle_bytes)
    backend = memory.backend_for(DeviceKind.CUDA)
    assert isinstance(backend, CudaBackend)
    device = memory.get_device(device_name)
    first = backend.open_ipc(handle, device, size)
    second = backend.open_ipc(handle, device, size)
    with pytest.raises(OutOfRangeError):
        backend.open_ipc(handle, device, size + (64 << 20))
    seen = read_back(first)
    memory.copy(second, np.frombuffer(payload, np.uint8), dst_offset=write_at)
    mapped_while_open = backend.ipc_mappings()
    backend.close_ipc(first)
    backend.close_ipc(first)
    second.free()
    return seen.tobytes(), first.address == second.address, mapped_while_open, backend.ipc_mappings()


def test_ipc_across_processes(cuda_backend: CudaBackend, cuda0: Device) -> None:
    size, offset, slack = (1 << 20) + 7, 4099, 13
    data = random_bytes(size, seed=6)
    payload = random_bytes(333, seed=7)
    write_at = size - payload.size  # touches the exported region's last byte
    with memory.allocate(offset + size + slack, cuda0) as allocation:
        memory.fill(allocation, POISON)
        region = allocation.view(offset, size)
        memory.copy(region, data)
        handle = cuda_backend.export_handles(region)["cuda_ipc"]
        assert (handle.pid, handle.offset, len(handle.handle)) == (os.getpid(), offset, 64)
        with pytest.raises(ArgumentError, match="exported"):
            cuda_backend.open_ipc(handle, cuda0, size)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            job = pool.submit(_ipc_child, handle.SerializeToString(), cuda0.name, size, write_at, payload.tobytes())
            seen, same_mapping, mapped_while_open, mapped_after = job.result(timeout=100)
        back = read_back(allocation)
    assert_bytes_equal(np.frombuffer(seen, np.uint8), data)
    assert same_mapping and (mapped_while_open, mapped_after) == (1, 0)
    expected = np.full(allocation.size, POISON, np.uint8)
    expected[offset : offset + size] = data
    expected[offset + write_at : offset + size] = payload
    assert_bytes_equal(back, expected)


def test_dmabuf_export_recorded_when_supported(cuda_backend: CudaBackend, cuda0: Device) -> None:
    driver = pytest.importorskip("cuda.bindings.driver")
    attribute = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
    _, supported = driver.cuDeviceGetAttribute(attribute, driver.cuDeviceGet(0)[1])
    open_fds = len(os.listdir("/proc/self/fd"))
    with memory.allocate((2 << 20) + 5, cuda0) as allocation:
        region = allocation.view(4097, 1000)
        handles = cuda_backend.export_handles(region)
    assert len(os.listdir("/proc/self/fd")) == open_fds
    if not supported:
        pytest.skip("the device reports no dma-buf support")
    dmabuf = handles["dmabuf"]
    page = os.sysconf("SC_PAGE_SIZE")
    assert dmabuf.pid == os.getpid() and dmabuf.address % page == 0 and dmabuf.length % page == 0
    assert dmabuf.address <= region.address and region.address + region.size <= dmabuf.address + dmabuf.length
    assert isinstance(dmabuf, common_pb2.DmabufHandle)
