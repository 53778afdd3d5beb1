"""The front end's check of kv_transfer_params, before a request reaches the engine: refusals a client can read.

vLLM's API server answers a request that fails inside the engine with "Internal server error"; why
(which compatibility factor differs, or that the KV offered is another prompt's) would only reach the
decode instance's log. The API server process knows the prompt's token ids and every compatibility
factor but the two a worker measures, so HMCConnector runs the same checks there first, around
`InputProcessor.process_inputs` (vLLM 0.32; installed by the plugin in every process, active only where
HMCConnector is configured). A refusal raises one of vLLM's own HTTP errors, whose message is the body's:
  409  the offer comes from an incompatible instance ("incompatible KV caches (block_size: peer 64, here 32)")
  400  the offer is for another prompt, malformed, or `hmc_loads` is not an integer in 1..1024
       (another prompt under kv_load_failure_policy "recompute" is let through: the engine recomputes)
  202  a release (`hmc_release`): the proxy freeing the blocks of a prefill reply it abandons
vLLM then hands the refused request to the engine as aborted (`notify_kv_transfer_request_rejected`),
and the scheduler half releases the offered blocks at once (`HMCConnectorScheduler.request_finished`).
The engine's scheduler half checks again: this module only moves the refusal to where it can be read.

Concurrency: `process_inputs` runs on the API server's renderer threads; the local factors are
computed once per InputProcessor under a lock.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any

from hmc.errors import ProtocolError
from hmc_vllm.compat import engine_factors, refusal
from hmc_vllm.identity import prompt_digest
from hmc_vllm.bodies import LOADS_KEY, RELEASE_KEY
from hmc_vllm.metadata import MAX_LOADS, offers
from hmc_vllm.plugin import CONNECTOR_NAMES

_lock = threading.Lock()


def check(processor: Any, request: Any) -> None:
    """Raise vLLM's HTTP error for a request HMCConnector would refuse (a no-op for every other request)."""
    from vllm.exceptions import GracefulHTTPError, VLLMValidationError

    sampling = getattr(request, "sampling_params", None)
    params = (getattr(sampling, "extra_args", None) or {}).get("kv_transfer_params")
    if not isinstance(params, Mapping):
        return
    if params.get(RELEASE_KEY):
        raise GracefulHTTPError(f"HMCConnector: the blocks of request {params.get('remote_request_id')} are released", HTTPStatus.ACCEPTED)
    loads = params.get(LOADS_KEY, 1)
    if params.get("do_remote_decode") and (type(loads) is not int or not 1 <= loads <= MAX_LOADS):
        raise VLLMValidationError(f"HMCConnector: {LOADS_KEY} must be an integer in 1..{MAX_LOADS}, not {loads!r}", parameter="kv_transfer_params")
    try:
        candidates = offers(params)
    except ProtocolError as exc:
        raise VLLMValidationError(str(exc), parameter="kv_transfer_params") from exc
    if not candidates or request.prompt_token_ids is None:
        return
    prompt = prompt_digest(request.prompt_token_ids)
    mine = [offer for offer in candidates if offer.prompt == prompt]
    for offer in mine:
        reason = refusal(_factors(processor), offer.factors)
        if reason is not None:
            raise GracefulHTTPError(reason, HTTPStatus.CONFLICT)
    recompute = processor.vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
    if not mine and not recompute:
        offered = ", ".join(offer.prompt[:12] for offer in candidates)
        raise VLLMValidationError(
            f"HMCConnector: the KV offered is for another prompt (this prompt's digest {prompt[:12]}, offered {offered}): "
            "kv_transfer_params must be the prefill instance's reply for this very prompt",
            parameter="kv_transfer_params",
        )


def _factors(processor: Any) -> dict[str, Any]:
    """This instance's compatibility factors as its front end knows them (computed once)."""
    with _lock:
        factors = getattr(processor, "_hmc_factors", None)
        if factors is None:
            factors = processor._hmc_factors = engine_factors(processor.vllm_config, processor.tokenizer)
        return factors


def _ours(processor: Any) -> bool:
    transfer = processor.vllm_config.kv_transfer_config
    return transfer is not None and (transfer.kv_connector in CONNECTOR_NAMES or transfer.kv_connector_module_path == "hmc_vllm.connector")


def install() -> None:
    """Wrap vLLM's InputProcessor.process_inputs with `check` (once per process)."""
    from vllm.v1.engine.input_processor import InputProcessor

    original: Callable[..., Any] = InputProcessor.process_inputs
    if getattr(original, "__hmc_admission__", False):
        return

    @functools.wraps(original)
    def process_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        request = original(self, *args, **kwargs)
        if _ours(self):
            check(self, request)
        return request

    process_inputs.__hmc_admission__ = True  # type: ignore[attr-defined]
    InputProcessor.process_inputs = process_inputs  # type: ignore[method-assign]
