"""What both halves of an HMCConnector worker share: the agent, its KV buffers, and the results vLLM collects.

The prefill side (hmc_vllm.prefill) and the decode side (hmc_vllm.decode) are mixins over this state;
hmc_vllm.worker joins them and runs the connector thread that drives both.
Concurrency: everything here belongs to the connector thread ("hmc-connector"), except the four result
sets, which the engine's thread takes each step under `_lock`.
"""

from __future__ import annotations

import threading
from typing import Any

import hmc
from hmc_vllm.layout import KVLayout
from hmc_vllm.metadata import WorkerHandshake
from hmc_vllm.stats import TransferRecorder


class WorkerSide:
    """One worker's agent, registered KV buffers, and the results it leaves for vLLM."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.agent: hmc.Agent | None = None
        self.buffers: list[hmc.ConnBuffer] = []
        self.layout: KVLayout | None = None
        self._handshake: WorkerHandshake | None = None
        self._lock = threading.Lock()  # guards the four result sets below, shared with the engine's thread
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._bad_blocks: set[int] = set()
        self.stats = TransferRecorder()  # taken by vLLM every step (HMCConnector.get_kv_connector_stats)

    def _message(self, remote: hmc.BufferDescriptor, payload: bytes) -> hmc.TransferHandle:
        """A notification to the peer that owns `remote`, riding on an empty transfer."""
        assert self.agent is not None
        return self.agent.write(self.buffers[0], remote, [], [], [], notify=payload, timeout=self.settings.message_timeout_s)
