"""Test support shipped with HMC: a loopback transport, a peer agent in another process,
`check_transport()` (the conformance suite every path passes), real hmcd and etcd
processes, and several namespaced nodes on one machine (`NetnsCluster`)."""

from hmc.testing._check_transport import AgentOwner, BufferOwner, TransportPair, check_transport
from hmc.testing._loopback import LoopbackTransport
from hmc.agent._peer_process import PeerProcess, ranges_digest
from hmc.testing._etcd import EtcdServer, etcd_available
from hmc.testing._hmcd import HmcdProcess
from hmc.testing._netns import NetnsCluster, NetnsNode, netns_available
from hmc.testing._tls import make_certificates

__all__ = [
    "AgentOwner",
    "BufferOwner",
    "EtcdServer",
    "HmcdProcess",
    "LoopbackTransport",
    "NetnsCluster",
    "NetnsNode",
    "PeerProcess",
    "TransportPair",
    "check_transport",
    "etcd_available",
    "make_certificates",
    "netns_available",
    "ranges_digest",
]
