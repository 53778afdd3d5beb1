"""The negative control: an HMCConnector whose prefill side replaces each block with random
normal values (the model's dtype is float32 here) just before pushing it.

Loaded by vLLM through `kv_connector_module_path="_corrupt_connector"` (the tests put this folder on
PYTHONPATH). If decode output stays the same with these blocks, the decode side is not using them.
"""

from __future__ import annotations

from typing import Any

import torch

from hmc_vllm import connector
from hmc_vllm.metadata import SendTask
from hmc_vllm.worker import HMCConnectorWorker


class _ScramblingWorker(HMCConnectorWorker):
    def before_push(self, send: SendTask, block_ids: list[int]) -> None:
        assert self.layout is not None
        generator = torch.Generator().manual_seed(1234)
        for buffer, offset, stride in self.layout.segments:
            for block in block_ids:
                start = offset + block * stride
                values = self.kv_bytes[buffer][start : start + self.layout.block_bytes].view(torch.float32)
                values.copy_(torch.randn(values.numel(), generator=generator))


class HMCConnector(connector.HMCConnector):
    def make_worker(self, engine_id: str, tp_rank: int, num_blocks: int, settings: Any) -> HMCConnectorWorker:
        return _ScramblingWorker(engine_id, tp_rank, num_blocks, settings)
