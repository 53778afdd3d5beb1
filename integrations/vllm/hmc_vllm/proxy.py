"""Disaggregated prefill/decode proxy: one OpenAI-compatible endpoint in front of prefill and decode vLLM instances.

Each completion or chat request goes twice upstream, with the same `X-Request-Id` (the client's, else a
fresh one, returned in the response headers):

1. to a prefill instance (P) with `stream: false`, `max_tokens: 1` (and `max_completion_tokens: 1` when the
   client used it), no `stream_options` or `min_tokens`, and `kv_transfer_params` asking for a remote decode;
2. to a decode instance (D) with the client's own body plus the `kv_transfer_params` P returned. D's reply
   goes back as-is: its JSON, or its server-sent events chunk by chunk when the client asked `stream: true`.

P and D are picked round-robin, each stage on its own. An instance that fails with a connection error is
marked down for `cooldown_s` and skipped while another instance of its stage is up; it is tried again once
the cooldown is over, or as soon as `GET /health` on the proxy finds it answering.

Failures are JSON errors, never hangs: the whole request has one deadline (`timeout_s`), connecting has a
shorter one. An upstream that cannot be reached, drops the connection, misses the deadline or answers 5xx
gives HTTP 502 `{"error": {"message": ..., "type": "upstream_error", "code": 502}}` whose message names the
stage, the instance and the cause; an upstream 4xx is passed through with its body. When D fails after P
succeeded, the proxy does nothing about P's blocks: the connector's lease on P frees them. When D fails in
the middle of a stream (the status line is already sent), the stream ends with one event
`data: {"error": {... "type": "upstream_error", "code": 502}}` followed by `data: [DONE]`, the shape vLLM
itself uses for errors inside a stream.

Exceptions::

    ProxyError
    ├── UpstreamError      an instance was unreachable, dropped the connection, timed out or answered 5xx (502)
    └── UpstreamRejected   an instance answered 4xx: its status and body go back to the client

Concurrency: everything runs on the server's one event loop; the pools' round-robin state is only touched
there, between awaits, so it needs no lock.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

__all__ = ["ProxyConfig", "ProxyError", "UpstreamError", "UpstreamRejected", "build_app", "main"]

logger = logging.getLogger(__name__)

#: What P is sent: "prefill only, a decode instance will pull or receive the KV" (upstream vLLM's toy proxy).
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: Client headers passed on to both instances (besides `X-Request-Id`, which the proxy always sets).
FORWARDED_HEADERS: tuple[str, ...] = ("authorization",)


class ProxyError(Exception):
    """Base of the proxy's errors; each knows the HTTP response the client gets."""

    def response(self, headers: dict[str, str]) -> Response:
        """The reply to the client."""
        raise NotImplementedError


class UpstreamError(ProxyError):
    """An instance was unreachable, dropped the connection, missed the deadline or answered 5xx."""

    def __init__(self, stage: str, url: str, cause: str) -> None:
        super().__init__(f"{stage} instance {url} failed: {cause}")
        self.stage = stage
        self.url = url
        self.cause = cause

    def payload(self) -> dict[str, Any]:
        """The OpenAI-style error body."""
        return {"error": {"message": str(self), "type": "upstream_error", "code": 502}}

    def response(self, headers: dict[str, str]) -> Response:
        return JSONResponse(self.payload(), status_code=502, headers=headers)


class UpstreamRejected(ProxyError):
    """An instance answered 4xx; the client gets the same status and body."""

    def __init__(self, stage: str, url: str, status: int, content: bytes, content_type: str) -> None:
        super().__init__(f"{stage} instance {url} answered HTTP {status}")
        self.status = status
        self.content = content
        self.content_type = content_type

    def response(self, headers: dict[str, str]) -> Response:
        return Response(self.content, status_code=self.status, media_type=self.content_type, headers=headers)


@dataclass(frozen=True)
class ProxyConfig:
    """Where the instances are and how long the proxy waits for them."""

    prefill_urls: tuple[str, ...]
    """Base URLs of the prefill instances, e.g. `http://10.0.0.1:8100`."""
    decode_urls: tuple[str, ...]
    """Base URLs of the decode instances."""
    timeout_s: float = 300.0
    """Deadline for a whole client request: prefill, decode and the whole stream."""
    connect_timeout_s: float = 5.0
    """Deadline for opening one connection to an instance, and for one `/health` probe."""
    cooldown_s: float = 10.0
    """How long an instance that failed with a connection error is skipped."""

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("the proxy needs at least one prefill and one decode URL")
        if min(self.timeout_s, self.connect_timeout_s) <= 0 or self.cooldown_s < 0:
            raise ValueError("timeouts must be positive and the cooldown not negative")


@dataclass
class Instance:
    """One upstream vLLM server and until when it is skipped."""

    url: str
    down_until: float = 0.0


class InstancePool:
    """The instances of one stage, picked round-robin, skipping those marked down while another is up."""

    def __init__(self, stage: str, urls: Sequence[str], cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stage = stage
        self.instances = [Instance(url.rstrip("/")) for url in urls]
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._next = 0

    def pick(self) -> Instance:
        """The next instance that is up; when all are down, the next one in turn (its failure is then reported)."""
        now = self._clock()
        count = len(self.instances)
        order = [self.instances[(self._next + i) % count] for i in range(count)]
        chosen = next((instance for instance in order if instance.down_until <= now), order[0])
        self._next = (self.instances.index(chosen) + 1) % count
        return chosen

    def mark_down(self, instance: Instance) -> None:
        """Skip `instance` for the cooldown."""
        instance.down_until = self._clock() + self._cooldown_s
        logger.warning("%s instance %s marked down for %gs", self.stage, instance.url, self._cooldown_s)

    def mark_up(self, instance: Instance) -> None:
        """Use `instance` again right away."""
        if instance.down_until > self._clock():
            logger.info("%s instance %s is back", self.stage, instance.url)
        instance.down_until = 0.0


@contextlib.asynccontextmanager
async def _upstream(pool: InstancePool, instance: Instance, deadline: float) -> AsyncIterator[None]:
    """The one place httpx errors and the request's deadline become `UpstreamError`; connection errors mark the instance down."""
    try:
        async with asyncio.timeout_at(deadline):
            yield
    except (TimeoutError, httpx.TimeoutException) as exc:
        raise UpstreamError(pool.stage, instance.url, f"no answer in time ({type(exc).__name__})") from exc
    except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
        pool.mark_down(instance)
        raise UpstreamError(pool.stage, instance.url, f"connection failed ({type(exc).__name__}: {exc})") from exc
    except httpx.HTTPError as exc:
        raise UpstreamError(pool.stage, instance.url, f"{type(exc).__name__}: {exc}") from exc


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body turned into a prefill-only request: one token, not streamed, KV kept for a remote decode."""
    out = {key: value for key, value in body.items() if key not in ("stream_options", "min_tokens")}
    out.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS))
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


async def _json_object(request: Request) -> dict[str, Any] | None:
    """The client's body if it is a JSON object, else None."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


def _sse_error(error: UpstreamError, separate: bool) -> bytes:
    """The closing events of a stream that broke: the error, then `[DONE]` (after a blank line if an event was cut)."""
    event = f"data: {json.dumps(error.payload())}\n\ndata: [DONE]\n\n".encode()
    return b"\n\n" + event if separate else event


class Proxy:
    """The two pools, one HTTP client, and the request flow behind the routes."""

    def __init__(self, config: ProxyConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.prefill = InstancePool("prefill", config.prefill_urls, config.cooldown_s, clock)
        self.decode = InstancePool("decode", config.decode_urls, config.cooldown_s, clock)
        # trust_env=False: instances are internal addresses, never reached through an HTTP(S)_PROXY.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False,
        )

    def _deadline(self) -> float:
        """When a request that starts now must be done, on the event loop's clock."""
        return asyncio.get_running_loop().time() + self.config.timeout_s

    async def _open(
        self, pool: InstancePool, instance: Instance, request: httpx.Request, deadline: float,
    ) -> httpx.Response:
        """Send `request` and return the open response once its status is 2xx/3xx; 4xx and 5xx raise."""
        async with _upstream(pool, instance, deadline):
            response = await self.client.send(request, stream=True)
            if response.status_code < 400:
                return response
            content = await response.aread()
            await response.aclose()
        if response.status_code >= 500:
            raise UpstreamError(pool.stage, instance.url, f"HTTP {response.status_code}: {content[:500].decode(errors='replace')}")
        content_type = response.headers.get("content-type", "application/json")
        raise UpstreamRejected(pool.stage, instance.url, response.status_code, content, content_type)

    async def _read(self, pool: InstancePool, instance: Instance, response: httpx.Response, deadline: float) -> bytes:
        """The rest of a non-streamed reply's body; the response is closed afterwards."""
        try:
            async with _upstream(pool, instance, deadline):
                return await response.aread()
        finally:
            await response.aclose()

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str], deadline: float) -> dict[str, Any] | None:
        """Run the prefill-only request; the `kv_transfer_params` P returned (None when it returned none)."""
        instance = self.prefill.pick()
        request = self.client.build_request("POST", instance.url + path, json=prefill_body(body), headers=headers)
        content = await self._read(self.prefill, instance, await self._open(self.prefill, instance, request, deadline), deadline)
        try:
            reply = json.loads(content)
        except json.JSONDecodeError as exc:
            raise UpstreamError("prefill", instance.url, "reply is not JSON") from exc
        params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
        if not params:
            logger.warning("prefill instance %s returned no kv_transfer_params: decode recomputes the prompt", instance.url)
        return params

    async def _relay(self, instance: Instance, response: httpx.Response, deadline: float) -> AsyncIterator[bytes]:
        """D's stream, chunk by chunk; if D breaks mid-stream, an error event and `[DONE]` close it."""
        chunks = response.aiter_bytes()
        last = b"\n\n"
        try:
            while True:
                async with _upstream(self.decode, instance, deadline):
                    chunk = await anext(chunks, None)
                if chunk is None:
                    return
                last = chunk or last
                yield chunk
        except UpstreamError as exc:
            logger.warning("stream cut: %s", exc)
            yield _sse_error(exc, separate=not last.endswith(b"\n\n"))
        finally:
            await response.aclose()

    async def generate(self, request: Request, path: str) -> Response:
        """One completion or chat request through P then D; errors become the client's reply."""
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        reply_headers = {"X-Request-Id": request_id}
        body = await _json_object(request)
        if body is None:
            error = {"error": {"message": "the body must be a JSON object", "type": "invalid_request_error", "code": 400}}
            return JSONResponse(error, status_code=400, headers=reply_headers)
        try:
            return await self._disaggregate(path, body, self._upstream_headers(request, request_id), reply_headers)
        except ProxyError as exc:
            logger.warning("request %s: %s", request_id, exc)
            return exc.response(reply_headers)

    async def _disaggregate(
        self, path: str, body: dict[str, Any], headers: dict[str, str], reply_headers: dict[str, str],
    ) -> Response:
        """Prefill on P, then D's reply: streamed through when the client asked for a stream, else its JSON."""
        deadline = self._deadline()
        params = await self._prefill(path, body, headers, deadline)
        instance = self.decode.pick()
        decode_body = {**body, "kv_transfer_params": params} if params else body
        upstream = self.client.build_request("POST", instance.url + path, json=decode_body, headers=headers)
        response = await self._open(self.decode, instance, upstream, deadline)
        if body.get("stream"):
            media_type = response.headers.get("content-type", "text/event-stream")
            return StreamingResponse(self._relay(instance, response, deadline), media_type=media_type, headers=reply_headers)
        content = await self._read(self.decode, instance, response, deadline)
        return Response(content, status_code=response.status_code, media_type="application/json", headers=reply_headers)

    async def models(self, request: Request) -> Response:
        """`GET /v1/models`, answered by a decode instance."""
        instance = self.decode.pick()
        headers = self._upstream_headers(request, request.headers.get("x-request-id") or uuid.uuid4().hex)
        deadline = self._deadline()
        try:
            upstream = self.client.build_request("GET", instance.url + "/v1/models", headers=headers)
            response = await self._open(self.decode, instance, upstream, deadline)
            content = await self._read(self.decode, instance, response, deadline)
        except ProxyError as exc:
            return exc.response({})
        return Response(content, status_code=response.status_code, media_type="application/json")

    async def health(self) -> JSONResponse:
        """Probe every instance now: 200 when a prefill and a decode instance are up, else 503; the body lists both."""
        pools = (self.prefill, self.decode)
        probes = [(pool, instance) for pool in pools for instance in pool.instances]
        alive = await asyncio.gather(*(self._probe(pool, instance) for pool, instance in probes))
        summary: dict[str, dict[str, list[str]]] = {pool.stage: {"up": [], "down": []} for pool in pools}
        for (pool, instance), up in zip(probes, alive):
            summary[pool.stage]["up" if up else "down"].append(instance.url)
        healthy = all(summary[pool.stage]["up"] for pool in pools)
        return JSONResponse(summary, status_code=200 if healthy else 503)

    async def _probe(self, pool: InstancePool, instance: Instance) -> bool:
        """`GET /health` on one instance; marks it up or down by the answer."""
        try:
            response = await self.client.get(instance.url + "/health", timeout=self.config.connect_timeout_s)
        except httpx.HTTPError:
            up = False
        else:
            up = response.status_code == 200
        if up:
            pool.mark_up(instance)
        else:
            pool.mark_down(instance)
        return up

    @staticmethod
    def _upstream_headers(request: Request, request_id: str) -> dict[str, str]:
        """The headers both instances get: the forwarded client headers and the request id."""
        forwarded = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
        return {**forwarded, "X-Request-Id": request_id}

    async def aclose(self) -> None:
        """Close the HTTP client and its connections."""
        await self.client.aclose()


def build_app(
    prefill_urls: Sequence[str], decode_urls: Sequence[str], timeout_s: float = 300.0, *,
    connect_timeout_s: float = 5.0, cooldown_s: float = 10.0,
) -> FastAPI:
    """The proxy as an ASGI app: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`."""
    config = ProxyConfig(tuple(prefill_urls), tuple(decode_urls), timeout_s, connect_timeout_s, cooldown_s)
    proxy = Proxy(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await proxy.aclose()

    app = FastAPI(title="hmc-vllm-proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.generate(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.models(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        return await proxy.health()

    return app


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hmc-vllm-proxy",
        description="OpenAI-compatible proxy for disaggregated prefill/decode vLLM instances (round-robin per stage).",
    )
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instance base URLs")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instance base URLs")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds for a whole request (default: %(default)s)")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help="deadline in seconds to connect to an instance (default: %(default)s)")
    parser.add_argument("--cooldown", type=float, default=10.0, help="seconds an unreachable instance is skipped (default: %(default)s)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="(default: %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """The `hmc-vllm-proxy` command."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(args.prefill, args.decode, args.timeout, connect_timeout_s=args.connect_timeout, cooldown_s=args.cooldown)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
