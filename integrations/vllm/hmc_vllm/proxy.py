"""Disaggregated prefill/decode proxy: one OpenAI-compatible endpoint in front of prefill and decode vLLM instances.

Each completion or chat request goes to one or more prefill instances (P), then to one decode instance (D),
all with the same `X-Request-Id` (the client's, else a fresh one, returned in the response headers):

1. P prefills each prompt once. A completions `prompt` that is a list of strings or of token-id lists is
   split, one prefill request per element, run concurrently (round-robin over P); a string or a list of
   ints is one prompt, and a chat request always is. Each prefill request is the client's body with
   `stream: false`, `max_tokens: 1` (and `max_completion_tokens: 1` when the client used it), every field
   that only shapes the output removed (`n`, `best_of`, `use_beam_search`, `echo`, `logprobs`,
   `top_logprobs`, `prompt_logprobs`, `stop`, `stream_options`, `min_tokens`, `logit_bias`, ... see
   `hmc_vllm.bodies.OUTPUT_ONLY_FIELDS`), and `kv_transfer_params` asking for a remote decode, with `hmc_loads` = the
   client's `n`: how many decode sub-requests will load this prompt's KV.
2. D gets the client's own body (less any `kv_transfer_params` of the client's) plus `kv_transfer_params`: P's reply params unchanged when one prefill
   ran, `{"do_remote_prefill": true, "hmc_batch": [params of prompt 0, prompt 1, ...]}` when several ran.
   D's reply goes back as-is: its JSON, or its server-sent events chunk by chunk when the client asked
   `stream: true`. A prefill reply without `kv_transfer_params` (P is no KV producer) is fine: D then
   recomputes that prompt. Requests whose decode computes the prompt whatever it is offered skip P
   (`needs_prefill`: beam search, prompt logprobs, completions' `echo` with `logprobs`), so no prefill
   pins blocks nobody loads; `best_of`, which vLLM 0.32 ignores, reaches D unchanged, so every answer
   equals a single instance's.

Health: a monitor probes `GET /health` on every instance every `health_interval_s` (one loop per instance,
each probe with the connect timeout as its deadline; the first round runs before the proxy serves) and
marks instances up or down; a connection error on a request marks its instance down at once, and the
next probe that gets 200 marks it up. P and D are picked round-robin among the instances that are up,
each stage on its own. When no decode (or no prefill) instance is up, a request gets HTTP 503
`{"error": {"message": "no decode instance is up (...)", "type": "upstream_error", "code": 503}}` at once,
before any prefill runs. The proxy's own `GET /health` reports the monitor's view (200 when a prefill and
a decode instance are up, else 503), and costs the instances nothing.

Failures are JSON errors, never hangs: the whole request has one deadline (`timeout_s`), connecting has a
shorter one. An upstream that cannot be reached, drops the connection, misses the deadline or answers 5xx
gives HTTP 502 `{"error": {"message": ..., "type": "upstream_error", "code": 502}}` whose message names the
stage, the instance and the cause; an upstream 4xx is passed through with its body. When D fails in the
middle of a stream (the status line is already sent), the stream ends with one event
`data: {"error": {... "type": "upstream_error", "code": 502}}` followed by `data: [DONE]`, the shape vLLM
itself uses for errors inside a stream.

Release: when the proxy abandons prefilled requests (a prefill of the same request failed, D failed in
any way before answering 2xx, or the client went away before D answered), it tells each P whose reply
carried `kv_transfer_params` to free those blocks at once instead of holding them for the lease:
`POST {P}/v1/completions {"model": <client's>, "prompt": "release", "max_tokens": 1,
"kv_transfer_params": {**P's params, "hmc_release": true}}`. Releases are fire-and-forget background
tasks (deadline: the connect timeout) that never delay the client's reply; P refuses the request before
its engine once it has freed the blocks, and its answer is only logged at debug level. Once D answered
2xx, D's connector owns the blocks and nothing is released, with one exception: vLLM checks a streamed
request only after its stream began (HTTP 200), so a stream whose first event is an error (D refused the
KV) is released too.

Exceptions::

    ProxyError
    ├── UpstreamError      an instance was unreachable, dropped the connection, timed out or answered 5xx (502)
    ├── UpstreamRejected   an instance answered 4xx: its status and body go back to the client
    └── NoInstanceUp       no instance of a stage is up (503), found before anything is sent upstream

Concurrency: everything runs on the server's one event loop. The pools' round-robin and up/down state is
only touched there, between awaits, so it needs no lock; the monitor's probe loops, the requests and
the release tasks all run as tasks of that loop. The proxy keeps a reference to every release task
until it ends; shutdown stops the monitor and waits for the releases for at most the connect timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hmc_vllm.bodies import (
    RELEASE_PATH,
    decode_params,
    needs_prefill,
    prefill_bodies,
    release_body,
)
from hmc_vllm.upstream import HealthMonitor, Instance, InstancePool, NoInstanceUp, ProxyError, UpstreamError, UpstreamRejected

__all__ = [
    "HealthMonitor",
    "NoInstanceUp",
    "ProxyConfig",
    "ProxyError",
    "UpstreamError",
    "UpstreamRejected",
    "build_app",
    "decode_params",
    "main",
    "prefill_bodies",
    "release_body",
]

logger = logging.getLogger(__name__)

FORWARDED_HEADERS: tuple[str, ...] = ("authorization",)




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
    """Deadline for opening one connection to an instance, for one `/health` probe and for one release."""
    health_interval_s: float = 1.0
    """How often every instance's `/health` is probed."""

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("the proxy needs at least one prefill and one decode URL")
        if min(self.timeout_s, self.connect_timeout_s, self.health_interval_s) <= 0:
            raise ValueError("timeouts and the health interval must be positive")




@dataclass(frozen=True)
class Prefilled:
    """One prefill request that succeeded: where it ran and the `kv_transfer_params` P returned (if any)."""

    instance: Instance
    params: dict[str, Any] | None


@contextlib.asynccontextmanager
async def _upstream(pool: InstancePool, instance: Instance, deadline: float) -> AsyncIterator[None]:
    """The one place httpx errors and the request's deadline become `UpstreamError`; connection errors mark the instance down."""
    try:
        async with asyncio.timeout_at(deadline):
            yield
    except (TimeoutError, httpx.TimeoutException) as exc:
        raise UpstreamError(pool.stage, instance.url, f"no answer in time ({type(exc).__name__})") from exc
    except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
        pool.mark(instance, False, f"{type(exc).__name__}: {exc}")
        raise UpstreamError(pool.stage, instance.url, f"connection failed ({type(exc).__name__}: {exc})") from exc
    except httpx.HTTPError as exc:
        raise UpstreamError(pool.stage, instance.url, f"{type(exc).__name__}: {exc}") from exc



async def _json_object(request: Request) -> dict[str, Any] | None:
    """The client's body if it is a JSON object, else None."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (its body is read already, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse_error(error: UpstreamError, separate: bool) -> bytes:
    """The closing events of a stream that broke: the error, then `[DONE]` (after a blank line if an event was cut)."""
    event = f"data: {json.dumps(error.payload())}\n\ndata: [DONE]\n\n".encode()
    return b"\n\n" + event if separate else event


class Proxy:
    """The two pools, their health monitor, one HTTP client, the release tasks, and the request flow behind the routes."""

    def __init__(self, config: ProxyConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.prefill = InstancePool("prefill", config.prefill_urls, clock)
        self.decode = InstancePool("decode", config.decode_urls, clock)
        self.monitor = HealthMonitor((self.prefill, self.decode), self._probe, config.health_interval_s, clock=clock)
        # trust_env=False: instances are internal addresses, never reached through an HTTP(S)_PROXY.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False,
        )
        # Release POSTs in flight; referenced here until done so they are not garbage-collected.
        self._releases: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Learn every instance's state once, then keep probing in the background."""
        await self.monitor.check()
        self.monitor.start()

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

    async def _prefill(
        self, instance: Instance, path: str, body: dict[str, Any], headers: dict[str, str], deadline: float,
    ) -> Prefilled:
        """Run one prefill-only request on `instance`."""
        request = self.client.build_request("POST", instance.url + path, json=body, headers=headers)
        content = await self._read(self.prefill, instance, await self._open(self.prefill, instance, request, deadline), deadline)
        try:
            reply = json.loads(content)
        except json.JSONDecodeError as exc:
            raise UpstreamError("prefill", instance.url, "reply is not JSON") from exc
        params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
        if not params:
            logger.warning("prefill instance %s returned no kv_transfer_params: decode recomputes the prompt", instance.url)
        return Prefilled(instance, params or None)

    async def _prefill_all(
        self, path: str, body: dict[str, Any], headers: dict[str, str], deadline: float,
    ) -> list[Prefilled]:
        """Prefill every prompt of `body` concurrently; if one fails (or this is cancelled), the others are released."""
        bodies = prefill_bodies(body)
        instances = [self.prefill.pick() for _ in bodies]  # NoInstanceUp before anything is sent
        tasks = [asyncio.create_task(self._prefill(i, path, b, headers, deadline)) for i, b in zip(instances, bodies)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            self._release([task.result() for task in tasks if not task.cancelled() and task.exception() is None], body, headers)
            raise

    def _release(self, prefilled: Sequence[Prefilled], body: dict[str, Any], headers: dict[str, str]) -> None:
        """Tell P to free the blocks of every abandoned prefill that has any, in background tasks."""
        for done in prefilled:
            if done.params:
                release = self._send_release(done.instance.url, release_body(body.get("model"), done.params), headers)
                task = asyncio.create_task(release, name=f"hmc-proxy-release {done.instance.url}")
                self._releases.add(task)
                task.add_done_callback(self._releases.discard)

    async def _send_release(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        """One release POST to the prefill instance at `url`; whatever P answers is only logged."""
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                response = await self.client.post(url + RELEASE_PATH, json=body, headers=headers)
            logger.debug("release sent to prefill instance %s: HTTP %d", url, response.status_code)
        except (TimeoutError, httpx.HTTPError) as exc:
            logger.debug("release to prefill instance %s failed: %s: %s", url, type(exc).__name__, exc)

    async def _relay(self, instance: Instance, response: httpx.Response, deadline: float, refused: Callable[[], None]) -> AsyncIterator[bytes]:
        """D's stream, chunk by chunk; if D breaks mid-stream, an error event and `[DONE]` close it.

        vLLM validates a streamed request only once its stream has begun (HTTP 200): when D's first
        event is an error (D refused the KV), `refused` runs, so P frees the blocks at once.
        """
        chunks = response.aiter_bytes()
        last = b"\n\n"
        first = True
        try:
            while True:
                async with _upstream(self.decode, instance, deadline):
                    chunk = await anext(chunks, None)
                if chunk is None:
                    return
                if first and chunk.startswith(b'data: {"error"'):
                    refused()
                first = first and not chunk
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
        work = self._disaggregate(path, body, self._upstream_headers(request, request_id), reply_headers)
        try:
            return await self._unless_disconnected(request, work, request_id)
        except ProxyError as exc:
            logger.warning("request %s: %s", request_id, exc)
            return exc.response(reply_headers)

    @staticmethod
    async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, Response], request_id: str) -> Response:
        """`work`'s response, or, if the client goes away first, `work` cancelled (which releases its prefills)."""
        task = asyncio.create_task(work)
        gone = asyncio.create_task(_disconnected(request))
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()  # a cancelled task is only done once it has run its cleanup
        if task.done():
            return task.result()
        with contextlib.suppress(asyncio.CancelledError, ProxyError):
            await task
        logger.info("request %s: the client went away before the decode instance answered", request_id)
        return Response(status_code=499)

    async def _disaggregate(
        self, path: str, body: dict[str, Any], headers: dict[str, str], reply_headers: dict[str, str],
    ) -> Response:
        """Prefill on P, then D's reply: streamed through when the client asked for a stream, else its JSON."""
        deadline = self._deadline()
        instance = self.decode.pick()  # NoInstanceUp before any prefill runs
        prefilled = await self._prefill_all(path, body, headers, deadline) if needs_prefill(body) else []
        params = decode_params([done.params for done in prefilled])
        # The client's own kv_transfer_params never reach D: only what P returned for these prompts.
        decode_body = {key: value for key, value in body.items() if key != "kv_transfer_params"}
        if params:
            decode_body["kv_transfer_params"] = params
        upstream = self.client.build_request("POST", instance.url + path, json=decode_body, headers=headers)
        try:
            response = await self._open(self.decode, instance, upstream, deadline)
        except BaseException:  # failed, rejected, late, or cancelled because the client went away
            self._release(prefilled, body, headers)
            raise
        if body.get("stream"):
            media_type = response.headers.get("content-type", "text/event-stream")
            relay = self._relay(instance, response, deadline, lambda: self._release(prefilled, body, headers))
            return StreamingResponse(relay, media_type=media_type, headers=reply_headers)
        content = await self._read(self.decode, instance, response, deadline)
        return Response(content, status_code=response.status_code, media_type="application/json", headers=reply_headers)

    async def models(self, request: Request) -> Response:
        """`GET /v1/models`, answered by a decode instance."""
        headers = self._upstream_headers(request, request.headers.get("x-request-id") or uuid.uuid4().hex)
        deadline = self._deadline()
        try:
            instance = self.decode.pick()
            upstream = self.client.build_request("GET", instance.url + "/v1/models", headers=headers)
            response = await self._open(self.decode, instance, upstream, deadline)
            content = await self._read(self.decode, instance, response, deadline)
        except ProxyError as exc:
            return exc.response({})
        return Response(content, status_code=response.status_code, media_type="application/json")

    def health(self) -> JSONResponse:
        """The monitor's view: 200 when a prefill and a decode instance are up, else 503; the body lists both stages."""
        summary = {pool.stage: pool.summary() for pool in (self.prefill, self.decode)}
        healthy = all(stage["up"] for stage in summary.values())
        return JSONResponse(summary, status_code=200 if healthy else 503)

    async def _probe(self, instance: Instance) -> bool:
        """Whether `GET /health` on `instance` answers 200 within the connect timeout."""
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                response = await self.client.get(instance.url + "/health")
        except (TimeoutError, httpx.HTTPError):
            return False
        return response.status_code == 200

    @staticmethod
    def _upstream_headers(request: Request, request_id: str) -> dict[str, str]:
        """The headers every instance gets: the forwarded client headers and the request id."""
        forwarded = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
        return {**forwarded, "X-Request-Id": request_id}

    async def aclose(self) -> None:
        """Stop the monitor, give the releases in flight the connect timeout to finish, close the HTTP client."""
        await self.monitor.aclose()
        if self._releases:
            _, late = await asyncio.wait(set(self._releases), timeout=self.config.connect_timeout_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self.client.aclose()


def build_app(
    prefill_urls: Sequence[str], decode_urls: Sequence[str], timeout_s: float = 300.0, *,
    connect_timeout_s: float = 5.0, health_interval_s: float = 1.0,
) -> FastAPI:
    """The proxy as an ASGI app: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`."""
    config = ProxyConfig(tuple(prefill_urls), tuple(decode_urls), timeout_s, connect_timeout_s, health_interval_s)
    proxy = Proxy(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            await proxy.start()
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
        return proxy.health()

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
    parser.add_argument(
        "--connect-timeout", type=float, default=5.0,
        help="deadline in seconds to connect to an instance, for one health probe and for one release (default: %(default)s)",
    )
    parser.add_argument(
        "--health-interval", type=float, default=1.0,
        help="seconds between two GET /health probes of each instance; requests skip instances that are down (default: %(default)s)",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="(default: %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """The `hmc-vllm-proxy` command."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(
        args.prefill, args.decode, args.timeout, connect_timeout_s=args.connect_timeout, health_interval_s=args.health_interval,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
