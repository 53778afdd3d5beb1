"""What one HMCConnector worker accepts from its peers: which blocks, from which agent, and until when.

Real workers (real HMC agents, real transfers) over real KV tensors, as in test_connector_halves.py,
whose helpers these tests share: random bytes at the source, a poisoned destination, every byte compared.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import hmc
from test_connector_halves import NUM_BLOCKS, block_bytes, blocks, collect, cpu_caches, decoder, fresh_worker, pair, prefill_params, recv_task, request, settings, tiny_model

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"),
]

if importlib.util.find_spec("vllm") is not None:
    import torch

    from hmc_vllm.metadata import HMCConnectorMetadata, SendTask, encode
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
        for t in p_caches.values():
            t.copy_(torch.randn(t.shape))
        for t in d_caches.values():
            t.fill_(-7.0)
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
