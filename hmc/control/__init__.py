"""The control plane: hmcd (the per-node daemon), the agent's link to it, and `hmc.Client`.

    Client          synchronous client of hmcd (inventory, buffers, paths, transfers, events)
    EventStream     the iterator Client.events() returns
    NodeHealth      what Client.health() returns (grpc.health.v1 status and node name)
    DaemonLink      an agent's registration stream to its local hmcd
    Daemon          hmcd itself, to embed in a process or a test (`hmcd` runs it standalone)
"""

from __future__ import annotations

from hmc.control._agent_link import DaemonLink
from hmc.control._client import Client, EventStream, NodeHealth
from hmc.control._hmcd import Daemon

__all__ = ["Client", "Daemon", "DaemonLink", "EventStream", "NodeHealth"]
