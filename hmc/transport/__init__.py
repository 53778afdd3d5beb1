"""Paths between ConnBuffers (local, ipc, staged; rdma and ucx to come), range lists and negotiation.

Transport authors implement `Transport` (declare `Capabilities`, complete each
`TransferRequest` through its `Completion`, optionally offer an `InlineCopy`)
and run `hmc.testing.check_transport()` against it.
"""

from hmc.transport._base import Capabilities, Completion, InlineCopy, PathName, TransferOp, TransferRequest, Transport
from hmc.transport._negotiate import Endpoint, PathChoice, negotiate
from hmc.transport._ranges import RangeList

__all__ = [
    "Capabilities",
    "Completion",
    "Endpoint",
    "InlineCopy",
    "PathChoice",
    "PathName",
    "RangeList",
    "TransferOp",
    "TransferRequest",
    "Transport",
    "negotiate",
]
