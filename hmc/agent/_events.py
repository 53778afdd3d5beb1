"""What an agent learns about the world outside its own transfers: `AgentEvent`s, drained with `Agent.events()`.

hmcd pushes the withdrawal of other agents' buffers and the end of other
agents down the agent's stream; the agent acts on them first (a withdrawn
buffer is refused with BufferWithdrawnError on its next use; a lost peer's
connections and grants are dropped) and then queues them here for the user. The
agent's own link adds when hmcd was lost and when it attached again.

Concurrency: any thread may deliver or drain; `_ready` (a Condition over its own
lock) guards the queue, which is bounded: when the user never drains, the oldest
events are dropped (and counted in `dropped`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import threading

__all__ = ["AgentEvent", "AgentEventKind", "EventInbox"]

log = logging.getLogger(__name__)


class AgentEventKind(enum.Enum):
    BUFFER_WITHDRAWN = "buffer_withdrawn"
    """Another agent's buffer was withdrawn (unregistered, or its owner ended or died): its next use raises BufferWithdrawnError."""
    AGENT_DOWN = "agent_down"
    """Another agent ended or died: connections and grants into it were dropped."""
    HMCD_LOST = "hmcd_lost"
    """The link to hmcd broke; transfers go on, lookups raise UnavailableError until it attaches again."""
    HMCD_ATTACHED = "hmcd_attached"
    """The link attached to hmcd again and registers this agent's buffers again."""


@dataclasses.dataclass(frozen=True)
class AgentEvent:
    """One event; fields that do not apply to its kind are empty."""

    kind: AgentEventKind
    buffer_id: str = ""
    agent_id: str = ""
    """The agent concerned: the withdrawn buffer's owner, or the agent that went down."""
    buffer_name: str = ""
    node: str = ""
    detail: str = ""
    """Why, in words (the link's error for HMCD_LOST; the registry epoch for HMCD_ATTACHED)."""


class EventInbox:
    """A bounded queue of AgentEvents."""

    def __init__(self, capacity: int = 1 << 14) -> None:
        self._ready = threading.Condition(threading.Lock())  # guards _events and dropped
        self._events: collections.deque[AgentEvent] = collections.deque()
        self._capacity = capacity
        self.dropped = 0

    def deliver(self, event: AgentEvent) -> None:
        with self._ready:
            if len(self._events) >= self._capacity:
                self._events.popleft()
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("nobody drains Agent.events(): dropping the oldest (keeping %d)", self._capacity)
            self._events.append(event)
            self._ready.notify_all()

    def drain(self, timeout: float | None = 0) -> list[AgentEvent]:
        """Everything queued; waits up to `timeout` (None: forever) for the first one."""
        with self._ready:
            if timeout != 0:
                self._ready.wait_for(lambda: self._events, timeout)
            out = list(self._events)
            self._events.clear()
        return out
