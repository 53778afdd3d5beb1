"""Every request shape through the proxy and HMCConnector, KV identity, readable refusals, a decode outage.

Real vLLM OpenAI servers on the CPU, all serving one generated model as "tiny": a plain instance (the
reference), a prefill instance P, a decode instance D that reaches the same weights through a
symlinked path (the model is compared by identity, not path), and two decode instances with another
block size, one per kv_load_failure_policy. A proxy pairs P with each decode instance, and one pairs
P with a decode URL nothing listens on.
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

if importlib.util.find_spec("vllm") is not None:
    from hmc_vllm.testing import ProxyProcess, VllmServer, free_port, make_tiny_llama, post_json

MAX_TOKENS = 12
LEASE_S = 30.0  # long: every release below must come from a refusal, not from the lease
NAME = "tiny"
CHAT = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog 12"}]


@dataclass
class Cluster:
    single: VllmServer
    prefill: VllmServer
    decode: VllmServer
    proxy: ProxyProcess  # prefill -> decode
    to_other_blocks: dict[str, ProxyProcess]  # policy -> proxy to a decode instance of block size 64
    to_nowhere: ProxyProcess  # prefill -> a decode URL nothing listens on


def _kv(role: str, policy: str = "fail") -> dict[str, Any]:
    return {"kv_connector": "hmc", "kv_role": role, "kv_load_failure_policy": policy, "kv_connector_extra_config": {"lease_s": LEASE_S}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    link = tmp_path_factory.mktemp("elsewhere") / "model_link"
    link.symlink_to(model, target_is_directory=True)
    logs = tmp_path_factory.mktemp("logs")
    named = ("--served-model-name", NAME)
    started: list[Any] = []
    try:
        single = VllmServer(model, log=logs / "single.log", extra_args=named)
        prefill = VllmServer(model, kv_transfer_config=_kv("kv_producer"), log=logs / "prefill.log", extra_args=named)
        decode = VllmServer(link, kv_transfer_config=_kv("kv_both"), log=logs / "decode.log", extra_args=named)
        other = {
            policy: VllmServer(model, kv_transfer_config=_kv("kv_consumer", policy), log=logs / f"other-{policy}.log", extra_args=(*named, "--block-size", "64"))
            for policy in ("fail", "recompute")
        }
        started += [single, prefill, decode, *other.values()]
        for server in started:
            server.wait_ready(timeout=600)
        proxy = ProxyProcess([prefill.url], [decode.url], log=logs / "proxy.log", options=("--timeout", "60"))
        to_other = {policy: ProxyProcess([prefill.url], [server.url], log=logs / f"proxy-{policy}.log", options=("--timeout", "60")) for policy, server in other.items()}
        to_nowhere = ProxyProcess([prefill.url], [f"http://127.0.0.1:{free_port()}"], log=logs / "proxy-nowhere.log", options=("--timeout", "60"))
        started += [proxy, *to_other.values(), to_nowhere]
        for item in (proxy, *to_other.values()):
            item.wait_ready()
        yield Cluster(single, prefill, decode, proxy, to_other, to_nowhere)
    finally:
        for item in started:
            item.stop()


def _metric(server: VllmServer, name: str) -> float:
    """The sum of a metric's samples on the server's /metrics."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as reply:
        values = [float(line.rsplit(" ", 1)[1]) for line in reply.read().decode().splitlines() if line.startswith(name + "{") or line.startswith(name + " ")]
    assert values, f"no {name} in /metrics"
    return sum(values)


def _wait_kv_free(server: VllmServer, within: float) -> float:
    """Seconds until the server's KV cache usage is 0 (fails after `within`)."""
    started = time.monotonic()
    while _metric(server, "vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() - started < within, f"KV still in use after {within:g}s"
        time.sleep(0.05)
    return time.monotonic() - started


def _loaded(server: VllmServer) -> int:
    assert server.log_path is not None
    return len(re.findall(r"HMCConnector: loaded request", server.log_path.read_text(errors="replace")))


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return post_json(url + path, {"model": NAME, **body}, timeout=120)


def _stream(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a streamed reply, [DONE] excluded."""
    request = urllib.request.Request(url + path, data=json.dumps({"model": NAME, **body, "stream": True}).encode(), headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=120) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def _comparable(reply: dict[str, Any]) -> Any:
    """What two instances' replies must agree on: the choices (ids and timestamps differ) and the usage."""
    return {"choices": reply["choices"], "usage": reply.get("usage")}


def test_the_generated_model_reads_every_prompt_token(cluster: Cluster) -> None:
    """Changing one token in the middle of a prompt changes the greedy continuation (else KV could be wrong unnoticed)."""
    for length in (20, 150, 400):
        prompt = [(i * 37 + 11) % 400 + 5 for i in range(length)]
        changed = list(prompt)
        changed[length // 2] = (changed[length // 2] + 1) % 400 + 5
        outputs = [_post(cluster.single.url, "/v1/completions", {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0})[1]["choices"][0]["text"] for p in (prompt, changed)]
        assert outputs[0] != outputs[1], length


SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "n=2 seeded sampling": ("/v1/completions", {"prompt": "the quick brown fox jumps over", "n": 2, "temperature": 1.0, "seed": 7}),
    "prompt list": ("/v1/completions", {"prompt": ["dog fox", "over the lazy dog 3 over the lazy dog 4 over the lazy dog 5 over the lazy dog 6 over the"], "temperature": 0}),
    "token-id prompt list with n=2": ("/v1/completions", {"prompt": [[5, 9, 11, 40], list(range(5, 105))], "n": 2, "temperature": 0.8, "seed": 3}),
    "echo and logprobs": ("/v1/completions", {"prompt": "jumps over the lazy dog 17 and the quick", "echo": True, "logprobs": 3, "temperature": 0}),
    "stop string": ("/v1/completions", {"prompt": "the quick brown fox jumps over the lazy dog", "stop": ["the"], "temperature": 0}),
    "chat": ("/v1/chat/completions", {"messages": CHAT, "temperature": 0}),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_request_shapes_through_the_proxy_equal_one_instance(cluster: Cluster, shape: str) -> None:
    path, body = SHAPES[shape]
    body = {"max_tokens": MAX_TOKENS, **body}
    status, expected = _post(cluster.single.url, path, body)
    assert status == 200, expected
    before = _loaded(cluster.decode)
    started = time.monotonic()
    status, got = _post(cluster.proxy.url, path, body)
    assert status == 200, got
    assert time.monotonic() - started < 20  # nothing waited for KV that never came
    assert _comparable(got) == _comparable(expected)
    # Every sub-request loaded its KV over HMC, but for prompt logprobs, which vLLM computes from the prompt itself.
    recomputed = body.get("echo") and body.get("logprobs") is not None
    assert _loaded(cluster.decode) - before == (0 if recomputed else len(expected["choices"]))
    _wait_kv_free(cluster.prefill, within=5.0)  # and P holds nothing afterwards


def test_streaming_with_usage_through_the_proxy_equals_one_instance(cluster: Cluster) -> None:
    body = {"prompt": ["the quick brown fox", "dog fox dog fox the the the quick quick brown"], "max_tokens": MAX_TOKENS, "temperature": 0, "stream_options": {"include_usage": True}}
    expected, got = _stream(cluster.single.url, "/v1/completions", body), _stream(cluster.proxy.url, "/v1/completions", body)

    def texts(events: list[dict[str, Any]]) -> dict[int, str]:
        out: dict[int, str] = {}
        for event in events:
            for choice in event["choices"]:
                out[choice["index"]] = out.get(choice["index"], "") + choice["text"]
        return out

    assert texts(got) == texts(expected) and len(texts(got)) == 2
    assert got[-1]["usage"] == expected[-1]["usage"] and got[-1]["usage"]["prompt_tokens"] > 0


def _prefilled(cluster: Cluster, prompt: list[int]) -> dict[str, Any]:
    status, reply = _post(cluster.prefill.url, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, reply
    return dict(reply["kv_transfer_params"])


def test_kv_for_another_prompt_is_refused_readably_and_never_cached(cluster: Cluster) -> None:
    """The swapped-params attack: B sent to the decode instance with the params P returned for A (4 tokens differ)."""
    a = [(i * 13 + 7) % 400 + 5 for i in range(200)]
    b = list(a)
    for i in (60, 61, 120, 121):
        b[i] = (b[i] + 3) % 400 + 5
    params = _prefilled(cluster, a)
    assert _metric(cluster.prefill, "vllm:kv_cache_usage_perc") > 0  # P holds A's blocks
    status, reply = _post(cluster.decode.url, "/v1/completions", {"prompt": b, "max_tokens": MAX_TOKENS, "temperature": 0, "kv_transfer_params": params})
    assert status == 400, reply
    assert "another prompt" in reply["error"]["message"], reply
    assert _wait_kv_free(cluster.prefill, within=1.0) <= 1.0  # A's blocks are released at the refusal, not at the lease
    _, honest = _post(cluster.proxy.url, "/v1/completions", {"prompt": b, "max_tokens": MAX_TOKENS, "temperature": 0})
    _, reference = _post(cluster.single.url, "/v1/completions", {"prompt": b, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert honest["choices"][0]["text"] == reference["choices"][0]["text"]


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_block_size_mismatch_reaches_the_client_and_frees_the_prefill_at_once(cluster: Cluster, policy: str) -> None:
    status, reply = _post(cluster.to_other_blocks[policy].url, "/v1/completions", {"prompt": "the quick brown fox jumps over the lazy dog 3", "max_tokens": MAX_TOKENS, "temperature": 0})
    refused_at = time.monotonic()
    assert status == 409, reply
    assert "block_size: peer 32, here 64" in reply["error"]["message"], reply
    _wait_kv_free(cluster.prefill, within=1.0 - (time.monotonic() - refused_at))


def test_a_refused_stream_says_why_and_frees_the_prefill_at_once(cluster: Cluster) -> None:
    """vLLM checks a streamed request after its stream began: the refusal is the stream's first event."""
    events = _stream(cluster.to_other_blocks["fail"].url, "/v1/completions", {"prompt": "the quick brown fox jumps over", "max_tokens": MAX_TOKENS})
    refused_at = time.monotonic()
    assert "block_size: peer 32, here 64" in events[0]["error"]["message"], events
    _wait_kv_free(cluster.prefill, within=1.0 - (time.monotonic() - refused_at))


def test_with_the_decode_instance_down_requests_fail_fast_and_nothing_is_prefilled(cluster: Cluster) -> None:
    proxy = cluster.to_nowhere
    proxy.wait_ready(status=503)  # up, and its monitor found no decode instance
    prompts_before = _metric(cluster.prefill, "vllm:prompt_tokens_total")
    for _ in range(4):
        started = time.monotonic()
        status, reply = _post(proxy.url, "/v1/completions", {"prompt": "the quick brown fox", "max_tokens": MAX_TOKENS})
        assert status == 503 and time.monotonic() - started < 2.0, reply
        assert "decode" in reply["error"]["message"]
    assert _metric(cluster.prefill, "vllm:prompt_tokens_total") == prompts_before
    assert _metric(cluster.prefill, "vllm:kv_cache_usage_perc") == 0
