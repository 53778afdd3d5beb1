"""Reads the owner pushes, on the `ucx` and `rdma` paths: what both ends share of them.

Where gets are slow (NIXL's READ over UCX falls back to 0.5 GB/s on one GPU), an asker sends its buffer's owner a
Push naming its own registered memory (`push_message`: key, address, workers), and the owner puts the ranges
there. The owner keeps the askers' memories it pushed into as grants (`PushTargets`, bounded: an evicted one's
keys are destroyed where nothing uses them), and answers only once the push has also settled in UCX
(`PushCompletion`): the asker, told, may let go of its memory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from hmc.errors import HMCError
from hmc.transport import _ucx_engine as engine
from hmc.transport._deadlines import expires_ms
from hmc.transport._ranges import RangeList
from hmc.transport._ucx_lanes import Grant
from hmc.transport._wire import raise_for_reply
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["PushCompletion", "PushTargets", "push_message", "reply_error"]

_TARGETS = 256
"""Askers' memories of pushed reads kept unpacked."""


class PushCompletion:
    """The owner's completion of a pushed read: `done` hears its end, once, when it has also settled (nothing of
    it runs in UCX any more)."""

    on_cancel: Callable[[], None] | None = None
    cancelled = False

    def __init__(self, done: Callable[[BaseException | None], None]) -> None:
        self._done: Callable[[BaseException | None], None] | None = done
        self._lock = threading.Lock()  # guards the rest
        self._finished = self._settled = False
        self._error: BaseException | None = None

    def set_running(self) -> None:
        return None

    def add_bytes(self, nbytes: int) -> None:
        return None

    def finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished, self._error = True, error
        self._tell()

    def settled(self) -> None:
        with self._lock:
            self._settled = True
        self._tell()

    def _tell(self) -> None:
        with self._lock:
            done = self._done if self._finished and self._settled else None
            if done is not None:
                self._done = None
        if done is not None:
            done(self._error)


class PushTargets:
    """The owner's cache of askers' memories, as grants to write them (the same buffer is pushed into again)."""

    def __init__(self, lanes: int) -> None:
        self._lanes = lanes
        self._lock = threading.Lock()  # guards _targets
        self._targets: dict[tuple[bytes, int, int, tuple[bytes, ...]], Grant] = {}

    def get(self, handle: common_pb2.UcxHandle, size: int) -> tuple[Grant, list[Grant]]:
        """The target `handle` names, and the targets evicted to make room for it (their keys are to be dropped)."""
        key = (bytes(handle.rkey), handle.address, size, tuple(handle.workers))
        evicted: list[Grant] = []
        with self._lock:
            target = self._targets.get(key)
            if target is None:
                if len(self._targets) >= _TARGETS:
                    evicted = [self._targets.pop(old) for old in list(self._targets)[: _TARGETS // 2]]
                target = self._targets[key] = Grant(handle, buffer_id="(a pushed read's target)", size=size, read_only=False, key=b"", owner="", lanes=self._lanes)
        return target, evicted


def push_message(path: str, remote: common_pb2.BufferDescriptor, ranges: RangeList, local: Any, mapping: engine.Mapping, workers: list[bytes], deadline: float, transfer_id: str) -> peer_pb2.Push:
    """The Push asking `remote`'s owner to put `ranges` into `local` (registered as `mapping`, reached through `workers`)."""
    target = common_pb2.UcxHandle(rkey=mapping.rkey, address=mapping.address, workers=workers, ucx_version=engine.version())
    return peer_pb2.Push(
        buffer_id=remote.id, path=path, ranges=ranges.to_proto(), target=target, target_size=local.size, transfer_id=transfer_id, expires_ms=expires_ms(deadline)
    )


def reply_error(reply: peer_pb2.PeerReply | None) -> HMCError | None:
    """The typed error a reply carries (None: it carries none)."""
    try:
        raise_for_reply(reply)  # type: ignore[arg-type]
    except HMCError as exc:
        return exc
    return None
