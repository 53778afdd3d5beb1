"""The `ucx` path between real agents in two processes, with the UCX of the libucx wheel: over tcp and over
shared memory with cma (what UCX has on a machine without RDMA or GPU). Skipped, with the reason, where the
UCP binding is not built."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from ucx_support import requires_ucx

from hmc.agent import Agent, TransferState
from hmc.config import Config, PathPolicy
from hmc.errors import AccessDeniedError, BrokenResourceError, BufferWithdrawnError, CancelledError, TimeoutError, UnsupportedError
from hmc.memory import DeviceKind
from hmc.testing import PeerProcess, TransportPair, check_transport
from hmc.transport._base import PathName
from hmc.transport import _ucx as ucx_transport
from hmc.transport import _ucx_lanes as ucx_lanes
from hmc.transport._ucx import UcxTransport

pytestmark = requires_ucx

POISON = 0xA5
TRANSPORTS = ["tcp", "sm,cma"]


@pytest.fixture(params=TRANSPORTS)
def ucx_config(request: pytest.FixtureRequest, config: Config) -> Config:
    return config.replace(ucx_transports=request.param)


@pytest.fixture
def ucx_peer(ucx_config: Config, make_peer: Callable[..., PeerProcess]) -> PeerProcess:
    return make_peer(("ucx",), ucx_transports=ucx_config.ucx_transports)


@pytest.fixture
def ucx_agent(ucx_config: Config, make_agent: Callable[..., Agent]) -> Agent:
    return make_agent(("ucx",), ucx_transports=ucx_config.ucx_transports)


def test_ucx_conforms(ucx_config: Config, make_peer: Callable[..., PeerProcess]) -> None:
    @contextlib.contextmanager
    def pair() -> Iterator[TransportPair]:
        peer = make_peer(("ucx",), ucx_transports=ucx_config.ucx_transports)
        with Agent(ucx_config.replace(policy=PathPolicy(allow=("ucx",))), daemon=False) as a:
            yield TransportPair(a, peer, "ucx", stalled=peer.stalled)

    check_transport(pair)


def test_lanes_a_transfer_takes_to_a_peer_on_this_host() -> None:
    """Over sockets alone, at most half this host's cores (each lane busies a core at both ends); otherwise no limit."""
    assert ucx_lanes.sockets_only("tcp") and ucx_lanes.sockets_only(" tcp,cuda_copy ") and ucx_lanes.sockets_only("tcp,self")
    assert not any(ucx_lanes.sockets_only(t) for t in ("", "sm,cma", "tcp,cma", "rc,dc,ud", "cuda_copy", "all"))
    assert [ucx_lanes.lanes_on_one_host("tcp", cores) for cores in (1, 2, 3, 4, 64)] == [1, 1, 1, 2, 32]
    assert ucx_lanes.lanes_on_one_host("sm,cma", 2) == 0 and ucx_lanes.lanes_on_one_host("", 2) == 0


def test_a_large_transfer_over_tcp_to_a_peer_on_this_host_takes_one_lane_on_two_cores(
    ucx_config: Config, make_peer: Callable[..., PeerProcess], rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Two cores: over tcp one part (the owner's threads need the other core); over cma two (the owner moves nothing).
    Every byte lands either way."""
    monkeypatch.setattr(ucx_transport.os, "sched_getaffinity", lambda pid: {0, 1})
    parts: list[int] = []

    class Counted(ucx_lanes.Transfer):
        def __init__(self, request: object, grant: object, count: int, on_end: Callable[[], None]) -> None:
            parts.append(count)
            super().__init__(request, grant, count, on_end)  # type: ignore[arg-type]

    monkeypatch.setattr(ucx_lanes, "Transfer", Counted)
    peer = make_peer(("ucx",), ucx_transports=ucx_config.ucx_transports)
    size = 32 << 20
    theirs = peer.register(size, fill=POISON)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    with Agent(ucx_config.replace(policy=PathPolicy(allow=("ucx",))), daemon=False) as agent:
        agent.write(agent.register(data), theirs, 0, 0, size).wait()
    assert parts == [1 if ucx_config.ucx_transports == "tcp" else 2]
    assert np.array_equal(np.frombuffer(peer.contents(theirs.id), np.uint8), data)


def test_the_agent_declares_what_ucx_reaches(ucx_agent: Agent) -> None:
    [ucx] = [t for t in ucx_agent.info.transports if t.path == "ucx"]
    assert ucx.one_sided and "UCX 1." in ucx.detail and ucx_agent.config.ucx_transports in ucx.detail
    assert "rdma" not in [t.path for t in ucx_agent.info.transports]  # no RDMA device here


def test_scattered_kv_ranges_both_ways(ucx_agent: Agent, ucx_peer: PeerProcess, rng: np.random.Generator) -> None:
    size, block = 32 << 20, 16 << 10
    theirs = ucx_peer.register(size, fill=POISON)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    mine = ucx_agent.register(data)
    count = 1500
    src = rng.permutation(size // block)[:count] * block
    dst = rng.permutation(size // block)[:count] * block
    handle = ucx_agent.write(mine, theirs, src, dst, block)
    handle.wait()
    assert handle.path == "ucx"
    expected = np.full(size, POISON, np.uint8)
    for s, d in zip(src.tolist(), dst.tolist()):
        expected[d : d + block] = data[s : s + block]
    assert np.array_equal(np.frombuffer(ucx_peer.contents(theirs.id), np.uint8), expected)
    sink = ucx_agent.register(np.full(size, POISON ^ 0xFF, np.uint8))
    ucx_agent.read(sink, theirs, dst, src, block).wait()  # back where they came from
    back = np.full(size, POISON ^ 0xFF, np.uint8)
    for s in src.tolist():
        back[s : s + block] = data[s : s + block]
    assert np.array_equal(sink.numpy(), back)


def test_a_peer_killed_mid_transfer_fails_it_within_the_deadline(ucx_agent: Agent, ucx_peer: PeerProcess, rng: np.random.Generator) -> None:
    size = 64 << 20
    theirs = ucx_peer.register(size, fill=POISON)
    mine = ucx_agent.register(rng.integers(0, 256, size, dtype=np.uint8))
    ucx_agent.write(mine, theirs, 0, 0, 4096).wait()  # connected and granted
    with ucx_peer.stalled():  # frozen: the transfer cannot finish before the kill
        handle = ucx_agent.write(mine, theirs, np.arange(64) * (1 << 20), np.arange(64) * (1 << 20), 1 << 20, notify=b"x", timeout=8.0)
        ucx_peer.kill()
    with pytest.raises((BrokenResourceError, TimeoutError)):
        handle.wait()
    assert handle.state is TransferState.FAILED
    with pytest.raises((BrokenResourceError, TimeoutError)):
        ucx_agent.write(mine, theirs, 0, 0, 4096, timeout=2.0).wait()


def test_a_withdrawn_buffer_is_refused_and_nothing_lands(ucx_agent: Agent, ucx_peer: PeerProcess, rng: np.random.Generator) -> None:
    theirs = ucx_peer.register(1 << 20, fill=POISON)
    mine = ucx_agent.register(rng.integers(0, 256, 1 << 20, dtype=np.uint8))
    ucx_agent.write(mine, theirs, 0, 0, 1 << 20).wait()
    ucx_peer.unregister(theirs.id)
    for _ in range(2):
        with pytest.raises(BufferWithdrawnError):
            ucx_agent.write(mine, theirs, 0, 0, 4096).wait()


def test_read_only_memory_is_read_never_written(ucx_config: Config, make_agent: Callable[..., Agent], rng: np.random.Generator) -> None:
    owner, initiator = make_agent(("ucx",), ucx_transports=ucx_config.ucx_transports), make_agent(("ucx",), ucx_transports=ucx_config.ucx_transports)
    content = rng.integers(0, 256, 8192, dtype=np.uint8).tobytes()
    frozen = owner.register(content)  # bytes: read-only memory
    source = initiator.register(rng.integers(0, 256, 8192, dtype=np.uint8))
    sink = initiator.register(np.zeros(8192, np.uint8))
    initiator.read(sink, frozen.descriptor, 0, 0, 8192).wait()
    assert sink.numpy().tobytes() == content
    for args in ((0, 0, 16), ([0, 100], [0, 1000], [8, 8]), (0, 0, 8192)):
        handle = initiator.write(source, frozen.descriptor, *args)
        with pytest.raises(AccessDeniedError, match="read-only"):
            handle.wait()
        assert handle.path == "ucx"
    assert frozen.numpy().tobytes() == content


def test_many_threads_submit_at_once(ucx_agent: Agent, ucx_peer: PeerProcess, rng: np.random.Generator) -> None:
    size, threads = 8 << 20, 6
    theirs = ucx_peer.register(size * threads, fill=POISON)
    data = rng.integers(0, 256, size * threads, dtype=np.uint8)
    mine = ucx_agent.register(data)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            for _ in range(5):
                ucx_agent.write(mine, theirs, i * size, i * size, size).wait()
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    workers = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert not errors
    assert ucx_peer.contents(theirs.id) == data.tobytes()


def test_cancel_waits_for_what_is_in_flight(ucx_agent: Agent, ucx_peer: PeerProcess, rng: np.random.Generator) -> None:
    size = 128 << 20
    theirs = ucx_peer.register(size, fill=POISON)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    mine = ucx_agent.register(data)
    ucx_agent.write(mine, theirs, 0, 0, 4096).wait()
    handle = ucx_agent.write(mine, theirs, 0, 0, size)
    handle.cancel()
    with pytest.raises(CancelledError):
        handle.wait()
    first = np.frombuffer(ucx_peer.contents(theirs.id), np.uint8)
    assert bool(np.all((first == POISON) | (first == data)))
    assert np.array_equal(np.frombuffer(ucx_peer.contents(theirs.id), np.uint8), first), "bytes landed after the cancel returned"


def test_bad_construction_and_use_after_close() -> None:
    with pytest.raises(Exception, match="ucx and rdma"):
        UcxTransport(lambda d, t: None, lambda *a: None, path=PathName.STAGED)  # type: ignore[arg-type,return-value]
    transport = UcxTransport(lambda d, t: None, lambda *a: None)  # type: ignore[arg-type,return-value]
    assert transport.unavailable_reason() is None
    assert DeviceKind.HOST in transport.capabilities.memory_kinds
    transport.close()
    transport.close()
    rdma = UcxTransport(lambda d, t: None, lambda *a: None, path=PathName.RDMA)  # type: ignore[arg-type,return-value]
    assert "no RDMA device" in (rdma.unavailable_reason() or "")


def test_many_windows_per_worker_all_land(
    ucx_agent: Agent, ucx_peer: PeerProcess, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ucx_lanes, "_WINDOW_BYTES", 256 << 10)  # 32 MiB over 2 workers: 64 windows each
    size = 32 << 20
    theirs = ucx_peer.register(size, fill=POISON)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    mine = ucx_agent.register(data)
    offsets = rng.permutation(size // 8192) * 8192
    handle = ucx_agent.write(mine, theirs, offsets, offsets, 8192)
    handle.wait()
    assert handle.bytes_done == size and ucx_peer.contents(theirs.id) == data.tobytes()
    sink = ucx_agent.register(np.full(size, POISON, np.uint8))
    ucx_agent.read(sink, theirs, 0, 0, size).wait()
    assert np.array_equal(sink.numpy(), data)


def test_reads_measured_once_and_pushed_by_the_owner_where_pushes_win(
    ucx_agent: Agent, ucx_peer: PeerProcess, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ucx_transport, "_PUSH_PREFERRED", 1e9)  # whatever was measured, reads go as pushes
    size = 8 << 20
    theirs = ucx_peer.register(size, fill=POISON)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    ucx_peer.fill(theirs.id, data.tobytes())
    sink = ucx_agent.register(np.full(size, POISON ^ 0xFF, np.uint8))
    offsets = rng.permutation(size // 4096)[:700] * 4096
    handle = ucx_agent.read(sink, theirs, offsets, offsets, 4096)
    handle.wait()
    assert handle.path == "ucx" and handle.bytes_done == 700 * 4096
    expected = np.full(size, POISON ^ 0xFF, np.uint8)
    for o in offsets.tolist():
        expected[o : o + 4096] = data[o : o + 4096]
    assert np.array_equal(sink.numpy(), expected)
    ucx_agent.read(sink, theirs, 0, 0, size).wait()  # one range: pushed too
    assert np.array_equal(sink.numpy(), data)
    choice = ucx_agent.path_to(sink, theirs)
    assert "owner's push" in choice.reason and "reads are pushed by the owner" in choice.reason and choice.preferred_op == "write"


def test_a_push_asked_for_out_of_range_is_refused_and_writes_nothing(ucx_agent: Agent, ucx_peer: PeerProcess, rng: np.random.Generator) -> None:
    from hmc.errors import OutOfRangeError
    from hmc.transport._ranges import RangeList

    theirs = ucx_peer.register(1 << 20, fill=POISON)
    sink = ucx_agent.register(np.full(1 << 20, 0x11, np.uint8))
    ucx_agent.read(sink, theirs, 0, 0, 4096).wait()  # granted, measured
    transport = ucx_agent._transports[PathName.UCX]  # type: ignore[attr-defined]
    mapping = transport._mappings[sink.id]
    for ranges, size in ((RangeList.build(0, 0, (1 << 20) + 1), 2 << 20), (RangeList.build(0, 4096, 8192), 8192)):
        with pytest.raises(OutOfRangeError):
            transport._push_and_wait(theirs, ranges, type("Local", (), {"size": size})(), mapping, time.monotonic() + 5.0)
    assert sink.numpy().tobytes()[4096:] == bytes([0x11]) * ((1 << 20) - 4096)


def test_rdma_with_a_nic_but_the_wheels_ucx_says_no_verbs_and_what_it_would_register(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ucx_transport, "rdma_nics", lambda: [("mlx5_0", ["1"])])
    rdma = UcxTransport(lambda d, t: None, lambda *a: None, path=PathName.RDMA)  # type: ignore[arg-type,return-value]
    reason = rdma.unavailable_reason() or ""
    assert "UCX has no verbs transport for mlx5_0" in reason and "set [ucx] library" in reason
    assert "device memory it would register by dma-buf: none" in reason  # no GPU here


def test_only_the_rdma_paths_context_keeps_ucxs_own_rail_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket-minded split (`_ucx_engine._SOCKET_TUNING`) is asked for on the ucx path's context where UCX may use
    sockets (its own choice, or tcp listed), not on rdma's nor on one restricted to verbs or shared memory."""
    monkeypatch.setattr(ucx_transport, "rdma_nics", lambda: [("mlx5_0", ["1"])])
    asked: list[tuple[str, bool]] = []

    def context(*, wakeup: bool, transports: str, library: str, sockets: bool) -> None:
        asked.append((transports, sockets))
        raise UnsupportedError("recorded")

    monkeypatch.setattr(ucx_transport.engine, "Context", context)
    monkeypatch.delenv("UCX_TLS", raising=False)
    for path, transports in ((PathName.UCX, ""), (PathName.UCX, "tcp,cuda_copy"), (PathName.UCX, "rc,ud"), (PathName.UCX, "sm,cma"), (PathName.RDMA, "")):
        transport = UcxTransport(lambda d, t: None, lambda *a: None, path=path, transports=transports)  # type: ignore[arg-type,return-value]
        assert "recorded" in (transport.unavailable_reason() or "")
    assert asked == [("", True), ("tcp,cuda_copy", True), ("rc,ud", False), ("sm,cma", False), ("rc,dc,ud", False)]
    assert ucx_lanes.may_use_sockets("all") and not ucx_lanes.may_use_sockets("cuda_copy")
