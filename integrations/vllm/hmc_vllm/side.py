"""What both halves of an HMCConnector worker share: the agent, its KV buffers, and the results vLLM collects.

The prefill side (hmc_vllm.prefill) and the decode side (hmc_vllm.decode) are mixins over this state;
hmc_vllm.worker joins them and runs the connector thread that drives both.
Concurrency: everything here belongs to the connector thread ("hmc-connector"), except the four result
sets, which the engine's thread takes each step under `_lock`. The connector thread never writes to a peer
itself (a write to a new peer blocks until it answers): every message and push goes through `outbox`.
"""

from __future__ import annotations

import threading
from typing import Any

import hmc
from hmc_vllm.layout import KVLayout
from hmc_vllm.metadata import WorkerHandshake
from hmc_vllm.outbox import Outbox, Outgoing, peer_key
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
        self.outbox = Outbox()

    def _message(self, remote: hmc.BufferDescriptor, payload: bytes, what: str) -> Outgoing:
        """A notification to the peer that owns `remote`, riding on an empty transfer, sent by that peer's sender."""
        agent, local, timeout = self.agent, self.buffers[0], self.settings.message_timeout_s
        assert agent is not None

        def send(out: Outgoing, issued: list[hmc.TransferHandle]) -> None:
            issued.append(agent.write(local, remote, [], [], [], notify=payload, timeout=timeout))

        return self.outbox.post(peer_key(remote), send, what)
