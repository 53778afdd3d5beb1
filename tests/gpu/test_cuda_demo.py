"""`hmc demo --json` on a GPU machine: besides the host paths it moves CUDA memory across processes over ipc and staged, every byte verified."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hmc import memory
from hmc.memory import DeviceKind

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
SIZE = 256 << 20


def test_demo_moves_and_verifies_cuda_memory_over_ipc_and_staged(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("HMC_")}
    private = tmp_path / "hmc"
    private.mkdir(mode=0o700)  # hmcd refuses a socket directory open to others
    env["HMC_SOCKET"] = str(private / "demo.sock")
    result = subprocess.run(
        [sys.executable, "-m", "hmc.cli._main", "demo", "--size", f"{SIZE >> 20}MiB", "--json"],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["ok"]
    gpus = [device.name for device in memory.devices() if device.kind is DeviceKind.CUDA]
    cuda = report["cuda"]
    assert cuda["source"] == "cuda:0" and cuda["target"] == (gpus[1] if len(gpus) > 1 else "cuda:0")
    assert cuda["size_bytes"] == SIZE and "error" not in cuda
    by_path = {row["path"]: row for row in cuda["paths"]}
    assert by_path["ipc"]["negotiated"] == "ipc"
    for path in ("ipc", "staged"):
        row = by_path[path]
        assert row["available"] and row["verified"] and row["bytes"] == SIZE and row["gbps"] > 0 and row["warm_up_bytes"] == 4096, row
    assert not by_path["rdma"]["available"] and "local" not in by_path
    assert {"local", "ipc", "staged"} <= {row["path"] for row in report["paths"] if row["available"] and row["verified"]}
