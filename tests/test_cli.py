"""The `hmc` command as a user runs it: real hmcd, real agents in other processes, JSON out."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from control_fixtures import REPO, DaemonSet, Hmcd, clean_env, daemon_set

from hmc.testing import PeerProcess


@pytest.fixture(scope="module")
def daemons() -> Iterator[DaemonSet]:
    yield from daemon_set()


@pytest.fixture(scope="module")
def hmcd(daemons: DaemonSet) -> Hmcd:
    return daemons.start("cli-node")


def hmc(*args: str, env: dict[str, str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hmc.cli._main", *args], capture_output=True, text=True, timeout=timeout, env=env or clean_env(), cwd=REPO
    )


def test_help_answers() -> None:
    result = hmc("--help")
    assert result.returncode == 0
    for command in ("status", "devices", "buffers", "path", "bench", "demo"):
        assert command in result.stdout
    assert "--json" in hmc("path", "--help").stdout


def test_status_and_devices(hmcd: Hmcd) -> None:
    status = json.loads(hmc("status", "--json", "--address", hmcd.unix_address).stdout)
    assert status["node"] == "cli-node"
    assert any(device["name"] == "host" for device in status["devices"])
    devices = json.loads(hmc("devices", "--json", "--address", hmcd.unix_address).stdout)
    assert devices["source"] == "hmcd" and devices["devices"][0]["name"] == "host"


def test_buffers_and_path_between_two_agents(hmcd: Hmcd) -> None:
    config = hmcd.config()
    with PeerProcess(config, daemon=True) as first, PeerProcess(config, daemon=True) as second:
        first.register(4096, name="cli-src")
        second.register(4096, name="cli-dst")
        listing = json.loads(hmc("buffers", "--json", "--address", hmcd.unix_address).stdout)
        listed = listing["buffers"]
        assert {"cli-src", "cli-dst"} <= {b["name"] for b in listed} and listing["directory_age_s"] == 0
        assert all(b["access_key"] == "<redacted>" for b in listed)
        path = json.loads(hmc("path", "cli-src", "cli-dst", "--json", "--address", hmcd.unix_address).stdout)
        assert path["path"] == "ipc"
        assert {"path": "local", "reason": "the buffers belong to different agents"} in path["rejected"]
        table = hmc("path", "cli-src", "cli-dst", "--address", hmcd.unix_address).stdout
        assert "chosen" in table and "rejected" in table


def test_errors_are_one_line_and_nonzero(tmp_path: Path) -> None:
    result = hmc("status", "--address", f"unix:{tmp_path}/nobody.sock", "--timeout", "2")
    assert result.returncode == 1
    assert "UnavailableError" in result.stderr and "Traceback" not in result.stderr


def test_demo_starts_hmcd_and_verifies_every_path(tmp_path: Path) -> None:
    env = clean_env(HMC_SOCKET=str(tmp_path / "demo.sock"))
    result = hmc("demo", "--size", "8MiB", "--json", env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["hmcd"] == "started" and report["ok"]
    by_path = {row["path"]: row for row in report["paths"]}
    for path in ("local", "ipc", "staged"):
        assert by_path[path]["available"] and by_path[path]["verified"], by_path[path]
        assert by_path[path]["bytes"] == 8 << 20 and by_path[path]["used"] == path
    assert not by_path["rdma"]["available"] and "rdma" in by_path["rdma"]["why"] and "used" not in by_path["rdma"]
    assert ("cuda" in report) == ("cuda_cross_vendor" in report)  # device sections only where CUDA devices exist (tests/gpu)
    assert not (tmp_path / "demo.sock").exists()
