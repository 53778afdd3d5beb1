"""The `vllm.general_plugins` entry point: registers HMCConnector and, when asked, the HMC PP transport.

vLLM calls `register()` once per process (front end, engine core, every worker), so it must be idempotent.
The connector is registered under every name in `CONNECTOR_NAMES`: vLLM's factory matches names exactly
and reports any other as "Unsupported connector type: <name>", with no hook to add a hint; so the
spellings users reach for ("hmc", as in "vLLM with the hmc connector") are registered too.
"""

from __future__ import annotations

import logging
import os

from hmc_vllm import SUPPORTED_VLLM

_log = logging.getLogger(__name__)

CONNECTOR_NAME = "HMCConnector"

#: Every `kv_connector` value that selects HMCConnector: the class name first, then its aliases.
CONNECTOR_NAMES: tuple[str, ...] = (CONNECTOR_NAME, "hmc", "HMC", "HmcConnector", "hmc_connector", "hmc-connector")

#: Set to 1 to carry pipeline-parallel intermediate tensors over HMC instead of torch.distributed.
PP_ENV = "HMC_VLLM_PP"


def register() -> None:
    """Register HMCConnector under `CONNECTOR_NAMES` with vLLM's connector factory (once), install the
    front end's admission check (`hmc_vllm.admission`) and, if enabled, the PP transport."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from hmc_vllm import admission

    _log_like_vllm()
    if vllm.__version__ not in SUPPORTED_VLLM:
        _log.warning("hmc_vllm is tested with vLLM %s; this is vLLM %s", ", ".join(SUPPORTED_VLLM), vllm.__version__)
    for name in CONNECTOR_NAMES:
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, "hmc_vllm.connector", CONNECTOR_NAME)
    admission.install()
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
