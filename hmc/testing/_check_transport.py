"""`check_transport()`: the conformance suite every path must pass.

Given a factory of `TransportPair`s (an initiating Agent in this process, a
`BufferOwner` holding the remote buffers, and the path transfers must take),
it moves random bytes into poisoned destinations and compares every byte, over
odd sizes, unaligned offsets, ranges that touch the last byte and batches of
ranges; it checks that bad requests (out of range, wrong access key, unknown or
withdrawn buffer) raise the typed error and leave the destination unchanged;
that a notification reaches the owner exactly once and after the data; that
deadlines are respected and cancellation works.

Owners that can freeze (`stalled()`, e.g. a PeerProcess) get the strict
deadline and cancel checks; in-process owners the weaker ones.

Concurrency: runs on the calling thread; owners are driven one call at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from hmc.agent import Agent, ConnBuffer, Notification, TransferState
from hmc.errors import (
    AccessDeniedError,
    BufferWithdrawnError,
    CancelledError,
    HMCError,
    OutOfRangeError,
    TimeoutError,
    UnknownBufferError,
)
from hmc.v1 import common_pb2

__all__ = ["AgentOwner", "BufferOwner", "TransportPair", "check_transport"]

_POISON = 0xA5
_SLACK_S = 1.0
"""How late past its deadline a failing wait may return (thread wake-ups, slow CI)."""


class BufferOwner(Protocol):
    """Where the remote buffers of a pair live."""

    def register(self, size: int, *, name: str | None = None, fill: int = 0) -> common_pb2.BufferDescriptor: ...

    def fill(self, buffer_id: str, data: bytes, offset: int = 0) -> None: ...

    def contents(self, buffer_id: str) -> bytes: ...

    def unregister(self, buffer_id: str) -> None: ...

    def notifications(self, timeout: float = 0.0) -> list[tuple[Notification, bytes]]: ...


@dataclasses.dataclass
class TransportPair:
    agent: Agent
    """The initiator, in this process."""
    owner: BufferOwner
    path: str
    """The path every transfer between them must take."""
    stalled: Callable[[], AbstractContextManager[None]] | None = None
    """Freezes the owner for a block, when the owner can be frozen."""


class AgentOwner:
    """A `BufferOwner` backed by an Agent of this process (the same one for the local path)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._buffers: dict[str, ConnBuffer] = {}

    def register(self, size: int, *, name: str | None = None, fill: int = 0) -> common_pb2.BufferDescriptor:
        buffer = self.agent.register(np.full(size, fill, dtype=np.uint8), name=name)
        self._buffers[buffer.id] = buffer
        return buffer.descriptor

    def fill(self, buffer_id: str, data: bytes, offset: int = 0) -> None:
        self._buffers[buffer_id].numpy()[offset : offset + len(data)] = np.frombuffer(data, np.uint8)

    def contents(self, buffer_id: str) -> bytes:
        return self._buffers[buffer_id].numpy().tobytes()

    def unregister(self, buffer_id: str) -> None:
        self.agent.unregister(buffer_id)

    def notifications(self, timeout: float = 0.0) -> list[tuple[Notification, bytes]]:
        return [(n, self.contents(n.buffer_id)) for n in self.agent.notifications(timeout)]


def check_transport(make_pair: Callable[[], AbstractContextManager[TransportPair]], *, seed: int = 0) -> None:
    """Run every conformance check against one pair from `make_pair`; AssertionError on failure."""
    rng = np.random.default_rng(seed)
    with make_pair() as pair:
        for check in _CHECKS:
            try:
                check(pair, rng)
            except AssertionError as exc:
                raise AssertionError(f"{check.__name__} over {pair.path}: {exc}") from exc


class _Scene:
    """A local source/destination and a poisoned remote buffer, with the expected remote bytes."""

    def __init__(self, pair: TransportPair, rng: np.random.Generator, local_size: int, remote_size: int) -> None:
        self.pair = pair
        self.data = rng.integers(0, 256, local_size, dtype=np.uint8)
        self.local = pair.agent.register(self.data.copy())
        self.remote = pair.owner.register(remote_size, fill=_POISON)
        self.expected = np.full(remote_size, _POISON, dtype=np.uint8)

    def remote_bytes(self) -> np.ndarray:
        return np.frombuffer(self.pair.owner.contents(self.remote.id), np.uint8)

    def assert_remote(self, what: str) -> None:
        got = self.remote_bytes()
        bad = np.flatnonzero(got != self.expected)
        assert bad.size == 0, f"{what}: {bad.size} remote bytes differ, first at offset {bad[:1].tolist()}"

    def write(self, src: Any, dst: Any, lengths: Any, **kwargs: Any) -> Any:
        handle = self.pair.agent.write(self.local, self.remote, src, dst, lengths, **kwargs)
        handle.wait()
        assert handle.state is TransferState.DONE, handle
        assert handle.path == self.pair.path, f"took {handle.path}, expected {self.pair.path}"
        for s, d, n in _triples(src, dst, lengths):
            self.expected[d : d + n] = self.data[s : s + n]
        return handle

    def close(self) -> None:
        self.pair.agent.unregister(self.local)
        with contextlib.suppress(HMCError):
            self.pair.owner.unregister(self.remote.id)


@contextlib.contextmanager
def _scene(pair: TransportPair, rng: np.random.Generator, local_size: int = (1 << 20) + 7, remote_size: int = (1 << 20) + 13) -> Iterator[_Scene]:
    scene = _Scene(pair, rng, local_size, remote_size)
    try:
        yield scene
    finally:
        scene.close()


def _triples(a: Any, b: Any, n: Any) -> Iterator[tuple[int, int, int]]:
    """(a, b, n) per range, a scalar standing for every range."""
    return zip(*(x.tolist() for x in np.broadcast_arrays(np.atleast_1d(a), np.atleast_1d(b), np.atleast_1d(n))))


def _disjoint_ranges(rng: np.random.Generator, count: int, space: int, longest: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` non-overlapping (offset, length) pairs inside `space` bytes, shuffled."""
    slot = space // count
    lengths = rng.integers(1, min(longest, slot) + 1, count)
    offsets = np.arange(count) * slot + rng.integers(0, slot - lengths + 1)
    order = rng.permutation(count)
    return offsets[order], lengths[order]


def _check_write_patterns(pair: TransportPair, rng: np.random.Generator) -> None:
    with _scene(pair, rng) as scene:
        size = scene.expected.size
        scene.write(3, 5, 4093)
        scene.assert_remote("one unaligned range")
        scene.write(11, size - 1, 1)
        scene.write(0, size - 4097, 4097)
        scene.assert_remote("ranges touching the last byte")
        dst, lengths = _disjoint_ranges(rng, 257, size, 3001)
        src = rng.integers(0, scene.data.size - lengths)
        scene.write(src, dst, lengths)
        scene.assert_remote("257 random ranges of odd lengths")
        starts = np.arange(0, 64 * 1024, 4096)
        scene.write(starts + 1, starts + 2, 4096)
        scene.assert_remote("adjacent ranges (coalesced)")
        scene.write(0, 0, size - 6)
        scene.assert_remote("one large range")


def _check_read_patterns(pair: TransportPair, rng: np.random.Generator) -> None:
    with _scene(pair, rng) as scene:
        remote = rng.integers(0, 256, scene.expected.size, dtype=np.uint8)
        pair.owner.fill(scene.remote.id, remote.tobytes())
        local = scene.local.numpy()
        local[:] = _POISON
        expected = local.copy()
        src, src_lengths = _disjoint_ranges(rng, 129, remote.size, 5003)
        dst, dst_lengths = _disjoint_ranges(rng, 129, local.size, 5003)
        batches = [(remote.size - 1, 0, 1), (7, 9, 4099), (remote.size - 65536, 65536, 65536), (src, dst, np.minimum(src_lengths, dst_lengths))]
        for s, d, n in batches:
            handle = pair.agent.read(scene.local, scene.remote, s, d, n)
            handle.wait()
            assert handle.path == pair.path, f"read took {handle.path}"
            for a, b, c in _triples(s, d, n):
                expected[b : b + c] = remote[a : a + c]
            bad = np.flatnonzero(local != expected)
            assert bad.size == 0, f"read: {bad.size} local bytes differ, first at {bad[:1].tolist()}"


def _expect(error: type[HMCError], run: Callable[[], Any]) -> None:
    try:
        handle = run()
        handle.wait()
    except error:
        return
    raise AssertionError(f"expected {error.__name__}, the transfer succeeded")


def _check_refusals(pair: TransportPair, rng: np.random.Generator) -> None:
    with _scene(pair, rng) as scene:
        agent, size = pair.agent, scene.expected.size
        scene.write(0, 0, 4096)  # establish grants and connections first: refusals must not rely on cold paths
        _expect(OutOfRangeError, lambda: agent.write(scene.local, scene.remote, 0, size - 100, 101))
        _expect(OutOfRangeError, lambda: agent.write(scene.local, scene.remote, [0, 10], [0, -1], 5))
        _expect(OutOfRangeError, lambda: agent.read(scene.local, scene.remote, size, 0, 1))
        lying = common_pb2.BufferDescriptor()
        lying.CopyFrom(scene.remote)
        lying.size = size + 4096  # a descriptor claiming more than the owner registered
        _expect(OutOfRangeError, lambda: agent.write(scene.local, lying, 0, size, 4096))
        wrong_key = common_pb2.BufferDescriptor()
        wrong_key.CopyFrom(scene.remote)
        wrong_key.access_key = bytes(16)
        _expect(AccessDeniedError, lambda: agent.write(scene.local, wrong_key, 0, 0, 4096))
        _expect(AccessDeniedError, lambda: agent.write(scene.local, wrong_key, [0, 8192], [0, 8192], 100))
        unknown = common_pb2.BufferDescriptor()
        unknown.CopyFrom(scene.remote)
        unknown.id = "0" * 16
        _expect(UnknownBufferError, lambda: agent.write(scene.local, unknown, 0, 0, 4096))
        scene.assert_remote("after refused requests")
        withdrawn = pair.owner.register(8192, fill=_POISON)
        agent.write(scene.local, withdrawn, 0, 0, 4096).wait()
        pair.owner.unregister(withdrawn.id)
        _expect(BufferWithdrawnError, lambda: agent.write(scene.local, withdrawn, 0, 0, 4096))
        _expect(BufferWithdrawnError, lambda: agent.read(scene.local, withdrawn, 0, 0, 10))
        scene.write(1, 1, 4096)
        scene.assert_remote("the pair still works after refusals")


def _check_notification(pair: TransportPair, rng: np.random.Generator) -> None:
    with _scene(pair, rng) as scene:
        pair.owner.notifications(0)
        handle = scene.write([0, 300000], [17, 500000], 200001, notify=b"kv-ready")
        seen = pair.owner.notifications(5.0)
        seen += pair.owner.notifications(0.2)
        mine = [(n, snapshot) for n, snapshot in seen if n.transfer_id == handle.id]
        assert len(mine) == 1, f"notification delivered {len(mine)} times"
        notification, snapshot = mine[0]
        assert notification.payload == b"kv-ready" and notification.buffer_id == scene.remote.id
        assert notification.sender_agent == pair.agent.id
        assert np.array_equal(np.frombuffer(snapshot, np.uint8), scene.expected), "notification arrived before the data"


def _check_deadline_and_cancel(pair: TransportPair, rng: np.random.Generator) -> None:
    big = 64 << 20  # more than socket buffers can absorb
    with _scene(pair, rng, local_size=big, remote_size=big) as scene:
        scene.write(0, 0, 4096)  # connections and grants are up before the owner freezes
        with pair.stalled() if pair.stalled is not None else contextlib.nullcontext():
            handle = pair.agent.write(scene.local, scene.remote, 0, 0, big, notify=b"c", timeout=5.0)
            handle.cancel()
            if pair.stalled is not None:
                assert handle.state is TransferState.CANCELLED, handle
            if handle.state is TransferState.CANCELLED:
                _expect(CancelledError, lambda: handle)
            started = time.monotonic()
            handle = pair.agent.write(scene.local, scene.remote, 0, 0, big, notify=b"d", timeout=0.5)
            try:
                handle.wait()
            except TimeoutError:
                assert handle.state is TransferState.FAILED, handle
            else:
                assert pair.stalled is None, "a transfer to a frozen owner succeeded"
            assert time.monotonic() - started < 0.5 + _SLACK_S, "wait overran the deadline"
        pair.owner.notifications(0.5)
        scene.write(0, 0, 1 << 20)
        got = scene.remote_bytes()
        assert np.array_equal(got[: 1 << 20], scene.data[: 1 << 20]), "the pair does not work after a deadline and a cancel"
        rest, data = got[1 << 20 :], scene.data[1 << 20 :]
        assert bool(np.all((rest == _POISON) | (rest == data))), "abandoned transfers wrote foreign bytes"


_CHECKS = (_check_write_patterns, _check_read_patterns, _check_refusals, _check_notification, _check_deadline_and_cancel)
