"""ConnBuffers and the table of an agent's local registrations.

A `ConnBuffer` is registered memory plus its descriptor (plain protobuf data that
peers use to address it). The `BufferTable` answers "may this peer touch that
buffer?": it checks the access key in constant time, remembers withdrawn ids so
late requests get BufferWithdrawnError rather than UnknownBufferError, and counts
in-flight users, each with the connection it serves (its holder), so that
`unregister()` can wait for them and cut the connections of those that do not
finish: it returns only when no receive is still writing into the memory.
Over TCP a peer proves its access key (`prove(key) == proof`, an HMAC bound to
the connection) rather than sending it.

Concurrency: a table is shared by the user's threads and the agent's server
threads; one condition variable guards its dicts and user counts.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable, Collection, Hashable
from typing import Any

import numpy as np

from hmc.errors import AccessDeniedError, BufferWithdrawnError, StaleDescriptorError, UnknownBufferError
from hmc.memory import MemoryRegion
from hmc.v1 import common_pb2

__all__ = ["BufferTable", "ConnBuffer"]


class ConnBuffer:
    """A registered memory region that peers may read or write."""

    __slots__ = ("descriptor", "id", "inline_routes", "name", "outgoing", "region", "size", "_view")

    def __init__(self, region: MemoryRegion, descriptor: common_pb2.BufferDescriptor) -> None:
        self.region = region
        self.descriptor = descriptor
        self.id: str = descriptor.id
        self.name: str = descriptor.name
        self.size: int = region.size
        self.inline_routes: dict[str, Any] = {}
        """The agent's cached single-range fast paths (dropped on withdrawal): per remote buffer id for
        unforced calls, per (remote buffer id, path) for calls that force a path."""
        self.outgoing: list[Any] = []
        """The agent's own transfers of this buffer's bytes (TransferHandles; ended ones pruned now and then, under the
        agent's lock): unregister cancels those still running before it returns."""
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

    def __init__(self, epochs: Callable[[], tuple[int, Collection[int]]] = lambda: (0, ())) -> None:
        """`epochs`: the registry epoch of the hmcd this agent's buffers are registered with now, and the earlier
        ones (a proof made with one of those is a stale descriptor's)."""
        self._epochs = epochs
        self._lock = threading.Lock()  # guards the three dicts/sets below and _waiting
        self._cond = threading.Condition(self._lock)  # a buffer's last in-flight use ended
        self._by_id: dict[str, ConnBuffer] = {}
        self._withdrawn: set[str] = set()
        self._users: dict[str, dict[Hashable, int]] = {}
        """Per buffer id: in-flight uses by holder (the connection each serves; None for local uses)."""
        self._waiting = 0
        """Threads in `wait_unused()`: only then does a release notify (the staged path's hot loop releases)."""

    def add(self, buffer: ConnBuffer) -> None:
        with self._cond:
            self._by_id[buffer.id] = buffer
            self._withdrawn.discard(buffer.id)

    def get(
        self, buffer_id: str, access_key: bytes | None = None, *, prove: Callable[[bytes, int], bytes] | None = None, proof: bytes = b""
    ) -> ConnBuffer:
        """The buffer, if it exists and `access_key` (when given) matches, or `proof` is `prove(its key, epoch)` of the
        current registry epoch (or 0: a descriptor no hmcd served); typed error otherwise."""
        with self._lock:
            buffer = self._by_id.get(buffer_id)
            if buffer is None:
                if buffer_id in self._withdrawn:
                    raise BufferWithdrawnError(f"buffer {buffer_id} was withdrawn")
                raise UnknownBufferError(f"no buffer {buffer_id!r} on this agent")
        if access_key is not None and not hmac.compare_digest(access_key, buffer.descriptor.access_key):
            raise AccessDeniedError(f"wrong access key for buffer {buffer_id}")
        if prove is not None:
            self._check_proof(buffer, prove, proof)
        return buffer

    def _check_proof(self, buffer: ConnBuffer, prove: Callable[[bytes, int], bytes], proof: bytes) -> None:
        key = buffer.descriptor.access_key
        current, earlier = self._epochs()
        if hmac.compare_digest(prove(key, current), proof) or (current and hmac.compare_digest(prove(key, 0), proof)):
            return
        for epoch in earlier:
            if hmac.compare_digest(prove(key, epoch), proof):
                raise StaleDescriptorError(
                    f"stale descriptor: buffer {buffer.id} was served by registry epoch {epoch} of its hmcd, which has started again since "
                    f"(epoch {current}); look it up again"
                )
        raise AccessDeniedError(f"wrong access key proof for buffer {buffer.id}")

    def by_name(self, name: str) -> ConnBuffer:
        with self._cond:
            for buffer in self._by_id.values():
                if buffer.name == name:
                    return buffer
        raise UnknownBufferError(f"no buffer named {name!r} on this agent")

    def acquire(
        self, buffer_id: str, access_key: bytes | None = None, *, prove: Callable[[bytes, int], bytes] | None = None, proof: bytes = b"",
        holder: Hashable = None,
    ) -> ConnBuffer:
        """Check access, then hold the buffer so `unregister()` waits for this use to end (or cuts `holder`): pair
        with `release()`."""
        buffer = self.get(buffer_id, access_key, prove=prove, proof=proof)
        with self._lock:
            if buffer_id not in self._by_id:
                raise BufferWithdrawnError(f"buffer {buffer_id} was withdrawn")
            users = self._users.get(buffer_id)
            if users is None:
                users = self._users[buffer_id] = {}
            users[holder] = users.get(holder, 0) + 1
        return buffer

    def release(self, buffer_id: str, holder: Hashable = None) -> None:
        with self._lock:
            users = self._users[buffer_id]
            users[holder] -= 1
            if users[holder] <= 0:
                del users[holder]
            if not users:
                del self._users[buffer_id]
                if self._waiting:
                    self._cond.notify_all()

    def holders(self, buffer_id: str) -> list[Hashable]:
        """Who still uses the buffer's memory (the connections whose receives write into it)."""
        with self._cond:
            return list(self._users.get(buffer_id, ()))

    def wait_unused(self, buffer_id: str, deadline: float) -> bool:
        """Wait until no in-flight use touches the buffer's memory, or `deadline` (a monotonic time); True when unused."""
        with self._cond:
            while self._users.get(buffer_id):
                left = deadline - time.monotonic()
                self._waiting += 1
                try:
                    woken = left > 0 and self._cond.wait(left)
                finally:
                    self._waiting -= 1
                if not woken:
                    return not self._users.get(buffer_id)
        return True

    def remove(self, buffer_id: str, timeout: float = 5.0) -> ConnBuffer | None:
        """Withdraw a buffer (later requests get BufferWithdrawnError); wait (bounded) until no in-flight use touches it."""
        with self._cond:
            buffer = self._by_id.pop(buffer_id, None)
            self._withdrawn.add(buffer_id)
        self.wait_unused(buffer_id, time.monotonic() + timeout)
        return buffer

    def withdrawn(self, buffer_id: str) -> bool:
        with self._cond:
            return buffer_id in self._withdrawn

    def values(self) -> list[ConnBuffer]:
        with self._cond:
            return list(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)
