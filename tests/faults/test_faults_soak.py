"""The short soak CI runs: bench/soak.py's engine, small.

Random verified transfers over ipc and staged (every byte compared with a model of the
buffer it landed in), a load run of a few agents with transfers in flight, and checks
that the soak's own parts hold: its batches never overlap at the destination, and its
whole-buffer check sees a byte that changed behind its back. The full-size runs
(100,000 transfers, 64 agents x 100 in flight) are `python bench/soak.py`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from hmc.config import Config

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def soak(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """bench/soak.py as the module `soak` (bench/ is not a package; load workers import bench/soak_load.py by name)."""
    monkeypatch.syspath_prepend(str(BENCH))
    yield importlib.import_module("soak")


def test_random_batches_have_disjoint_destinations_inside_the_buffer(soak: ModuleType) -> None:
    packed = 0
    for seed in range(2000):
        rng = np.random.default_rng(seed)
        batch = soak.Batch.draw(rng, 16, 1 << 16, 1 << 21, 1 << 21)
        assert 1 <= batch.lengths.size <= 16 and batch.lengths.min() >= 1 and batch.lengths.max() <= 1 << 16
        assert batch.src.min() >= 0 and (batch.src + batch.lengths).max() <= 1 << 21
        order = np.argsort(batch.dst)
        starts, ends = batch.dst[order], (batch.dst + batch.lengths)[order]
        assert starts[0] >= 0 and ends[-1] <= 1 << 21
        assert (starts[1:] >= ends[:-1]).all(), f"seed {seed}: destinations overlap"
        packed += batch.lengths.size > 1 and bool((starts[1:] == ends[:-1]).all())
    assert packed > 50  # end-to-end batches occur, so coalescing is exercised


def test_short_soak_moves_every_byte_right_and_stays_bounded(soak: ModuleType, config: Config) -> None:
    spec = soak.SoakSpec(transfers=2000, warmup=500, max_bytes=256 << 10, full_check_every=500, deadline_s=10.0)
    result = soak.run_soak(spec, config)
    assert result["completed"] == 2500 and result["stuck"] is None
    assert result["mismatches"] == 0, result["examples"]
    assert result["errors"] == {}, result["examples"]
    assert result["hung"] == 0 and result["lost"] == 0
    assert result["full_checks"] == 5
    seen = {(r["path"], r["op"], r["workload"]) for r in result["rows"]}
    assert {(p, op, w) for p in ("ipc", "staged") for op in ("WRITE", "READ") for w in ("soak-random", "soak-random-peer-initiated")} <= seen
    assert all(r["verified"] for r in result["rows"])
    assert set(result["rss_growth"]) == {"self", "peer_ipc", "peer_staged"}
    assert all(growth < spec.rss_limit for growth in result["rss_growth"].values()), result["resources"]
    assert result["ok"]


def test_the_soak_sees_bytes_changed_behind_its_back(soak: ModuleType, config: Config) -> None:
    spec = soak.SoakSpec(transfers=0, warmup=0, max_bytes=64 << 10, deadline_s=10.0)
    with soak.open_soak(spec, config) as s:
        for i in range(50):
            s.step(i)
        s.full_check()
        assert s.tally.ok and s.tally.mismatches == 0
        remote = s.remotes["staged"]
        changed = bytes(~remote.model[1000:1010])
        remote.peer.fill(remote.descriptor.id, changed, offset=1000)
        s.local[77] ^= 0xFF
        s.full_check()
    assert s.tally.mismatches == 1 and s.tally.mismatched_bytes == 11
    assert sorted((e["buffer"], e["wrong_bytes"]) for e in s.tally.examples["stray"]) == [("local", 1), ("staged", 10)]


def test_short_load_run_loses_nothing(soak: ModuleType, config: Config) -> None:
    spec = soak.LoadSpec(agents=4, in_flight=8, targets=2, seconds=3.0, deadline_s=10.0)
    result = soak.run_load(spec, config)
    assert result["lost"] == 0 and result["hung"] == 0 and result["unresponsive_workers"] == 0 and result["stuck"] == []
    assert result["mismatches"] == 0, result["examples"]
    assert result["errors"] == {}, result["examples"]
    assert result["transfers"] >= 2 * spec.agents * spec.in_flight  # every slot wrote and read back at least once
    assert {(r["path"], r["op"]) for r in result["rows"]} == {(p, op) for p in ("ipc", "staged") for op in ("WRITE", "READ")}
    assert result["ok"]
