"""A peer agent killed (SIGKILL) or frozen mid-transfer: every pending operation fails within its deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hmc.agent import Agent, TransferState
from hmc.agent._peer_process import wait_stopped
from hmc.errors import BrokenResourceError, HMCError, TimeoutError, UnavailableError
from hmc.testing import PeerProcess

BIG = 128 << 20
PROMPT_S = 3.0
"""A dead peer must be noticed this fast (the transfers' deadline is 10 s)."""


@pytest.mark.parametrize("path", ["staged", "ipc"])
def test_owner_killed_mid_transfer_fails_the_handle_promptly(make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess], path: str) -> None:
    peer = make_peer()
    a = make_agent((path,))
    remote = peer.register(BIG)
    src = a.register(np.ones(BIG, np.uint8))
    for length in (4096, 4 << 20):  # connections and grants up (staged: the small transfers' round-trip connection and the streams)
        a.write(src, remote, 0, 0, length).wait()
    with peer.stalled():  # frozen first, so the kill surely lands mid-transfer
        handle = a.write(src, remote, 0, 0, BIG, notify=b"never")
        started = time.monotonic()
        peer.kill()
    with pytest.raises(BrokenResourceError):
        handle.wait()
    assert time.monotonic() - started < PROMPT_S
    assert handle.state is TransferState.FAILED and isinstance(handle.error, BrokenResourceError)


def test_transfers_to_a_dead_peer_fail_fast(make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess]) -> None:
    peer = make_peer()
    staged, ipc = make_agent(("staged",)), make_agent(("ipc",))
    remote = peer.register(1 << 20)
    sources = [(x, x.register(np.ones(1 << 20, np.uint8))) for x in (staged, ipc)]
    for x, src in sources:
        x.write(src, remote, 0, 0, 4096).wait()
    peer.kill()
    for x, src in sources:
        started = time.monotonic()
        for length in (4096, 1 << 20):  # the inline fast path and the posted one
            with pytest.raises((BrokenResourceError, UnavailableError)):
                x.write(src, remote, 0, 0, length).wait()
        assert time.monotonic() - started < PROMPT_S


def test_frozen_owner_times_out_and_the_pair_recovers(make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess]) -> None:
    peer = make_peer()
    a = make_agent(("staged",))
    remote = peer.register(64 << 20)
    src = a.register(np.full(64 << 20, 7, np.uint8))
    a.write(src, remote, 0, 0, 4096).wait()
    with peer.stalled():
        started = time.monotonic()
        handle = a.write(src, remote, 0, 0, 64 << 20, timeout=0.5)
        with pytest.raises(TimeoutError):
            handle.wait()
        assert time.monotonic() - started < 0.5 + PROMPT_S
    handle = a.write(src, remote, 0, 0, 64 << 20)
    try:
        handle.wait()
    except HMCError as exc:  # pragma: no cover - the message says what went wrong
        pytest.fail(f"pair did not recover: {exc}")
    assert peer.contents(remote.id) == src.numpy().tobytes()


def test_wait_stopped_returns_once_every_thread_stopped_and_never_waits_past_its_deadline() -> None:
    """The freeze every fault test relies on: a running process is a TimeoutError at the deadline, a stopped one
    (all of its threads) returns, and so does one that is gone."""
    code = "import threading, time\nfor _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\ntime.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="did not stop"):
            wait_stopped(child.pid, start + 0.05)
        assert time.monotonic() - start < 5.0
        os.kill(child.pid, signal.SIGSTOP)
        wait_stopped(child.pid, time.monotonic() + 10.0)
        states = [Path(f"/proc/{child.pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()[0] for task in os.listdir(f"/proc/{child.pid}/task")]
        assert states and all(state in ("T", "t") for state in states)
        os.kill(child.pid, signal.SIGCONT)
    finally:
        child.kill()
        child.wait(10)
    wait_stopped(child.pid, time.monotonic() + 1.0)  # gone: nothing to wait for


def test_unregistering_a_buffer_stops_this_agents_transfers_into_it(make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess]) -> None:
    """unregister() waited for peers writing into the memory, but not for the agent's own transfers: a read still
    coming from a frozen owner landed after unregister returned (and after the caller freed the memory, in memory it
    no longer owned). Now unregister cancels them first: their transports stop them, and nothing lands later."""
    peer = make_peer()
    a = make_agent(("staged",))  # its bytes come from the owner's process, frozen below
    remote = peer.register(BIG, fill=0x3C)
    sink = np.full(BIG, 0xA5, np.uint8)
    local = a.register(sink)
    for length in (4096, 4 << 20):  # connections and grants up first
        a.read(local, remote, 0, 0, length).wait()
    sink[:] = 0xA5
    with peer.stalled():  # the read cannot finish before the unregister
        handle = a.read(local, remote, 0, 0, BIG)
        a.unregister(local)
        assert handle.state is TransferState.CANCELLED
        ended = sink.copy()
    assert len(peer.contents(remote.id)) == BIG  # a round trip with the owner after it ran again: what was coming has come
    assert np.array_equal(sink, ended), "bytes of a transfer landed in a buffer after it was unregistered"
    assert (ended == 0xA5).any()  # cut short: the owner was frozen
    with pytest.raises(HMCError):
        handle.wait()
