"""HMCConnector's scheduler half: decides which requests load or hold KV blocks, and says so to the workers.

Prefill side (`do_remote_decode` in the request's kv_transfer_params): when the request finishes,
keep its blocks (lease) for `hmc_loads` decode loads, and return the parameters a decode instance
needs: the block ids, the digest of the prompt they hold, the workers' ConnBuffer descriptors and
layouts, and the compatibility factors. A request carrying `hmc_release` frees the blocks of the offer
it names. Decode side (`do_remote_prefill`): each request takes the offer for its own prompt (by
digest; a batch offers one per prompt, each for `loads` sub-requests), claims the prompt's tokens as
loaded asynchronously, and hands the workers a RecvTask once blocks are allocated. A request whose
prompt has no offer, or whose offer comes from an incompatible instance, is refused as a load error
(so kv_load_failure_policy applies) and the offer is released at once. This half never moves a byte.

Concurrency: vLLM calls every method from the engine core's scheduler thread.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.v1.request import RequestStatus

from hmc.errors import ProtocolError
from hmc_vllm.compat import engine_factors, refusal
from hmc_vllm.identity import prompt_digest
from hmc_vllm.bodies import BATCH_KEY, LOADS_KEY, RELEASE_KEY
from hmc_vllm.metadata import (
    MAX_LOADS,
    PARAMS_KEY,
    HMCConnectorMetadata,
    Offer,
    RecvTask,
    SendTask,
    WorkerHandshake,
    offers,
)

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Match:
    """What a decode request loads: its offer (None: nothing to release either) and why not, if refused."""

    offer: Offer | None
    prompt: str
    refused: str | None = None
    release_all: bool = False


def match_offer(candidates: list[Offer], prompt: str, taken: Mapping[tuple[str, str], int]) -> tuple[Offer | None, str | None]:
    """The first offer for `prompt` with a load left (given `taken` loads per offer), else why there is none."""
    mine = [o for o in candidates if o.prompt == prompt]
    for offer in mine:
        if taken.get(offer.key, 0) < offer.loads:
            return offer, None
    if mine:  # nothing is released: the offers belong to the sub-requests that took them
        return None, (
            f"HMCConnector: the KV offered for this prompt serves {sum(o.loads for o in mine)} load(s), all taken "
            f"(a request with n > 1 needs {LOADS_KEY} = n in its prefill request)"
        )
    offered = ", ".join(o.prompt[:12] for o in candidates)
    return None, f"HMCConnector: the KV offered is for another prompt (this prompt's digest {prompt[:12]}, offered {offered})"


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
        self._releases: list[str] = []
        self._matched: dict[str, _Match] = {}  # decode: request id -> its offer, from first look to allocation
        self._taken: OrderedDict[tuple[str, str], int] = OrderedDict()  # decode: loads claimed per offer
        self._taken_until: dict[tuple[str, str], float] = {}  # when a claim count may be forgotten

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

    def _match(self, request: Any) -> _Match | None:
        """The offer `request` loads from, claimed on first look; None when it asks for no remote prefill."""
        known = self._matched.get(request.request_id)
        if known is not None:
            return known
        params = request.kv_transfer_params
        try:
            candidates = offers(params)
        except ProtocolError as exc:
            known = _Match(None, "", str(exc))
        else:
            if not candidates:
                return None
            prompt = prompt_digest(request.prompt_token_ids) if request.prompt_token_ids is not None else ""
            offer, reason = match_offer(candidates, prompt, self._taken)
            if not prompt:
                known = _Match(None, prompt, "HMCConnector: a request without prompt token ids (prompt embeddings) cannot load KV")
            elif offer is None:  # a lone offer for another prompt is released: nobody else may take it
                lone = len(candidates) == 1 and BATCH_KEY not in params and candidates[0].prompt != prompt
                known = _Match(candidates[0] if lone else None, prompt, reason, release_all=True)
            else:
                self._claim(offer)
                known = _Match(offer, prompt, refusal(self._factors, offer.factors))
        self._matched[request.request_id] = known
        return known

    def _claim(self, offer: Offer) -> None:
        now = time.time()
        while self._taken and self._taken_until[next(iter(self._taken))] <= now:
            self._taken_until.pop(self._taken.popitem(last=False)[0])
        self._taken[offer.key] = self._taken.get(offer.key, 0) + 1
        self._taken_until[offer.key] = now + self.settings.lease_s + self.settings.load_timeout_s

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """All prompt tokens not computed here arrive asynchronously from the prefill instance."""
        match = self._match(request)
        if match is None or (match.refused and self.recompute_on_failure):
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Queue the load for the workers (once per request), or the release when nothing is loaded."""
        match = self._match(request)
        if match is None:
            return
        self._settle(request, match)
        load = num_external_tokens > 0 and not (match.refused and self.recompute_on_failure)
        self._queue_recv(request.request_id, match, blocks.get_unhashed_block_ids() if load else [])

    def _settle(self, request: Any, match: _Match) -> None:
        """The request's transfer is decided: never again (vLLM may call update_state_after_alloc twice)."""
        self._matched.pop(request.request_id, None)
        request.kv_transfer_params["do_remote_prefill"] = False
        if match.refused:
            _log.error("%s; request %s", match.refused, request.request_id)

    def _queue_recv(self, request_id: str, match: _Match, local: list[int]) -> None:
        offer, reason = match.offer, match.refused
        if offer is None:
            if local:  # nothing to load from and nobody to tell: the load fails at once
                self._recvs.append(RecvTask(request_id, "", "", {}, tuple(local), (), time.time(), match.prompt, reason or "HMCConnector: no offer"))
            return
        remote = list(offer.block_ids)
        if len(local) > len(remote):
            reason = reason or f"HMCConnector: {len(local)} blocks to load but the prefill instance sent {len(remote)}"
        self._recvs.append(
            RecvTask(
                request_id=request_id,
                remote_request_id=offer.request_id,
                remote_engine_id=offer.engine_id,
                remote_workers=offer.workers,
                local_blocks=tuple(local),
                remote_blocks=tuple(remote[len(remote) - len(local) :]) if local else (),
                deadline=min(time.time() + self.settings.load_timeout_s, offer.expiry or float("inf")),
                prompt=match.prompt,
                refused=reason,
                release_all=match.release_all,
            )
        )

    # -- prefill side ---------------------------------------------------------------

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: hold the blocks and return kv_transfer_params; decode: release a load that never started."""
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get(RELEASE_KEY):
            if str(params.get("remote_engine_id")) == self.engine_id:
                self._releases.append(str(params.get("remote_request_id")))
            return False, None
        match = self._match(request)
        if match is not None:  # finished or aborted before its blocks were allocated
            self._settle(request, match)
            self._release_unstarted(request, match)
            return False, None
        if not params.get("do_remote_decode") or request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        if not block_ids or request.prompt_token_ids is None:  # no token ids (prompt embeddings): no identity to offer
            return False, None
        if not self._workers:
            _log.error("HMCConnector: no worker handshake yet; request %s is not offered for transfer", request.request_id)
            return False, None
        loads = params.get(LOADS_KEY, 1)
        if type(loads) is not int or not 1 <= loads <= MAX_LOADS:
            _log.error("HMCConnector: %s must be an integer in 1..%d, not %r; request %s is not offered", LOADS_KEY, MAX_LOADS, loads, request.request_id)
            return False, None
        prompt = prompt_digest(request.prompt_token_ids)
        expiry = time.time() + self.settings.lease_s
        self._sends.append(SendTask(request.request_id, tuple(block_ids), expiry, prompt, loads))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids),
            "remote_num_tokens": request.num_computed_tokens,
            "remote_lease_expiry": expiry,
            PARAMS_KEY: {"factors": self._factors, "workers": self._workers, "prompt": prompt, "tokens": len(request.prompt_token_ids), "loads": loads},
        }

    def _release_unstarted(self, request: Any, match: _Match) -> None:
        """Free what a decode request that never loaded held at the prefill instance.

        Its own offer gives back one load; a request matching none of a batch's offers (vLLM's stand-in
        for a request refused before it reached the engine) releases every offer of the batch.
        """
        if match.offer is not None:
            self._queue_recv(request.request_id, match, [])
            return
        try:
            batch = offers(request.kv_transfer_params | {"do_remote_prefill": True})
        except ProtocolError:
            return
        for offer in batch:
            self._queue_recv(request.request_id, _Match(offer, match.prompt, match.refused, release_all=True), [])

    # -- per step -------------------------------------------------------------------

    def build_connector_meta(self) -> HMCConnectorMetadata:
        """This step's loads, holds and releases, handed to every worker; the queues start empty again."""
        meta = HMCConnectorMetadata(recvs=self._recvs, sends=self._sends, releases=self._releases)
        self._recvs, self._sends, self._releases = [], [], []
        return meta
