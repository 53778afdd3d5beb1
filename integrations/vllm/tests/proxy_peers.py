"""Peers for the proxy's tests: the proxy served in a thread, a recording front for a real vLLM server, decoys.

`Recorder` is a small HTTP server in front of a real vLLM server that records every POST and forwards
it; with `stamp=True` it also plays the part of a KV producer's reply (plain vLLM returns no
`kv_transfer_params`). `decoy` stands in for a decode instance that is healthy but fails the request in
a chosen way; `silent_listener` accepts and never answers; `dying_stream_peer` breaks off a stream.

Concurrency: each served app runs its own uvicorn loop on its own thread; `Recorder`'s lists are
appended on that loop and read by the test after the request returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hmc_vllm.proxy import build_app
from hmc_vllm.testing import VllmServer, free_port


class Served:
    """`app` served by uvicorn in a thread on 127.0.0.1 (on `port`, else one the kernel picks), until `stop()` or the block's end."""

    def __init__(self, app: Any, port: int = 0) -> None:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", ws="none", lifespan="on", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, name="hmc-proxy-test-server", daemon=True)
        self._thread.start()
        wait_until(lambda: self._server.started or not self._thread.is_alive(), 15, "the server did not start")
        assert self._thread.is_alive(), "the server stopped at startup"

    def stop(self) -> None:
        """Shut the server down (its lifespan's shutdown included) and close its socket; idempotent."""
        self._server.should_exit = True
        self._thread.join(15)
        self._sock.close()

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_proxy(prefill: list[str], decode: list[str], **options: Any) -> Iterator[str]:
    """`build_app(...)` served in a thread; yields its base URL. Leaving waits for the proxy's shutdown (and its releases)."""
    with Served(build_app(prefill, decode, **options)) as served:
        yield served.url


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll `condition` until it is true; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class Recorder:
    """An HTTP server in front of `upstream` that records every POST body, forwards it and returns the answer.

    With `stamp`, prefill replies get `kv_transfer_params` naming their prompt (as a KV producer's would),
    and release POSTs are answered 400 (as an HMC prefill instance refuses them once freed) after
    `gate` is set, without reaching `upstream`. Bodies are appended on the server's thread.
    """

    def __init__(self, upstream: str, *, stamp: bool = False) -> None:
        self.upstream = upstream
        self.stamp = stamp
        self.posts: list[dict[str, Any]] = []
        self.stamped: list[dict[str, Any]] = []
        self.gate = threading.Event()
        self.gate.set()

    def prefills(self) -> list[dict[str, Any]]:
        return [body for body in self.posts if (body.get("kv_transfer_params") or {}).get("do_remote_decode")]

    def releases(self) -> list[dict[str, Any]]:
        return [body for body in self.posts if (body.get("kv_transfer_params") or {}).get("hmc_release")]

    def app(self) -> FastAPI:
        client: dict[str, httpx.AsyncClient] = {}

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            async with httpx.AsyncClient(base_url=self.upstream, timeout=60, trust_env=False) as client["upstream"]:
                yield

        app = FastAPI(lifespan=lifespan)

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def forward(path: str, request: Request) -> Response:
            body = await request.json() if request.method == "POST" else None
            if body is not None:
                self.posts.append(body)
                if self.stamp and body["kv_transfer_params"].get("hmc_release"):
                    await asyncio.to_thread(self.gate.wait, 30)
                    return JSONResponse({"error": {"message": "released", "code": 400}}, status_code=400)
            headers = {name: value for name, value in request.headers.items() if name == "x-request-id"}
            upstream = await client["upstream"].request(request.method, "/" + path, json=body, headers=headers)
            content = upstream.content
            if self.stamp and upstream.status_code == 200 and body is not None and body["kv_transfer_params"].get("do_remote_decode"):
                content = json.dumps({**upstream.json(), "kv_transfer_params": self._stamp(body)}).encode()
            return Response(content, status_code=upstream.status_code, media_type=upstream.headers.get("content-type"))

        return app

    def _stamp(self, body: dict[str, Any]) -> dict[str, Any]:
        index = len(self.stamped)
        params = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "recorder",
            "remote_request_id": f"prefill-{index}", "remote_block_ids": [index],
            "hmc": {"prompt": body.get("prompt", body.get("messages")), "loads": body["kv_transfer_params"]["hmc_loads"]},
        }
        self.stamped.append(params)
        return params

    def stamped_for(self, prompt: Any) -> dict[str, Any]:
        """The parameters stamped on the prefill reply for `prompt`."""
        return next(params for params in self.stamped if params["hmc"]["prompt"] == prompt)


def decoy(failure: str) -> FastAPI:
    """A decode instance whose `/health` is 200 and which fails every generation: HTTP 500, HTTP 400, or never answering."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/v1/{path:path}")
    async def generate(path: str, request: Request) -> Response:
        if failure == "hang":  # until the proxy gives up and closes the connection
            while (await request.receive())["type"] != "http.disconnect":
                pass
        status, message = (400, "block_size: peer 64, here 32") if failure == "400" else (500, "Internal server error")
        return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)

    return app


@dataclass
class Disaggregated:
    """A proxy with a recorder in front of each instance."""

    url: str
    prefill: Recorder
    decode: Recorder


@contextlib.contextmanager
def disaggregated(prefill: VllmServer, decode: VllmServer, *, stamp: bool = True, **options: Any) -> Iterator[Disaggregated]:
    p, d = Recorder(prefill.url, stamp=stamp), Recorder(decode.url)
    with Served(p.app()) as p_served, Served(d.app()) as d_served, running_proxy([p_served.url], [d_served.url], **options) as proxy:
        yield Disaggregated(proxy, p, d)


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
    """A decode instance that dies mid-stream: `/health` answers 200; a POST gets 200, one SSE event, then a dropped connection.

    A real socket, not a vLLM: killing a real server between two events of a 12-token stream is a race.
    """
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(60)

    def serve() -> None:
        while True:
            conn, _ = listener.accept()
            with conn:
                received = b""
                while b"\r\n\r\n" not in received:
                    received += conn.recv(65536)
                if received.startswith(b"GET"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    continue
                head, body = received.split(b"\r\n\r\n", 1)
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
                while len(body) < length:  # read the whole request, so closing sends FIN, not RST
                    body += conn.recv(65536)
                event = f"data: {FIRST_EVENT}\n\n".encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                    + f"{len(event):x}\r\n".encode() + event + b"\r\n"
                )
                return

    thread = threading.Thread(target=serve, name="dying-stream-peer", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        thread.join(10)
        listener.close()


def dead_url() -> str:
    """A loopback URL where nothing listens (the port is closed again before use)."""
    return f"http://127.0.0.1:{free_port()}"


def client(timeout: float = 60) -> httpx.Client:
    return httpx.Client(timeout=timeout, trust_env=False)
