"""HMC: move GPU and host memory between processes, GPUs and nodes, whatever the vendor.

The public API, grouped:

- data plane: `Agent`, `AgentEvent`, `AgentEventKind`, `ConnBuffer`, `PreparedTransfer`, `TransferHandle`, `TransferState`, `Notification`
- descriptors and paths: `BufferDescriptor`, `PathName`, `PathChoice`, `RangeList`
- control plane: `Client`
- configuration: `Config`, `PathPolicy`
- modules: `hmc.memory` (the Memory API), `hmc.errors` (the exception tree), `hmc.testing`
"""

from hmc import errors, memory
from hmc.agent import Agent, AgentEvent, AgentEventKind, ConnBuffer, Notification, PreparedTransfer, TransferHandle, TransferState
from hmc.config import Config, PathPolicy
from hmc.control import Client
from hmc.errors import HMCError
from hmc.transport import PathChoice, PathName, RangeList
from hmc.v1.common_pb2 import BufferDescriptor

__version__ = "0.1.0"

__all__ = [
    # data plane
    "Agent",
    "AgentEvent",
    "AgentEventKind",
    "ConnBuffer",
    "Notification",
    "PreparedTransfer",
    "TransferHandle",
    "TransferState",
    # descriptors and paths
    "BufferDescriptor",
    "PathChoice",
    "PathName",
    "RangeList",
    # control plane
    "Client",
    # configuration
    "Config",
    "PathPolicy",
    # errors and modules
    "HMCError",
    "errors",
    "memory",
    "__version__",
]
