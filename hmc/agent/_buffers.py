"""ConnBuffers and the table of an agent's local registrations.

A `ConnBuffer` is registered memory plus its descriptor (plain protobuf data that
peers use to address it). The `BufferTable` answers "may this peer touch that
buffer?": it checks the access key in constant time, remembers withdrawn ids so
late requests get BufferWithdrawnError rather than UnknownBufferError, and counts
in-flight users so `remove()` returns only when no receive is still writing into
the memory.

Concurrency: a table is shared by the user's threads and the agent's server
threads; one condition variable guards its dicts and user counts.
"""

from __future__ import annotations

import contextlib
import hmac
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from hmc.errors import AccessDeniedError, BufferWithdrawnError, UnknownBufferError
from hmc.memory import MemoryRegion
from hmc.v1 import common_pb2

__all__ = ["BufferTable", "ConnBuffer"]


class ConnBuffer:
    """A registered memory region that peers may read or write."""

    __slots__ = ("descriptor", "id", "inline_routes", "name", "region", "size", "_view")

    def __init__(self, region: MemoryRegion, descriptor: common_pb2.BufferDescriptor) -> None:
        self.region = region
        self.descriptor = descriptor
        self.id: str = descriptor.id
        self.name: str = descriptor.name
        self.size: int = region.size
        self.inline_routes: dict[str, Any] = {}
        """The agent's cached single-range fast paths (dropped on withdrawal): per remote buffer id for
        unforced calls, per (remote buffer id, path) for calls that force a path."""
        self._view: memoryview | None = None

    def numpy(self) -> np.ndarray:
        """A zero-copy uint8 array over the buffer (host memory only)."""
        return self.region.numpy()

    @property
    def view(self) -> memoryview:
        """A zero-copy byte view for socket I/O (host memory only)."""
        if self._view is None:
            self._view = memoryview(self.region.numpy())
        return self._view

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"<ConnBuffer {self.id}{label} {self.size} bytes on {self.region.device.name}>"


class BufferTable:
    """Local registrations by id and name, with access checks, withdrawn ids and in-flight users."""

    def __init__(self) -> None:
        self._cond = threading.Condition()  # guards the three dicts/sets below
        self._by_id: dict[str, ConnBuffer] = {}
        self._withdrawn: set[str] = set()
        self._users: dict[str, int] = {}

    def add(self, buffer: ConnBuffer) -> None:
        with self._cond:
            self._by_id[buffer.id] = buffer
            self._withdrawn.discard(buffer.id)

    def get(self, buffer_id: str, access_key: bytes | None = None) -> ConnBuffer:
        """The buffer, if it exists and `access_key` (when given) matches; typed error otherwise."""
        with self._cond:
            buffer = self._by_id.get(buffer_id)
            if buffer is None:
                if buffer_id in self._withdrawn:
                    raise BufferWithdrawnError(f"buffer {buffer_id} was withdrawn")
                raise UnknownBufferError(f"no buffer {buffer_id!r} on this agent")
        if access_key is not None and not hmac.compare_digest(access_key, buffer.descriptor.access_key):
            raise AccessDeniedError(f"wrong access key for buffer {buffer_id}")
        return buffer

    def by_name(self, name: str) -> ConnBuffer:
        with self._cond:
            for buffer in self._by_id.values():
                if buffer.name == name:
                    return buffer
        raise UnknownBufferError(f"no buffer named {name!r} on this agent")

    @contextlib.contextmanager
    def use(self, buffer_id: str, access_key: bytes) -> Iterator[ConnBuffer]:
        """Check access, then hold the buffer so `remove()` waits for this use to end."""
        buffer = self.acquire(buffer_id, access_key)
        try:
            yield buffer
        finally:
            self.release(buffer_id)

    def acquire(self, buffer_id: str, access_key: bytes) -> ConnBuffer:
        """`use()` without a context manager (the staged owner's per-request path): pair with `release()`."""
        buffer = self.get(buffer_id, access_key)
        with self._cond:
            if buffer_id not in self._by_id:
                raise BufferWithdrawnError(f"buffer {buffer_id} was withdrawn")
            self._users[buffer_id] = self._users.get(buffer_id, 0) + 1
        return buffer

    def release(self, buffer_id: str) -> None:
        with self._cond:
            left = self._users[buffer_id] - 1
            if left:
                self._users[buffer_id] = left
            else:
                del self._users[buffer_id]
                self._cond.notify_all()

    def remove(self, buffer_id: str, timeout: float = 5.0) -> ConnBuffer | None:
        """Withdraw a buffer; wait (bounded) until no in-flight use touches its memory."""
        deadline = time.monotonic() + timeout
        with self._cond:
            buffer = self._by_id.pop(buffer_id, None)
            self._withdrawn.add(buffer_id)
            while self._users.get(buffer_id) and self._cond.wait(max(deadline - time.monotonic(), 0.0)):
                pass
        return buffer

    def withdrawn(self, buffer_id: str) -> bool:
        with self._cond:
            return buffer_id in self._withdrawn

    def values(self) -> list[ConnBuffer]:
        with self._cond:
            return list(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)
