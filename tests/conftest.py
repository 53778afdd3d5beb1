"""Shared fixtures: embedded agents, real peer agents in other processes, random bytes.

Every agent here runs embedded (its hmcd socket points into tmp_path, where no hmcd
listens) unless a test says otherwise. Peer processes are `hmc.testing.PeerProcess`
(multiprocessing "spawn"); hmcd tests can build them with `daemon=True`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from hmc.agent import Agent
from hmc.config import Config, PathPolicy
from hmc.testing import PeerProcess

POISON = 0xA5


@pytest.fixture
def config(tmp_path: Path) -> Config:
    """An embedded-mode config with short deadlines."""
    return Config(socket=str(tmp_path / "no-hmcd.sock"), timeout_s=10.0)


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """Random bytes, seeded per test (never zeros: tests must see every byte move)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def agent(config: Config) -> Iterator[Agent]:
    with Agent(config, daemon=False) as a:
        yield a


@pytest.fixture
def make_agent(config: Config) -> Iterator[Callable[..., Agent]]:
    """Build more agents (`paths=("staged",)` restricts negotiation); all closed at teardown."""
    made: list[Agent] = []

    def make(paths: tuple[str, ...] | None = None, **changes: object) -> Agent:
        if paths is not None:
            changes["policy"] = PathPolicy(allow=paths)
        made.append(Agent(config.replace(**changes), daemon=False))
        return made[-1]

    yield make
    for a in made:
        a.close()


@pytest.fixture
def make_peer(config: Config) -> Iterator[Callable[..., PeerProcess]]:
    """Start real peer agents in other processes; all stopped at teardown."""
    started: list[PeerProcess] = []

    def make(paths: tuple[str, ...] | None = None, *, daemon: bool | None = False, **changes: object) -> PeerProcess:
        if paths is not None:
            changes["policy"] = PathPolicy(allow=paths)
        started.append(PeerProcess(config.replace(**changes), daemon=daemon))
        return started[-1]

    yield make
    for peer in started:
        peer.close()


@pytest.fixture
def peer(make_peer: Callable[..., PeerProcess]) -> PeerProcess:
    return make_peer()


@pytest.fixture
def peer_buffer(peer: PeerProcess) -> bytes:
    """A 1 MiB poisoned ConnBuffer in a peer process, as the serialized descriptor users exchange."""
    return peer.register(1 << 20, fill=POISON).SerializeToString()
