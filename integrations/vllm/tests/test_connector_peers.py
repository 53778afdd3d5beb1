"""What one HMCConnector worker accepts from its peers: which blocks, from which agent, and until when.

Real workers (real HMC agents, real transfers) over real KV tensors, as in test_connector_halves.py,
whose helpers these tests share: random bytes at the source, a poisoned destination, every byte compared.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hmc
from test_connector_halves import NUM_BLOCKS, block_bytes, blocks, collect, cpu_caches, decoder, fresh_worker, pair, prefill_params, recv_task, request, settings, tiny_model, worker_pair, randomize_and_poison

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"),
]

if importlib.util.find_spec("vllm") is not None:
    from hmc_vllm.connector import ConnectorSettings
    from hmc_vllm.layout import block_ranges, describe, storages
    from hmc_vllm.metadata import HMCConnectorMetadata, SendTask, WorkerHandshake, decode, encode
    from hmc_vllm.worker import HMCConnectorWorker

__all__ = ["pair", "settings", "tiny_model"]  # fixtures, used by name


# -- F2: the blocks a decode instance asks for are the held request's, in order ------------------------


def test_an_offer_naming_a_block_twice_is_refused(tiny_model: Path) -> None:
    params = prefill_params(tiny_model)
    d = decoder(tiny_model)
    incoming = request("d-dup", 70, {**params, "remote_block_ids": [4, 4, 6]})
    d.get_num_new_matched_tokens(incoming, 0)
    d.update_state_after_alloc(incoming, blocks([11, 12, 13]), 70)
    [task] = d.build_connector_meta().recvs
    assert task.refused is not None and "more than once" in task.refused


@pytest.mark.parametrize("remote", [(5, 4, 3), (3, 4), (3, 3, 5), ()], ids=["reordered", "not-the-tail", "repeated", "none"])
def test_a_want_for_blocks_out_of_order_is_refused_and_nothing_is_written(pair: Any, remote: tuple[int, ...]) -> None:
    p, _, d, d_caches = pair
    assert d.layout is not None
    local = (11, 12, 13)[: len(remote)] or (11,)
    poisoned = {b: block_bytes(d_caches, d.layout, b) for b in local}
    p.submit(HMCConnectorMetadata(sends=[SendTask("p-20", (3, 4, 5), time.time() + 30, prompt="A")]))
    task = recv_task(p, "d-20", "p-20", local, remote, prompt="A")
    d.submit(HMCConnectorMetadata(recvs=[task]))
    _, _, failed = collect(d, lambda s, r, f: "d-20" in r)
    assert failed == {"d-20"} and d.block_ids_with_load_errors() == set(local)
    sending, _, _ = collect(p, lambda s, r, f: "p-20" in s)  # its one load is spent on the refusal
    assert sending == {"p-20"}
    assert {b: block_bytes(d_caches, d.layout, b) for b in local} == poisoned


# -- F5: kv, err and release count only from the agents the request is bound to --------------------------


def test_kv_and_err_from_an_agent_that_is_not_the_loads_peer_are_ignored(pair: Any, settings: Any) -> None:
    """P2 holds a key of D's first buffer (every prefill worker D sent a want to does): its kv or err must not end D's load from P."""
    p, p_caches, d, d_caches = pair
    other, _ = fresh_worker("P2", settings)
    try:
        assert p.layout is not None and d.layout is not None and other.agent is not None and d.handshake() is not None
        mine = hmc.BufferDescriptor.FromString(d.handshake().buffers[0])  # type: ignore[union-attr]
        poisoned = block_bytes(d_caches, d.layout, 12)
        d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "d-30", "p-30", (11,), (3,), seconds=30, prompt="A"), recv_task(p, "d-31", "p-31", (12,), (4,), seconds=1, prompt="A")]))
        for note in (encode("err", dreq="d-30", reason="forged"), encode("kv", dreq="d-31", part=0, parts=1, prompt="A")):
            other.agent.write(other.buffers[0], mine, [], [], [], notify=note, timeout=3).wait()  # queued at D before P pushes anything
        p.submit(HMCConnectorMetadata(sends=[SendTask("p-30", (3,), time.time() + 30, prompt="A")]))
        _, _, failed = collect(d, lambda s, r, f: {"d-30", "d-31"} <= r)
        assert failed == {"d-31"}  # d-30 loaded despite the forged err; d-31 failed at its deadline despite the forged kv
        assert block_bytes(d_caches, d.layout, 11) == block_bytes(p_caches, p.layout, 3)
        assert block_bytes(d_caches, d.layout, 12) == poisoned
    finally:
        other.close()


def test_a_release_from_an_agent_that_sent_no_want_is_ignored(pair: Any, settings: Any) -> None:
    p, p_caches, d, d_caches = pair
    other, _ = fresh_worker("P2", settings)
    try:
        assert p.layout is not None and d.layout is not None and other.agent is not None
        p.submit(HMCConnectorMetadata(sends=[SendTask("p-32", (3, 9), time.time() + 30, prompt="A", loads=2)]))
        d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "0_d-32", "p-32", (11, 12), (3, 9), prompt="A")]))
        collect(d, lambda s, r, f: "0_d-32" in r)
        theirs = hmc.BufferDescriptor.FromString(p.handshake().buffers[0])  # type: ignore[union-attr]
        other.agent.write(other.buffers[0], theirs, [], [], [], notify=encode("release", req="p-32", all=True), timeout=3).wait()
        d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "1_d-32", "p-32", (21, 22), (3, 9), prompt="A")]))
        _, _, failed = collect(d, lambda s, r, f: "1_d-32" in r)
        assert not failed  # the second load was still served
        collect(p, lambda s, r, f: "p-32" in s)
        for src, dst in ((3, 11), (9, 12), (3, 21), (9, 22)):
            assert block_bytes(d_caches, d.layout, dst) == block_bytes(p_caches, p.layout, src)
    finally:
        other.close()


# -- F1: no push writes into blocks a decode side has reported failed -----------------------------------


def test_a_want_waiting_for_its_hold_past_the_decode_deadline_is_never_pushed(pair: Any) -> None:
    """D's load fails at its deadline before P's hold exists; the hold that comes after must not write into D's blocks."""
    p, _, d, d_caches = pair
    assert d.layout is not None
    poisoned = block_bytes(d_caches, d.layout, 11)
    d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "d-40", "p-40", (11,), (3,), seconds=1.0, prompt="A")]))
    _, _, failed = collect(d, lambda s, r, f: "d-40" in r)
    assert failed == {"d-40"} and d.block_ids_with_load_errors() == {11}  # vLLM may hand block 11 to another request now
    p.submit(HMCConnectorMetadata(sends=[SendTask("p-40", (3,), time.time() + 30, prompt="A")]))
    sending, _, _ = collect(p, lambda s, r, f: "p-40" in s)  # its load is spent on the refusal; a push would end first
    assert sending == {"p-40"}
    assert block_bytes(d_caches, d.layout, 11) == poisoned


def test_a_push_stalled_past_the_decode_deadline_writes_nothing(settings: Any) -> None:
    """P holds the request, takes the want, then stalls until D has given up: the push must not start late."""

    class StalledPrefill(HMCConnectorWorker):
        """A prefill worker whose connector thread stalls just before it pushes, until the test lets it go."""

        go = threading.Event()

        def before_push(self, send: SendTask, block_ids: list[int]) -> None:
            assert self.go.wait(timeout=30)

    p = StalledPrefill("P", 0, NUM_BLOCKS, settings)
    p_caches = cpu_caches()
    p.register_kv_caches(p_caches)
    d, d_caches = fresh_worker("D", settings)
    try:
        randomize_and_poison(p_caches, d_caches)
        assert d.layout is not None
        poisoned = block_bytes(d_caches, d.layout, 11)
        p.submit(HMCConnectorMetadata(sends=[SendTask("p-41", (3,), time.time() + 30, prompt="A")]))
        d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "d-41", "p-41", (11,), (3,), seconds=1.0, prompt="A")]))
        _, _, failed = collect(d, lambda s, r, f: "d-41" in r)
        assert failed == {"d-41"}
        p.go.set()
        sending, _, _ = collect(p, lambda s, r, f: "p-41" in s)  # refused, or pushed: either way over
        assert sending == {"p-41"}
        assert block_bytes(d_caches, d.layout, 11) == poisoned
    finally:
        p.go.set()
        p.close()
        d.close()


# -- F3: in pull mode the prefill side checks what a decode side reads: claim, then grant -------------


@pytest.fixture
def pulling() -> Iterator[tuple[HMCConnectorWorker, dict[str, Any], HMCConnectorWorker, dict[str, Any]]]:
    """A prefill and a decode worker in pull mode: random bytes at P, poison at D."""
    yield from worker_pair(ConnectorSettings(mode="pull", lease_s=3.0, load_timeout_s=3.0, message_timeout_s=3.0))


@pytest.mark.parametrize(
    ("remote", "prompt"), [((4, 5, 6), "B"), ((4, 5, 6), "C"), ((20, 21, 22), "B")], ids=["reviewer", "other-blocks", "other-prompt"],
)
def test_a_pull_of_blocks_not_held_for_its_prompt_fails_and_reads_nothing(pulling: Any, remote: tuple[int, ...], prompt: str) -> None:
    """The reviewer's scenario: genuine descriptors, remote_block_ids of another prompt's blocks, the offer's digest set to this prompt's."""
    p, _, d, d_caches = pulling
    assert d.layout is not None
    local = (11, 12, 13)
    poisoned = {b: block_bytes(d_caches, d.layout, b) for b in local}
    p.submit(HMCConnectorMetadata(sends=[SendTask("p-c", (20, 21, 22), time.time() + 30, prompt="C")]))  # P's blocks 4, 5, 6 hold prompt A, offered to nobody
    d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "d-b", "p-c", local, remote, prompt=prompt)]))
    _, _, failed = collect(d, lambda s, r, f: "d-b" in r)
    assert failed == {"d-b"} and d.block_ids_with_load_errors() == set(local)
    sending, _, _ = collect(p, lambda s, r, f: "p-c" in s)  # its one load is spent on the refusal
    assert sending == {"p-c"}
    assert {b: block_bytes(d_caches, d.layout, b) for b in local} == poisoned


@pytest.mark.parametrize("remote", [(5, 4, 3), (3, 4), (3, 3, 5)], ids=["reordered", "not-the-tail", "repeated"])
def test_a_claim_for_blocks_out_of_order_is_refused_and_nothing_is_read(pulling: Any, remote: tuple[int, ...]) -> None:
    p, _, d, d_caches = pulling
    assert d.layout is not None
    local = (11, 12, 13)[: len(remote)]
    poisoned = {b: block_bytes(d_caches, d.layout, b) for b in local}
    p.submit(HMCConnectorMetadata(sends=[SendTask("p-21", (3, 4, 5), time.time() + 30, prompt="A")]))
    d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "d-21", "p-21", local, remote, prompt="A")]))
    _, _, failed = collect(d, lambda s, r, f: "d-21" in r)
    assert failed == {"d-21"} and d.block_ids_with_load_errors() == set(local)
    sending, _, _ = collect(p, lambda s, r, f: "p-21" in s)
    assert sending == {"p-21"}
    assert {b: block_bytes(d_caches, d.layout, b) for b in local} == poisoned


def test_a_grant_from_an_agent_that_is_not_the_loads_peer_is_ignored(pulling: Any) -> None:
    """P2 holds a key of D's first buffer: its grant must not start D's reads; P's own answer (err: another prompt) decides."""
    p, _, d, d_caches = pulling
    other, _ = fresh_worker("P2", ConnectorSettings(mode="pull"))
    try:
        assert d.layout is not None and other.agent is not None and d.handshake() is not None
        poisoned = block_bytes(d_caches, d.layout, 11)
        d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "d-50", "p-50", (11,), (3,), seconds=30, prompt="B")]))  # parked at P: not held yet
        mine = hmc.BufferDescriptor.FromString(d.handshake().buffers[0])  # type: ignore[union-attr]
        forged = encode("grant", dreq="d-50", req="p-50", rblocks=[3], prompt="B")
        other.agent.write(other.buffers[0], mine, [], [], [], notify=forged, timeout=3).wait()  # queued at D before P answers
        p.submit(HMCConnectorMetadata(sends=[SendTask("p-50", (3,), time.time() + 30, prompt="A")]))
        _, _, failed = collect(d, lambda s, r, f: "d-50" in r)
        assert failed == {"d-50"}
        assert block_bytes(d_caches, d.layout, 11) == poisoned
    finally:
        other.close()


def test_a_claim_naming_another_agents_buffers_is_dropped_unanswered(pulling: Any) -> None:
    """P2 claims D's load of P's request, naming D's buffers: P grants nothing (to D) and spends no load; D's own claim is served."""
    p, p_caches, d, d_caches = pulling
    other, _ = fresh_worker("P2", ConnectorSettings(mode="pull"))
    try:
        assert p.layout is not None and d.layout is not None and other.agent is not None and d.handshake() is not None
        p.submit(HMCConnectorMetadata(sends=[SendTask("p-51", (3, 4), time.time() + 30, prompt="A")]))
        theirs = hmc.BufferDescriptor.FromString(p.handshake().buffers[0])  # type: ignore[union-attr]
        claim = encode("claim", req="p-51", dreq="d-51", blocks=[11, 12], rblocks=[3, 4], prompt="A", peer=d.handshake().to_wire(), budget=30.0)  # type: ignore[union-attr]
        other.agent.write(other.buffers[0], theirs, [], [], [], notify=claim, timeout=3).wait()
        d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "d-51", "p-51", (11, 12), (3, 4), prompt="A")]))
        _, _, failed = collect(d, lambda s, r, f: "d-51" in r)
        assert not failed
        collect(p, lambda s, r, f: "p-51" in s)
        for src, dst in ((3, 11), (4, 12)):
            assert block_bytes(d_caches, d.layout, dst) == block_bytes(p_caches, p.layout, src)
    finally:
        other.close()


class Claimer:
    """A bare HMC agent with KV buffers that claims blocks and reads them when it likes (a decode side held mid-read)."""

    def __init__(self) -> None:
        self.caches = cpu_caches()
        flat = storages(self.caches)
        self.agent = hmc.Agent(hmc.Config.load())
        self.buffers = [self.agent.register(b, name=f"claimer/kv{i}") for i, b in enumerate(flat)]
        self.handshake = WorkerHandshake(tuple(b.descriptor.SerializeToString() for b in self.buffers), describe(self.caches, flat, NUM_BLOCKS))
        self.answers: dict[str, dict[str, Any]] = {}  # by decode request id, until asked for

    def send(self, p: HMCConnectorWorker, kind: str, **fields: Any) -> None:
        theirs = hmc.BufferDescriptor.FromString(p.handshake().buffers[0])  # type: ignore[union-attr]
        self.agent.write(self.buffers[0], theirs, [], [], [], notify=encode(kind, **fields), timeout=3).wait()

    def answer(self, dreq: str, timeout: float = 10.0) -> dict[str, Any]:
        """The grant or err for `dreq` (waits on the agent's inbox; answers for others are kept for their turn)."""
        deadline = time.monotonic() + timeout
        while dreq not in self.answers:
            assert time.monotonic() < deadline, f"no answer for {dreq}"
            for note in self.agent.notifications(timeout=0.5):
                message = decode(note.payload)
                self.answers[str(message.get("dreq"))] = message
        return self.answers.pop(dreq)

    def read(self, p: HMCConnectorWorker, rblocks: list[int], blocks: list[int]) -> None:
        assert p.layout is not None
        remote = [hmc.BufferDescriptor.FromString(b) for b in p.handshake().buffers]  # type: ignore[union-attr]
        for (src, dst), (r_off, l_off, lengths) in block_ranges(p.layout, self.handshake.layout, rblocks, blocks).items():
            self.agent.read(self.buffers[dst], remote[src], r_off, l_off, lengths, timeout=3).wait()


def test_a_granted_pull_holds_its_blocks_past_a_release_of_all_and_the_lease_until_its_read_ends_or_its_budget(pulling: Any) -> None:
    p, p_caches, _, _ = pulling
    assert p.layout is not None
    claimer = Claimer()
    try:
        peer = claimer.handshake.to_wire()
        p.submit(HMCConnectorMetadata(sends=[SendTask("p-60", (3,), time.time() + 30, prompt="A", loads=2), SendTask("p-62", (5,), time.time() + 1.0, prompt="A")]))
        claimer.send(p, "claim", req="p-60", dreq="x-60", blocks=[11], rblocks=[3], prompt="A", peer=peer, budget=30.0)
        claimer.send(p, "claim", req="p-62", dreq="x-62", blocks=[12], rblocks=[5], prompt="A", peer=peer, budget=2.5)
        assert claimer.answer("x-60") == {"t": "grant", "dreq": "x-60", "req": "p-60", "rblocks": [3], "prompt": "A"}
        assert claimer.answer("x-62")["t"] == "grant"
        granted = time.monotonic()
        # A release of all, then a marker held and released in a later step: once the marker is reported, the release was taken.
        p.submit(HMCConnectorMetadata(releases=["p-60"]))
        p.submit(HMCConnectorMetadata(sends=[SendTask("marker", (9,), time.time() + 30)], releases=["marker"]))
        sending, _, _ = collect(p, lambda s, r, f: "marker" in s)
        assert sending == {"marker"}  # p-60 released and p-62's lease soon over, but their reads may still run
        claimer.read(p, [3], [11])
        assert block_bytes(claimer.caches, claimer.handshake.layout, 11) == block_bytes(p_caches, p.layout, 3)
        claimer.send(p, "release", req="p-60", dreq="x-60")  # the read is over: now the release of all frees it
        sending, _, _ = collect(p, lambda s, r, f: "p-60" in s)
        assert sending == {"p-60"}
        sending, _, _ = collect(p, lambda s, r, f: "p-62" in s)  # nobody releases it: freed when its budget ends, not at its lease
        assert sending == {"p-62"} and time.monotonic() - granted > 2.0
    finally:
        claimer.agent.close()


def test_a_pull_serves_each_load_byte_for_byte_then_frees_the_request(pulling: Any) -> None:
    p, p_caches, d, d_caches = pulling
    assert p.layout is not None and d.layout is not None
    untouched = block_bytes(d_caches, d.layout, 0)
    p.submit(HMCConnectorMetadata(sends=[SendTask("p-70", (3, 4, 5, 20), time.time() + 30, prompt="A", loads=2)]))
    d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "0_d-70", "p-70", (7, 8, 9, 63), (3, 4, 5, 20), prompt="A")]))
    _, _, failed = collect(d, lambda s, r, f: "0_d-70" in r)
    assert not failed
    assert p.get_transfer_results()[0] == set()  # one load of two: still held
    d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "1_d-70", "p-70", (21, 22), (5, 20), prompt="A")]))
    _, _, failed = collect(d, lambda s, r, f: "1_d-70" in r)
    assert not failed
    collect(p, lambda s, r, f: "p-70" in s)
    for src, dst in ((3, 7), (4, 8), (5, 9), (20, 63), (5, 21), (20, 22)):
        assert block_bytes(d_caches, d.layout, dst) == block_bytes(p_caches, p.layout, src)
    assert block_bytes(d_caches, d.layout, 0) == untouched and d.block_ids_with_load_errors() == set()
