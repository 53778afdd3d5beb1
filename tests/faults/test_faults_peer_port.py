"""Issue 9, scenario 4: the agent's peer port admits only peers holding a key, and survives those who do not.

An attacker in another process opens hundreds of connections that send nothing, or announce 64 MiB
frames, against an agent whose process may open few file descriptors; another peer sends `Withdrawn`
for a third agent's buffer. The agent reserves nothing for them, its accept loop survives, and an
honest peer (a real agent in another process) keeps moving verified bytes during and after each attack.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from hmc.agent import Agent, ConnBuffer
from hmc.errors import AccessDeniedError
from hmc.testing import PeerProcess
from hmc.transport._handshake import accept_handshake
from hmc.transport._wire import FrameStream, error_reply
from hmc.v1 import common_pb2, peer_pb2

SIZE = 1 << 20
ATTACK = r"""
import socket, struct, sys
host, port, mode, count = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
held = []
for _ in range(count):
    try:
        s = socket.create_connection((host, port), timeout=5)
    except OSError:
        continue
    if mode == "flood":
        try:
            s.sendall(struct.pack("<I", 64 << 20) + b"\0" * 4096)
        except OSError:
            pass
    held.append(s)
print(len(held), flush=True)
sys.stdin.read()
"""


def _attack(agent: Agent, mode: str, count: int) -> subprocess.Popen[str]:
    """Start the attacker; returns once it has made its connections (it holds them until its stdin closes)."""
    attacker = subprocess.Popen(
        [sys.executable, "-c", ATTACK, "127.0.0.1", str(agent.info.endpoint.port), mode, str(count)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert attacker.stdout is not None
    assert int(attacker.stdout.readline()) > 0
    return attacker


def _stop(attacker: subprocess.Popen[str]) -> None:
    assert attacker.stdin is not None and attacker.stdout is not None
    attacker.stdin.close()
    attacker.wait(10)
    attacker.stdout.close()


def _honest_write(peer: PeerProcess, target: ConnBuffer, rng: np.random.Generator) -> None:
    """The honest peer writes random bytes into `target` (poisoned first); every byte is compared."""
    data = rng.integers(1, 255, SIZE, dtype=np.uint8)
    source = peer.register(SIZE)
    peer.fill(source.id, data.tobytes())
    target.numpy()[:] = 0xA5
    assert peer.transfer("write", source.id, target.descriptor, 0, 0, SIZE, timeout=20) == "staged"
    assert np.array_equal(target.numpy(), data)


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.fixture
def few_descriptors() -> Iterator[None]:
    """This process may open 256 descriptors (as a tight container would), for the test's duration."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_connections_that_send_nothing_cannot_exhaust_the_port(
    few_descriptors: None, make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess], rng: np.random.Generator
) -> None:
    victim = make_agent(("staged",))
    target = victim.register(np.full(SIZE, 0xA5, np.uint8))
    peer = make_peer(("staged",))
    attacker = _attack(victim, "idle", 700)  # more than this process has descriptors for
    try:
        _honest_write(peer, target, rng)  # during the attack
    finally:
        _stop(attacker)
    assert any(t.name == "hmc-peer-accept" and t.is_alive() for t in threading.enumerate())
    _honest_write(peer, target, rng)  # and after it


def test_a_flood_of_64_mib_frames_reserves_nothing(make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess], rng: np.random.Generator) -> None:
    victim = make_agent(("staged",))
    target = victim.register(np.full(SIZE, 0xA5, np.uint8))
    peer = make_peer(("staged",))
    _honest_write(peer, target, rng)  # connections and caches up before measuring
    rss, threads = _rss_bytes(), threading.active_count()
    flood, idle = _attack(victim, "flood", 16), _attack(victim, "idle", 200)
    try:
        _honest_write(peer, target, rng)
        grown = _rss_bytes() - rss
        assert grown < 64 << 20, f"the flood made the agent reserve {grown >> 20} MiB"
        assert threading.active_count() - threads <= victim._server.max_connections
    finally:
        _stop(flood)
        _stop(idle)
    _honest_write(peer, target, rng)


def test_withdrawn_is_accepted_only_from_the_buffers_owner(make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess], rng: np.random.Generator) -> None:
    """A rogue listener that the victim talks to withdraws a third agent's buffer: refused, the buffer stays usable."""
    victim = make_agent(("ipc",))
    owner = make_peer(("ipc",))
    third = owner.register(SIZE)
    local = victim.register(rng.integers(1, 255, SIZE, dtype=np.uint8))
    victim.write(local, third, 0, 0, SIZE).wait()  # the victim opened the third agent's buffer

    answers: list[BaseException | None] = []
    listener = __import__("socket").create_server(("127.0.0.1", 0))
    rogue_info = common_pb2.AgentInfo(id="rogue", host_id=third.owner.host_id, pid=third.owner.pid)

    def rogue() -> None:
        sock, _ = listener.accept()
        stream = FrameStream(sock, "victim")
        accept_handshake(stream, rogue_info, time.monotonic() + 5, lambda s, a: None)
        opened = stream.recv(time.monotonic() + 5)
        stream.send(peer_pb2.PeerFrame(request_id=opened.request_id, reply=error_reply(AccessDeniedError("no"))))
        stream.send(peer_pb2.PeerFrame(request_id=77, withdrawn=peer_pb2.Withdrawn(buffer_id=third.id)))
        reply = stream.recv(time.monotonic() + 5).reply
        answers.append(AccessDeniedError(reply.error.message) if reply.error.code == common_pb2.ERROR_CODE_ACCESS_DENIED else None)
        stream.close()

    thread = threading.Thread(target=rogue, name="rogue-listener")
    thread.start()
    fake = common_pb2.BufferDescriptor()
    fake.CopyFrom(third)
    fake.id, fake.owner.id = "rogue-buffer", "rogue"
    fake.owner.endpoint.port = listener.getsockname()[1]
    with pytest.raises(AccessDeniedError):
        victim.write(local, fake, 0, 0, 4096, path="ipc").wait()
    thread.join(10)
    listener.close()
    assert answers and isinstance(answers[0], AccessDeniedError), "the spoofed Withdrawn was not refused"
    data = rng.integers(1, 255, SIZE, dtype=np.uint8)
    local.numpy()[:] = data
    owner.poison(third.id, 0xA5)
    victim.write(local, third, 0, 0, SIZE).wait()  # still served: the spoof changed nothing
    assert owner.contents(third.id) == data.tobytes()


def test_running_out_of_descriptors_sheds_connections_and_the_port_recovers(
    few_descriptors: None, make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess], rng: np.random.Generator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Descriptors run out below the connection bound (the process holds them elsewhere): accept fails with EMFILE,
    the agent sheds the connection it cannot serve and goes on; once the attacker leaves, honest peers are served."""
    victim = make_agent(("staged",))
    target = victim.register(np.full(SIZE, 0xA5, np.uint8))
    peer = make_peer(("staged",))
    _honest_write(peer, target, rng)
    held: list[int] = []
    try:
        while True:  # leave this process a handful of descriptors
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        for _ in range(12):
            os.close(held.pop())
    try:
        with caplog.at_level("WARNING", logger="hmc.agent._server"):
            attacker = _attack(victim, "idle", 200)
            try:
                assert any("shedding a connection" in record.getMessage() for record in caplog.records), "EMFILE never hit"
                assert any(t.name == "hmc-peer-accept" and t.is_alive() for t in threading.enumerate())
            finally:
                _stop(attacker)
    finally:
        for fd in held:
            os.close(fd)
    _honest_write(peer, target, rng)
