"""The in-process data plane: the agent, its ConnBuffers, transfer handles and notifications."""

from hmc.agent._agent import Agent
from hmc.agent._buffers import ConnBuffer
from hmc.agent._transfer import Notification, TransferHandle, TransferState

__all__ = ["Agent", "ConnBuffer", "Notification", "TransferHandle", "TransferState"]
