"""The local path (same agent) and the loopback test transport pass the conformance suite."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from hmc.agent import Agent
from hmc.agent._buffers import BufferTable
from hmc.config import Config
from hmc.testing import AgentOwner, LoopbackTransport, TransportPair, check_transport


def test_local_path_conforms(config: Config) -> None:
    @contextlib.contextmanager
    def pair() -> Iterator[TransportPair]:
        with Agent(config, daemon=False) as a:
            yield TransportPair(a, AgentOwner(a), "local")

    check_transport(pair)


def test_loopback_transport_conforms(config: Config) -> None:
    @contextlib.contextmanager
    def pair() -> Iterator[TransportPair]:
        fabric = BufferTable()
        with Agent(config, daemon=False, transports=[LoopbackTransport(fabric)]) as a, Agent(config, daemon=False, transports=[LoopbackTransport(fabric)]) as b:
            yield TransportPair(a, AgentOwner(b), "ipc")

    check_transport(pair)


def test_local_copies_within_one_buffer_and_coalesces(agent: Agent, rng: np.random.Generator) -> None:
    data = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    buffer = agent.register(data.copy())
    starts = np.arange(0, 8192, 512)
    handle = agent.write(buffer, buffer, starts, starts + 32768, 512)
    handle.wait()
    expected = data.copy()
    expected[32768 : 32768 + 8192] = data[:8192]
    assert np.array_equal(buffer.numpy(), expected)
    assert handle.bytes_total == handle.bytes_done == 8192 and handle.path == "local"


def test_second_single_range_write_takes_the_inline_route(agent: Agent, rng: np.random.Generator) -> None:
    src = agent.register(rng.integers(0, 256, 8192, dtype=np.uint8))
    dst = agent.register(np.zeros(8192, np.uint8))
    agent.write(src, dst, 0, 0, 4096).wait()
    assert dst.id in src.inline_routes
    handle = agent.write(src, dst.descriptor, 4096, 4096, 4096)
    assert handle.done() and handle.path == "local"
    handle.wait()
    assert np.array_equal(dst.numpy(), src.numpy())
