"""HMCConnector: vLLM's KVConnectorBase_V1 as a thin facade over the scheduler and worker halves.

vLLM builds the class twice, once per role; each instance holds one half and only delegates.
Configure through `kv_connector_extra_config`:
  mode            "push" (default: the prefill instance writes into the decode instance's blocks), "pull",
                  or "hmcd" (KV-cache migration: hmcd has the prefill instance's agent write the blocks;
                  both instances' agents must be attached to hmcd, see HMC_SOCKET)
  lease_s         how long a prefill instance holds a finished request's blocks for the decode side (30)
  load_timeout_s  how long a decode instance waits for a request's blocks before failing the load (lease_s)
HMC itself is configured as always (hmc.Config: HMC_* variables or the TOML file); with an hmcd on the
node, the KV buffers are visible there as `vllm/<engine_id>/tp<rank>/kv<i>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from hmc_vllm.metadata import HMCConnectorMetadata, WorkerHandshake
from hmc_vllm.scheduler import HMCConnectorScheduler
from hmc_vllm.stats import HMCKVConnectorStats, HMCPromMetrics
from hmc_vllm.worker import HMCConnectorWorker


#: How blocks move: the prefill side writes them, the decode side reads them, or hmcd has them written.
MODES = ("push", "pull", "hmcd")


@dataclass(frozen=True)
class ConnectorSettings:
    """HMCConnector's options, read once from kv_connector_extra_config."""

    mode: str = "push"
    lease_s: float = 30.0
    load_timeout_s: float = 30.0
    message_timeout_s: float = 10.0
    poll_s: float = 0.002

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        mode = str(extra.get("mode", "push"))
        if mode not in MODES:
            raise ValueError(f"HMCConnector mode must be one of {', '.join(map(repr, MODES))}, not {mode!r}")
        lease = float(extra.get("lease_s", cls.lease_s))
        return cls(mode=mode, lease_s=lease, load_timeout_s=float(extra.get("load_timeout_s", lease)))


class HMCConnector(KVConnectorBase_V1):
    """KV-cache transfer between vLLM instances over HMC (push by default, pull on request)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        settings = ConnectorSettings.from_extra(transfer.kv_connector_extra_config or {})
        engine_id = str(transfer.engine_id)
        self.connector_scheduler: HMCConnectorScheduler | None = None
        self.connector_worker: HMCConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = HMCConnectorScheduler(vllm_config, engine_id, settings)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.connector_worker = self.make_worker(engine_id, get_tensor_model_parallel_rank(), kv_cache_config.num_blocks, settings)

    def make_worker(self, engine_id: str, tp_rank: int, num_blocks: int, settings: ConnectorSettings) -> HMCConnectorWorker:
        """The worker half (a subclass may return its own, as the tests' negative control does)."""
        return HMCConnectorWorker(engine_id, tp_rank, num_blocks, settings)

    def _scheduler(self) -> HMCConnectorScheduler:
        assert self.connector_scheduler is not None, "scheduler hook called on a worker-side HMCConnector"
        return self.connector_scheduler

    def _worker(self) -> HMCConnectorWorker:
        assert self.connector_worker is not None, "worker hook called on a scheduler-side HMCConnector"
        return self.connector_worker

    # -- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta()

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._scheduler().set_handshakes({(0, tp): m for tp, m in metadata.items() if isinstance(m, WorkerHandshake)})

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        self._scheduler().set_handshakes({rank: m for rank, m in metadata.items() if isinstance(m, WorkerHandshake)})

    # -- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker().handshake()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Hand the step's holds and loads to the connector thread now, before the forward runs.

        vLLM calls `start_load_kv` only after the forward for asynchronous loads; a prefill instance
        would then learn which blocks it holds (and a decode instance which to ask for) a forward late.
        """
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, HMCConnectorMetadata)
        self._worker().submit(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Loads started when the step's metadata was bound (`bind_connector_metadata`)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are per request, not per layer: nothing to wait for here."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Blocks are pushed whole once the request finishes, not per layer."""

    def wait_for_save(self) -> None:
        """Pushes run asynchronously and hold their blocks until reported in finished_sending."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker().get_transfer_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.close()

    # -- metrics: vLLM's KVConnectorStats -------------------------------------------

    def get_kv_connector_stats(self) -> HMCKVConnectorStats | None:
        """The worker's transfers since vLLM last asked (every step); the scheduler half records none."""
        return self.connector_worker.stats.take() if self.connector_worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HMCKVConnectorStats:
        """Stats from their wire form (`to_dict`, in vLLM's front end), or empty ones."""
        return HMCKVConnectorStats() if data is None else HMCKVConnectorStats.from_dict(data)

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: dict[type[Any], type[Any]], labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
    ) -> HMCPromMetrics:
        """HMC's /metrics series (vllm:hmc_*), registered by vLLM's Prometheus logger in the front end."""
        return HMCPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
