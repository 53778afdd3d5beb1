"""The `vllm.general_plugins` entry point: registers HMCConnector and, when asked, the HMC PP transport.

vLLM calls `register()` once per process (front end, engine core, every worker), so it must be idempotent.
"""

from __future__ import annotations

import logging
import os

from hmc_vllm import SUPPORTED_VLLM

_log = logging.getLogger(__name__)

CONNECTOR_NAME = "HMCConnector"

#: Set to 1 to carry pipeline-parallel intermediate tensors over HMC instead of torch.distributed.
PP_ENV = "HMC_VLLM_PP"


def register() -> None:
    """Register "HMCConnector" with vLLM's connector factory (once) and install the PP transport if enabled."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    _log_like_vllm()
    if vllm.__version__ not in SUPPORTED_VLLM:
        _log.warning("hmc_vllm is tested with vLLM %s; this is vLLM %s", ", ".join(SUPPORTED_VLLM), vllm.__version__)
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "hmc_vllm.connector", CONNECTOR_NAME)
    if os.environ.get(PP_ENV, "0") not in ("", "0"):
        from hmc_vllm.pp import install_pp_transport

        install_pp_transport()


def _log_like_vllm() -> None:
    """Send hmc_vllm's log records through vLLM's handlers, so they appear (and look) like vLLM's own."""
    ours, theirs = logging.getLogger("hmc_vllm"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)
        ours.propagate = False
