"""The disaggregated proxy against real vLLM servers (plain ones: they ignore `kv_transfer_params`).

Two vLLM servers run in subprocesses for the whole module; the proxy runs in this process under uvicorn
on a port the kernel picked, and is talked to over HTTP. Plain servers make every answer checkable: the
decode instance recomputes the prompt, so greedy output through the proxy equals output from one server.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
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
    import uvicorn

    from hmc_vllm.proxy import build_app
    from hmc_vllm.testing import PROMPTS, VllmServer, make_tiny_llama

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
MAX_TOKENS = 12


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


@contextlib.contextmanager
def running_proxy(prefill: list[str], decode: list[str], **options: Any) -> Iterator[str]:
    """`build_app(...)` served by uvicorn in a thread on a kernel-chosen port; yields its base URL."""
    app = build_app(prefill, decode, **options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws="none", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="hmc-proxy-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextlib.contextmanager
def silent_listener() -> Iterator[str]:
    """A TCP port that accepts connections (kernel backlog) and never answers: an instance that hangs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


FIRST_EVENT = '{"choices": [{"index": 0, "text": " fox"}]}'


@contextlib.contextmanager
def dying_stream_peer() -> Iterator[str]:
    """A decode instance that dies mid-stream: it answers 200, sends one SSE event, then drops the connection.

    A real socket, not a vLLM: killing a real server between two events of a 12-token stream is a race.
    """
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(60)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            received = b""
            while b"\r\n\r\n" not in received:
                received += conn.recv(65536)
            head, body = received.split(b"\r\n\r\n", 1)
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
            while len(body) < length:  # read the whole request, so closing sends FIN, not RST
                body += conn.recv(65536)
            event = f"data: {FIRST_EVENT}\n\n".encode()
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + f"{len(event):x}\r\n".encode() + event + b"\r\n"
            )

    thread = threading.Thread(target=serve, name="dying-stream-peer", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        thread.join(10)
        listener.close()


def dead_url() -> str:
    """A loopback URL where nothing listens (the port is closed again before use)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def client() -> httpx.Client:
    return httpx.Client(timeout=60, trust_env=False)


def completion(model: Path, prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def chat(model: Path, prompt: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {"model": str(model), "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def streamed_text(http: httpx.Client, url: str, body: dict[str, Any]) -> tuple[str, list[str]]:
    """POST a streamed request; the concatenated text and the raw `data:` payloads, in order."""
    text, events = [], []
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
                text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(text), events


def success_count(http: httpx.Client, server: VllmServer) -> float:
    """`vllm:request_success_total` summed over its labels, from the server's Prometheus endpoint."""
    metrics = http.get(server.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("vllm:request_success_total{"))


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
    a, b = servers
    with running_proxy([a.url], [b.url]) as proxy, client() as http:
        for prompt in PROMPTS:
            direct = http.post(a.url + "/v1/completions", json=completion(model, prompt)).json()
            text, events = streamed_text(http, proxy + "/v1/completions", completion(model, prompt))
            assert text == direct["choices"][0]["text"]
            assert events[-1] == "[DONE]" and len(events) > 2


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


def test_prefill_instances_alternate(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    """Prefill round-robins over [a, b], decode is always b: a finishes a request every other time."""
    a, b = servers
    with running_proxy([a.url, b.url], [b.url]) as proxy, client() as http:
        seen_by_a = []
        for prompt in PROMPTS:
            before_a, before_b = success_count(http, a), success_count(http, b)
            assert http.post(proxy + "/v1/completions", json=completion(model, prompt)).status_code == 200
            deadline = time.monotonic() + 10
            while success_count(http, a) + success_count(http, b) < before_a + before_b + 2:
                assert time.monotonic() < deadline, "vLLM metrics did not count the two requests"
                time.sleep(0.05)
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


def test_health_is_503_naming_the_instance_that_is_down(servers: tuple[VllmServer, VllmServer]) -> None:
    a, _ = servers
    gone = dead_url()
    with running_proxy([a.url], [gone], connect_timeout_s=2) as proxy, client() as http:
        health = http.get(proxy + "/health")
    assert health.status_code == 503
    assert health.json()["decode"] == {"up": [], "down": [gone]}


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


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_unreachable_instance_is_a_502_naming_stage_and_url(model: Path, servers: tuple[VllmServer, VllmServer], stage: str) -> None:
    a, _ = servers
    gone = dead_url()
    prefill, decode = ([gone], [a.url]) if stage == "prefill" else ([a.url], [gone])
    with running_proxy(prefill, decode, connect_timeout_s=2) as proxy, client() as http:
        for stream in (False, True):
            started = time.monotonic()
            reply = http.post(proxy + "/v1/completions", json=completion(model, PROMPTS[0], stream=stream))
            assert time.monotonic() - started < 5
            assert reply.status_code == 502
            error = reply.json()["error"]
            assert error["type"] == "upstream_error" and error["code"] == 502
            assert stage in error["message"] and gone in error["message"] and "ConnectError" in error["message"]


def test_dead_decode_instance_is_skipped_after_its_first_failure(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, b = servers
    gone = dead_url()
    with running_proxy([a.url], [gone, b.url], cooldown_s=120) as proxy, client() as http:
        first = http.post(proxy + "/v1/completions", json=completion(model, PROMPTS[0]))
        assert first.status_code == 502 and gone in first.json()["error"]["message"]
        for prompt in PROMPTS * 2:
            assert http.post(proxy + "/v1/completions", json=completion(model, prompt)).status_code == 200


def test_dead_decode_instance_is_tried_again_after_its_cooldown(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, b = servers
    gone = dead_url()
    with running_proxy([a.url], [gone, b.url], cooldown_s=0.5) as proxy, client() as http:
        assert http.post(proxy + "/v1/completions", json=completion(model, PROMPTS[0])).status_code == 502
        assert http.post(proxy + "/v1/completions", json=completion(model, PROMPTS[0])).status_code == 200
        time.sleep(0.6)
        retried = http.post(proxy + "/v1/completions", json=completion(model, PROMPTS[0]))
    assert retried.status_code == 502 and gone in retried.json()["error"]["message"]


def test_silent_instance_hits_the_deadline(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, _ = servers
    with silent_listener() as silent, running_proxy([a.url], [silent], timeout_s=2) as proxy, client() as http:
        started = time.monotonic()
        reply = http.post(proxy + "/v1/completions", json=completion(model, PROMPTS[0]))
        elapsed = time.monotonic() - started
    assert reply.status_code == 502
    assert "decode" in reply.json()["error"]["message"] and silent in reply.json()["error"]["message"]
    assert 1.5 < elapsed < 5


def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event(model: Path, servers: tuple[VllmServer, VllmServer]) -> None:
    a, _ = servers
    with dying_stream_peer() as dying, running_proxy([a.url], [dying]) as proxy, client() as http:
        with http.stream("POST", proxy + "/v1/completions", json=completion(model, PROMPTS[0], stream=True)) as reply:
            assert reply.status_code == 200
            events = [line[len("data: "):] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[0] == FIRST_EVENT
    error = json.loads(events[1])["error"]
    assert error["type"] == "upstream_error" and error["code"] == 502
    assert "decode" in error["message"] and dying in error["message"]
    assert events[2:] == ["[DONE]"]


def test_cli_help() -> None:
    done = subprocess.run([sys.executable, "-m", "hmc_vllm.proxy", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "--prefill" in done.stdout and "--decode" in done.stdout and "--timeout" in done.stdout


def test_cli_serves(model: Path, servers: tuple[VllmServer, VllmServer], tmp_path: Path) -> None:
    a, b = servers
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "hmc_vllm.proxy", "--prefill", a.url, "--decode", b.url, "--port", str(port), "--log-level", "warning"]
    log = tmp_path / "proxy.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        with client() as http:
            deadline = time.monotonic() + 30
            while True:
                assert process.poll() is None, log.read_text()
                with contextlib.suppress(httpx.TransportError):
                    if http.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        break
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            direct = http.post(a.url + "/v1/completions", json=completion(model, PROMPTS[1])).json()
            proxied = http.post(f"http://127.0.0.1:{port}/v1/completions", json=completion(model, PROMPTS[1])).json()
        assert proxied["choices"][0]["text"] == direct["choices"][0]["text"]
    finally:
        process.terminate()
        process.wait(10)
