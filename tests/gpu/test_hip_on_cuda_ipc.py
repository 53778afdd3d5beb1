"""The `ipc` path between two HIP agents (both AMD: HIP IPC), run through the HIP-on-CUDA runtime: two peer processes
switched with HMC_HIP_ON_CUDA=1 on one GPU, one initiating. Negotiation picks ipc (same vendor, same host); a single
range and a batch of scattered ranges (one kernel launch, compiled by hiprtc) both ways, random data into poisoned
destinations, every byte compared. Not run on AMD hardware."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hmc.config import Config
from hmc.testing import PeerProcess
from hmc.testing.hip_on_cuda import SWITCH

from ._support import POISON, random_bytes, scatter

pytestmark = [pytest.mark.cuda, pytest.mark.hip_on_cuda, pytest.mark.timeout(300)]
HIP = "hip:0"
SIZE = (64 << 20) + 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PeerProcess, PeerProcess]]:
    config = Config(socket=str(Path(tmp_path_factory.mktemp("hip-ipc")) / "no-hmcd.sock"), timeout_s=60.0)
    with PeerProcess(config, timeout=120.0, env={SWITCH: "1"}) as a, PeerProcess(config, timeout=120.0, env={SWITCH: "1"}) as b:
        yield a, b


def _ranges(count: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`count` disjoint destination ranges (one ends at the last byte), shuffled, and sources anywhere."""
    rng = np.random.default_rng(seed)
    slot = SIZE // count
    lengths = rng.integers(1, slot + 1, count)
    dst = np.arange(count) * slot + rng.integers(0, slot - lengths + 1)
    dst[-1], lengths[-1] = SIZE - 999, 999
    order = rng.permutation(count)
    dst, lengths = dst[order], lengths[order]
    return rng.integers(0, SIZE - lengths), dst, lengths


@pytest.mark.parametrize("count", [1, 2001])
def test_hip_on_cuda_ipc_between_two_hip_agents_both_ways(pair: tuple[PeerProcess, PeerProcess], count: int) -> None:
    a, b = pair
    data = random_bytes(SIZE, count)
    mine = a.register(SIZE, device=HIP)
    a.fill(mine.id, data.tobytes())
    theirs = b.register(SIZE, fill=POISON, device=HIP)
    src, dst, lengths = _ranges(count, count)
    assert a.transfer("write", mine.id, theirs, src, dst, lengths) == "ipc"
    expected = scatter(np.full(SIZE, POISON, np.uint8), data, src, dst, lengths)
    assert np.array_equal(np.frombuffer(b.contents(theirs.id), np.uint8), expected), "write"
    a.fill(mine.id, bytes([POISON]) * SIZE)
    back = np.arange(count, dtype=np.int64) * (SIZE // count)
    assert a.transfer("read", mine.id, theirs, dst, back, lengths) == "ipc"
    assert np.array_equal(np.frombuffer(a.contents(mine.id), np.uint8), scatter(np.full(SIZE, POISON, np.uint8), expected, dst, back, lengths)), "read"
    a.unregister(mine.id)
    b.unregister(theirs.id)
