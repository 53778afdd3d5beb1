"""Wants and claims that came before the prefill worker's hold of their request: parked, capped, answered once.

The scheduler's hold follows a want within an engine step, so a few wait here briefly. Anyone holding the
prefill side's key can also send wants for requests that never come, each answered `err` when it goes
stale; so the parked wants are capped per sending agent and in total, a repeat of a parked want (same agent,
same decode request) is dropped, and each parked want is answered at most once (`answered`).
Concurrency: connector thread only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

#: Wants and claims parked at once, from one agent and from all.
MAX_PER_SENDER = 32
MAX_PARKED = 256


@dataclass(frozen=True)
class Want:
    """A decode worker's `want` or `claim` and the agent that sent it."""

    message: dict[str, Any]
    sender: str
    received: float  # time.monotonic()
    deadline: float | None  # time.monotonic() by which the decode side's budget is spent (counted early); None: no budget named
    answered: bool = False  # the sender was told `err` already: never answer it again

    @property
    def kind(self) -> str:
        return str(self.message.get("t"))

    @property
    def dreq(self) -> str:
        return str(self.message.get("dreq"))


class ParkedWants:
    """Parked wants by the request they name, with per-sender counts for the caps."""

    def __init__(self, per_sender: int = MAX_PER_SENDER, total: int = MAX_PARKED) -> None:
        self.per_sender, self.total = per_sender, total
        self._by_req: dict[str, list[Want]] = {}
        self._count: Counter[str] = Counter()

    def park(self, req: str, want: Want) -> str | None:
        """Park `want` for `req`; None if parked, "repeat" if it is parked already, else why it is refused."""
        parked = self._by_req.get(req, [])
        if any(w.sender == want.sender and w.dreq == want.dreq for w in parked):
            return "repeat"
        if self._count[want.sender] >= self.per_sender:
            return f"agent {want.sender} has {self.per_sender} wants parked for requests not held here"
        if self._count.total() >= self.total:
            return f"{self.total} wants are parked for requests not held here"
        self._by_req.setdefault(req, []).append(want)
        self._count[want.sender] += 1
        return None

    def take(self, req: str) -> list[Want]:
        """Unpark every want for `req` (its hold came, or they went stale)."""
        wants = self._by_req.pop(req, [])
        self._count.subtract(w.sender for w in wants)
        self._count += Counter()  # drop the zero counts
        return wants

    def stale(self, now: float, max_age: float) -> list[tuple[str, list[Want]]]:
        """Unpark and return the requests whose first want has waited more than `max_age` seconds."""
        old = [req for req, wants in self._by_req.items() if now - wants[0].received > max_age]
        return [(req, self.take(req)) for req in old]

    def cancel(self, req: str, sender: str, dreq: str) -> Want | None:
        """Mark `sender`'s parked want for `dreq` cancelled (refused when its hold comes); the want, if not yet answered."""
        wants = self._by_req.get(req, [])
        for i, want in enumerate(wants):
            if want.sender == sender and want.dreq == dreq and not want.answered:
                wants[i] = Want(want.message, want.sender, want.received, -float("inf"), answered=True)
                return want
        return None
