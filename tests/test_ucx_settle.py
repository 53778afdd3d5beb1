"""The `ucx` path when UCX still runs what a transfer posted after the transfer reported its end: UCX cancels no put,
get or flush, so a flush that misses its landing bound stays counted (on its grant and on this end's memory) until it
ends, and a withdrawal that cannot wait that long says so (DeviceError) instead of returning as if nothing could land.
A pushed read runs within the owner's own timeout whatever the asker asks for, and the targets of pushed reads the
owner evicts from its cache let go of their keys. Real agents, a real peer process frozen with SIGSTOP where the owner
must stop progressing, UCX from the libucx wheel over tcp; random bytes, poisoned destinations, every byte compared."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from ucx_support import requires_ucx

from hmc.agent import Agent
from hmc.errors import BufferWithdrawnError, CancelledError, DeviceError, HMCError, StaleDescriptorError, TimeoutError
from hmc.testing import PeerProcess
from hmc.transport import _ucx as ucx_transport
from hmc.transport import _ucx_engine
from hmc.transport import _ucx_lanes as ucx_lanes
from hmc.transport import _ucx_push as ucx_push
from hmc.transport._base import PathName
from hmc.transport._ranges import RangeList
from hmc.transport._ucx import UcxTransport
from hmc.v1 import common_pb2, peer_pb2

pytestmark = requires_ucx

POISON = 0xA5


def _transport(agent: Agent) -> UcxTransport:
    transport = agent._transports[PathName.UCX]  # type: ignore[attr-defined]
    assert isinstance(transport, UcxTransport)
    return transport


def _until(condition: Callable[[], bool], what: str, deadline_s: float = 10.0) -> None:
    """Return once `condition()` holds; fail the test at the deadline."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        os.sched_yield()


def _posted(transport: UcxTransport) -> bool:
    """Whether a part of a transfer on the path's lanes has something in flight."""
    lanes = transport._lanes
    return lanes is not None and any(part.in_flight for lane in lanes.lanes for part in list(lane.parts))


def test_a_write_whose_flush_outlives_its_landing_bound_counts_until_it_lands(
    make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess], rng: np.random.Generator
) -> None:
    """A write to a frozen owner reported its timeout at its landing bound and stopped counting against its grant while
    UCX still had its windows queued: the owner, running again, landed them after its unregister() returned (99 MiB with
    an owner slowed by a CPU quota). Now the grant counts the transfer until its flushes end, and the owner's unregister
    returns only once they did: nothing of it lands afterwards."""
    peer = make_peer(("ucx",), ucx_transports="tcp")
    initiator = make_agent(("ucx",), ucx_transports="tcp")
    size = 128 << 20
    theirs, sync = peer.register(size, fill=POISON), peer.register(4096, fill=POISON)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    mine = initiator.register(data)
    initiator.write(mine, theirs, 0, 0, 4096).wait()  # granted and connected
    initiator.write(mine, sync, 0, 0, 4096).wait()
    grant = _transport(initiator)._grants[theirs.id]
    with peer.stalled():
        handle = initiator.write(mine, theirs, 0, 0, size, timeout=0.2)
        with pytest.raises(TimeoutError):
            handle.wait()
        assert grant.flights == 1, "a transfer whose flushes UCX still runs stopped counting against its grant"
    peer.unregister(theirs.id)  # the initiator confirms once its windows have landed
    at_unregister = np.frombuffer(peer.contents(theirs.id), np.uint8)
    initiator.write(mine, sync, 0, 0, 4096).wait()  # a round trip on the same connections, behind anything still coming
    later = np.frombuffer(peer.contents(theirs.id), np.uint8)
    assert np.array_equal(at_unregister, later), "bytes landed after the owner's unregister returned"
    assert grant.flights == 0
    assert bool(np.all((later == POISON) | (later == data)))


def test_unregistering_memory_a_read_still_lands_in_says_so(
    make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """unregister() cancelled a read into the buffer from a frozen owner, waited 5 s for its windows and returned: when the
    owner ran again, 94 MiB landed in memory the caller had been told was free. UCX cannot cancel the gets, so now
    unregister raises DeviceError (keep the memory) and leaves the memory registered with UCX."""
    monkeypatch.setattr(ucx_lanes, "STOP_WAIT_S", 0.3)
    monkeypatch.setattr(ucx_transport, "STOP_WAIT_S", 0.3)
    peer = make_peer(("ucx",), ucx_transports="tcp")
    initiator = make_agent(("ucx",), ucx_transports="tcp", timeout_s=30.0)
    size = 64 << 20
    theirs = peer.register(size, fill=0x3C)
    sink = np.full(size, POISON, np.uint8)
    local = initiator.register(sink)
    initiator.read(local, theirs, 0, 0, 4096).wait()  # granted, measured, connected
    transport = _transport(initiator)
    mapping = transport._mappings[local.id]
    with peer.stalled():
        handle = initiator.read(local, theirs, 0, 0, size)
        _until(lambda: _posted(transport), "the read's first gets are posted")
        with pytest.raises(DeviceError, match="keep its memory"):
            initiator.unregister(local)
        assert mapping.users == 1 and not mapping._released, "memory UCX may still write was unregistered"
        with pytest.raises(CancelledError):
            handle.wait()


def _blocked_asker(asker: Agent) -> threading.Event:
    """Stop the asker's lanes from progressing (its workers land nothing) until the returned event is set."""
    release = threading.Event()
    lanes = _transport(asker)._lanes
    assert lanes is not None
    for lane in lanes.lanes:
        lane.progress.submit(lambda: release.wait(60))
    return release


def _push(asker: Agent, remote: common_pb2.BufferDescriptor, local_id: str, nbytes: int, expires_ms: int, address_shift: int = 0) -> threading.Event:
    """Ask `remote`'s owner to push `nbytes` into the asker's buffer `local_id` (raw, as a hostile asker may);
    the event is set with the reply (`.outcome`)."""
    transport = _transport(asker)
    mapping = transport._mappings[local_id]
    target = common_pb2.UcxHandle(rkey=mapping.rkey, address=mapping.address + address_shift, workers=transport._running().addresses, ucx_version=_ucx_engine.version())
    message = peer_pb2.Push(
        buffer_id=remote.id, path="ucx", ranges=RangeList.build(0, 0, nbytes).to_proto(), target=target, target_size=nbytes, expires_ms=expires_ms
    )
    ended = threading.Event()

    def replied(reply: peer_pb2.PeerReply | None, error: BaseException | None) -> None:
        ended.outcome = (reply, error)  # type: ignore[attr-defined]
        ended.set()

    transport._request_push(remote, message, time.monotonic() + 60, replied)
    return ended


def test_a_pushed_read_runs_within_the_owners_timeout_whatever_the_asker_asks(make_agent: Callable[..., Agent]) -> None:
    """A key holder asked for a push with expires_ms = 2**32 - 1 and stopped progressing: the owner's push held the
    buffer for 49.7 days. The owner now bounds it by its own timeout_s."""
    owner = make_agent(("ucx",), ucx_transports="tcp", timeout_s=1.0)
    asker = make_agent(("ucx",), ucx_transports="tcp")
    size = 32 << 20
    theirs = owner.register(np.full(size, 7, np.uint8))
    mine = asker.register(np.zeros(size, np.uint8))
    asker.read(mine, theirs.descriptor, 0, 0, 4096).wait()  # granted, measured, connected
    release = _blocked_asker(asker)
    try:
        ended = _push(asker, theirs.descriptor, mine.id, size, (1 << 32) - 1)
        pushing = _transport(owner)
        _until(lambda: _posted(pushing), "the owner pushes")
        _until(lambda: not _posted(pushing), "the owner's push ends at its own timeout", 1.0 + ucx_lanes._LANDING_S + 5.0)
        assert not ended.is_set(), "the owner replied while its puts could still land in the asker's memory"
    finally:
        release.set()
    assert ended.wait(10), "the owner did not reply once its puts had landed"
    reply, error = ended.outcome  # type: ignore[attr-defined]
    assert error is None and reply.HasField("error"), "a push the asker never took ended without an error"


def test_evicted_push_targets_let_go_of_their_keys(make_agent: Callable[..., Agent], monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner caches pushed reads' targets and evicted half when full, but their unpacked keys stayed with its
    workers: a key holder naming a new target address per push grew the owner without bound (20000 pushes: 20004
    keys). Evicted targets' keys are now destroyed."""
    monkeypatch.setattr(ucx_push, "_TARGETS", 8)
    owner = make_agent(("ucx",), ucx_transports="tcp")
    asker = make_agent(("ucx",), ucx_transports="tcp")
    theirs = owner.register(np.full(1 << 20, 7, np.uint8))
    mine = asker.register(np.zeros(1 << 20, np.uint8))
    asker.read(mine, theirs.descriptor, 0, 0, 4096).wait()
    mine.numpy()[:] = POISON
    lanes = _transport(owner)._lanes
    assert lanes is not None

    def keys() -> int:
        return sum(len(lane.progress.worker._owned) for lane in lanes.lanes)

    before = keys()
    for i in range(40):
        ended = _push(asker, theirs.descriptor, mine.id, 8, 5000, address_shift=8 * i)
        assert ended.wait(10)
        reply, error = ended.outcome  # type: ignore[attr-defined]
        assert error is None and not reply.HasField("error")
    _until(lambda: keys() <= before + 8, "the evicted targets' keys are dropped (on the lanes' threads)")
    pushed = mine.numpy()[: 8 * 40 + 8]
    assert bool(np.all(pushed[:-8] == 7)) and bool(np.all(pushed[-8:] == POISON))


def test_a_transfer_ended_at_once_for_a_lost_peer_ends_once_when_its_flush_lingers_after() -> None:
    """A peer's loss reports its parts at once, flushes still watched; one that then missed its landing bound lingered
    and ended later, and `on_end` ran a second time: the grant's and the memory's counts went negative."""
    from types import SimpleNamespace

    ended: list[str] = []
    finished: list[BaseException | None] = []
    request = SimpleNamespace(completion=SimpleNamespace(finish=finished.append))
    transfer = ucx_lanes.Transfer(request, grant=None, parts=1, on_end=lambda: ended.append("on_end"))  # type: ignore[arg-type]
    transfer.part_ended(BrokenPipeError("gone"))  # the lost peer's part, reported with its flush still watched
    transfer.linger()  # that flush then missed its landing bound
    transfer.lingered(None)  # and ended
    assert ended == ["on_end"] and len(finished) == 1


def test_a_holder_that_cannot_confirm_a_withdrawal_keeps_its_channel_and_its_other_grants(
    make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder whose transfers into a withdrawn buffer may still land answers DeviceError; the owner then aborted its
    control channel, and the holder took the live owner for gone (every other grant of its revoked as "gone", their
    counts given back while their puts could still land). The owner now raises DeviceError from unregister() and
    keeps the channel: a later withdrawal of another buffer reaches the holder as a withdrawal."""
    monkeypatch.setattr(ucx_transport, "STOP_WAIT_S", 0.3)
    owner = make_peer(("ucx",), ucx_transports="tcp")
    holder = make_agent(("ucx",), ucx_transports="tcp")
    size = 64 << 20
    x, y = owner.register(size, fill=1), owner.register(4096, fill=2)
    mine = holder.register(np.full(size, 3, np.uint8))
    holder.write(mine, x, 0, 0, 4096).wait()
    holder.write(mine, y, 0, 0, 4096).wait()
    transport = _transport(holder)
    grant_y = transport._grants[y.id]
    handle = holder.write(mine, x, 0, 0, size, timeout=30)
    _until(lambda: _posted(transport), "the write's first windows are posted")
    release = _blocked_asker(holder)  # its lanes land nothing more: the write stays in flight
    try:
        with pytest.raises(DeviceError, match="did not confirm"):
            owner.unregister(x.id)
    finally:
        release.set()
    with contextlib.suppress(HMCError):  # its windows were all posted before the withdrawal: it may well complete
        handle.wait()
    owner.unregister(y.id)  # over the same control channel: a withdrawal, not the owner's loss
    assert isinstance(grant_y.revoked, BufferWithdrawnError) and not isinstance(grant_y.revoked, StaleDescriptorError)
    assert "gone" not in str(grant_y.revoked)


def test_a_pushed_read_that_timed_out_lets_go_of_its_memory_once_the_owner_replies(
    make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read the owner pushes counts on this end's memory until the owner replies (its puts land until then). The
    reply came after the asker's channel had expired the request, was dropped, and the memory stayed counted for good:
    its unregister() raised DeviceError although the owner had settled long before."""
    monkeypatch.setattr(ucx_transport, "_PUSH_PREFERRED", 1e9)  # reads go as pushes
    owner = make_peer(("ucx",), ucx_transports="tcp")
    asker = make_agent(("ucx",), ucx_transports="tcp")
    size = 16 << 20
    theirs = owner.register(size, fill=7)
    sink = np.full(size, POISON, np.uint8)
    local = asker.register(sink)
    asker.read(local, theirs, 0, 0, 4096).wait()
    transport = _transport(asker)
    assert all(probe.push_reads for probe in transport._probes.values())
    mapping = transport._mappings[local.id]
    with owner.stalled():
        handle = asker.read(local, theirs, 0, 0, size, timeout=0.3)
        with pytest.raises(TimeoutError):
            handle.wait()
        assert mapping.users == 1  # the owner may still push
    _until(lambda: mapping.users == 0, "the owner's late reply lets go of the memory")
    asker.unregister(local)
    assert bool(np.all((sink == POISON) | (sink == 7)))


def test_a_frozen_holder_leaves_the_other_holders_of_a_withdrawn_buffer_confirmed(
    make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess]
) -> None:
    """A withdrawal asks every holder at once, each with the whole deadline. Asked one after the other, a frozen
    holder used up the deadline and every holder asked after it timed out too: counted as unconfirmed, its control
    channel cut, so it took the live owner for gone. Now only the frozen one is unconfirmed."""
    owner = make_agent(("ucx",), ucx_transports="tcp", timeout_s=1.0)  # the withdrawal's grace: min(timeout_s, 5 s)
    owner._server._opened = _InOpeningOrder()  # type: ignore[attr-defined]  # the frozen holder is the first one asked
    holders = [make_peer(("ucx",), ucx_transports="tcp") for _ in range(3)]
    x = owner.register(np.full(4096, POISON, np.uint8))
    for value, holder in enumerate(holders, start=1):
        local = holder.register(4096, fill=value)
        assert holder.transfer("write", local.id, x.descriptor, 0, 0, 4096) == "ucx"  # each holds a grant of x now
    with holders[0].stalled(), pytest.raises(DeviceError, match="did not confirm") as refused:
        owner.unregister(x.id)
    assert str(refused.value).count("hmc-peer-") == 1, str(refused.value)


class _InOpeningOrder(dict):  # type: ignore[type-arg]
    """The agent server's holders of each buffer, kept in the order they opened it (its own are sets)."""

    def setdefault(self, key: object, default: object = None) -> _Holders:
        return super().setdefault(key, _Holders())  # type: ignore[no-any-return]


class _Holders(dict):  # type: ignore[type-arg]
    def add(self, channel: object) -> None:
        self[channel] = None

    def discard(self, channel: object) -> None:
        self.pop(channel, None)
