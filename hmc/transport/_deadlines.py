"""The deadline a staged data request carries, both ends: what the initiator stamps on a frame and what the owner
makes of it.

A DataWrite or DataRead carries what was left of its transfer's deadline when it was built (`expires_ms`), and the
owner counts that from when it reads the frame: a frame that waited (in the sender's socket, or in a sender that was
stopped after building it) gets its whole budget again. So to a peer whose CLOCK_MONOTONIC is its own (the same
kernel and time namespace: `AgentInfo.clock_id`), the initiator also sends the deadline itself (`deadline_monotonic_s`),
and the owner takes the earlier of the two. A peer can only shorten its own transfers with it.

The owner remembers each transfer's deadline as first seen on a connection (`Expiry`, bounded), so a later frame
of a transfer cannot extend it.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from hmc.errors import TimeoutError
from hmc.memory._machine import clock_id
from hmc.v1 import common_pb2

__all__ = ["Expiry", "expires_ms", "shares_clock", "stamp"]

_EXPECTED_MAX = 4096
"""Transfers a data connection remembers the deadline of; older entries past their deadline are forgotten (and, when
that is not enough, the first seen of those not over)."""
_ID_KEPT = 256
"""A transfer id up to this long is remembered as it is; a longer one (a peer's frames may carry megabytes) by its digest."""


def expires_ms(deadline: float) -> int:
    """What is left of `deadline` in whole milliseconds, as a frame carries it (at least 1, fits a uint32);
    TimeoutError once it passed: a passed deadline never goes out as a fresh budget."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"the deadline passed {-left:.3f}s before the frame could be sent")
    return min(max(int(left * 1000), 1), 0xFFFFFFFF)


def shares_clock(remote: common_pb2.BufferDescriptor) -> bool:
    """Whether `remote`'s owner reads our CLOCK_MONOTONIC (its agent said so: `clock_id`)."""
    return bool(remote.owner.clock_id) and remote.owner.clock_id == clock_id()


def stamp(request: Any, deadline: float, clocked: bool) -> Any:
    """Set a DataWrite's or DataRead's deadline fields (TimeoutError once `deadline` passed; `clocked`: the owner
    reads our clock, `shares_clock`); returns it."""
    request.expires_ms = expires_ms(deadline)
    if clocked:
        request.deadline_monotonic_s = deadline
    return request


class Expiry:
    """An owner's data connection's record of its transfers' deadlines, as first seen there."""

    __slots__ = ("_deadlines", "_default_s")

    def __init__(self, default_s: float) -> None:
        self._default_s = default_s
        self._deadlines: dict[str | bytes, float] = {}

    def deadline(self, transfer_id: str, expires_ms: int, deadline_monotonic_s: float = 0.0) -> float:
        """The monotonic deadline of `transfer_id`'s frames (a frame without one gets the agent's default budget;
        one stamped with this host's clock, the earlier of the two)."""
        now = time.monotonic()
        budget = now + (expires_ms / 1000 if expires_ms else self._default_s)
        if deadline_monotonic_s > 0:  # (a NaN compares false: ignored)
            budget = min(budget, deadline_monotonic_s)
        if not transfer_id:
            return budget
        key: str | bytes = transfer_id if len(transfer_id) <= _ID_KEPT else hashlib.blake2b(transfer_id.encode(), digest_size=16).digest()
        known = self._deadlines.get(key)
        if known is None:
            if len(self._deadlines) >= _EXPECTED_MAX:
                live = [(tid, when) for tid, when in self._deadlines.items() if when >= now]
                # still full of transfers not over (a peer's far deadlines): forget the first seen of them; a later
                # frame of one gets the deadline it carries itself
                self._deadlines = dict(live[-(_EXPECTED_MAX // 2) :])
            known = self._deadlines[key] = budget
        return known
