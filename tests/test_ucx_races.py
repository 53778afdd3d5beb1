"""The `ucx` path where threads meet: first transfers and first reads at once, close against a peer that stopped,
small transfers behind one to a stopped peer, and processes with more than 1023 open files. Real agents, real
peer processes (frozen with SIGSTOP), UCX from the libucx wheel over tcp (and shared memory with cma where the
race does not need a peer that stops progressing); random bytes, poisoned destinations, every byte compared.
Where a race depends on timing, the test forces the overlap (a barrier inside the path) rather than hoping for
it. Skipped, with the reason, where the UCP binding is not built."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from ucx_support import requires_ucx

from hmc.agent import Agent
from hmc.config import Config, PathPolicy
from hmc.errors import BufferWithdrawnError, HMCError, TimeoutError
from hmc.testing import PeerProcess
from hmc.transport import _ucx as ucx_transport
from hmc.transport import _ucx_engine
from hmc.transport import _ucx_lanes as ucx_lanes
from hmc.transport import _ucx_progress as ucx_progress
from hmc.transport._base import PathName
from hmc.transport._ucx import UcxTransport

pytestmark = requires_ucx

POISON = 0xA5
TRANSPORTS = ["tcp", "sm,cma"]


def _transport(agent: Agent) -> UcxTransport:
    transport = agent._transports[PathName.UCX]  # type: ignore[attr-defined]
    assert isinstance(transport, UcxTransport)
    return transport


def _until(condition: Callable[[], bool], deadline_s: float, what: str) -> None:
    """Return once `condition()` holds; fail the test at the deadline."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        os.sched_yield()


def _run_threads(count: int, run: Callable[[int], None], deadline_s: float) -> list[BaseException | None]:
    """Run `run(i)` on `count` threads at once; each one's error (None: it returned), all joined by the deadline."""
    outcomes: list[BaseException | None] = [None] * count
    started = threading.Barrier(count)

    def one(i: int) -> None:
        try:
            started.wait(30)
            run(i)
        except BaseException as exc:  # collected for the assertions
            outcomes[i] = exc

    threads = [threading.Thread(target=one, args=(i,), name=f"test-ucx-race-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + deadline_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a transfer thread did not end"
    return outcomes


@pytest.mark.parametrize("tls", TRANSPORTS)
def test_concurrent_first_transfers_share_one_grant_and_unregister_stops_them_all(
    tls: str, make_agent: Callable[..., Agent], rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Two first transfers to one buffer both open a grant (forced to overlap); only one may be used, and the owner's
    unregister must revoke what they use: nothing lands after it returned."""
    monkeypatch.setattr(ucx_lanes, "_WINDOW_BYTES", 1 << 20)  # many windows: each checks its grant before it is posted
    owner, initiator = make_agent(("ucx",), ucx_transports=tls), make_agent(("ucx",), ucx_transports=tls)
    size, parts = 256 << 20, 2
    landing = np.full(size, POISON, np.uint8)
    theirs = owner.register(landing)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    mine = initiator.register(data)
    transport = _transport(initiator)
    opened: list[ucx_lanes.Grant] = []
    granted = ucx_lanes.Grant.granted.__func__  # type: ignore[attr-defined]

    def recording(cls: type[ucx_lanes.Grant], *args: Any, **kwargs: Any) -> ucx_lanes.Grant:
        grant = granted(cls, *args, **kwargs)
        opened.append(grant)
        return grant

    monkeypatch.setattr(ucx_lanes.Grant, "granted", classmethod(recording))
    both_opening = threading.Barrier(parts)
    open_grant = transport._open_grant

    def overlapping(remote: Any, deadline: float) -> Any:
        both_opening.wait(30)  # each first transfer is inside its opening before either comes back
        return open_grant(remote, deadline)

    monkeypatch.setattr(transport, "_open_grant", overlapping)
    part = size // parts
    outcomes: list[BaseException | None] = []
    runner = threading.Thread(
        target=lambda: outcomes.extend(_run_threads(parts, lambda i: initiator.write(mine, theirs.descriptor, i * part, i * part, part, timeout=60.0).wait(), 90.0))
    )  # fmt: skip
    runner.start()
    try:
        _until(lambda: not runner.is_alive() or bool(np.count_nonzero(landing[:: 1 << 16] != POISON) >= 16), 60.0, "bytes land")
        owner.unregister(theirs)
        at_unregister = landing.copy()
    finally:
        runner.join(120.0)
    assert not runner.is_alive()
    assert len(opened) == parts, "the first transfers did not open their grants at once"
    assert all(grant.revoked is not None for grant in opened), "a grant outlived the owner's unregister"
    assert all(outcome is None or isinstance(outcome, BufferWithdrawnError) for outcome in outcomes), outcomes
    assert np.array_equal(landing, at_unregister), "bytes landed after the owner's unregister returned"
    assert bool(np.all((landing == POISON) | (landing == data)))
    for i, outcome in enumerate(outcomes):
        if outcome is None:  # it ended before the unregister: every byte of it landed
            assert np.array_equal(landing[i * part : (i + 1) * part], data[i * part : (i + 1) * part])


def test_close_against_a_frozen_peer_returns_in_time_with_no_thread_left_in_ucx(
    config: Config, make_peer: Callable[..., PeerProcess], rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Windows pending to peers that stopped (over tcp an endpoint's close then waits for them): close() ends the
    lanes' threads within its bound, and destroys the context only once no thread is inside UCX."""
    monkeypatch.setattr(ucx_transport, "_CLOSE_S", 1.5)  # less than two endpoints' closes of 1 s each
    monkeypatch.setattr(ucx_progress, "_JOIN_S", 1.5)
    peers = [make_peer(("ucx",), ucx_transports="tcp") for _ in range(2)]
    agent = Agent(config.replace(ucx_transports="tcp", policy=PathPolicy(allow=("ucx",))), daemon=False)
    try:
        size = 64 << 20
        mine = agent.register(rng.integers(0, 256, size, dtype=np.uint8))
        theirs = [peer.register(size, fill=POISON) for peer in peers]
        for descriptor in theirs:
            agent.write(mine, descriptor, 0, 0, 4096).wait()
            agent.write(mine, descriptor, 0, 0, 16 << 20).wait()  # every lane connected to it
        transport = _transport(agent)
        assert transport._lanes is not None
        threads = [lane.progress._thread for lane in transport._lanes.lanes]
        context = transport._context
        assert context is not None
        with contextlib.ExitStack() as frozen:
            for peer in peers:
                frozen.enter_context(peer.stalled())
            handles = [agent.write(mine, descriptor, 0, 0, size, timeout=1.0) for descriptor in theirs]
            for handle in handles:
                with pytest.raises(TimeoutError):
                    handle.wait()
            started = time.monotonic()
            agent.close()
            took = time.monotonic() - started
            alive = [thread.name for thread in threads if thread.is_alive()]
        assert took < 1.5 + 2.0, f"close took {took:.1f} s"
        assert not alive, f"lane threads still run after close: {alive}"
        assert context._closed
    finally:
        agent.close()


def test_close_leaves_the_context_to_a_lane_thread_that_does_not_end(
    config: Config, make_peer: Callable[..., PeerProcess], rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """A lane's thread that does not end by close()'s bound (held here inside a command): close returns in time,
    says so, and leaves the context allocated; the thread, once let go, closes its worker on it without harm."""
    monkeypatch.setattr(ucx_transport, "_CLOSE_S", 1.0)
    peer = make_peer(("ucx",), ucx_transports="tcp")
    agent = Agent(config.replace(ucx_transports="tcp", policy=PathPolicy(allow=("ucx",))), daemon=False)
    release = threading.Event()
    try:
        size = 16 << 20
        data = rng.integers(0, 256, size, dtype=np.uint8)
        mine = agent.register(data)
        theirs = peer.register(size, fill=POISON)
        agent.write(mine, theirs, 0, 0, size).wait()
        assert peer.contents(theirs.id) == data.tobytes()
        transport = _transport(agent)
        assert transport._lanes is not None
        lane = transport._lanes.lanes[0]
        held = threading.Event()

        def hold() -> None:
            held.set()
            release.wait(60.0)

        lane.progress.submit(hold)
        assert held.wait(10.0)
        context = transport._context
        assert context is not None
        with caplog.at_level(logging.ERROR, logger=ucx_transport.__name__):
            started = time.monotonic()
            agent.close()
            took = time.monotonic() - started
        assert took < 1.0 + 2.0, f"close took {took:.1f} s"
        assert lane.progress._thread.is_alive() and not context._closed
        assert any("left allocated" in record.getMessage() for record in caplog.records)
        release.set()
        lane.progress._thread.join(10.0)
        assert not lane.progress._thread.is_alive()
        assert not context._closed  # left for good: nothing frees it under a thread that may still come back
    finally:
        release.set()
        agent.close()


@contextlib.contextmanager
def _descriptors_past(number: int) -> Iterator[None]:
    """Open descriptors (duplicates of one) until the next one this process opens is numbered past `number`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = number + 256
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below {needed}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    gc.collect()  # files of earlier tests' garbage closed now, not in the middle: their numbers would be taken first
    base = os.open(os.devnull, os.O_RDONLY)
    opened = [base]
    try:
        while opened[-1] <= number:
            opened.append(os.dup(base))
        yield
    finally:
        for fd in opened:
            os.close(fd)
        if soft < needed:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("tls", TRANSPORTS)
def test_progress_threads_sleep_on_descriptors_past_1023(tls: str, make_agent: Callable[..., Agent], rng: np.random.Generator) -> None:
    """A serving process has many files open: the workers' and wake-up descriptors are numbered past 1023 (where
    select() refuses them), and both agents' progress threads still sleep on them and move every byte."""
    with _descriptors_past(1100):
        owner, initiator = make_agent(("ucx",), ucx_transports=tls), make_agent(("ucx",), ucx_transports=tls)
        for agent in (owner, initiator):
            lanes = _transport(agent)._lanes
            assert lanes is not None
            fds = [(lane.progress.worker.fd(), lane.progress._wake) for lane in lanes.lanes]
            assert all(fd > 1023 for pair in fds for fd in pair), fds
        size = 32 << 20
        theirs = owner.register(np.full(size, POISON, np.uint8))
        data = rng.integers(0, 256, size, dtype=np.uint8)
        mine = initiator.register(data)
        sink = initiator.register(np.full(size, POISON ^ 0xFF, np.uint8))
        for _ in range(3):  # between rounds every progress thread goes back to sleep on its descriptors
            initiator.write(mine, theirs.descriptor, 0, 0, 4096, timeout=10.0).wait()
            initiator.write(mine, theirs.descriptor, 0, 0, size, timeout=10.0).wait()
            assert np.array_equal(theirs.numpy(), data)
            initiator.read(sink, theirs.descriptor, 0, 0, size, timeout=10.0).wait()
            assert np.array_equal(sink.numpy(), data)
            theirs.numpy().fill(POISON)
            sink.numpy().fill(POISON ^ 0xFF)
        assert all(lane.progress._thread.is_alive() for agent in (owner, initiator) for lane in _transport(agent)._lanes.lanes)  # type: ignore[union-attr]


@pytest.mark.parametrize("tls", TRANSPORTS)
def test_concurrent_first_reads_all_succeed_through_one_scratch_buffer(
    tls: str, make_agent: Callable[..., Agent], rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Several first reads from one owner each measure the pair (forced to meet where the probe's scratch buffer is
    made): one scratch buffer serves them all, none is freed under a probe, and every read lands every byte."""
    owner, initiator = make_agent(("ucx",), ucx_transports=tls), make_agent(("ucx",), ucx_transports=tls)
    size, count = 4 << 20, 6
    data = rng.integers(0, 256, size, dtype=np.uint8)
    theirs = owner.register(data)
    sinks = [initiator.register(np.full(size, POISON, np.uint8)) for _ in range(count)]
    transport = _transport(initiator)
    freed: list[int] = []
    close = ucx_transport._Scratch.close

    def recording_close(scratch: Any) -> None:
        freed.append(scratch.address)
        close(scratch)

    monkeypatch.setattr(ucx_transport._Scratch, "close", recording_close)
    meeting = threading.Barrier(count)
    scratch = UcxTransport._scratch

    def met(self: UcxTransport, *args: Any) -> Any:
        meeting.wait(30)  # every probe asks for its scratch buffer at once
        return scratch(self, *args)

    monkeypatch.setattr(UcxTransport, "_scratch", met)
    outcomes = _run_threads(count, lambda i: initiator.read(sinks[i], theirs.descriptor, 0, 0, size, timeout=30.0).wait(), 90.0)
    assert outcomes == [None] * count, outcomes
    assert not freed, "a scratch buffer was freed while the path was open"
    assert len(transport._scratches) == 1
    for sink in sinks:
        assert np.array_equal(sink.numpy(), data)


def test_small_transfers_keep_their_deadline_behind_one_to_a_frozen_peer(
    config: Config, make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess], rng: np.random.Generator,
) -> None:  # fmt: skip
    """A 1 MiB write to a frozen peer holds the callers' worker until its deadline: 4 KiB writes to a healthy peer
    meanwhile end by their own (short) deadline, and the one to the frozen peer by its own, not later."""
    frozen, healthy = make_peer(("ucx",), ucx_transports="tcp"), make_peer(("ucx",), ucx_transports="tcp")
    agent = make_agent(("ucx",), ucx_transports="tcp")
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    mine = agent.register(data)
    stuck, fine = frozen.register(1 << 20, fill=POISON), healthy.register(1 << 20, fill=POISON)
    for descriptor in (stuck, fine):
        agent.write(mine, descriptor, 0, 0, 4096).wait()  # granted, the callers' worker connected
    inline = _transport(agent)._inline
    assert inline is not None
    with frozen.stalled():
        outcome: list[tuple[BaseException | None, float]] = []

        def to_frozen() -> None:
            started = time.monotonic()
            try:
                agent.write(mine, stuck, 0, 0, 1 << 20, timeout=3.0).wait()
                outcome.append((None, time.monotonic() - started))
            except HMCError as exc:
                outcome.append((exc, time.monotonic() - started))

        writer = threading.Thread(target=to_frozen)
        writer.start()
        try:
            _until(inline.lock.locked, 10.0, "the write to the frozen peer holds the callers' worker")
            for _ in range(3):
                started = time.monotonic()
                with pytest.raises(TimeoutError):
                    agent.write(mine, fine, 4096, 4096, 4096, timeout=0.5).wait()
                took = time.monotonic() - started
                assert took < 0.5 + 0.5, f"a 4 KiB write with a 0.5 s timeout took {took:.2f} s"
        finally:
            writer.join(30.0)
        assert not writer.is_alive()
        [(error, took)] = outcome
        assert isinstance(error, TimeoutError) and took < 3.0 + 1.0, (error, took)
        agent.write(mine, fine, 8192, 8192, 4096, timeout=5.0).wait()  # the healthy peer, with the worker free again
        expected = np.full(1 << 20, POISON, np.uint8)
        expected[:4096], expected[8192:12288] = data[:4096], data[8192:12288]
        assert np.frombuffer(healthy.contents(fine.id), np.uint8).tobytes() == expected.tobytes()


@pytest.mark.parametrize("tls", TRANSPORTS)
def test_a_withdrawn_grants_keys_are_destroyed_on_every_worker(
    tls: str, config: Config, make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess], rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Buffers registered, written (the callers' worker and both lanes) and withdrawn over and over: each withdrawal
    destroys the remote keys its grant unpacked, so the workers hold none once the last is gone (not one per grant)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))  # over tcp, both lanes on a 2-core host too
    peer = make_peer(("ucx",), ucx_transports=tls)
    agent = make_agent(("ucx",), ucx_transports=tls)
    size = 16 << 20
    data = rng.integers(0, 256, size, dtype=np.uint8)
    mine = agent.register(data)
    transport = _transport(agent)
    assert transport._lanes is not None and transport._inline is not None
    lanes, inline = transport._lanes.lanes, transport._inline

    def keys(worker: Any) -> int:
        return sum(isinstance(thing, _ucx_engine.RemoteKey) for thing in worker._owned)

    def held_by_lanes(deadline: float) -> list[int]:
        """The keys each lane's worker holds, counted on its thread (after the commands queued before)."""
        return [lane.progress.call(functools.partial(keys, lane.progress.worker), deadline) for lane in lanes]

    for cycle in range(8):
        theirs = peer.register(size, fill=POISON)
        agent.write(mine, theirs, 4096, 0, 4096, timeout=10.0).wait()  # the callers' worker
        agent.write(mine, theirs, 0, 0, size, timeout=10.0).wait()  # both lanes
        assert peer.contents(theirs.id) == data.tobytes()
        held = held_by_lanes(time.monotonic() + 10.0)
        assert all(count == 1 for count in held), (cycle, held)  # used by this cycle's grant
        peer.unregister(theirs.id)
    held = held_by_lanes(time.monotonic() + 10.0)  # after the drops the withdrawals queued on the lanes
    with inline.lock:
        held.append(keys(inline.worker))
    assert held == [0] * (len(lanes) + 1), held
    theirs = peer.register(size, fill=POISON)  # and a new grant still works
    agent.write(mine, theirs, 0, 0, size, timeout=10.0).wait()
    assert peer.contents(theirs.id) == data.tobytes()


def test_a_write_that_timed_out_lands_nothing_after_its_end_nor_after_unregister(make_agent: Callable[..., Agent], rng: np.random.Generator) -> None:
    """Its flushes expired with the deadline: the handle reported the timeout and the grant stopped counting it while
    its windows still landed, so the owner's unregister returned before they did (over tcp, 70 MiB landed after it).
    Now no window starts after the deadline, and the transfer ends when those in flight have landed. A later write
    on the same connections, done, shows that nothing more was on its way."""
    owner, initiator = make_agent(("ucx",), ucx_transports="tcp"), make_agent(("ucx",), ucx_transports="tcp")
    size = 512 << 20
    landing, later = np.full(size, POISON, np.uint8), np.full(4096, POISON, np.uint8)
    theirs, sync = owner.register(landing), owner.register(later)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    mine = initiator.register(data)
    initiator.write(mine, theirs.descriptor, 0, 0, 4096).wait()  # granted and connected
    initiator.write(mine, sync.descriptor, 0, 0, 4096).wait()
    handle = initiator.write(mine, theirs.descriptor, 0, 0, size, timeout=0.02)
    with pytest.raises(TimeoutError):
        handle.wait()
    at_end = landing.copy()
    owner.unregister(theirs)
    at_unregister = landing.copy()
    initiator.write(mine, sync.descriptor, 4096, 0, 4096).wait()  # behind whatever was still on the way
    assert np.array_equal(later, data[4096:8192])
    assert np.array_equal(at_end, at_unregister), "bytes landed after the transfer reported its end"
    assert np.array_equal(landing, at_unregister), "bytes landed after the owner's unregister returned"
    assert bool(np.all((landing == POISON) | (landing == data))) and (landing == POISON).any()
