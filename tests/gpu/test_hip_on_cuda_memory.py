"""The HIP backend on an NVIDIA GPU, through the HIP-on-CUDA runtime (`hmc.memory._hip_on_cuda`): the backend's
real code (allocation, copies, fill, streams, events, pointers, IPC export and import across processes) in
processes switched with HMC_HIP_ON_CUDA=1. Not run on AMD hardware."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.cuda, pytest.mark.hip_on_cuda]
CHECKS = Path(__file__).with_name("_hip_on_cuda_checks.py")
ENV = {**os.environ, "HMC_HIP_ON_CUDA": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}


def _run(check: str, *args: object) -> dict[str, Any]:
    result = subprocess.run([sys.executable, str(CHECKS), check, *map(str, args)], capture_output=True, text=True, timeout=120, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_hip_on_cuda_backend_allocates_copies_fills_and_resolves() -> None:
    seen = _run("backend")
    assert "hip:0" in seen["devices"] and not any(name.startswith("cuda:") for name in seen["devices"])
    assert (seen["vendor"], seen["physical"]) == ("amd", "nvidia")
    assert "HMC_HIP_ON_CUDA" in seen["absent"]["cuda"]
    assert seen["copied"] and seen["filled"] and seen["streamed"]
    assert seen["device_pointer"] == ["hip:0", "device"]
    assert seen["pinned_pointer"] == ["host", "host_pinned"]
    assert "hip_ipc" in seen["handles"]
    assert seen["registered"] in (None, "hip:0")
    assert seen["kernel"] == ["hiprtc", True]  # the ranges' copy kernel compiled by hiprtc (NVRTC underneath)


def test_hip_on_cuda_ipc_export_and_import_across_processes_every_byte() -> None:
    size = (8 << 20) + 7
    command = [sys.executable, str(CHECKS), "exporter", str(size)]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) as exporter:
        try:
            assert exporter.stdout is not None and exporter.stderr is not None
            line = exporter.stdout.readline()
            assert line, exporter.stderr.read()[-3000:]
            exported = json.loads(line)
            seen = _run("importer", exported["handle"], exported["offset"], exported["pid"], size)
            rest, errors = exporter.communicate("done\n", timeout=60)
            assert exporter.returncode == 0, errors[-3000:]
            after = json.loads(rest.strip().splitlines()[-1])
        except BaseException:
            exporter.kill()
            raise
    assert seen["read"] == exported["digest"]  # every byte the exporter wrote, read through the mapping
    assert after["digest"] == seen["wrote"]  # every byte written through the mapping, seen by the exporter
    assert (seen["mappings"], seen["left"], seen["too_far"]) == (1, 0, "OutOfRangeError")
