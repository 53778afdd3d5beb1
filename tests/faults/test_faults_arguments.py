"""Issue 9, scenario 5: a bad argument raises a typed error at the API boundary and writes nothing, on every route.

Each case first moves random bytes over the route with a valid single-range call (so
the agent has learned the pair's route and its inline copy), then makes the bad call,
then a valid call on the same route as a barrier, and compares every byte of the
poisoned destination with what the two valid calls alone put there. Routes: the
negotiated one (ipc: single-range int calls copy inline on the caller's thread), ipc
forced, and staged forced (its route waits on the peer, so calls with a timeout take
the full path). The peer is a real agent process; hmcd's third-party transfers are
checked against a real hmcd.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from control_fixtures import DaemonSet, FakeAgent, Hmcd, daemon_set, wait_until

from hmc.agent import Agent, ConnBuffer
from hmc.config import Config
from hmc.control import Client
from hmc.errors import ArgumentError, OutOfRangeError
from hmc.testing import PeerProcess
from hmc.transport._ranges import MAX_NOTIFY_BYTES, RangeList
from hmc.v1 import common_pb2, daemon_pb2

SIZE = 64 << 10
BLOCK = 4096
POISON = 0xA5


@dataclasses.dataclass(frozen=True)
class Case:
    """A bad call: the valid call's arguments with `changes` (a: source offsets, b: destination offsets, n: lengths)."""

    name: str
    changes: dict[str, Any]
    error: type[ArgumentError] = ArgumentError

    def __str__(self) -> str:
        return self.name


PAIR = {"a": [0, 2 * BLOCK], "b": [BLOCK, 4 * BLOCK], "n": BLOCK}
"""Two valid ranges, for the cases that need arrays."""

CASES = [
    Case("timeout-nan", {"timeout": math.nan}),
    Case("timeout-inf", {"timeout": math.inf}),
    Case("timeout-minus-inf", {"timeout": -math.inf}),
    Case("timeout-negative", {"timeout": -1}),
    Case("timeout-zero", {"timeout": 0}),
    Case("timeout-str", {"timeout": "abc"}),
    Case("timeout-bool", {"timeout": True}),
    Case("timeout-beyond-bound", {"timeout": 2e6}),
    Case("timeout-int-beyond-float", {"timeout": 10**400}),
    Case("timeout-nan-batch", {**PAIR, "timeout": math.nan}),
    Case("length-bool", {"n": True}),
    Case("length-none", {"n": None}),
    Case("length-float", {"n": float(BLOCK)}),
    Case("length-negative", {"n": -1}, OutOfRangeError),
    Case("length-2**70", {"n": 2**70}, OutOfRangeError),
    Case("lengths-2d", {**PAIR, "n": np.full((1, 2), BLOCK)}),
    Case("lengths-bool-array", {**PAIR, "n": np.array([True, True])}),
    Case("lengths-float-array", {**PAIR, "n": np.array([BLOCK, BLOCK], np.float64)}),
    Case("offset-bool", {"b": True}),
    Case("offset-none", {"b": None}),
    Case("offset-str", {"b": "0"}),
    Case("offset-negative", {"b": -1}, OutOfRangeError),
    Case("src-offset-negative", {"a": -BLOCK}, OutOfRangeError),
    Case("offset-2**70", {"b": 2**70}, OutOfRangeError),
    Case("offsets-2**70-in-list", {**PAIR, "a": [0, 2**70]}, OutOfRangeError),
    Case("offsets-uint64-beyond-int64", {**PAIR, "b": np.array([BLOCK, 2**63], np.uint64)}, OutOfRangeError),
    Case("offsets-negative-array", {**PAIR, "b": np.array([BLOCK, -BLOCK])}, OutOfRangeError),
    Case("offsets-2d", {**PAIR, "b": np.array([[BLOCK, 4 * BLOCK]])}),
    Case("offsets-float-array", {**PAIR, "b": np.array([BLOCK, 4 * BLOCK], np.float64)}),
    Case("offsets-bool-array", {**PAIR, "b": np.array([True, False])}),
    Case("dst-overlap", {**PAIR, "b": [BLOCK, BLOCK + BLOCK // 2]}),
    Case("dst-same-range-twice", {**PAIR, "b": [BLOCK, BLOCK]}),
    Case("dst-overlap-in-a-block-batch", {"a": np.arange(12) * BLOCK, "b": np.array([2, 5, 3, 9, 7, 4, 11, 6, 8, 10, 12, 5]) * BLOCK, "n": BLOCK}),
    Case("dst-overlap-in-a-mixed-batch", {"a": np.arange(10) * BLOCK, "b": np.array([9, 1, 3, 5, 7, 2, 11, 13, 15, 12]) * BLOCK, "n": np.array([BLOCK] * 5 + [BLOCK + 1] + [BLOCK] * 4)}),
    Case("notify-str", {"notify": "done"}),
    Case("notify-over-1MiB", {"notify": memoryview(bytes(MAX_NOTIFY_BYTES + 1))}),
    Case("local-none", {"local": None}),
    Case("remote-none", {"remote": None}),
    Case("remote-bytes", {"remote": b"descriptor"}),
]

ROUTES = [None, "ipc", "staged"]
OPS = ["write", "read", "prepare_write", "prepare_read"]


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, PeerProcess]]:
    """One embedded agent here and one peer agent process, shared by the module (each case registers fresh buffers)."""
    config = Config(socket=str(tmp_path_factory.mktemp("args") / "no-hmcd.sock"), timeout_s=10.0)
    with Agent(config, daemon=False) as agent:
        peer = PeerProcess(config)
        try:
            yield agent, peer
        finally:
            peer.close()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "negotiated")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_bad_argument_is_refused_typed_and_nothing_lands(scene: tuple[Agent, PeerProcess], rng: np.random.Generator, case: Case, route: str | None, op: str) -> None:
    agent, peer = scene
    read = op.endswith("read")
    base = getattr(agent, "read" if read else "write")
    source = rng.integers(0, 256, SIZE, dtype=np.uint8)
    if read:  # the destination is this agent's buffer, the source the peer's
        local = agent.register(np.full(SIZE, POISON, np.uint8))
        remote = peer.register(SIZE)
        peer.fill(remote.id, source.tobytes())
    else:
        local = agent.register(source.copy())
        remote = peer.register(SIZE, fill=POISON)
    expected = np.full(SIZE, POISON, np.uint8)

    def valid(a: int, b: int) -> None:
        handle = base(local, remote, a, b, BLOCK, path=route)
        handle.wait()
        assert handle.path == (route or "ipc")
        expected[b : b + BLOCK] = source[a : a + BLOCK]

    valid(0, 0)
    assert (remote.id if route is None else (remote.id, route)) in local.inline_routes  # the route (and its inline copy) is known
    call = {"local": local, "remote": remote, "a": BLOCK, "b": 2 * BLOCK, "n": BLOCK, "timeout": None, "notify": None, **case.changes}
    args = (call["local"], call["remote"], call["a"], call["b"], call["n"])
    with pytest.raises(case.error):
        if not op.startswith("prepare"):
            base(*args, notify=call["notify"], timeout=call["timeout"], path=route)
        elif call["notify"] is not None:  # a prepared transfer takes its notification per post
            getattr(agent, op)(*args, timeout=call["timeout"], path=route).post(notify=call["notify"])
        else:
            getattr(agent, op)(*args, timeout=call["timeout"], path=route)
    valid(8 * BLOCK, 12 * BLOCK)  # a barrier: a later transfer on the same route has finished
    landed = local.numpy().tobytes() if read else peer.contents(remote.id)
    assert landed == expected.tobytes()


def test_source_ranges_may_overlap(scene: tuple[Agent, PeerProcess], rng: np.random.Generator) -> None:
    """Reading the same source bytes into two places is fine, on every route; only destinations must be disjoint."""
    agent, peer = scene
    source = rng.integers(0, 256, SIZE, dtype=np.uint8)
    local = agent.register(source.copy())
    src, dst, lengths = np.array([0, BLOCK // 2, 0]), np.array([0, 2 * BLOCK, 5 * BLOCK]), np.array([BLOCK, BLOCK, 3 * BLOCK])
    for route in ROUTES:
        remote = peer.register(SIZE, fill=POISON)
        agent.write(local, remote, src, dst, lengths, path=route).wait()
        expected = np.full(SIZE, POISON, np.uint8)
        for s, d, n in zip(src, dst, lengths):
            expected[d : d + n] = source[s : s + n]
        assert peer.contents(remote.id) == expected.tobytes(), route


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0, 0, "abc", True, 2e6], ids=repr)
def test_waiting_with_a_bad_timeout_is_refused_and_the_transfer_runs_on(scene: tuple[Agent, PeerProcess], rng: np.random.Generator, timeout: Any) -> None:
    agent, peer = scene
    local = agent.register(rng.integers(0, 256, SIZE, dtype=np.uint8))
    remote = peer.register(SIZE, fill=POISON)
    offsets = np.arange(0, SIZE, BLOCK)[::-1].copy()
    handle = agent.write(local, remote, np.arange(0, SIZE, BLOCK), offsets, BLOCK, path="staged")
    with pytest.raises(ArgumentError):
        handle.wait(timeout)
    handle.wait()  # the transfer was left alone: it completes within its own deadline
    expected = local.numpy().reshape(-1, BLOCK)[::-1].tobytes()
    assert peer.contents(remote.id) == expected
    with pytest.raises(ArgumentError):  # a handle born finished checks too
        agent.write(local, remote, 0, 0, 16).wait(timeout)


# -- hmcd's third-party transfers ------------------------------------------------------------


@pytest.fixture(scope="module")
def daemons() -> Iterator[DaemonSet]:
    yield from daemon_set()


@pytest.fixture(scope="module")
def hmcd(daemons: DaemonSet) -> Hmcd:
    return daemons.start("args")


def _submit_raw(client: Client, request: daemon_pb2.SubmitTransferRequest) -> daemon_pb2.TransferStatus:
    return client._call(client._transfers.Submit, request)  # noqa: SLF001 - a raw request, as another client could send


@pytest.mark.parametrize(
    "case",
    [
        Case("timeout-nan", {"timeout_s": math.nan}),
        Case("timeout-inf", {"timeout_s": math.inf}),
        Case("timeout-huge", {"timeout_s": 1e300}),
        Case("timeout-negative", {"timeout_s": -1.0}),
        Case("dst-overlap", {"ranges": RangeList.build([0, BLOCK], [BLOCK, BLOCK + 1], BLOCK).to_proto()}),
    ],
    ids=str,
)
def test_hmcd_refuses_a_bad_submission_before_instructing_anyone(hmcd: Hmcd, case: Case) -> None:
    source, sink = FakeAgent(hmcd.config()), FakeAgent(hmcd.config())
    try:
        src = source.register(f"a-src-{case.name}", size=SIZE)
        sink.register(f"a-dst-{case.name}", size=SIZE)
        good = {"src": daemon_pb2.BufferRef(name=src.name), "dst": daemon_pb2.BufferRef(name=f"a-dst-{case.name}"), "ranges": RangeList.build(0, 0, BLOCK).to_proto(), "timeout_s": 3.0}
        with hmcd.client() as client:
            with pytest.raises(case.error):
                _submit_raw(client, daemon_pb2.SubmitTransferRequest(**{**good, **case.changes}))
            status = _submit_raw(client, daemon_pb2.SubmitTransferRequest(**good))  # a barrier: this one is instructed
            wait_until(lambda: source.instructions, what="the valid instruction")
            assert [i.transfer_id for i in source.instructions] == [status.transfer_id] and not sink.instructions
            with pytest.raises(ArgumentError):  # a bad wait, raw and through the client
                client._call(client._transfers.Wait, daemon_pb2.TransferRef(transfer_id=status.transfer_id, timeout_s=math.nan))  # noqa: SLF001
            for timeout in (math.nan, math.inf, "abc", 0):
                with pytest.raises(ArgumentError):
                    client.wait(status.transfer_id, timeout=timeout)
                with pytest.raises(ArgumentError):
                    client.submit(src.name, f"a-dst-{case.name}", 0, 0, BLOCK, timeout=timeout)
            with pytest.raises(ArgumentError):
                client.submit(src.name, f"a-dst-{case.name}", [0, BLOCK], [0, BLOCK // 2], BLOCK)
            assert client.status(status.transfer_id).state == common_pb2.TRANSFER_STATE_PENDING
            assert len(source.instructions) == 1 and not sink.instructions
    finally:
        source.close()
        sink.close()


def test_read_into_overlapping_local_ranges_is_refused_for_a_connbuffer_remote(scene: tuple[Agent, PeerProcess], rng: np.random.Generator) -> None:
    """A read's destination is local: overlap there is refused even between two buffers of this agent (the local path)."""
    agent, _ = scene
    source: ConnBuffer = agent.register(rng.integers(0, 256, SIZE, dtype=np.uint8))
    sink = agent.register(np.full(SIZE, POISON, np.uint8))
    with pytest.raises(ArgumentError, match="overlap"):
        agent.read(sink, source, [0, BLOCK], [0, BLOCK - 1], BLOCK)
    agent.read(sink, source, [BLOCK, BLOCK], [0, 2 * BLOCK], BLOCK).wait()  # the same source twice is fine
    expected = np.full(SIZE, POISON, np.uint8)
    expected[0:BLOCK] = expected[2 * BLOCK : 3 * BLOCK] = source.numpy()[BLOCK : 2 * BLOCK]
    assert sink.numpy().tobytes() == expected.tobytes()


def test_a_batch_past_one_frame_goes_through_staged_as_it_does_ipc(make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess], rng: np.random.Generator) -> None:
    """4.3 million one-byte ranges (their offsets and lengths alone exceed a 64 MiB frame): staged cuts them into frames."""
    count = 4_300_000
    peer = make_peer(("staged",))
    agent = make_agent(("staged",))
    remote = peer.register(2 * count)
    peer.poison(remote.id, 0xA5)
    data = rng.integers(1, 255, 2 * count, dtype=np.uint8)
    local = agent.register(data)
    offsets = np.arange(0, 2 * count, 2, dtype=np.int64)  # every other byte: nothing coalesces
    agent.write(local, remote, offsets, offsets, 1, timeout=120).wait()
    landed = np.frombuffer(peer.contents(remote.id), np.uint8)
    assert np.array_equal(landed[0::2], data[0::2]) and (landed[1::2] == 0xA5).all()
