"""Prepared transfers: one write or read of fixed ranges, checked once, posted again and again.

NIXL's prepared requests, in HMC's terms. A caller that moves the same ranges
between the same pair over and over (a pipeline stage's activation slots, a
latency probe) pays the argument checks (the timeout, the range list, its bounds
and disjoint destinations, whose verdict the list caches) once, at
`Agent.prepare_write`/`prepare_read`. Each `post()` then takes one of two ways:

- the pair's fast path (a single range over a path with an inline copy, as
  `Agent.write` learns it): the route is looked up by its key and, when it is
  the route this transfer already vetted, the copy runs at once;
- otherwise the agent's full path with the prepared range list, which negotiates,
  learns the route for later posts, and raises the precise error when something
  changed since (a withdrawn buffer, a lost peer, a closed agent).

The remote descriptor is copied at preparation: changing the caller's message
afterwards changes nothing here.

Concurrency: post() may run on several threads at once. Vetting a route sets its
copy and handle before marking it vetted, so a post that sees the mark finds them;
a post racing a route's replacement copies over either route, both to this buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hmc.agent._buffers import ConnBuffer
from hmc.agent._transfer import TransferHandle
from hmc.errors import HMCError
from hmc.transport._base import TransferOp
from hmc.transport._ranges import RangeList
from hmc.v1 import common_pb2

if TYPE_CHECKING:
    from hmc.agent._agent import Agent
    from hmc.agent._routes import Route

__all__ = ["PreparedTransfer"]


class PreparedTransfer:
    """A write or read of fixed ranges between a local ConnBuffer and a remote buffer; `post()` starts it."""

    __slots__ = ("_agent", "_args", "_copy", "_done", "_key", "_length", "_local", "_op", "_path", "_ranges", "_remote", "_timeout", "_vetted")

    def __init__(
        self, agent: Agent, op: TransferOp, local: ConnBuffer, remote: Any, ranges: RangeList, *, timeout: float | None, path: str | None,
    ) -> None:
        self._agent = agent
        self._op = op
        self._local = local
        if isinstance(remote, ConnBuffer):
            self._remote: Any = remote
        else:
            self._remote = common_pb2.BufferDescriptor()
            self._remote.CopyFrom(remote)
        self._ranges = ranges
        self._timeout = timeout
        self._path = path
        remote_id = self._remote.id
        self._key: Any = remote_id if path is None else (remote_id, path)
        self._length = int(ranges.lengths[0]) if len(ranges) == 1 else 0
        self._args: tuple[int, int, int] | None = None
        """A single range's inline-copy arguments: (local offset, remote offset, length)."""
        if self._length:
            local_offsets, remote_offsets = (ranges.src, ranges.dst) if op is TransferOp.WRITE else (ranges.dst, ranges.src)
            self._args = (int(local_offsets[0]), int(remote_offsets[0]), self._length)
        self._vetted: Route | None = None
        self._copy: Any = None
        """The vetted route's copy for this op."""
        self._done: TransferHandle | None = None
        """What a post over the vetted route returns: one finished handle, as NIXL reposts one request."""

    @property
    def nbytes(self) -> int:
        """Bytes each post moves."""
        return self._ranges.total

    def post(self, *, notify: bytes | None = None) -> TransferHandle:
        """Start the transfer once more; returns its handle.

        Over the pair's fast path the copy has finished when post() returns, and
        every such post returns the same finished handle (one id: a prepared
        transfer is one request, reposted). Otherwise each post has a handle of its own.
        """
        route = self._local.inline_routes.get(self._key)
        if notify is None and route is not None and (route is self._vetted or self._vet(route)) and not self._agent._closed:
            try:
                self._copy(*self._args)
            except HMCError as exc:
                return self._agent._inline_failed(self._local, route, self._length, exc)
            return self._done  # type: ignore[return-value]
        return self._agent._submit(self._op, self._local, self._remote, self._ranges, notify, self._timeout, self._path)

    def _vet(self, route: Route) -> bool:
        """Whether `route` may carry this transfer (the checks `Agent.write`/`read` make per call, made once)."""
        if self._args is None:
            return False
        local_offset, remote_offset, length = self._args
        write = self._op is TransferOp.WRITE
        timed = self._timeout is not None
        if write:
            local_size, max_bytes = route.local_size, (route.timed_max_bytes if timed else route.max_bytes)
        else:
            local_size, max_bytes = route.read_size, (route.timed_read_max_bytes if timed else route.read_max_bytes)
        descriptor = self._remote.descriptor if isinstance(self._remote, ConnBuffer) else self._remote
        if not (
            0 < length <= max_bytes
            and 0 <= local_offset <= local_size - length
            and 0 <= remote_offset <= route.remote_size - length
            and route.key == descriptor.access_key
        ):
            return False
        self._copy = route.write if write else route.read
        self._done = TransferHandle.finished(route.path, length)
        self._vetted = route
        return True

    def __repr__(self) -> str:
        return f"<PreparedTransfer {self._op.name} {self._ranges.total} bytes in {len(self._ranges)} ranges {self._local.id} <-> {self._key}>"
