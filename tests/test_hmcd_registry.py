"""The registry: agents' Attach streams, registration, lookups, and withdrawal when an agent ends or dies."""

from __future__ import annotations

import os
import queue
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from control_fixtures import DaemonSet, FakeAgent, Hmcd, agent_info, daemon_set, descriptor, spawn_agent_child, submit_as_forwarder, wait_until

from hmc.config import Config
from hmc.control import Client, DaemonLink
from hmc.control._registry import MAX_NAME_BYTES
from hmc.errors import ArgumentError, BufferWithdrawnError, BusyResourceError, ClosedResourceError, StaleDescriptorError, TimeoutError, UnavailableError, UnknownBufferError
from hmc.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc


@pytest.fixture(scope="module")
def daemons() -> Iterator[DaemonSet]:
    yield from daemon_set()


@pytest.fixture(scope="module")
def hmcd(daemons: DaemonSet) -> Hmcd:
    return daemons.start("reg")


@pytest.fixture
def agent(hmcd: Hmcd) -> Iterator[FakeAgent]:
    fake = FakeAgent(hmcd.config())
    yield fake
    fake.close()


def test_register_lookup_list_unregister(hmcd: Hmcd, agent: FakeAgent) -> None:
    desc = agent.register("kv-0", size=4096)
    assert agent.link.lookup(desc.id).name == "kv-0"
    assert agent.link.lookup("kv-0").id == desc.id
    with hmcd.client() as client:
        found = client.lookup("kv-0")
        assert found.id == desc.id and found.size == 4096 and found.access_key == desc.access_key
        assert found.owner.id == agent.info.id and found.owner.node == "reg"
        assert client.lookup(f"id:{desc.id}").name == "kv-0"
        assert desc.id in {b.id for b in client.buffers(local_only=True)}
        assert client.node_info().buffers >= 1
        agent.link.unregister(desc.id)
        with pytest.raises(BufferWithdrawnError, match="kv-0"):
            client.lookup("kv-0")
        with pytest.raises(BufferWithdrawnError):
            agent.link.lookup(desc.id)
    with pytest.raises(UnknownBufferError):
        agent.link.unregister(desc.id)


def test_registration_refusals_are_typed(agent: FakeAgent, hmcd: Hmcd) -> None:
    taken = agent.register("taken")
    with pytest.raises(ArgumentError, match="already registered"):
        agent.register("taken")
    with pytest.raises(ArgumentError, match="already registered"):
        agent.link.register(taken)
    with pytest.raises(ArgumentError, match="size"):
        agent.link.register(descriptor("empty", size=0))
    with pytest.raises(ArgumentError, match="no id"):
        agent.link.register(descriptor("noid").__class__(name="noid", size=8))
    for long in (descriptor("n" * (MAX_NAME_BYTES + 1)), descriptor("fine").__class__(id="i" * (MAX_NAME_BYTES + 1), name="long-id", size=8)):
        with pytest.raises(ArgumentError, match=f"bytes long; at most {MAX_NAME_BYTES}"):  # its error, not BUSY: the message stays short
            agent.link.register(long)
    assert agent.register("é" * (MAX_NAME_BYTES // 2)).name  # the longest name, counted in UTF-8 bytes, passes
    stolen = descriptor("stolen")
    stolen.owner.id = "someone-else"
    with pytest.raises(ArgumentError, match="someone-else"):
        agent.link.register(stolen)
    other = FakeAgent(hmcd.config())
    try:
        with pytest.raises(ArgumentError, match="belongs to agent"):
            other.link.unregister(taken.id)
    finally:
        other.close()


def test_same_agent_id_twice_is_busy(hmcd: Hmcd, agent: FakeAgent) -> None:
    with pytest.raises(BusyResourceError, match="already attached"):
        DaemonLink(hmcd.config(), agent.info, lambda instruction: None)


def test_link_without_hmcd_is_unavailable(tmp_path: Path) -> None:
    config = Config(socket=str(tmp_path / f"hmc-missing-{uuid.uuid4().hex[:8]}.sock"), timeout_s=2.0)
    with pytest.raises(UnavailableError, match="hmc-missing"):
        DaemonLink(config, agent_info(), lambda instruction: None)


def test_closed_link_refuses(hmcd: Hmcd) -> None:
    fake = FakeAgent(hmcd.config())
    fake.close()
    fake.close()  # idempotent
    with pytest.raises(ClosedResourceError):
        fake.register("late")


def _attach_raw(hmcd: Hmcd, first: daemon_pb2.AgentMessage) -> grpc.RpcError:
    with grpc.insecure_channel(hmcd.unix_address) as channel:
        call = daemon_pb2_grpc.RegistryServiceStub(channel).Attach(iter([first]), timeout=5)
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
    return caught.value


def test_attach_must_start_with_a_version_1_hello(hmcd: Hmcd) -> None:
    not_hello = _attach_raw(hmcd, daemon_pb2.AgentMessage(unregister=daemon_pb2.UnregisterBuffer(buffer_id="x")))
    assert not_hello.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "hello" in not_hello.details()
    old = _attach_raw(hmcd, daemon_pb2.AgentMessage(hello=daemon_pb2.AgentHello(protocol_version=7, agent=agent_info())))
    assert old.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "version 7" in old.details()
    assert dict(old.trailing_metadata())["hmc-error-code"] == "9"  # VERSION_MISMATCH
    with hmcd.client() as client:
        assert client.health().serving


def test_clean_close_withdraws_and_tells_everyone(hmcd: Hmcd) -> None:
    watcher = FakeAgent(hmcd.config())
    leaving = FakeAgent(hmcd.config())
    try:
        desc = leaving.register("leaving-buffer")
        with hmcd.client() as client, client.events(timeout=5.0) as events:
            leaving.close()
            kinds = []
            for event in events:
                kinds.append((event.kind, event.buffer.id or event.agent_id))
                if event.kind == daemon_pb2.EVENT_KIND_AGENT_DOWN:
                    break
        assert kinds == [(daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN, desc.id), (daemon_pb2.EVENT_KIND_AGENT_DOWN, leaving.info.id)]
        wait_until(lambda: any(e.kind == daemon_pb2.EVENT_KIND_AGENT_DOWN for e in watcher.events), what="withdrawal and end pushed down the other agent's stream")
        pushed = [(e.kind, e.buffer.id or e.agent_id) for e in watcher.events if e.agent_id == leaving.info.id]
        assert pushed == kinds
        assert watcher.events[-1].agent.pid == leaving.info.pid  # AGENT_DOWN carries the AgentInfo: peers drop grants by pid
    finally:
        watcher.close()


def test_sigkilled_agent_is_withdrawn_and_hmcd_stays_up(hmcd: Hmcd) -> None:
    buffer_id = uuid.uuid4().hex
    watcher = FakeAgent(hmcd.config())
    child = spawn_agent_child(hmcd, "doomed-agent", "doomed-buffer", buffer_id)
    try:
        with hmcd.client() as client:
            assert client.lookup("doomed-buffer").owner.pid == child.pid
            seen: queue.Queue[daemon_pb2.Event] = queue.Queue()
            with client.events(timeout=8.0) as events:
                os.kill(child.pid, signal.SIGKILL)
                for event in events:
                    seen.put(event)
                    if event.kind == daemon_pb2.EVENT_KIND_AGENT_DOWN:
                        break
            got = [seen.get_nowait() for _ in range(seen.qsize())]
            assert [(e.kind, e.buffer.id or e.agent_id) for e in got] == [
                (daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN, buffer_id),
                (daemon_pb2.EVENT_KIND_AGENT_DOWN, "doomed-agent"),
            ]
            assert got[0].sequence < got[1].sequence
            assert client.health().serving
            with pytest.raises(BufferWithdrawnError):
                client.lookup("doomed-buffer")
            wait_until(lambda: any(e.buffer.id == buffer_id for e in watcher.events), what="withdrawal reached the other agent")
    finally:
        child.kill()
        child.wait(timeout=10)
        child.stdout.close()  # type: ignore[union-attr]
        watcher.close()


def test_link_reattaches_and_registers_again_after_hmcd_restarts(daemons: DaemonSet) -> None:
    first = daemons.start("phoenix")
    lost: list[Exception] = []
    attached: list[daemon_pb2.DaemonHello] = []
    info = agent_info()
    link = DaemonLink(first.config(), info, lambda instruction: None, on_lost=lost.append, on_attached=attached.append)
    try:
        held, gone, late = descriptor("held"), descriptor("gone"), descriptor("late")
        link.register(held)
        link.register(gone)
        old_epoch = link.registry_epoch
        first.stop()
        wait_until(lambda: link.broken is not None and lost, what="link to notice hmcd stopped")
        link.register(late)  # kept here, published on re-attach
        link.unregister(gone.id)  # forgotten here; hmcd forgot it with the old stream
        link.report(daemon_pb2.TransferReport(transfer_id="dropped"))
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="down.*reconnecting"):
            link.lookup("held")
        assert time.monotonic() - started < 1.0
        with pytest.raises(UnknownBufferError):
            link.unregister("never-registered")
        second = daemons.restart(first)
        wait_until(lambda: attached, what="link to attach again")
        assert link.broken is None and attached[0].registry_epoch == link.registry_epoch > old_epoch
        with second.client() as client:
            wait_until(lambda: {b.name for b in client.buffers(local_only=True)} == {"held", "late"}, what="held buffers registered again")
            found = client.lookup("held")
            assert found.id == held.id and found.owner.id == info.id and found.access_key == held.access_key
            assert found.registry_epoch == link.registry_epoch
            with pytest.raises(UnknownBufferError):
                client.lookup("gone")
            assert client.node_info().agents == 1
    finally:
        link.close()


def test_a_register_that_timed_out_on_a_stalled_hmcd_is_withdrawn_when_hmcd_runs_again(daemons: DaemonSet) -> None:
    """hmcd stalls (SIGSTOP: a pause, a frozen VM) while an agent registers: the agent is told TimeoutError and keeps
    nothing, so hmcd must not serve the buffer once it runs again, nor keep its name from the agent's next try."""
    stalling = daemons.start("stall")
    agent = FakeAgent(stalling.config(timeout_s=1.0))
    try:
        os.kill(stalling.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError, match="did not acknowledge"):
                agent.register("ghost")
        finally:
            os.kill(stalling.process.pid, signal.SIGCONT)
        with stalling.client() as client:
            wait_until(lambda: agent.link.broken is None and client.node_info().agents == 1, what="hmcd to run again")
            wait_until(lambda: not client.buffers(local_only=True), what="the timed-out registration withdrawn")
            again = agent.register("ghost")
            assert client.lookup("ghost").id == again.id
    finally:
        agent.close()


@pytest.mark.parametrize("a_keeps_it", [False, True], ids=["let-go", "kept"])
def test_a_name_registered_while_hmcd_was_down_is_published_once_its_old_holder_lets_it_go(daemons: DaemonSet, a_keeps_it: bool) -> None:
    """While hmcd is down, agent A unregisters 'kv' (or keeps it) and agent B registers 'kv': both only locally. The
    restarted hmcd reserves 'kv' for A from its state file. A's hello names what A still holds, so a name it let go is
    freed at once, and B's registration, sent again on re-attach, waits for the reservation rather than being refused
    for good: B gets 'kv' well inside the reservation's grace (30 s), whichever agent attaches first. If A kept
    'kv', A takes it back and B is refused."""
    first = daemons.start(f"down-{a_keeps_it}")
    a, b = FakeAgent(first.config()), FakeAgent(first.config())
    try:
        kv_a, kept = a.register("kv"), a.register("kept")
        first.kill()
        wait_until(lambda: a.link.broken is not None and b.link.broken is not None, what="both links to see hmcd gone")
        if not a_keeps_it:
            a.link.unregister(kv_a.id)
        kv_b = b.register("kv")  # acknowledged here, while hmcd is down
        second = daemons.restart(first)
        with second.client() as client:
            wait_until(lambda: a.link.broken is None and b.link.broken is None, what="both links attached again")
            owner = kv_a if a_keeps_it else kv_b
            wait_until(lambda: _found(client, "kv") == owner.id, what=f"'kv' published for {'A' if a_keeps_it else 'B'}")
            assert client.lookup("kept").id == kept.id
            assert {d.id for d in client.buffers(local_only=True)} == {owner.id, kept.id}
    finally:
        a.close()
        b.close()


def _found(client: Client, name: str) -> str | None:
    try:
        return client.lookup(name).id
    except (UnknownBufferError, UnavailableError):
        return None


def test_a_name_is_busy_for_other_agents_while_its_holder_lives(hmcd: Hmcd, agent: FakeAgent) -> None:
    held = agent.register("leased")
    other = FakeAgent(hmcd.config())
    try:
        with pytest.raises(BusyResourceError, match=f"'leased'.*{agent.info.id}"):
            other.register("leased")
        agent.link.unregister(held.id)
        assert other.register("leased").name == "leased"  # free once its holder let go
    finally:
        other.close()


def test_an_explicit_descriptor_of_an_older_epoch_is_refused_even_when_registered_again(hmcd: Hmcd) -> None:
    executor = FakeAgent(hmcd.config(), auto_report=common_pb2.TRANSFER_STATE_DONE)
    owner = FakeAgent(hmcd.config())
    try:
        executor.register("epoch-src")
        owner.register("epoch-dst")
        with hmcd.client() as client:
            served = client.lookup("epoch-dst")
        assert submit_as_forwarder(hmcd, "epoch-src", served).state in (common_pb2.TRANSFER_STATE_PENDING, common_pb2.TRANSFER_STATE_DONE)
        wait_until(lambda: executor.instructions, what="the instruction")
        assert executor.instructions[-1].remote.registry_epoch == served.registry_epoch
        older = common_pb2.BufferDescriptor()
        older.CopyFrom(served)
        older.registry_epoch -= 1  # as served before a restart; its owner registered it again since
        with pytest.raises(StaleDescriptorError, match="stale descriptor.*epoch.*registered it again"):
            submit_as_forwarder(hmcd, "epoch-src", older)
        gone = common_pb2.BufferDescriptor()
        gone.CopyFrom(older)
        gone.id = uuid.uuid4().hex  # never registered again in this epoch
        with pytest.raises(StaleDescriptorError, match="stale descriptor.*not registered it again"):
            submit_as_forwarder(hmcd, "epoch-src", gone)
        assert len(executor.instructions) == 1
    finally:
        executor.close()
        owner.close()
