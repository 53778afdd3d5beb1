"""Paths between ConnBuffers (local, ipc, staged; rdma and ucx to come), range lists and negotiation."""

from hmc.transport._base import Capabilities, PathName, TransferOp, Transport
from hmc.transport._negotiate import Endpoint, PathChoice, negotiate
from hmc.transport._ranges import RangeList

__all__ = ["Capabilities", "Endpoint", "PathChoice", "PathName", "RangeList", "TransferOp", "Transport", "negotiate"]
