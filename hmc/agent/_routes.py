"""A pair's cached fast path (`Route`): the inline copy to one remote buffer and the limits it serves calls under (see
`hmc.agent._agent`'s "Hot path")."""

from __future__ import annotations

from hmc.transport._base import InlineCopy

__all__ = ["Route"]

_TIMED_MAX_BYTES = 1 << 20
"""Longest range a call with a timeout of its own moves on a pair's fast path (a device copy of a GiB takes ~1 ms, which
the caller's deadline must bound: such calls take the slow path)."""


class Route:
    """A cached inline copy to one remote buffer."""

    __slots__ = (
        "key", "local_size", "max_bytes", "path", "read", "read_max_bytes", "read_size", "remote_size", "timed_max_bytes", "timed_read_max_bytes",
        "write",
    )  # fmt: skip

    def __init__(self, copy: InlineCopy, key: bytes, path: str, local_writable: bool) -> None:
        self.write, self.read = copy.write, copy.read
        self.max_bytes = copy.max_bytes
        self.read_max_bytes = copy.max_bytes if copy.read_max_bytes is None else copy.read_max_bytes
        timed = 0 if copy.waits else _TIMED_MAX_BYTES
        self.timed_max_bytes, self.timed_read_max_bytes = min(self.max_bytes, timed), min(self.read_max_bytes, timed)
        """The same limits for calls that bring a timeout of their own: the copy runs under its transport's default
        deadline, so only one that waits on no peer and ends within microseconds may carry them."""
        self.local_size = copy.local_size
        self.read_size = copy.local_size if local_writable else 0
        """Bound on local offsets of reads: 0 for read-only local memory, so every read takes the slow path, which refuses it."""
        self.remote_size = copy.remote_size
        self.key, self.path = key, path
