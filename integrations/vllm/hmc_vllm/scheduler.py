"""HMCConnector's scheduler half: decides which requests load or hold KV blocks, and says so to the workers.

Prefill side (`do_remote_decode` in the request's kv_transfer_params): when the request finishes,
keep its blocks (lease), and return the parameters a decode instance needs: the block ids, the
workers' ConnBuffer descriptors and layouts, and the compatibility factors. Decode side
(`do_remote_prefill`): claim the prompt's tokens as loaded asynchronously, check compatibility,
and hand the workers a RecvTask once blocks are allocated. This half never moves a byte.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from vllm.v1.request import RequestStatus

from hmc_vllm.compat import engine_factors, refusal
from hmc_vllm.metadata import PARAMS_KEY, HMCConnectorMetadata, RecvTask, SendTask, WorkerHandshake

_log = logging.getLogger(__name__)


class HMCConnectorScheduler:
    """Per-engine bookkeeping between vLLM's scheduler and the workers' transfers."""

    def __init__(self, vllm_config: Any, engine_id: str, settings: Any) -> None:
        self.engine_id = engine_id
        self.settings = settings
        self.recompute_on_failure = vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
        self._factors = engine_factors(vllm_config)
        self._workers: dict[str, Any] = {}
        self._recvs: list[RecvTask] = []
        self._sends: list[SendTask] = []

    # -- handshake ------------------------------------------------------------------

    def set_handshakes(self, handshakes: Mapping[tuple[int, int], WorkerHandshake]) -> None:
        """Record every worker's buffers and layout; the layout's shape joins the compatibility factors."""
        for (pp_rank, tp_rank), handshake in handshakes.items():
            if pp_rank != 0:
                raise ValueError("HMCConnector moves KV caches of pipeline stage 0 only: run it with pipeline_parallel_size=1")
            self._workers[str(tp_rank)] = handshake.to_wire()
            self._factors["block_bytes"] = handshake.layout.block_bytes
            self._factors["segments"] = len(handshake.layout.segments)

    # -- decode side ----------------------------------------------------------------

    @staticmethod
    def _incoming(request: Any) -> Mapping[str, Any] | None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and isinstance(params.get(PARAMS_KEY), Mapping):
            return params
        return None

    def _refusal(self, params: Mapping[str, Any]) -> str | None:
        return refusal(self._factors, params[PARAMS_KEY].get("factors", {}))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """All prompt tokens not computed here arrive asynchronously from the prefill instance."""
        params = self._incoming(request)
        if params is None or (self.recompute_on_failure and self._refusal(params)):
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Queue the load for the workers (once per request), or the release when nothing is needed."""
        params = self._incoming(request)
        if params is None:
            return
        params["do_remote_prefill"] = False  # one transfer per request, even if called again
        reason = self._refusal(params)
        if reason is not None:
            _log.error("%s; request %s from engine %s", reason, request.request_id, params.get("remote_engine_id"))
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 and not (reason and self.recompute_on_failure) else []
        self._recvs.append(self._recv_task(request.request_id, params, local, reason))

    def _recv_task(self, request_id: str, params: Mapping[str, Any], local: list[int], reason: str | None) -> RecvTask:
        remote = list(params.get("remote_block_ids") or ())
        if len(local) > len(remote):
            reason = reason or f"HMCConnector: {len(local)} blocks to load but the prefill instance sent {len(remote)}"
        return RecvTask(
            request_id=request_id,
            remote_request_id=str(params.get("remote_request_id")),
            remote_engine_id=str(params.get("remote_engine_id")),
            remote_workers=params[PARAMS_KEY].get("workers", {}),
            local_blocks=tuple(local),
            remote_blocks=tuple(remote[len(remote) - len(local) :]) if local else (),
            deadline=time.time() + self.settings.load_timeout_s,
            refused=reason,
        )

    # -- prefill side ---------------------------------------------------------------

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: hold the blocks and return kv_transfer_params; decode: release a load that never started."""
        params = request.kv_transfer_params
        if not params:
            return False, None
        if self._incoming(request) is not None:  # aborted before its blocks were allocated
            params["do_remote_prefill"] = False
            self._recvs.append(self._recv_task(request.request_id, params, [], None))
            return False, None
        if not params.get("do_remote_decode") or request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        if not block_ids:
            return False, None
        if not self._workers:
            _log.error("HMCConnector: no worker handshake yet; request %s is not offered for transfer", request.request_id)
            return False, None
        expiry = time.time() + self.settings.lease_s
        self._sends.append(SendTask(request.request_id, tuple(block_ids), expiry))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids),
            "remote_num_tokens": request.num_computed_tokens,
            "remote_lease_expiry": expiry,
            PARAMS_KEY: {"factors": self._factors, "workers": self._workers},
        }

    # -- per step -------------------------------------------------------------------

    def build_connector_meta(self) -> HMCConnectorMetadata:
        """This step's loads and holds, handed to every worker; the queues start empty again."""
        meta = HMCConnectorMetadata(recvs=self._recvs, sends=self._sends)
        self._recvs, self._sends = [], []
        return meta
