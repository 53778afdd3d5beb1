"""Fan-out of hmcd's events to Watch subscribers, with sequence numbers and bounded queues.

Every published event gets the next sequence number of this daemon (1, 2, ...),
its node (when empty) and a time. A subscriber that falls `queue_size` events
behind is dropped: its stream ends RESOURCE_EXHAUSTED (BusyResourceError) instead
of hmcd buffering without bound; it can watch again.

Events relayed from peer daemons are published with `relayed=True` and reach
only subscribers that asked for `include_peers`.

Concurrency: owned by hmcd's event loop; publish() never blocks or awaits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from hmc.errors import BusyResourceError
from hmc.v1 import daemon_pb2

__all__ = ["EventBus", "Subscription"]

Listener = Callable[[daemon_pb2.Event, bool], None]
"""A synchronous observer of every event: (event, relayed)."""


class Subscription:
    """One subscriber's bounded queue; iterate it to receive events."""

    def __init__(self, bus: EventBus, include_peers: bool, queue_size: int) -> None:
        self._bus = bus
        self.include_peers = include_peers
        # Holds events not yet sent to this subscriber; bounded, see module doc.
        self._queue: asyncio.Queue[daemon_pb2.Event | None] = asyncio.Queue(maxsize=queue_size)
        self.overflowed = False

    def offer(self, event: daemon_pb2.Event) -> None:
        if self.overflowed:
            return
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.overflowed = True
            self._queue = asyncio.Queue(maxsize=1)
            self._queue.put_nowait(None)

    def end(self) -> None:
        """Finish the iteration (daemon stopping)."""
        if self._queue.full():
            self._queue = asyncio.Queue(maxsize=1)
        self._queue.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[daemon_pb2.Event]:
        try:
            while True:
                event = await self._queue.get()
                if event is None:
                    break
                yield event
        finally:
            self._bus.unsubscribe(self)
        if self.overflowed:
            raise BusyResourceError("event watcher fell too far behind and was dropped; watch again")


class EventBus:
    """Publishes events to subscribers and synchronous listeners."""

    def __init__(self, node: str, queue_size: int = 4096, clock: Callable[[], float] = time.time) -> None:
        self._node = node
        self._queue_size = queue_size
        self._clock = clock
        self._sequence = 0
        self._subscriptions: set[Subscription] = set()
        self._listeners: list[Listener] = []

    @property
    def sequence(self) -> int:
        """The sequence number of the last published event."""
        return self._sequence

    def subscribe(self, include_peers: bool = False) -> Subscription:
        subscription = Subscription(self, include_peers, self._queue_size)
        self._subscriptions.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscriptions.discard(subscription)

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    @property
    def subscribers(self) -> int:
        return len(self._subscriptions)

    def publish(self, event: daemon_pb2.Event, *, relayed: bool = False) -> daemon_pb2.Event:
        """Stamp `event` (sequence, node, time) and deliver it; returns the stamped event."""
        self._sequence += 1
        event.sequence = self._sequence
        if not event.node:
            event.node = self._node
        if not event.time:
            event.time = self._clock()
        for listener in self._listeners:
            listener(event, relayed)
        for subscription in list(self._subscriptions):
            if subscription.include_peers or not relayed:
                subscription.offer(event)
        return event

    def close(self) -> None:
        """End every subscription."""
        for subscription in list(self._subscriptions):
            subscription.end()
