"""The proxy's upstream instances: its errors, the pools it picks instances from, and the health monitor.

Concurrency: everything runs on the proxy's one event loop; pools are only touched there, between
awaits, so they need no lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response

logger = logging.getLogger("hmc_vllm.proxy")


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


class NoInstanceUp(ProxyError):
    """Every instance of a stage is marked down: the request is refused before anything is sent upstream."""

    def __init__(self, stage: str, urls: Sequence[str]) -> None:
        super().__init__(f"no {stage} instance is up ({', '.join(urls)})")
        self.stage = stage

    def response(self, headers: dict[str, str]) -> Response:
        payload = {"error": {"message": str(self), "type": "upstream_error", "code": 503}}
        return JSONResponse(payload, status_code=503, headers=headers)


@dataclass
class Instance:
    """One upstream vLLM server, whether it is up, and since when (on the pool's clock)."""

    url: str
    up: bool = True
    since: float = 0.0


class InstancePool:
    """The instances of one stage, picked round-robin among those that are up."""

    def __init__(self, stage: str, urls: Sequence[str], clock: Callable[[], float] = time.monotonic) -> None:
        self.stage = stage
        self.instances = [Instance(url.rstrip("/"), since=clock()) for url in urls]
        self._clock = clock
        self._next = 0

    def pick(self) -> Instance:
        """The next instance that is up; `NoInstanceUp` when none is."""
        count = len(self.instances)
        order = [self.instances[(self._next + i) % count] for i in range(count)]
        chosen = next((instance for instance in order if instance.up), None)
        if chosen is None:
            raise NoInstanceUp(self.stage, [instance.url for instance in self.instances])
        self._next = (self.instances.index(chosen) + 1) % count
        return chosen

    def mark(self, instance: Instance, up: bool, why: str = "") -> None:
        """Record what a probe or a request found out about `instance`; changes are logged."""
        if instance.up == up:
            return
        now = self._clock()
        if up:
            logger.info("%s instance %s is up again after %.1fs down", self.stage, instance.url, now - instance.since)
        else:
            logger.warning("%s instance %s marked down: %s", self.stage, instance.url, why or "health check failed")
        instance.up, instance.since = up, now

    def summary(self) -> dict[str, list[str]]:
        """The URLs that are up and those that are down."""
        return {
            "up": [instance.url for instance in self.instances if instance.up],
            "down": [instance.url for instance in self.instances if not instance.up],
        }


class HealthMonitor:
    """Probes every instance of `pools` every `interval_s` and marks it up or down by the answer.

    Each instance has its own loop (a slow instance never delays another's probes), which starts its next
    probe `interval_s` after the start of the previous one, at once if that took longer. `probe` answers
    whether an instance is healthy and bounds its own time; `clock` and `sleep` are injectable for tests.
    """

    def __init__(
        self, pools: Sequence[InstancePool], probe: Callable[[Instance], Awaitable[bool]], interval_s: float, *,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._pools = tuple(pools)
        self._probe = probe
        self._interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self._tasks: list[asyncio.Task[None]] = []

    async def check(self) -> None:
        """One round: probe every instance now, concurrently, and mark each."""
        targets = [(pool, instance) for pool in self._pools for instance in pool.instances]
        for (pool, instance), up in zip(targets, await asyncio.gather(*(self._probe(i) for _, i in targets))):
            pool.mark(instance, up)

    def start(self) -> None:
        """Start one probe loop per instance on the running loop."""
        for pool in self._pools:
            for instance in pool.instances:
                self._tasks.append(asyncio.create_task(self._watch(pool, instance), name=f"hmc-proxy-health {instance.url}"))

    async def _watch(self, pool: InstancePool, instance: Instance) -> None:
        started = self._clock()
        while True:
            await self._sleep(max(0.0, started + self._interval_s - self._clock()))
            started = self._clock()
            pool.mark(instance, await self._probe(instance))

    async def aclose(self) -> None:
        """Stop the probe loops (idempotent)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
