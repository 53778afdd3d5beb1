"""Issue 9, scenario 6: errors say what happened (a dead owner is gone, not "withdrawn")."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from hmc.agent import Agent
from hmc.errors import BrokenResourceError, BufferWithdrawnError
from hmc.testing import PeerProcess

SIZE = 1 << 20


@pytest.mark.parametrize("length", [4096, SIZE], ids=["fast-path", "posted"])
def test_a_dead_ipc_owner_is_reported_as_gone_not_as_withdrawn(
    make_agent: Callable[..., Agent], make_peer: Callable[..., PeerProcess], rng: np.random.Generator, length: int
) -> None:
    peer = make_peer(("ipc",))
    agent = make_agent(("ipc",))
    remote = peer.register(SIZE)
    src = agent.register(rng.integers(1, 255, SIZE, dtype=np.uint8))
    agent.write(src, remote, 0, 0, length).wait()  # grant, mapping and fast path in place
    peer.kill()
    for _ in range(2):  # before and after the agent noticed the owner's control channel break
        with pytest.raises(BrokenResourceError) as caught:
            agent.write(src, remote, 0, 0, length).wait()
        assert not isinstance(caught.value, BufferWithdrawnError)
