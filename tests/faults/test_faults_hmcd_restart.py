"""Agents survive hmcd (issue 9, scenario 2): SIGKILL hmcd under two agent processes and restart it.

- Transfers between agents go on while hmcd is down; lookups say UnavailableError at once.
- Restarted on the same socket, hmcd finds both agents' buffers by name again within 5 s: the agents
  re-attach and register them again under the same ids and names.
- Names are leased: while a holder's process lives nobody else gets its name, during the grace window
  (holder stalled) and after it re-attached; a holder that died while hmcd was down frees its names at once.
- Peers are told: an agent that opened a dead agent's buffer gets an event and BufferWithdrawnError.
- The lease file: private, atomic, and ignored (with a log) when corrupt or loosely permitted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from control_fixtures import DaemonSet, Hmcd, daemon_set, wait_until

from hmc import AgentEvent, AgentEventKind
from hmc.agent import Agent
from hmc.control import Client
from hmc.control._events import EventBus
from hmc.control._leases import Lease, LeaseFile, ProcessIdentity, process_identity, state_path_for
from hmc.control._registry import Registry
from hmc.errors import BufferWithdrawnError, BusyResourceError, HMCError, UnavailableError
from hmc.testing import PeerProcess
from hmc.v1 import common_pb2, daemon_pb2

SIZE = 4 << 20
POISON = 0xA5
FOUND_WITHIN_S = 5.0


@pytest.fixture
def daemons() -> Iterator[DaemonSet]:
    yield from daemon_set()


def sigkill(hmcd: Hmcd) -> None:
    hmcd.process.kill()
    hmcd.process.wait(timeout=10)


def owner_of(client: Client, name: str) -> str:
    """The agent id that holds `name` ('' while hmcd cannot say)."""
    try:
        return client.lookup(name).owner.id
    except HMCError:
        return ""


def events_until(agent: Agent, done: Callable[[list[AgentEvent]], bool], timeout: float = 5.0) -> list[AgentEvent]:
    """The agent's events, drained until `done` says they are enough (AssertionError after `timeout`)."""
    seen: list[AgentEvent] = []
    deadline = time.monotonic() + timeout
    while not done(seen):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out after {timeout}s; events so far: {seen}")
        seen += agent.events(timeout=left)
    return seen


def test_agents_survive_sigkilled_hmcd_and_are_found_again(daemons: DaemonSet, rng: np.random.Generator) -> None:
    hmcd = daemons.start("phoenix")
    config = hmcd.config(timeout_s=10.0)
    with PeerProcess(config, daemon=True) as prefill, PeerProcess(config, daemon=True) as decode, Agent(config, daemon=True) as watcher:
        src = prefill.register(SIZE, name="kv-prefill")
        dst = decode.register(SIZE, name="kv-decode")
        sigkill(hmcd)

        payload = rng.integers(0, 256, SIZE, dtype=np.uint8).tobytes()
        prefill.fill(src.id, payload)
        decode.poison(dst.id, POISON)
        assert prefill.transfer("write", src.id, dst, 0, 0, SIZE) in ("ipc", "staged")
        assert decode.contents(dst.id) == payload
        late = prefill.register(4096, name="kv-late")  # registered while hmcd is down: published on re-attach
        assert [e.kind for e in events_until(watcher, lambda seen: len(seen) >= 1)] == [AgentEventKind.HMCD_LOST]
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="down"):
            watcher.lookup("kv-decode")
        assert time.monotonic() - started < 1.0
        watcher.close()  # two agents under the restarted hmcd, as in the scenario

        restarted = daemons.restart(hmcd)
        with restarted.client() as client:
            wait_until(
                lambda: (owner_of(client, "kv-prefill"), owner_of(client, "kv-decode"), owner_of(client, "kv-late")) == (prefill.info.id, decode.info.id, prefill.info.id),
                timeout=FOUND_WITHIN_S,
                what="both agents' buffers found by name after the restart",
            )
            found = client.lookup("kv-decode")
            assert found.id == dst.id and found.access_key == dst.access_key and found.registry_epoch > 0
            assert client.lookup("kv-late").id == late.id
            assert client.node_info().agents == 2
            with Agent(restarted.config(), daemon=True) as third:
                with pytest.raises(BusyResourceError, match=prefill.info.id):
                    third.register(np.zeros(4096, np.uint8), name="kv-prefill")
                assert third.buffers() == []
            decode.poison(dst.id, POISON)
            assert prefill.transfer("write", src.id, found, 0, 0, SIZE) in ("ipc", "staged")  # the served descriptor still works
            assert decode.contents(dst.id) == payload


def test_names_wait_for_a_living_holder_and_not_for_a_dead_one(daemons: DaemonSet) -> None:
    hmcd = daemons.start("leases")
    config = hmcd.config(timeout_s=10.0)
    with PeerProcess(config, daemon=True) as holder, PeerProcess(config, daemon=True) as doomed:
        holder.register(4096, name="kv-held")
        doomed.register(4096, name="kv-doomed")
        sigkill(hmcd)
        doomed.kill()  # dies while hmcd is down: nobody is left to claim its name
        with holder.stalled():  # alive but unable to re-attach: the grace window
            restarted = daemons.restart(hmcd)
            with restarted.client() as client, Agent(restarted.config(), daemon=True) as third:
                with pytest.raises(BusyResourceError, match=f"kv-held.*{holder.info.id}.*pid {holder.pid}"):
                    third.register(np.zeros(4096, np.uint8), name="kv-held")
                with pytest.raises(UnavailableError, match=holder.info.id):
                    client.lookup("kv-held")
                taken = third.register(np.zeros(4096, np.uint8), name="kv-doomed")  # at once: its holder is dead
                assert client.lookup("kv-doomed").owner.id == third.id
                third.unregister(taken)
        with restarted.client() as client, Agent(restarted.config(), daemon=True) as third:
            wait_until(lambda: owner_of(client, "kv-held") == holder.info.id, timeout=FOUND_WITHIN_S, what="the holder to take its name back")
            with pytest.raises(BusyResourceError, match=holder.info.id):
                third.register(np.zeros(4096, np.uint8), name="kv-held")


def test_an_agent_that_opened_a_dead_agents_buffer_is_told(daemons: DaemonSet, rng: np.random.Generator) -> None:
    hmcd = daemons.start("mourner")
    config = hmcd.config(timeout_s=10.0)
    with Agent(config, daemon=True) as survivor, PeerProcess(config, daemon=True) as doomed:
        theirs = doomed.register(SIZE, name="kv-doomed", fill=POISON)
        data = rng.integers(0, 256, SIZE, dtype=np.uint8)
        mine = survivor.register(data)
        survivor.write(mine, theirs, 0, 0, SIZE).wait()
        assert doomed.contents(theirs.id) == data.tobytes()
        doomed.kill()
        seen = events_until(survivor, lambda seen: any(e.kind is AgentEventKind.AGENT_DOWN for e in seen))
        assert AgentEvent(AgentEventKind.BUFFER_WITHDRAWN, theirs.id, doomed.info.id, "kv-doomed", "mourner") in seen
        assert [e.kind for e in seen].index(AgentEventKind.BUFFER_WITHDRAWN) < [e.kind for e in seen].index(AgentEventKind.AGENT_DOWN)
        with pytest.raises(BufferWithdrawnError, match=theirs.id):
            survivor.write(mine, theirs, 0, 0, 4096)


# -- the lease file and the registry's reservations, in this process -----------------------------------------


@pytest.fixture
def live_process() -> Iterator[subprocess.Popen[bytes]]:
    """A process that lives until the test kills it (or ends)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        yield child
    finally:
        child.kill()
        child.wait(timeout=10)
        assert child.stdin is not None
        child.stdin.close()


def identity(child: subprocess.Popen[bytes]) -> ProcessIdentity:
    found = process_identity(child.pid)
    assert found is not None
    return found


def dead_identity() -> ProcessIdentity:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=10)
    return ProcessIdentity(child.pid, 1)


def test_lease_file_is_private_atomic_and_round_trips(tmp_path: Path) -> None:
    path = state_path_for(str(tmp_path / "hmcd.sock"))
    assert path == str(tmp_path / "hmcd.registry.json")
    leases = [Lease("kv-0", "agent-a", ProcessIdentity(4242, 99)), Lease("kv-1", "agent-b", ProcessIdentity(4343, 7))]
    LeaseFile(path).save(17, leases)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert LeaseFile(path).load() == (17, leases)
    assert os.listdir(tmp_path) == ["hmcd.registry.json"]  # no temporary left behind


UNSAFE = {
    "corrupt": lambda path: Path(path).write_text("{not json"),
    "wrong types": lambda path: Path(path).write_text(json.dumps({"version": 1, "epoch": "7", "leases": []})),
    "lease without pid": lambda path: Path(path).write_text(json.dumps({"version": 1, "epoch": 7, "leases": [{"name": "x", "agent_id": "a", "pid": 0, "start_time": 1}]})),
    "other version": lambda path: Path(path).write_text(json.dumps({"version": 2, "epoch": 7, "leases": []})),
    "loose mode": lambda path: (LeaseFile(path).save(7, []), os.chmod(path, 0o644)),
    "symlink": lambda path: (LeaseFile(path + ".real").save(7, []), os.symlink(path + ".real", path)),
    "directory": lambda path: os.mkdir(path),
}


@pytest.mark.parametrize("damage", sorted(UNSAFE))
def test_an_unsafe_or_corrupt_lease_file_is_ignored_with_a_log(tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    path = str(tmp_path / "hmcd.registry.json")
    UNSAFE[damage](path)
    with caplog.at_level(logging.WARNING, logger="hmc.hmcd"):
        assert LeaseFile(path).load() == (0, [])
    assert any("ignoring hmcd state file" in r.getMessage() and path in r.getMessage() for r in caplog.records)

    async def start() -> int:
        registry = Registry("n", EventBus("n"), state_path=path, host_id="h", clock=lambda: 5.0)
        registry.restore()  # never raises: the registry starts with no reservations
        registry.close()
        return registry.epoch

    assert asyncio.run(start()) == 5000  # time-based: the file said nothing usable


def test_the_epoch_grows_with_every_start(tmp_path: Path) -> None:
    path = str(tmp_path / "hmcd.registry.json")

    async def start() -> int:
        registry = Registry("n", EventBus("n"), state_path=path, host_id="h", clock=lambda: 1.0)  # a clock that never moves
        registry.restore()
        registry.close()
        return registry.epoch

    epochs = [asyncio.run(start()) for _ in range(3)]
    assert epochs == [1000, 1001, 1002]


def agent(agent_id: str, process: ProcessIdentity | int) -> common_pb2.AgentInfo:
    pid = process.pid if isinstance(process, ProcessIdentity) else process
    return common_pb2.AgentInfo(id=agent_id, pid=pid, host_id="h")


def named(name: str) -> common_pb2.BufferDescriptor:
    return common_pb2.BufferDescriptor(id=os.urandom(8).hex(), name=name, size=4096)


async def until_free(registry: Registry, session: object, name: str, timeout: float = 5.0) -> None:
    """Register `name` for `session` as soon as the registry lets it (AssertionError after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            registry.register(session, named(name))  # type: ignore[arg-type]
            return
        except BusyResourceError:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name!r} still reserved after {timeout}s") from None
            await asyncio.sleep(0.01)  # the loop must run for the pidfd watch and the grace timer


def test_reservations_follow_the_holders_process(tmp_path: Path, live_process: subprocess.Popen[bytes]) -> None:
    path = str(tmp_path / "hmcd.registry.json")
    holder = identity(live_process)
    LeaseFile(path).save(41, [Lease("live-name", "holder", holder), Lease("dead-name", "ghost", dead_identity())])

    async def scenario() -> None:
        registry = Registry("n", EventBus("n"), state_path=path, grace_s=60.0, host_id="h")
        registry.restore()
        assert registry.epoch > 41
        other = registry.attach(agent("other", os.getpid()))
        registry.register(other, named("dead-name"))  # its holder is gone: free at once
        with pytest.raises(BusyResourceError, match=f"'live-name'.*'holder' \\(pid {holder.pid}\\)"):
            registry.register(other, named("live-name"))
        with pytest.raises(BusyResourceError, match="reserved for its process"):
            registry.attach(agent("holder", os.getpid()))  # the same id from another process is not the holder
        live_process.kill()
        await until_free(registry, other, "live-name", timeout=5.0)  # far below the 60 s grace: the pidfd said it died
        registry.close()

    asyncio.run(scenario())
    assert {lease.name: lease.agent_id for lease in LeaseFile(path).load()[1]} == {"dead-name": "other", "live-name": "other"}


def test_a_reservation_ends_with_its_grace_period_and_its_holder_takes_it_back_within_it(tmp_path: Path, live_process: subprocess.Popen[bytes]) -> None:
    path = str(tmp_path / "hmcd.registry.json")
    holder = identity(live_process)
    LeaseFile(path).save(1, [Lease("comes-back", "holder", holder), Lease("expires", "absent", holder)])

    async def scenario() -> None:
        registry = Registry("n", EventBus("n"), state_path=path, grace_s=0.3, host_id="h")
        registry.restore()
        back = registry.attach(agent("holder", holder))
        registry.register(back, named("comes-back"))
        other = registry.attach(agent("other", os.getpid()))
        with pytest.raises(BusyResourceError, match="comes-back"):
            registry.register(other, named("comes-back"))
        await until_free(registry, other, "expires", timeout=5.0)  # its holder lives but never came back
        registry.close()

    asyncio.run(scenario())


def test_a_broken_stream_of_a_living_agent_withdraws_nothing_until_it_dies(tmp_path: Path, live_process: subprocess.Popen[bytes]) -> None:
    process = identity(live_process)
    published: list[tuple[int, str]] = []

    async def scenario() -> None:
        bus = EventBus("n")
        bus.add_listener(lambda event, relayed: published.append((event.kind, event.buffer.id or event.agent_id)))
        registry = Registry("n", bus, state_path=str(tmp_path / "hmcd.registry.json"), grace_s=60.0, host_id="h")
        registry.restore()
        session = registry.attach(agent("cut", process))
        kept, dropped = named("kv-kept"), named("kv-dropped")
        registry.register(session, kept)
        registry.register(session, dropped)
        published.clear()
        registry.detach(session, clean=False)  # the stream broke; the process lives
        assert published == []
        with pytest.raises(UnavailableError, match="'cut'"):
            registry.require(daemon_pb2.BufferRef(name="kv-kept"))
        back = registry.attach(agent("cut", process))
        registry.register(back, kept)  # same id and name: taken back, never announced as withdrawn
        assert registry.require(daemon_pb2.BufferRef(name="kv-kept")).id == kept.id
        assert [kind for kind, _ in published] == [daemon_pb2.EVENT_KIND_AGENT_UP, daemon_pb2.EVENT_KIND_BUFFER_ADDED]
        registry.detach(back, clean=False)
        live_process.kill()  # now both buffers are gone for good: announced once, then the agent's end
        deadline = time.monotonic() + 5.0
        while not published or published[-1][0] != daemon_pb2.EVENT_KIND_AGENT_DOWN:
            assert time.monotonic() < deadline, published
            await asyncio.sleep(0.01)  # the loop must run for the pidfd watch
        assert published[2:] == [
            (daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN, dropped.id),
            (daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN, kept.id),
            (daemon_pb2.EVENT_KIND_AGENT_DOWN, "cut"),
        ]
        with pytest.raises(BufferWithdrawnError):
            registry.require(daemon_pb2.BufferRef(name="kv-kept"))
        registry.close()

    asyncio.run(scenario())
