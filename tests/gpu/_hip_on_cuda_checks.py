"""Checks run in a process switched to the HIP-on-CUDA runtime (HMC_HIP_ON_CUDA=1): `python this.py <check> [args]`.

Each prints one JSON line with what it saw; the test asserts on it. Random bytes, poisoned destinations, every byte
compared.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np


def _say(**facts: object) -> None:
    print(json.dumps(facts), flush=True)


def backend() -> None:
    """Devices, allocation, copies both ways, fill, a stream and an event, pointers, exports; torch if present."""
    from hmc import memory
    from hmc.memory import DeviceKind, MemoryKind

    hip = memory.backend_for(DeviceKind.HIP)
    device = memory.get_device("hip:0")
    rng = np.random.default_rng(7)
    size = (4 << 20) + 13
    src = rng.integers(1, 256, size, dtype=np.uint8)
    out = np.full(size, 0xA5, np.uint8)
    with memory.allocate(size, "hip:0") as region, hip.allocate_pinned_host(size) as pinned:
        memory.copy(region, src)
        memory.copy(out, region)
        copied = bool(np.array_equal(out, src))
        memory.fill(region.view(100, 1000), 0x3C)
        memory.copy(out, region)
        expected = src.copy()
        expected[100:1100] = 0x3C
        filled = bool(np.array_equal(out, expected))
        stream = hip.stream(device)
        pinned.numpy()[:] = 0x11
        hip.copy(pinned, region, size, stream=stream)
        event = stream.record_event()
        event.synchronize()
        streamed = bool(np.array_equal(pinned.numpy(), expected))
        event.close()
        stream.close()
        where = hip.resolve_pointer(region.address + 5)
        pinned_where = hip.resolve_pointer(pinned.address)
        handles = sorted(hip.export_handles(region))
    kernel = _batch_through_the_lane(hip, device)
    registered = None
    try:
        import torch
    except ImportError:
        pass
    else:  # torch's CUDA tensors, as ROCm torch's report themselves: registered through the HIP backend
        tensor = torch.arange(1 << 16, dtype=torch.int32, device="cuda")
        registered = memory.register(tensor).device.name
    _say(
        devices=[d.name for d in memory.devices()], vendor=device.vendor.value, physical=device.physical_vendor.value,
        absent=memory.absent_backends(), copied=copied, filled=filled, streamed=streamed,
        device_pointer=[where[0].name, where[1].value], pinned_pointer=[pinned_where[0].name, pinned_where[1].value],
        handles=handles, registered=registered, kind=MemoryKind.DEVICE.value, kernel=kernel,
    )


def _batch_through_the_lane(backend: object, device: object) -> list[object]:
    """A batch of 64 scattered ranges on a copy lane of hip:0 (one kernel launch): [how, every byte right]."""
    from hmc import memory
    from hmc.transport._gpu_copy import Lane

    rng = np.random.default_rng(3)
    size = 8 << 20
    data = rng.integers(1, 256, size, dtype=np.uint8)
    lengths = rng.integers(1, 60000, 64).astype(np.int64)
    src = np.arange(64, dtype=np.int64) * 100000
    dst = rng.permutation(64).astype(np.int64) * 120000
    lane = Lane(backend, device)
    with memory.allocate(size, "hip:0") as a, memory.allocate(size, "hip:0") as b:
        memory.copy(a, data)
        memory.fill(b, 0x5A)
        event = lane.enqueue(src, a.address, dst, b.address, lengths, time.monotonic() + 30, record=True)
        assert lane.event_wait(event, time.monotonic() + 30)
        lane.release_event(event)
        out = np.empty(size, np.uint8)
        memory.copy(out, b)
    expected = np.full(size, 0x5A, np.uint8)
    for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist()):
        expected[d : d + n] = data[s : s + n]
    kind = lane.kernel_kind
    assert lane.close(time.monotonic() + 30)
    return [kind, bool(np.array_equal(out, expected))]


def exporter(size: str) -> None:
    """Allocate random bytes on hip:0, print the HIP IPC handle and their digest, wait for a line, print the new digest."""
    from hmc import memory
    from hmc.memory import DeviceKind

    nbytes = int(size)
    rng = np.random.default_rng(11)
    data = rng.integers(1, 256, nbytes, dtype=np.uint8)
    region = memory.allocate(nbytes + 4096, "hip:0").view(4096, nbytes)  # not at the allocation's start
    memory.copy(region, data)
    handle = memory.backend_for(DeviceKind.HIP).export_handles(region)["hip_ipc"]
    _say(handle=handle.handle.hex(), offset=handle.offset, pid=handle.pid, digest=hashlib.sha256(data.tobytes()).hexdigest())
    sys.stdin.readline()
    out = np.empty(nbytes, np.uint8)
    memory.copy(out, region)
    _say(digest=hashlib.sha256(out.tobytes()).hexdigest())


def importer(handle: str, offset: str, pid: str, size: str) -> None:
    """Open the exported memory twice (one mapping), read it, write new random bytes into it, close."""
    from hmc import memory
    from hmc.errors import OutOfRangeError
    from hmc.memory import DeviceKind
    from hmc.v1 import common_pb2

    hip = memory.backend_for(DeviceKind.HIP)
    nbytes = int(size)
    exported = common_pb2.HipIpcHandle(handle=bytes.fromhex(handle), offset=int(offset), pid=int(pid))
    first = hip.open_ipc(exported, memory.get_device("hip:0"), nbytes)
    second = hip.open_ipc(exported, memory.get_device("hip:0"), nbytes)
    mappings = hip.ipc_mappings()
    seen = np.full(nbytes, 0x5A, np.uint8)
    memory.copy(seen, first)
    data = np.random.default_rng(int(pid)).integers(1, 256, nbytes, dtype=np.uint8)
    memory.copy(second, data)
    try:
        hip.open_ipc(exported, memory.get_device("hip:0"), nbytes + (64 << 20))
        too_far = "opened"
    except OutOfRangeError:
        too_far = "OutOfRangeError"
    first.free()
    second.free()
    _say(read=hashlib.sha256(seen.tobytes()).hexdigest(), wrote=hashlib.sha256(data.tobytes()).hexdigest(),
         mappings=mappings, left=hip.ipc_mappings(), too_far=too_far)


if __name__ == "__main__":
    assert os.environ.get("HMC_HIP_ON_CUDA") == "1", "run me switched to the HIP-on-CUDA runtime"
    globals()[sys.argv[1]](*sys.argv[2:])
