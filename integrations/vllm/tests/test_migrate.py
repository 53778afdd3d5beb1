"""KV-cache migration through hmcd: a real hmcd, two real vLLM servers attached to it, and the example script.

Instance B loads each request's blocks with a third-party transfer (hmc.Client.submit): hmcd instructs
instance A's agent to write them into B's. A's own greedy output for the same prompt is the reference.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

if importlib.util.find_spec("vllm") is not None:
    from hmc_vllm.testing import PROMPTS, VllmServer, make_tiny_llama, post_json, server_env

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "migrate.py"


@pytest.fixture(scope="module")
def hmcd_socket() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="hmc-", dir="/tmp")  # unix socket paths are short
    socket = os.path.join(directory, "hmcd.sock")
    log = open(os.path.join(directory, "hmcd.log"), "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen([sys.executable, "-m", "hmc.control._hmcd_main", "--socket", socket, "--node", "vllm-node"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(socket):
            assert process.poll() is None and time.monotonic() < deadline, "hmcd did not start"
            time.sleep(0.05)
        yield socket
    finally:
        process.terminate()
        process.wait(10)
        log.close()


@pytest.fixture(scope="module")
def instances(hmcd_socket: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, VllmServer, VllmServer]]:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    logs = tmp_path_factory.mktemp("logs")
    env = server_env(HMC_SOCKET=hmcd_socket)
    a = VllmServer(model, kv_transfer_config={"kv_connector": "HMCConnector", "kv_role": "kv_producer"}, log=logs / "a.log", env=env)
    b = VllmServer(
        model, kv_transfer_config={"kv_connector": "HMCConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"mode": "hmcd"}},
        log=logs / "b.log", env=env,
    )
    try:
        a.wait_ready(timeout=600)
        b.wait_ready(timeout=600)
        yield model, a, b
    finally:
        a.stop()
        b.stop()


def test_example_migrates_kv_through_hmcd_and_b_continues_exactly(hmcd_socket: str, instances: tuple[Path, VllmServer, VllmServer]) -> None:
    model, a, b = instances
    for prompt in PROMPTS:
        status, reference = post_json(a.url + "/v1/completions", {"model": str(model), "prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert status == 200
        run = subprocess.run(
            [sys.executable, str(EXAMPLE), "--a", a.url, "--b", b.url, "--prompt", prompt, "--json"],
            capture_output=True, text=True, timeout=180, env={**os.environ, "HMC_SOCKET": hmcd_socket},
        )
        assert run.returncode == 0, run.stderr
        report = json.loads(run.stdout)
        assert report["text"] == reference["choices"][0]["text"], prompt
        assert len([c for c in report["kv_caches"] if c.endswith("/tp0/kv0")]) == 2  # A's and B's, registered once each
        blocks = len(report["source"]["blocks"])
        assert report["hmcd_transfers_done"] == 1
        # every block of all 4 layers (16 KiB per layer and block: 32 tokens x 2 KV heads x head_dim 32 x K,V x fp32)
        assert report["hmcd_bytes"] == blocks * 4 * 16384


def test_example_answers_help() -> None:
    run = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "--a" in run.stdout and "hmcd" in run.stdout
