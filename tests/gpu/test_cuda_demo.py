"""`hmc demo --json --hip-on-cuda` on a GPU machine, one GPU or more: besides the host paths it moves CUDA memory across processes
over ipc and staged, every byte verified, then once more to a peer that declares its GPU AMD (a cross-vendor pair: negotiation
picks staged), and once more to a peer running HMC's HIP backend on the HIP-on-CUDA runtime (a CUDA -> HIP pair)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hmc import memory
from hmc.memory import DeviceKind

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
SIZE = 256 << 20


@pytest.fixture(scope="module")
def demo_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The JSON report of one `hmc demo --json` run (it starts its own hmcd on a private socket), which exited 0."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("HMC_")}
    private = tmp_path_factory.mktemp("hmc")
    private.chmod(0o700)  # hmcd refuses a socket directory open to others
    env["HMC_SOCKET"] = str(private / "demo.sock")
    result = subprocess.run(
        [sys.executable, "-m", "hmc.cli._main", "demo", "--size", f"{SIZE >> 20}MiB", "--json", "--hip-on-cuda"],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def test_demo_moves_and_verifies_cuda_memory_over_ipc_and_staged(demo_report: dict[str, Any]) -> None:
    assert demo_report["ok"]
    gpus = [device.name for device in memory.devices() if device.kind is DeviceKind.CUDA]
    cuda = demo_report["cuda"]
    assert cuda["source"] == "cuda:0" and cuda["target"] == (gpus[1] if len(gpus) > 1 else "cuda:0")
    assert cuda["size_bytes"] == SIZE and "error" not in cuda
    by_path = {row["path"]: row for row in cuda["paths"]}
    assert by_path["ipc"]["negotiated"] == "ipc"
    for path in ("ipc", "staged"):
        row = by_path[path]
        assert row["available"] and row["verified"] and row["used"] == path, row
        assert row["bytes"] == SIZE and row["gbps"] > 0 and row["warm_up_bytes"] == 4096, row
    assert not by_path["rdma"]["available"] and "local" not in by_path
    assert {"local", "ipc", "staged"} <= {row["path"] for row in demo_report["paths"] if row["available"] and row["verified"] and row["used"] == row["path"]}


def test_demo_moves_cuda_memory_to_a_peer_declared_amd_over_staged(demo_report: dict[str, Any]) -> None:
    """The peer declares its GPU (cuda:0 itself on a one-GPU machine) AMD: vendor IPC is refused, staged negotiated and verified."""
    cuda, cross = demo_report["cuda"], demo_report["cuda_cross_vendor"]
    assert (cross["source"], cross["target"], cross["size_bytes"]) == (cuda["source"], cuda["target"], SIZE)
    assert cross["vendor_override"] == {cross["target"]: "amd"} and "error" not in cross
    by_path = {row["path"]: row for row in cross["paths"]}
    staged = by_path["staged"]
    assert staged["negotiated"] == "staged" and staged["used"] == "staged", staged
    assert staged["available"] and staged["verified"] and staged["bytes"] == SIZE and staged["gbps"] > 0, staged
    assert any(r["path"] == "ipc" and r["reason"].startswith("cross-vendor pair (amd vs nvidia)") for r in staged["rejected"]), staged
    assert not by_path["ipc"]["available"] and "cross-vendor" in by_path["ipc"]["why"] and "local" not in by_path


def test_hip_on_cuda_demo_moves_cuda_memory_to_a_hip_agent_over_staged(demo_report: dict[str, Any]) -> None:
    """The third peer's GPU is hip:N (vendor AMD) through the HIP-on-CUDA runtime: staged negotiated, used and verified."""
    cuda, hip = demo_report["cuda"], demo_report["cuda_to_hip"]
    assert (hip["source"], hip["target"], hip["size_bytes"]) == (cuda["source"], cuda["target"].replace("cuda:", "hip:"), SIZE)
    assert hip["runtime"] == "hip_on_cuda" and "error" not in hip
    by_path = {row["path"]: row for row in hip["paths"]}
    staged = by_path["staged"]
    assert staged["negotiated"] == "staged" and staged["used"] == "staged", staged
    assert staged["available"] and staged["verified"] and staged["bytes"] == SIZE and staged["gbps"] > 0, staged
    assert not by_path["ipc"]["available"], by_path["ipc"]
