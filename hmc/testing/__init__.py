"""Test support shipped with HMC: a loopback transport, a peer agent in another process,
and `check_transport()`, the conformance suite every path passes."""

from hmc.testing._check_transport import AgentOwner, BufferOwner, TransportPair, check_transport
from hmc.testing._loopback import LoopbackTransport
from hmc.agent._peer_process import PeerProcess, ranges_digest

__all__ = ["AgentOwner", "BufferOwner", "LoopbackTransport", "PeerProcess", "TransportPair", "check_transport", "ranges_digest"]
