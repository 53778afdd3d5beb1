"""A copy stuck on the owner's GPU, on the staged ring (one host): a hung GPU made real.

The owner (this process) has its copy streams wait on a pinned word (`cuStreamWaitValue32`) before its first slot
copy, and its bound on a slot copy is cut to 2 s. The peer, declaring its GPU AMD, writes into the owner's device
buffer. What must hold: the write fails typed at the owner's bound (not its own 60 s deadline) with nothing landed;
the owner's `unregister` says the memory must be kept (a copy into it may still run); when the word is set (the GPU
"recovers") the copy runs from the ring the owner kept pinned and mapped, every byte right, and the pair moves
data again over a fresh connection. Skipped without a GPU.
"""

from __future__ import annotations

import mmap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hmc import memory
from hmc.agent import Agent
from hmc.config import Config
from hmc.errors import DeviceError, TimeoutError
from hmc.testing import PeerProcess
from hmc.transport import _staged_owner
from hmc.transport._pinned import SlotCopier

from ._support import POISON, assert_bytes_equal, host_copy, random_bytes

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(180)]


class _Gate:
    """A pinned word the GPU can wait on: `hold(stream)` queues a wait for it, `open()` lets every such wait pass."""

    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        from hmc.memory._cuda_driver import check

        self.cu, self.check = cu, check
        self._memory = mmap.mmap(-1, mmap.PAGESIZE)
        self._word = np.frombuffer(self._memory, np.uint32, count=1)
        self._device = 0

    def hold(self, stream: Any) -> None:
        """Make `stream` wait for the word (its device's context current)."""
        cu, check = self.cu, self.check
        if not self._device:
            host = self._word.ctypes.data
            check(cu.cuMemHostRegister(host, mmap.PAGESIZE, cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP))
            self._device = int(check(cu.cuMemHostGetDevicePointer(host, 0)))
        check(cu.cuStreamWaitValue32(stream, self._device, 1, cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ))

    def open(self) -> None:
        self._word[0] = 1

    def drained(self, runtime: Any, ordinal: int) -> None:
        """Wait for all the device's work in this process (the copy that was held included) to finish."""
        with runtime.use(ordinal):
            self.check(self.cu.cuCtxSynchronize())


def test_staged_a_copy_stuck_on_the_owners_gpu_keeps_its_buffer_and_ring_until_it_ran(
    tmp_path: Path, peer_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = Config(socket=str(tmp_path / "no-hmcd.sock"), timeout_s=60.0)
    monkeypatch.setattr(_staged_owner, "_OWNER_COPY_S", 2.0)
    gate = _Gate()
    held: list[Any] = []  # the GPU side of the owner's first connection: its streams wait for the gate
    start = SlotCopier.start

    def stuck_start(self: SlotCopier, region: Any, offsets: Any, lengths: Any, slot: Any, at: int, *, to_slot: bool, deadline: float) -> Any:
        if not held:
            gpu = self._gpu(region.device)  # the owner's own streams, made to hang
            with gpu.backend.runtime.use(gpu.device.index):
                for lane in (gpu.lane, gpu.kernels, gpu.small):
                    gate.hold(lane.stream.native)
            held.append(gpu)
        return start(self, region, offsets, lengths, slot, at, to_slot=to_slot, deadline=deadline)

    monkeypatch.setattr(SlotCopier, "start", stuck_start)
    size = (8 << 20) + 5
    data = random_bytes(size, 41)
    with Agent(config, daemon=False) as owner, PeerProcess(config.replace(vendor_override={peer_device: "amd"}), timeout=120.0) as peer:
        theirs = peer.register(size, device=peer_device)
        peer.fill(theirs.id, data.tobytes())
        region = memory.allocate(size, "cuda:0")
        memory.fill(region, POISON)
        mine = owner.register(region)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            peer.transfer("write", theirs.id, mine.descriptor, 0, 0, size)
        assert time.monotonic() - started < 30.0, "failed at the transfer's deadline, not the owner's copy bound"
        assert held, "the owner's copy was not the one made to hang"
        assert_bytes_equal(host_copy(mine), np.full(size, POISON, np.uint8), "before the GPU recovers")
        with pytest.raises(DeviceError, match="still run"):  # the stuck copy's hold: its memory must be kept
            owner.unregister(mine)
        gate.open()
        gate.drained(held[0].backend.runtime, held[0].device.index)
        landed = np.full(size, POISON, np.uint8)
        memory.copy(landed, region)
        assert_bytes_equal(landed, data, "the stuck copy, run late from the ring the owner kept")
        fresh = owner.register(memory.allocate(size, "cuda:0"))
        memory.fill(fresh.region, POISON)
        assert peer.transfer("write", theirs.id, fresh.descriptor, 0, 0, size) == "staged"
        assert_bytes_equal(host_copy(fresh), data, "the next write, over a fresh connection")
