"""The disaggregated proxy against real vLLM servers (plain ones: they ignore `kv_transfer_params`).

Two vLLM servers run in subprocesses for the whole module; the proxy runs in this process under uvicorn
on a port the kernel picked, and is talked to over HTTP. Plain servers make every answer checkable: the
decode instance recomputes the prompt, so output through the proxy equals output from one server.

What the proxy sends upstream is observed by `Recorder` (proxy_peers.py), a small HTTP server in front
of a real vLLM server that records every POST and forwards it. With `stamp=True` it also plays the part
of a KV producer's reply (plain vLLM returns no `kv_transfer_params`): each prefill reply gets
parameters naming its prompt, so the decode request's parameters and the release POSTs can be checked
exactly. `decoy` stands in for a decode instance that is healthy but fails the request in a chosen way.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    # Starting two vLLM servers on a small CPU machine takes a minute or more; it counts against the first test.
    pytest.mark.timeout(600),
]

if importlib.util.find_spec("vllm") is not None:
    import httpx

    from proxy_peers import (
        FIRST_EVENT,
        Disaggregated,
        Recorder,
        Served,
        client,
        dead_url,
        decoy,
        disaggregated,
        dying_stream_peer,
        running_proxy,
        silent_listener,
        wait_until,
    )

    from hmc_vllm.bodies import release_body
    from hmc_vllm.testing import PROMPTS, VllmServer, free_port, make_tiny_llama
    from hmc_vllm.upstream import HealthMonitor, Instance, InstancePool, NoInstanceUp

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
MAX_TOKENS = 12
#: Fields no prefill request may carry: they only shape the output.
OUTPUT_FIELDS = {"n", "best_of", "use_beam_search", "echo", "logprobs", "top_logprobs", "prompt_logprobs", "stop", "stream_options"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def servers(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    """Two plain vLLM servers, started together and always stopped."""
    logs = tmp_path_factory.mktemp("logs")
    template = logs / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    started: list[VllmServer] = []
    try:
        for name in ("a", "b"):
            started.append(VllmServer(model, log=logs / f"vllm-{name}.log", extra_args=("--chat-template", str(template))))
        for server in started:
            server.wait_ready()
        yield started[0], started[1]
    finally:
        for server in started:
            server.stop()




def completion(model: Path, prompt: Any, **extra: Any) -> dict[str, Any]:
    return {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def chat(model: Path, prompt: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {"model": str(model), "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def streamed(http: httpx.Client, url: str, body: dict[str, Any]) -> tuple[dict[int, str], list[str]]:
    """POST a streamed request; the text of each choice index and the raw `data:` payloads, in order."""
    texts: dict[int, str] = {}
    events: list[str] = []
    with http.stream("POST", url, json={**body, "stream": True}) as reply:
        assert reply.status_code == 200, reply.read()
        assert reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if events[-1] == "[DONE]":
                continue
            for choice in json.loads(events[-1])["choices"]:  # the usage event has none
                piece = choice.get("text") or choice.get("delta", {}).get("content") or ""
                texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts, events


def streamed_text(http: httpx.Client, url: str, body: dict[str, Any]) -> tuple[str, list[str]]:
    """POST a streamed one-choice request; its text and the raw `data:` payloads."""
    texts, events = streamed(http, url, body)
    return texts.get(0, ""), events


def rounded(value: Any) -> Any:
    """`value` with every float rounded to 4 places, so that answers computed twice compare equal."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [rounded(item) for item in value]
    return value


def comparable(reply: dict[str, Any]) -> dict[str, Any]:
    """What two answers to one request must share: the choices and the token counts (not ids, times or cache hits)."""
    usage = reply.get("usage") or {}
    return {"choices": rounded(reply["choices"]), "usage": {key: usage.get(key) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}}


def success_count(http: httpx.Client, server: VllmServer) -> float:
    """`vllm:request_success_total` summed over its labels, from the server's Prometheus endpoint."""
    metrics = http.get(server.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("vllm:request_success_total{"))


# ---------------------------------------------------------------------------------------------------------
# Pools and the health monitor, on an injected clock (no servers)


class FakeClock:
    """A clock that only moves when something sleeps on it or `advance`s it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(round(seconds, 6))
        self.now += seconds
        await asyncio.sleep(0)


def test_monitor_probes_on_schedule_and_marks_each_answer() -> None:
    """Probes start one interval apart (at once after one that took longer); each answer marks the instance."""
    clock = FakeClock()
    pool = InstancePool("decode", ["http://d"], clock)
    script = [(0.2, True), (1.5, False), (0.1, False), (0.1, True)]  # (seconds the probe takes, healthy)
    seen: list[bool] = []
    done = asyncio.Event()

    async def probe(instance: Instance) -> bool:
        seen.append(instance.up)
        if not script:
            done.set()
            await asyncio.Event().wait()
        took, healthy = script.pop(0)
        clock.now += took
        return healthy

    async def scenario() -> None:
        monitor = HealthMonitor([pool], probe, 1.0, clock=clock, sleep=clock.sleep)
        monitor.start()
        await asyncio.wait_for(done.wait(), 10)
        await monitor.aclose()

    asyncio.run(scenario())
    assert clock.sleeps == [1.0, 0.8, 0.0, 0.9, 0.9]
    assert seen == [True, True, False, False, True]  # the state before each probe: down from the second answer on


def test_pool_picks_round_robin_among_instances_that_are_up() -> None:
    clock = FakeClock()
    pool = InstancePool("decode", ["http://x", "http://y/"], clock)
    x, y = pool.instances
    assert [pool.pick().url for _ in range(4)] == ["http://x", "http://y", "http://x", "http://y"]
    clock.now = 5.0
    pool.mark(x, False, "ConnectError")
    assert [pool.pick() for _ in range(3)] == [y, y, y]
    assert x.since == 5.0 and pool.summary() == {"up": ["http://y"], "down": ["http://x"]}
    pool.mark(y, False)
    with pytest.raises(NoInstanceUp, match=r"^no decode instance is up \(http://x, http://y\)$"):
        pool.pick()
    pool.mark(x, True)
    assert pool.pick() is x


# ---------------------------------------------------------------------------------------------------------
# Outputs equal a single instance's


def test_completions_match_one_server(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, b = servers
    with running_proxy([a.url, b.url], [b.url]) as proxy, client() as http:
        for prompt in PROMPTS:
            direct = http.post(a.url + "/v1/completions", json=completion(model, prompt))
            proxied = http.post(proxy + "/v1/completions", json=completion(model, prompt))
            assert proxied.status_code == 200, proxied.text
            assert proxied.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
            assert proxied.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_streamed_completions_match_one_server(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    """Streamed through the proxy, each completion's text equals one server's, ended by [DONE]; and the proxy passes
    events on as they come (at least one prompt arrives in several: vLLM merges a request's tokens into one event
    when its reader lags, as on a loaded 2-core CI machine, so not every prompt does)."""
    a, b = servers
    counts = []
    with running_proxy([a.url], [b.url]) as proxy, client() as http:
        for prompt in PROMPTS:
            direct = http.post(a.url + "/v1/completions", json=completion(model, prompt)).json()
            text, events = streamed_text(http, proxy + "/v1/completions", completion(model, prompt))
            assert text == direct["choices"][0]["text"]
            assert events[-1] == "[DONE]" and len(events) >= 2
            counts.append(len(events))
    assert max(counts) > 2, counts


def test_chat_matches_one_server(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, b = servers
    with running_proxy([a.url], [b.url]) as proxy, client() as http:
        for prompt in PROMPTS:
            direct = http.post(a.url + "/v1/chat/completions", json=chat(model, prompt))
            assert direct.status_code == 200, direct.text
            expected = direct.json()["choices"][0]["message"]["content"]
            proxied = http.post(proxy + "/v1/chat/completions", json=chat(model, prompt))
            assert proxied.status_code == 200, proxied.text
            assert proxied.json()["choices"][0]["message"]["content"] == expected
            body = chat(model, prompt, max_completion_tokens=MAX_TOKENS, stream_options={"include_usage": True})
            text, events = streamed_text(http, proxy + "/v1/chat/completions", body)
            assert text == expected
            assert json.loads(events[-2])["usage"]["completion_tokens"] == MAX_TOKENS


TOKEN_IDS = [[5, 60, 7, 81, 9, 100], [200, 17, 33]]
SAMPLED = {"temperature": 0.9, "top_p": 0.95}

#: name -> (route, body given the model, the prompts P must prefill, one each). A beam search has none.
SHAPES: dict[str, tuple[str, Callable[[Path], dict[str, Any]], list[Any]]] = {
    "n2-seeded": ("/v1/completions", lambda m: completion(m, PROMPTS[1], n=2, seed=7, **SAMPLED), [PROMPTS[1]]),
    "best-of-ignored": ("/v1/completions", lambda m: completion(m, PROMPTS[2], n=2, best_of=3, seed=8, **SAMPLED), [PROMPTS[2]]),
    "prompt-list": ("/v1/completions", lambda m: completion(m, [PROMPTS[0], PROMPTS[3]]), [PROMPTS[0], PROMPTS[3]]),
    "token-id-lists-n2": ("/v1/completions", lambda m: completion(m, TOKEN_IDS, n=2, seed=9, **SAMPLED), TOKEN_IDS),
    "token-ids": ("/v1/completions", lambda m: completion(m, TOKEN_IDS[0]), [TOKEN_IDS[0]]),
    # Prompt logprobs: D computes the prompt whatever it is offered, so P prefills nothing.
    "echo-logprobs": ("/v1/completions", lambda m: completion(m, PROMPTS[0], echo=True, logprobs=2), []),
    "chat-n2-logprobs": ("/v1/chat/completions", lambda m: chat(m, PROMPTS[1], n=2, seed=5, logprobs=True, top_logprobs=2, **SAMPLED), [None]),
    "beam-search": ("/v1/completions", lambda m: completion(m, PROMPTS[0], n=2, use_beam_search=True), []),
}


def check_upstream(pd: Disaggregated, body: dict[str, Any], prompts: list[Any]) -> None:
    """P got one prefill per prompt (output options removed, `hmc_loads` = n); D got the client's body with P's params."""
    prefills = pd.prefill.prefills()
    assert len(prefills) == len(prompts) and len(pd.prefill.posts) == len(prompts)
    for sent in prefills:
        assert not OUTPUT_FIELDS & set(sent), sent
        assert sent["max_tokens"] == 1 and sent["stream"] is False
        assert sent["kv_transfer_params"]["hmc_loads"] == body.get("n", 1)
        assert {key: sent[key] for key in ("model", "temperature")} == {key: body[key] for key in ("model", "temperature")}
        assert sent.get("messages") == body.get("messages")
    if "prompt" in body:
        assert sorted(json.dumps(sent["prompt"]) for sent in prefills) == sorted(json.dumps(prompt) for prompt in prompts)
    [decoded] = pd.decode.posts
    if not prompts:
        assert decoded == body
    elif len(prompts) == 1:
        assert decoded == {**body, "kv_transfer_params": pd.prefill.stamped[0]}
    else:
        batch = [pd.prefill.stamped_for(prompt) for prompt in prompts]
        assert decoded == {**body, "kv_transfer_params": {"do_remote_prefill": True, "hmc_batch": batch}}


@pytest.mark.parametrize("shape", SHAPES)
def test_request_shape_matches_one_server(model: Path, servers: tuple[VllmServer, VllmServer], shape: str) -> None:
    route, make_body, prompts = SHAPES[shape]
    body = make_body(model)
    a, b = servers
    with disaggregated(a, b) as pd, client() as http:
        direct = http.post(a.url + route, json=body)
        assert direct.status_code == 200, direct.text
        proxied = http.post(pd.url + route, json=body)
        assert proxied.status_code == 200, proxied.text
        assert comparable(proxied.json()) == comparable(direct.json())
        assert len(direct.json()["choices"]) == body.get("n", 1) * max(len(prompts), 1)
        check_upstream(pd, body, prompts)
    assert pd.prefill.releases() == []  # the proxy's shutdown waited for any release in flight


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_streams_with_usage_match_one_server(model: Path, servers: tuple[VllmServer, VllmServer], route: str) -> None:
    a, b = servers
    options = {"n": 2, "seed": 3, "stream_options": {"include_usage": True}, **SAMPLED}
    body = completion(model, [PROMPTS[1], PROMPTS[2]], **options) if "chat" not in route else chat(model, PROMPTS[3], **options)
    prompts = [PROMPTS[1], PROMPTS[2]] if "chat" not in route else [None]
    with disaggregated(a, b) as pd, client() as http:
        direct_texts, direct_events = streamed(http, a.url + route, body)
        texts, events = streamed(http, pd.url + route, body)
        check_upstream(pd, {**body, "stream": True}, prompts)
    assert texts == direct_texts and len(texts) == 2 * len(prompts)
    usage = json.loads(events[-2])["usage"]
    assert usage == json.loads(direct_events[-2])["usage"] and usage["completion_tokens"] == 2 * len(prompts) * MAX_TOKENS
    assert pd.prefill.releases() == []


def test_stop_string_matches_one_server(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, b = servers
    with disaggregated(a, b) as pd, client() as http:
        unstopped = http.post(a.url + "/v1/completions", json=completion(model, PROMPTS[1])).json()["choices"][0]["text"]
        stop = unstopped[len(unstopped) // 2:][:3]
        body = completion(model, PROMPTS[1], stop=[stop])
        direct = http.post(a.url + "/v1/completions", json=body).json()
        proxied = http.post(pd.url + "/v1/completions", json=body).json()
        check_upstream(pd, body, [PROMPTS[1]])
    assert direct["choices"][0]["finish_reason"] == "stop" and len(direct["choices"][0]["text"]) < len(unstopped)
    assert comparable(proxied) == comparable(direct)


def test_prefill_without_kv_transfer_params_still_decodes(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    """P is no KV producer (plain vLLM): D gets the client's body untouched and recomputes."""
    a, b = servers
    body = completion(model, [PROMPTS[2], PROMPTS[0]])
    with disaggregated(a, b, stamp=False) as pd, client() as http:
        direct = http.post(a.url + "/v1/completions", json=body).json()
        proxied = http.post(pd.url + "/v1/completions", json=body).json()
    assert comparable(proxied) == comparable(direct)
    assert len(pd.prefill.prefills()) == 2 and pd.decode.posts == [body]


def test_prefill_instances_alternate(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    """Prefill round-robins over [a, b], decode is always b: a finishes a request every other time."""
    a, b = servers
    with running_proxy([a.url, b.url], [b.url]) as proxy, client() as http:
        seen_by_a = []
        for prompt in PROMPTS:
            before_a, before_b = success_count(http, a), success_count(http, b)
            assert http.post(proxy + "/v1/completions", json=completion(model, prompt)).status_code == 200
            wait_until(lambda: success_count(http, a) + success_count(http, b) >= before_a + before_b + 2, 10, "vLLM did not count the two requests")
            seen_by_a.append(success_count(http, a) - before_a)
    assert seen_by_a in ([1, 0, 1, 0], [0, 1, 0, 1])


def test_request_id_is_shared_and_returned(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, b = servers
    with running_proxy([a.url], [b.url]) as proxy, client() as http:
        given = http.post(proxy + "/v1/completions", json=completion(model, PROMPTS[0]), headers={"X-Request-Id": "rid-42"})
        fresh = http.post(proxy + "/v1/completions", json=completion(model, PROMPTS[0]))
    assert given.headers["x-request-id"] == "rid-42"
    assert "rid-42" in given.json()["id"]  # vLLM names its request after the header
    assert fresh.headers["x-request-id"] and fresh.headers["x-request-id"] != "rid-42"
    assert fresh.headers["x-request-id"] in fresh.json()["id"]


def test_models_and_health(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, b = servers
    with running_proxy([a.url], [b.url]) as proxy, client() as http:
        models = http.get(proxy + "/v1/models")
        health = http.get(proxy + "/health")
    assert models.status_code == 200
    assert [entry["id"] for entry in models.json()["data"]] == [str(model)]
    assert health.status_code == 200
    assert health.json() == {"prefill": {"up": [a.url], "down": []}, "decode": {"up": [b.url], "down": []}}


def test_client_errors_pass_through(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, b = servers
    body = {**completion(model, PROMPTS[0]), "model": "no-such-model"}
    with running_proxy([a.url], [b.url]) as proxy, client() as http:
        direct = http.post(a.url + "/v1/completions", json=body)
        proxied = http.post(proxy + "/v1/completions", json=body)
        not_json = http.post(proxy + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert 400 <= direct.status_code < 500
    assert proxied.status_code == direct.status_code
    assert proxied.json()["error"]["message"] == direct.json()["error"]["message"]
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------------------------------------
# Health: fail fast, without a prefill


def assert_refused_at_once(http: httpx.Client, proxy: str, model: Path, stage: str, urls: list[str]) -> None:
    """Completions and chat, streamed or not: HTTP 503 naming the stage and its instances, in under 2 s."""
    for route, body in (("/v1/completions", completion(model, PROMPTS[1])), ("/v1/chat/completions", chat(model, PROMPTS[1]))):
        for stream in (False, True):
            started = time.monotonic()
            reply = http.post(proxy + route, json={**body, "stream": stream}, headers={"X-Request-Id": "refused"})
            assert time.monotonic() - started < 2
            assert reply.status_code == 503 and reply.headers["x-request-id"] == "refused"
            message = f"no {stage} instance is up ({', '.join(urls)})"
            assert reply.json() == {"error": {"message": message, "type": "upstream_error", "code": 503}}


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_no_instance_up_is_a_503_at_once_without_a_prefill(model: Path, servers: tuple[VllmServer, VllmServer], stage: str) -> None:
    a, b = servers
    gone = dead_url()
    p, d = Recorder(a.url), Recorder(b.url)
    with Served(p.app()) as p_served, Served(d.app()) as d_served, client() as http:
        prefill, decode = ([gone], [d_served.url]) if stage == "prefill" else ([p_served.url], [gone])
        with running_proxy(prefill, decode) as proxy:
            assert_refused_at_once(http, proxy, model, stage, [gone])
            health = http.get(proxy + "/health")
    assert health.status_code == 503 and health.json()[stage] == {"up": [], "down": [gone]}
    assert p.posts == [] and d.posts == []


def test_decode_that_goes_down_is_refused_after_the_next_probe(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, _ = servers
    p = Recorder(a.url)
    with Served(p.app()) as p_served, Served(decoy("500")) as d, client() as http:
        with running_proxy([p_served.url], [d.url], health_interval_s=0.2) as proxy:
            assert http.get(proxy + "/health").status_code == 200
            d.stop()
            wait_until(lambda: http.get(proxy + "/health").json()["decode"]["down"] == [d.url], 5, "the monitor did not mark D down")
            assert_refused_at_once(http, proxy, model, "decode", [d.url])
    assert p.posts == []


def test_silent_instance_is_marked_down_by_the_probe_deadline(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, _ = servers
    with silent_listener() as silent, client() as http:
        started = time.monotonic()
        with running_proxy([a.url], [silent], connect_timeout_s=1) as proxy:
            assert 0.9 < time.monotonic() - started < 5  # the first round of probes ran before the proxy served
            assert_refused_at_once(http, proxy, model, "decode", [silent])


def test_decode_instance_down_at_start_is_skipped(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, b = servers
    gone = dead_url()
    with running_proxy([a.url], [gone, b.url]) as proxy, client() as http:
        for prompt in PROMPTS * 2:
            assert http.post(proxy + "/v1/completions", json=completion(model, prompt)).status_code == 200
        assert http.get(proxy + "/health").json()["decode"] == {"up": [b.url], "down": [gone]}


def test_decode_instance_that_comes_back_is_used_again(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, b = servers
    port = free_port()
    later = f"http://127.0.0.1:{port}"
    d = Recorder(b.url)
    with running_proxy([a.url], [later], health_interval_s=0.2) as proxy, client() as http:
        assert http.post(proxy + "/v1/completions", json=completion(model, PROMPTS[0])).status_code == 503
        with Served(d.app(), port):
            wait_until(lambda: http.post(proxy + "/v1/completions", json=completion(model, PROMPTS[0])).status_code == 200, 10, "D was not used again")
    assert len(d.posts) == 1


# ---------------------------------------------------------------------------------------------------------
# Upstream failures and releases


@pytest.mark.parametrize("failure", ["500", "400", "hang", "refused"])
def test_abandoned_prefills_are_released(model: Path, servers: tuple[VllmServer, VllmServer], failure: str) -> None:
    """D fails after two prompts were prefilled: the client gets the error at once, and P a release per prefill."""
    a, _ = servers
    p = Recorder(a.url, stamp=True)
    p.gate.clear()  # P holds its answers to releases: the client's reply must not wait for them
    body = completion(model, [PROMPTS[0], PROMPTS[3]])
    options = {"timeout_s": 2} if failure == "hang" else {"health_interval_s": 60} if failure == "refused" else {}
    with Served(decoy(failure)) as d, Served(p.app()) as p_served, running_proxy([p_served.url], [d.url], **options) as proxy:
        with client() as http:
            if failure == "refused":
                d.stop()  # D was up at the last probe, and is gone now
            started = time.monotonic()
            reply = http.post(proxy + "/v1/completions", json=body)
            elapsed = time.monotonic() - started
            wait_until(lambda: len(p.releases()) == 2, 5, "P did not get a release per prefill")
            p.gate.set()
            if failure == "refused":  # the connection error marked D down at once
                assert_refused_at_once(http, proxy, model, "decode", [d.url])
    # P's answers to the releases were held: a reply that waited for them would take the connect timeout (5 s).
    assert (1.5 < elapsed < 4) if failure == "hang" else elapsed < 2
    if failure == "400":
        assert reply.status_code == 400 and reply.json() == {"error": {"message": "block_size: peer 64, here 32", "code": 400}}
    else:
        cause = {"500": "HTTP 500", "hang": "no answer in time", "refused": "connection failed"}[failure]
        assert reply.status_code == 502 and f"decode instance {d.url} failed: " in reply.json()["error"]["message"]
        assert cause in reply.json()["error"]["message"]
    stamped = sorted(json.dumps(release_body(str(model), params)) for params in p.stamped)
    assert sorted(json.dumps(release) for release in p.releases()) == stamped and len(stamped) == 2
    assert all(release["kv_transfer_params"]["hmc_release"] is True for release in p.releases())
    assert len(p.prefills()) == 2


def test_client_gone_before_decode_answers_releases_prefills(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, _ = servers
    p = Recorder(a.url, stamp=True)
    with Served(p.app()) as p_served, Served(decoy("hang")) as d, running_proxy([p_served.url], [d.url]) as proxy:
        with client(timeout=1) as http, pytest.raises(httpx.ReadTimeout):
            http.post(proxy + "/v1/completions", json=completion(model, PROMPTS[2]))
        wait_until(lambda: len(p.releases()) == 1, 5, "P did not get the release")
    assert p.releases() == [release_body(str(model), p.stamped[0])]


def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, _ = servers
    p = Recorder(a.url, stamp=True)
    with dying_stream_peer() as dying, Served(p.app()) as p_served, running_proxy([p_served.url], [dying]) as proxy, client() as http:
        with http.stream("POST", proxy + "/v1/completions", json=completion(model, PROMPTS[0], stream=True)) as reply:
            assert reply.status_code == 200
            events = [line[len("data: "):] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[0] == FIRST_EVENT
    error = json.loads(events[1])["error"]
    assert error["type"] == "upstream_error" and error["code"] == 502
    assert "decode" in error["message"] and dying in error["message"]
    assert events[2:] == ["[DONE]"]
    assert p.releases() == []  # D answered 200: its connector owns the blocks


# ---------------------------------------------------------------------------------------------------------
# The command line


def test_cli_help() -> None:
    done = subprocess.run([sys.executable, "-m", "hmc_vllm.proxy", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert all(option in done.stdout for option in ("--prefill", "--decode", "--timeout", "--health-interval"))


def test_cli_serves(model: Path, servers: tuple[VllmServer, VllmServer], tmp_path: Path) -> None:
    a, b = servers
    port = free_port()
    command = [
        sys.executable, "-m", "hmc_vllm.proxy", "--prefill", a.url, "--decode", b.url, "--port", str(port),
        "--health-interval", "0.5", "--log-level", "warning",
    ]
    log = tmp_path / "proxy.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        with client() as http:
            def healthy() -> bool:
                assert process.poll() is None, log.read_text()
                with contextlib.suppress(httpx.TransportError):
                    return http.get(f"http://127.0.0.1:{port}/health").status_code == 200
                return False

            wait_until(healthy, 30, "the proxy did not become healthy")
            direct = http.post(a.url + "/v1/completions", json=completion(model, PROMPTS[1])).json()
            proxied = http.post(f"http://127.0.0.1:{port}/v1/completions", json=completion(model, PROMPTS[1])).json()
        assert proxied["choices"][0]["text"] == direct["choices"][0]["text"]
    finally:
        process.terminate()
        process.wait(10)
