"""The Agent's public API: registration, descriptors, paths, argument checks, hmcd link hooks, lifecycle."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import hmc.memory as memory
from hmc.agent import Agent, ConnBuffer
from hmc.agent._events import AgentEvent, AgentEventKind, EventInbox
from hmc.config import Config
from hmc.control._registry import MAX_NAME_BYTES
from hmc.errors import ArgumentError, ClosedResourceError, OutOfRangeError, UnavailableError, UnknownBufferError
from hmc.transport._ranges import RangeList
from hmc.transport._wire import PROTOCOL_VERSION
from hmc.v1 import common_pb2, daemon_pb2


def test_descriptor_carries_owner_device_size_key_and_handles(agent: Agent) -> None:
    buffer = agent.register(bytearray(12345), name="kv-cache")
    d = buffer.descriptor
    assert isinstance(buffer, ConnBuffer) and buffer.size == d.size == 12345 and buffer.name == d.name == "kv-cache"
    assert d.owner.id == agent.id and d.owner.endpoint.port > 0 and d.owner.pid > 0 and d.owner.host_id
    assert d.owner.protocol_version == PROTOCOL_VERSION and {t.path for t in d.owner.transports} >= {"local", "ipc", "staged"}
    assert d.device.name == "host" and d.device.kind == common_pb2.DEVICE_KIND_HOST
    assert len(d.access_key) == 16 and d.handles.cma.pid == d.owner.pid and d.handles.cma.address == buffer.region.address
    again = common_pb2.BufferDescriptor.FromString(bytes(d.SerializeToString()))
    assert again == d
    assert buffer.numpy().size == 12345


def test_register_accepts_regions_arrays_and_bytes_like(agent: Agent) -> None:
    region = memory.allocate(4096)
    for thing in (region, np.zeros((4, 8), np.float32), bytearray(7), memoryview(bytearray(9))):
        assert agent.register(thing).size == memory.register(thing).size
    region.free()


def test_names_are_unique_per_agent_and_ids_are_not_reused(agent: Agent) -> None:
    first = agent.register(bytearray(8), name="x")
    with pytest.raises(ArgumentError):
        agent.register(bytearray(8), name="x")
    agent.unregister(first)
    second = agent.register(bytearray(8), name="x")
    assert second.id != first.id
    with pytest.raises(UnknownBufferError):
        agent.unregister("no-such-buffer")


@pytest.mark.parametrize("name", [5, b"kv", "n" * (MAX_NAME_BYTES + 1), "é" * (MAX_NAME_BYTES // 2 + 1), "kv\ud800"], ids=["int", "bytes", "long", "long-utf8", "surrogate"])
def test_a_name_that_is_not_short_text_is_refused_before_anything_is_registered(agent: Agent, name: Any) -> None:
    before = len(agent.buffers())
    with pytest.raises(ArgumentError, match="buffer name"):
        agent.register(bytearray(8), name=name)
    assert len(agent.buffers()) == before
    assert agent.register(bytearray(8), name="é" * (MAX_NAME_BYTES // 2)).name  # the longest, in UTF-8 bytes


def test_vendor_override_is_published(config: Config) -> None:
    with Agent(config.replace(vendor_override={"host": "amd"}), daemon=False) as a:
        assert a.register(bytearray(8)).descriptor.device.vendor == common_pb2.VENDOR_AMD


@pytest.mark.parametrize("method", ["write", "prepare_write"])
def test_bad_arguments_raise_before_anything_moves(agent: Agent, make_agent: Callable[..., Agent], method: str) -> None:
    write = getattr(agent, method)
    src = agent.register(np.ones(4096, np.uint8))
    dst = agent.register(np.zeros(4096, np.uint8))
    with pytest.raises(ArgumentError):
        write(src, dst, [0, 1], [0, 1, 2], 1)
    with pytest.raises(ArgumentError):
        write(src, dst, np.array([0.5]), 0, 1)
    with pytest.raises(OutOfRangeError):
        write(src, dst, 0, 1, 4096)
    with pytest.raises(ArgumentError):
        write(src, dst, 0, 0, 1, path="carrier-pigeon")
    other = make_agent()
    with pytest.raises(ArgumentError):
        write(other.register(bytearray(8)), dst, 0, 0, 1)
    assert not dst.numpy().any()


@pytest.mark.parametrize(
    "changes",
    [
        {"timeout": float("nan")}, {"timeout": float("inf")}, {"timeout": 0}, {"timeout": "abc"}, {"timeout": True},
        {"n": True}, {"n": 2**70}, {"n": np.array([[4096]])}, {"b": np.array([4096.0])}, {"b": np.array([True])}, {"b": -1},
        {"a": [0, 4096], "b": [4096, 6000], "n": 4096}, {"notify": 17}, {"remote": "not-a-descriptor"},
    ],
    ids=repr,
)
@pytest.mark.parametrize("op", ["write", "read", "prepare_write", "prepare_read"])
def test_bad_arguments_on_the_local_path_and_its_fast_path_write_nothing(agent: Agent, rng: np.random.Generator, changes: dict[str, Any], op: str) -> None:
    data = rng.integers(0, 256, 16384, dtype=np.uint8)
    src = agent.register(data.copy())
    dst = agent.register(np.full(16384, 0xA5, np.uint8))
    local, remote = (dst, src) if op.endswith("read") else (src, dst)  # a read's destination is its local buffer
    base = agent.read if op.endswith("read") else agent.write
    base(local, remote, 0, 0, 4096).wait()  # the pair's inline route is learned
    assert remote.id in local.inline_routes
    call = {"remote": remote, "a": 4096, "b": 8192, "n": 4096, "timeout": None, "notify": None, **changes}
    args = (local, call["remote"], call["a"], call["b"], call["n"])
    with pytest.raises(ArgumentError):
        if not op.startswith("prepare"):
            base(*args, timeout=call["timeout"], notify=call["notify"])
        else:
            getattr(agent, op)(*args, timeout=call["timeout"]).post(notify=call["notify"])
    expected = np.full(16384, 0xA5, np.uint8)
    expected[:4096] = data[:4096]
    assert dst.numpy().tobytes() == expected.tobytes() and src.numpy().tobytes() == data.tobytes()


def test_path_to_explains_and_forced_paths_are_honoured(agent: Agent, make_agent: Callable[..., Agent], rng: np.random.Generator) -> None:
    other = make_agent()
    mine = agent.register(rng.integers(0, 256, 8192, dtype=np.uint8))
    theirs = other.register(np.zeros(8192, np.uint8))
    assert agent.path_to(mine, mine).path.value == "local"
    choice = agent.path_to(mine, theirs.descriptor)
    assert choice.path.value == "ipc" and choice.rejected[0][0].value == "local"
    handle = agent.write(mine, theirs, 0, 0, 8192, path="staged")
    handle.wait()
    assert handle.path == "staged" and np.array_equal(theirs.numpy(), mine.numpy())


def test_read_only_memory_can_be_read_but_not_written(agent: Agent, make_agent: Callable[..., Agent]) -> None:
    from hmc.errors import AccessDeniedError

    frozen = agent.register(bytes(range(256)) * 16)
    peer = make_agent(("staged",))
    sink = peer.register(np.zeros(4096, np.uint8))
    peer.read(sink, frozen.descriptor, 0, 0, 4096).wait()
    assert sink.numpy().tobytes() == bytes(range(256)) * 16
    with pytest.raises(AccessDeniedError):
        peer.write(sink, frozen.descriptor, 0, 0, 16).wait()


def test_a_pair_whose_first_transfer_is_one_large_range_learns_its_fast_path(
    agent: Agent, make_agent: Callable[..., Agent], rng: np.random.Generator
) -> None:
    """The route is learned when the first single range is posted, also while it still moves (a large one runs on
    the ipc path's threads): every later range then takes the fast path, not a request each."""
    from hmc.agent._transfer import _FinishedHandle

    other = make_agent()
    size = 32 << 20
    data = rng.integers(0, 256, size, dtype=np.uint8)
    mine = agent.register(data)
    theirs = other.register(np.full(size, 0xA5, np.uint8))
    agent.write(mine, theirs.descriptor, 0, 0, size).wait()
    assert theirs.id in mine.inline_routes
    handle = agent.write(mine, theirs.descriptor, 4096, 8192, 4096)
    assert type(handle) is _FinishedHandle and handle.path == "ipc"
    expected = data.copy()
    expected[8192 : 8192 + 4096] = data[4096 : 4096 + 4096]
    assert np.array_equal(theirs.numpy(), expected)


def test_a_forced_path_the_pair_negotiates_anyway_takes_the_fast_path(agent: Agent, make_agent: Callable[..., Agent], rng: np.random.Generator) -> None:
    from hmc.agent._transfer import _FinishedHandle

    other = make_agent()
    mine = agent.register(rng.integers(0, 256, 8192, dtype=np.uint8))
    theirs = other.register(np.zeros(8192, np.uint8))
    agent.write(mine, theirs.descriptor, 0, 0, 4096, path="ipc").wait()  # a forced call sets the route up too
    assert agent.path_to(mine, theirs.descriptor).path.value == "ipc" and theirs.id in mine.inline_routes
    for path in ("ipc", None):
        handle = agent.write(mine, theirs.descriptor, 4096, 4096, 4096, path=path)
        assert type(handle) is _FinishedHandle and handle.path == "ipc"
        handle = agent.read(mine, theirs.descriptor, 0, 0, 16, path=path)
        assert type(handle) is _FinishedHandle and handle.path == "ipc"
    handle = agent.write(mine, theirs.descriptor, 0, 0, 4096, path="staged")  # another path: a route of its own
    handle.wait()
    assert type(handle) is not _FinishedHandle and handle.path == "staged"
    for op in (agent.write, agent.read):
        handle = op(mine, theirs.descriptor, 0, 0, 4096, path="staged")
        assert type(handle) is _FinishedHandle and handle.path == "staged"
        handle = op(mine, theirs.descriptor, 0, 0, 4096, path="staged", timeout=5.0)  # staged's route waits: not with a timeout
        assert type(handle) is not _FinishedHandle and handle.path == "staged"
        handle.wait()
    assert type(agent.write(mine, theirs.descriptor, 0, 0, 4096)) is _FinishedHandle  # the unforced route is still ipc's
    assert agent.write(mine, theirs.descriptor, 0, 0, 4096).path == "ipc"
    assert np.array_equal(theirs.numpy(), mine.numpy())
    # Forcing ipc between two buffers of one agent must not teach the pair's unforced route (local) anything.
    dst = agent.register(np.zeros(8192, np.uint8))
    for _ in range(2):
        handle = agent.write(mine, dst, 0, 0, 4096, path="ipc")
        handle.wait()
        assert handle.path == "ipc"
    assert agent.write(mine, dst, 0, 0, 4096).path == "local"
    assert agent.write(mine, dst, 0, 0, 4096).path == "local"


def test_a_forced_path_works_where_policy_leaves_the_pair_no_path_of_its_own(make_agent: Callable[..., Agent]) -> None:
    from hmc.errors import NoPathError

    a, b = make_agent(()), make_agent()  # a's policy allows no path at all
    mine = a.register(np.arange(4096, dtype=np.uint8))
    theirs = b.register(np.zeros(4096, np.uint8))
    with pytest.raises(NoPathError):
        a.path_to(mine, theirs.descriptor)
    for _ in range(3):  # the first one sets up the forced path's route, the others take it
        handle = a.write(mine, theirs.descriptor, 0, 0, 4096, path="ipc")
        handle.wait()
        assert handle.path == "ipc"
    assert np.array_equal(theirs.numpy(), mine.numpy())


@pytest.mark.parametrize("path", ["ipc", "staged", "local"])
def test_writes_into_read_only_memory_are_refused_before_any_byte_lands(
    agent: Agent, make_agent: Callable[..., Agent], path: str, rng: np.random.Generator
) -> None:
    from hmc.errors import AccessDeniedError

    content = bytes(range(256)) * 16
    frozen = agent.register(content)
    owner = agent if path == "local" else make_agent()
    source = owner.register(rng.integers(0, 256, 4096, dtype=np.uint8))
    forced = None if path == "local" else path
    sink = owner.register(np.zeros(4096, np.uint8))
    owner.read(sink, frozen.descriptor, 0, 0, 4096, path=forced).wait()  # reads work (and set up the grant / fast path)
    assert sink.numpy().tobytes() == content
    for attempt in range(3):  # the first write may set things up, later ones take whatever fast path exists
        for args in ((0, 0, 16), ([0, 100], [0, 1000], [8, 8]), (0, 0, 4096)):
            handle = owner.write(source, frozen.descriptor, *args, path=forced if attempt < 2 else None)
            with pytest.raises(AccessDeniedError, match="read-only"):
                handle.wait()
            assert handle.path == (path if attempt < 2 else owner.path_to(source, frozen).path.value)
    assert frozen.numpy().tobytes() == content


def test_read_only_local_memory_never_receives_a_read(agent: Agent, make_agent: Callable[..., Agent]) -> None:
    from hmc.errors import AccessDeniedError

    content = bytes(range(256)) * 16
    frozen = agent.register(content)
    other = make_agent()
    theirs = other.register(np.zeros(4096, np.uint8))
    agent.write(frozen, theirs.descriptor, 0, 0, 4096).wait()  # the pair's fast path exists now
    agent.write(frozen, theirs.descriptor, 0, 0, 4096).wait()
    assert theirs.numpy().tobytes() == content
    theirs.numpy()[:] = 7
    for path in (None, "ipc", "staged"):
        with pytest.raises(AccessDeniedError, match="read-only"):
            agent.read(frozen, theirs.descriptor, 0, 0, 16, path=path)
    assert frozen.numpy().tobytes() == content


def test_embedded_mode_and_daemon_requirements(config: Config) -> None:
    with Agent(config) as a:  # no hmcd socket: embedded
        with pytest.raises(UnavailableError):
            a.lookup("kv-cache")
    with pytest.raises(UnavailableError):
        Agent(config, daemon=True)



@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, "abc", 2e6], ids=repr)
def test_events_refuses_a_bad_timeout_and_an_embedded_agent_has_none(agent: Agent, timeout: Any) -> None:
    assert agent.events() == [] and agent.events(timeout=0.01) == []
    with pytest.raises(ArgumentError):
        agent.events(timeout=timeout)


def test_an_undrained_event_inbox_keeps_the_newest_and_counts_the_dropped() -> None:
    inbox = EventInbox(capacity=3)
    for i in range(5):
        inbox.deliver(AgentEvent(AgentEventKind.AGENT_DOWN, agent_id=str(i)))
    assert [e.agent_id for e in inbox.drain()] == ["2", "3", "4"] and inbox.dropped == 2
    assert inbox.drain(timeout=0.01) == []


class FakeLink:
    """Stands in for hmcd's DaemonLink: records calls, lets the test play hmcd's instructions."""

    def __init__(self, config: Config, info: common_pb2.AgentInfo, on_instruction: Callable[[daemon_pb2.TransferInstruction], None]) -> None:
        self.info, self.instruct = info, on_instruction
        self.registered: list[str] = []
        self.unregistered: list[str] = []
        self.reports: list[daemon_pb2.TransferReport] = []
        self.reported = threading.Event()
        self.closed = False

    def register(self, descriptor: common_pb2.BufferDescriptor) -> None:
        self.registered.append(descriptor.id)

    def unregister(self, buffer_id: str) -> None:
        self.unregistered.append(buffer_id)

    def report(self, report: daemon_pb2.TransferReport) -> None:
        self.reports.append(report)
        self.reported.set()

    def lookup(self, ref: str) -> common_pb2.BufferDescriptor:
        return common_pb2.BufferDescriptor(id=ref)

    def close(self) -> None:
        self.closed = True


def test_hmcd_link_sees_registrations_and_instructions_run_off_its_thread(config: Config, make_agent: Callable[..., Agent], rng: np.random.Generator) -> None:
    links: list[FakeLink] = []

    def factory(*args: Any) -> FakeLink:
        links.append(FakeLink(*args))
        return links[-1]

    a = Agent(config, daemon=True, link_factory=factory)
    link = links[0]
    assert link.info.id == a.id and a.lookup("abc").id == "abc"
    src = a.register(rng.integers(0, 256, 1 << 16, dtype=np.uint8), name="src")
    other = make_agent()
    dst = other.register(np.zeros(1 << 16, np.uint8))
    ranges = RangeList.build([0, 8192], [100, 30000], 5000).to_proto()
    link.instruct(
        daemon_pb2.TransferInstruction(
            transfer_id="hmcd-1", op=common_pb2.TRANSFER_OP_WRITE, local_buffer_id=src.id, remote=dst.descriptor, ranges=ranges, notification=b"moved", timeout_s=5
        )
    )
    assert link.reported.wait(10)
    [report] = link.reports
    assert report.transfer_id == "hmcd-1" and report.state == common_pb2.TRANSFER_STATE_DONE and report.bytes_done == 10000 and report.path == "ipc"
    assert np.array_equal(dst.numpy()[100:5100], src.numpy()[:5000]) and np.array_equal(dst.numpy()[30000:35000], src.numpy()[8192:13192])
    assert [(n.transfer_id, n.payload) for n in other.notifications(5)] == [("hmcd-1", b"moved")]
    link.reported.clear()
    link.instruct(daemon_pb2.TransferInstruction(transfer_id="hmcd-2", local_buffer_id="missing", remote=dst.descriptor, ranges=ranges))
    assert link.reported.wait(10)
    assert link.reports[-1].state == common_pb2.TRANSFER_STATE_FAILED and link.reports[-1].error.code == common_pb2.ERROR_CODE_UNKNOWN_BUFFER
    a.unregister(src)
    assert link.registered == [src.id] and link.unregistered == [src.id]
    a.close()
    assert link.closed


def test_close_is_idempotent_and_final(config: Config) -> None:
    a = Agent(config, daemon=False)
    buffer = a.register(bytearray(64))
    a.close()
    a.close()
    with pytest.raises(ClosedResourceError):
        a.register(bytearray(8))
    with pytest.raises(ClosedResourceError):
        a.write(buffer, buffer, 0, 0, 8)
    assert not [t for t in threading.enumerate() if t.name.startswith("hmc-peer")]


def test_a_registration_hmcd_refuses_is_rolled_back(config: Config) -> None:
    class Refusing(FakeLink):
        def register(self, descriptor: common_pb2.BufferDescriptor) -> None:
            if descriptor.name == "taken":
                raise ArgumentError("name taken on this node")

    with Agent(config, daemon=True, link_factory=Refusing) as a:
        with pytest.raises(ArgumentError):
            a.register(bytearray(64), name="taken")
        assert a.buffers() == []
        assert a.register(bytearray(64), name="free").name == "free"
