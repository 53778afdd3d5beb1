"""The fault suite: real processes, real sockets, nodes as network namespaces where root is available.

Fixtures shared by every fault test live in tests/conftest.py (agents, peer processes, random bytes);
what only fault tests need lives here: `two_nodes`, two network namespaces joined by a veth pair whose
link a test takes down and up, each able to run `_node.py` agents (see nodes.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from faults.nodes import TwoNodes, netns_unavailable


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[TwoNodes]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    nodes = TwoNodes(tmp_path)
    try:
        yield nodes
    finally:
        nodes.close()


