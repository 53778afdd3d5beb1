"""The in-process data plane: the agent, its ConnBuffers, prepared transfers, transfer handles and notifications."""

from hmc.agent._agent import Agent
from hmc.agent._buffers import ConnBuffer
from hmc.agent._events import AgentEvent, AgentEventKind
from hmc.agent._prepared import PreparedTransfer
from hmc.agent._transfer import Notification, TransferHandle, TransferState

__all__ = ["Agent", "AgentEvent", "AgentEventKind", "ConnBuffer", "Notification", "PreparedTransfer", "TransferHandle", "TransferState"]
