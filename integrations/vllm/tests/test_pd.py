"""Disaggregated prefill/decode with HMCConnector: real vLLM OpenAI servers, the proxy, a tiny model.

Five servers run for the module: one plain instance (the reference), a prefill instance P, a prefill
instance whose pushed blocks are scrambled (the negative control), and two decode instances (one with
`kv_role` kv_both, one kv_consumer).
Each proxy pairs one prefill with one decode instance, so every test knows which pair it exercises.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

if importlib.util.find_spec("vllm") is not None:
    from hmc_vllm.testing import PROMPTS, ProxyProcess, VllmServer, make_tiny_llama, post_json, server_env

MAX_TOKENS = 12
LEASE_S = 8.0
TESTS_DIR = Path(__file__).parent


@dataclass
class Cluster:
    model: Path
    single: VllmServer
    prefill: VllmServer
    scrambling: VllmServer
    decode: VllmServer
    doomed: VllmServer
    proxy: ProxyProcess  # prefill -> decode
    scrambled: ProxyProcess  # scrambling -> decode
    to_doomed: ProxyProcess  # prefill -> doomed


def _kv(role: str, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "HMCConnector", "kv_role": role, "kv_connector_extra_config": {"lease_s": LEASE_S, **extra}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    logs = tmp_path_factory.mktemp("logs")
    started: list[Any] = []
    try:
        single = VllmServer(model, log=logs / "single.log")
        prefill = VllmServer(model, kv_transfer_config=_kv("kv_producer"), log=logs / "prefill.log")
        scrambling = VllmServer(
            model,
            kv_transfer_config={**_kv("kv_producer"), "kv_connector_module_path": "_corrupt_connector"},
            log=logs / "scrambling.log",
            env=server_env(PYTHONPATH=os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])),
        )
        decode = VllmServer(model, kv_transfer_config=_kv("kv_both"), log=logs / "decode.log")  # the role the README shows
        doomed = VllmServer(model, kv_transfer_config=_kv("kv_consumer"), log=logs / "doomed.log")
        started += [single, prefill, scrambling, decode, doomed]
        for server in started:
            server.wait_ready(timeout=600)
        proxies = [
            ProxyProcess([p.url], [d.url], log=logs / f"proxy-{i}.log", options=("--timeout", "60"))
            for i, (p, d) in enumerate([(prefill, decode), (scrambling, decode), (prefill, doomed)])
        ]
        started += proxies
        for proxy in proxies:
            proxy.wait_ready()
        yield Cluster(model, single, prefill, scrambling, decode, doomed, *proxies)
    finally:
        for item in started:
            item.stop()


def _body(cluster: Cluster, prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": str(cluster.model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def _text(url: str, body: dict[str, Any]) -> str:
    status, reply = post_json(url + "/v1/completions", body)
    assert status == 200, reply
    return str(reply["choices"][0]["text"])


def _streamed_text(url: str, body: dict[str, Any]) -> str:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(), headers={"Content-Type": "application/json"})
    pieces = []
    with urllib.request.urlopen(request, timeout=120) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(pieces)


def _loaded(server: VllmServer) -> list[str]:
    """Request ids the decode server says it loaded over HMC (its log)."""
    assert server.log_path is not None
    return re.findall(r"HMCConnector: loaded request (\S+)", server.log_path.read_text(errors="replace"))


def _kv_usage(server: VllmServer) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("vllm:kv_cache_usage_perc"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:kv_cache_usage_perc in /metrics")


def test_greedy_outputs_through_the_proxy_equal_one_instance(cluster: Cluster) -> None:
    before = len(_loaded(cluster.decode))
    for prompt in PROMPTS:
        expected = _text(cluster.single.url, _body(cluster, prompt))
        assert _text(cluster.proxy.url, _body(cluster, prompt)) == expected, prompt
        assert _streamed_text(cluster.proxy.url, _body(cluster, prompt)) == expected, prompt
    assert len(_loaded(cluster.decode)) - before == 2 * len(PROMPTS)  # every decode request took its KV over HMC


def test_scrambled_kv_changes_the_output(cluster: Cluster) -> None:
    """The negative control: the same requests, with the pushed blocks replaced by noise."""
    before = len(_loaded(cluster.decode))
    changed = [_text(cluster.scrambled.url, _body(cluster, p)) != _text(cluster.single.url, _body(cluster, p)) for p in PROMPTS]
    assert len(_loaded(cluster.decode)) - before == len(PROMPTS)
    assert all(changed), changed


def test_prefill_blocks_are_released_after_the_transfer(cluster: Cluster) -> None:
    _text(cluster.proxy.url, _body(cluster, PROMPTS[1]))
    deadline = time.monotonic() + 10
    while _kv_usage(cluster.prefill) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _kv_usage(cluster.prefill) == 0


def test_a_load_that_cannot_succeed_fails_the_request_instead_of_hanging(cluster: Cluster) -> None:
    """Params of a request whose blocks the prefill already released: the decode load fails as data."""
    status, prefilled = post_json(cluster.prefill.url + "/v1/completions", {**_body(cluster, PROMPTS[2]), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200
    params = prefilled["kv_transfer_params"]
    assert _text(cluster.decode.url, {**_body(cluster, PROMPTS[2]), "kv_transfer_params": params})  # consumes the blocks
    # D knows the load was taken; another D asks P, which refuses either way: while it still holds the request (the
    # first D's acknowledgement of the notification on its way) or once it let go of it
    for decode, says in ((cluster.decode, r"all taken"), (cluster.doomed, r"is not held here|served its \d+ load\(s\) or was released")):
        assert decode.log_path is not None
        before = len(decode.log_path.read_text(errors="replace"))
        started = time.monotonic()
        status, reply = post_json(decode.url + "/v1/completions", {**_body(cluster, PROMPTS[2]), "kv_transfer_params": dict(params)}, timeout=60)
        assert status >= 500 and time.monotonic() - started < 20, (status, reply)  # kv_load_failure_policy "fail"
        assert re.search(says, decode.log_path.read_text(errors="replace")[before:]), says
    assert _text(cluster.proxy.url, _body(cluster, PROMPTS[2])) == _text(cluster.single.url, _body(cluster, PROMPTS[2]))


def test_decode_killed_mid_request_frees_prefill_blocks_and_the_rest_keep_serving(cluster: Cluster) -> None:
    """D is frozen while P holds the request's blocks, then killed: the proxy answers 502 and has P free them."""
    cluster.doomed.kill(signal.SIGSTOP)
    result: dict[str, Any] = {}

    def ask() -> None:
        started = time.monotonic()
        result["status"], result["body"] = post_json(cluster.to_doomed.url + "/v1/completions", _body(cluster, PROMPTS[3]), timeout=90)
        result["seconds"] = time.monotonic() - started

    client = threading.Thread(target=ask)
    client.start()
    deadline = time.monotonic() + 60
    while _kv_usage(cluster.prefill) == 0 and time.monotonic() < deadline:  # P prefilled and now holds the blocks
        time.sleep(0.1)
    assert _kv_usage(cluster.prefill) > 0
    held_at = time.monotonic()
    cluster.doomed.kill(signal.SIGKILL)
    client.join(timeout=60)
    assert not client.is_alive(), "the proxy did not answer after the decode instance died"
    assert result["status"] == 502, result
    assert "decode" in result["body"]["error"]["message"] and cluster.doomed.url in result["body"]["error"]["message"]

    freed_by = time.monotonic() + 2.0  # the proxy's release, well before the lease (LEASE_S after the prefill)
    while _kv_usage(cluster.prefill) > 0 and time.monotonic() < freed_by:
        time.sleep(0.05)
    assert _kv_usage(cluster.prefill) == 0, "the prefill instance kept the dead decode instance's blocks"
    assert time.monotonic() < held_at + LEASE_S

    assert _text(cluster.proxy.url, _body(cluster, PROMPTS[0])) == _text(cluster.single.url, _body(cluster, PROMPTS[0]))
