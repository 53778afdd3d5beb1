"""A decode peer that stops answering must not stall the prefill worker's connector thread.

A write to a peer whose connection is new blocks its caller until the peer answers; a silent peer is modelled
by a port that listens and never answers, named in the descriptors of a want from the agent that owns them.
Real workers and transfers, as in test_connector_halves.py: random bytes at the source, a poisoned
destination, every byte compared; hooks on the prefill worker say when the connector thread has got that far.
"""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import hmc
from test_connector_halves import NUM_BLOCKS, block_bytes, collect, cpu_caches, fresh_worker, pair, recv_task, settings
from test_connector_peers import Claimer

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"),
]

if importlib.util.find_spec("vllm") is not None:
    import torch

    from hmc_vllm.connector import ConnectorSettings
    from hmc_vllm.metadata import HMCConnectorMetadata, SendTask, WorkerHandshake
    from hmc_vllm.worker import HMCConnectorWorker

__all__ = ["pair", "settings"]  # fixtures, used by name

if importlib.util.find_spec("vllm") is not None:

    class WatchedPrefill(HMCConnectorWorker):
        """A prefill worker that says when its connector thread starts a push or answers `err`."""

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.pushing: set[str] = set()
            self.refusing: set[str] = set()
            self.changed = threading.Condition()

        def before_push(self, send: SendTask, block_ids: list[int]) -> None:
            with self.changed:
                self.pushing.add(send.request_id)
                self.changed.notify_all()

        def _reply_error(self, want: Any, reason: str) -> None:
            with self.changed:
                self.refusing.add(str(want.get("dreq")))
                self.changed.notify_all()
            super()._reply_error(want, reason)

        def wait_for(self, seen: set[str], name: str, timeout: float = 20.0) -> None:
            with self.changed:
                assert self.changed.wait_for(lambda: name in seen, timeout=timeout), f"the connector thread never reached {name}"


@pytest.fixture
def silent() -> Iterator[list[socket.socket]]:
    """Listening ports that never answer (new ones on demand via `listen`)."""
    ports: list[socket.socket] = []
    yield ports
    for s in ports:
        s.close()


def listen(ports: list[socket.socket]) -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(0)
    ports.append(s)
    return int(s.getsockname()[1])


def at_port(handshake: WorkerHandshake, port: int) -> dict[str, Any]:
    """`handshake` with its buffers' owner reached at `port` (the same agent, at an address that never answers)."""
    moved = []
    for wire in handshake.buffers:
        desc = hmc.BufferDescriptor.FromString(wire)
        desc.owner.endpoint.port = port
        desc.owner.unix_path = ""
        moved.append(desc.SerializeToString())
    return WorkerHandshake(tuple(moved), handshake.layout).to_wire()


@pytest.fixture
def watched() -> Iterator[tuple[WatchedPrefill, dict[str, Any], HMCConnectorWorker, dict[str, Any]]]:
    """P (watched; unknown wants go stale after 1 s; messages time out after 3 s) and D: random bytes at P, poison at D."""
    settings = ConnectorSettings(lease_s=1.0, load_timeout_s=3.0, message_timeout_s=3.0)
    p = WatchedPrefill("P", 0, NUM_BLOCKS, settings)
    p_caches = cpu_caches()
    p.register_kv_caches(p_caches)
    d, d_caches = fresh_worker("D", settings)
    for t in p_caches.values():
        t.copy_(torch.randn(t.shape))
    for t in d_caches.values():
        t.fill_(-7.0)
    try:
        yield p, p_caches, d, d_caches
    finally:
        p.close()
        d.close()


def healthy_load(p: WatchedPrefill, p_caches: dict[str, Any], d: HMCConnectorWorker, d_caches: dict[str, Any], seconds: float = 2.0) -> None:
    """D loads P's request p-ok (blocks 3, 4 into 11, 12) within `seconds`: every byte lands, nothing else is touched."""
    assert d.layout is not None and p.layout is not None
    poisoned = block_bytes(d_caches, d.layout, 13)
    started = time.monotonic()
    d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "d-ok", "p-ok", (11, 12), (3, 4), seconds=seconds, prompt="A")]))
    _, recving, failed = collect(d, lambda s, r, f: "d-ok" in r)
    assert recving == {"d-ok"} and not failed, f"the healthy load failed after {time.monotonic() - started:.2f}s"
    for src, dst in ((3, 11), (4, 12)):
        assert block_bytes(d_caches, d.layout, dst) == block_bytes(p_caches, p.layout, src)
    assert block_bytes(d_caches, d.layout, 13) == poisoned


def test_a_silent_peers_want_does_not_delay_a_healthy_load(watched: Any, silent: list[socket.socket]) -> None:
    """A peer sends a want for a held request, then never answers: the push to it must not hold up D's load."""
    p, p_caches, d, d_caches = watched
    frozen = Claimer()
    try:
        p.submit(HMCConnectorMetadata(sends=[SendTask("p-frozen", (1,), time.time() + 30, prompt="F"), SendTask("p-ok", (3, 4), time.time() + 30, prompt="A")]))
        peer = at_port(frozen.handshake, listen(silent))
        frozen.send(p, "want", req="p-frozen", dreq="x-frozen", blocks=[5], rblocks=[1], prompt="F", peer=peer, budget=20.0)
        p.wait_for(p.pushing, "p-frozen")  # the push to the silent peer is under way
        healthy_load(p, p_caches, d, d_caches)
        collect(p, lambda s, r, f: "p-ok" in s)
    finally:
        frozen.agent.close()


def test_many_forged_wants_naming_silent_peers_do_not_delay_a_healthy_load(watched: Any, silent: list[socket.socket]) -> None:
    """Wants for requests P never holds, each naming another silent address, are refused when stale: off the connector thread."""
    p, p_caches, d, d_caches = watched
    forger = Claimer()
    try:
        p.submit(HMCConnectorMetadata(sends=[SendTask("p-ok", (3, 4), time.time() + 30, prompt="A")]))
        for i in range(4):
            peer = at_port(forger.handshake, listen(silent))
            forger.send(p, "want", req=f"nope-{i}", dreq=f"x-{i}", blocks=[5], rblocks=[1], prompt="A", peer=peer, budget=20.0)
        p.wait_for(p.refusing, "x-0")  # the stale wants are being refused
        healthy_load(p, p_caches, d, d_caches)
    finally:
        forger.agent.close()


def test_a_repeated_or_cancelled_want_is_answered_once(watched: Any) -> None:
    """The same want twice, then cancelled, for a request P never holds: one `err` for it, never a second."""
    p, _, _, _ = watched
    asker = Claimer()
    try:
        peer = asker.handshake.to_wire()
        for _ in range(2):
            asker.send(p, "want", req="nope", dreq="x-1", blocks=[5], rblocks=[1], prompt="A", peer=peer, budget=20.0)
        asker.send(p, "release", req="nope", dreq="x-1")
        assert asker.answer("x-1")["t"] == "err"
        asker.send(p, "want", req="nope-2", dreq="x-2", blocks=[5], rblocks=[1], prompt="A", peer=peer, budget=20.0)
        assert asker.answer("x-2")["t"] == "err"  # refused when stale, after nope's wants went stale: any second answer came first
        assert "x-1" not in asker.answers
    finally:
        asker.agent.close()


def test_wants_parked_past_the_cap_are_refused_at_once(pair: Any) -> None:
    """One agent may park only so many wants for requests not held; the next is refused at once, and a push still serves."""
    from hmc_vllm.parked import MAX_PER_SENDER

    p, p_caches, d, d_caches = pair
    asker = Claimer()
    try:
        peer = asker.handshake.to_wire()
        for i in range(MAX_PER_SENDER + 1):
            asker.send(p, "want", req=f"later-{i}", dreq=f"x-{i}", blocks=[5], rblocks=[1], prompt="A", peer=peer, budget=20.0)
        answer = asker.answer(f"x-{MAX_PER_SENDER}", timeout=2.5)  # before any parked want goes stale (3 s)
        assert answer["t"] == "err" and "parked" in answer["reason"]
        p.submit(HMCConnectorMetadata(sends=[SendTask("p-ok", (3, 4), time.time() + 30, prompt="A")]))
        healthy_load(p, p_caches, d, d_caches)
    finally:
        asker.agent.close()
