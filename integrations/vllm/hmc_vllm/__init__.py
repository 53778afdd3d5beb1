"""HMC for vLLM: the HMCConnector KV connector, KV-cache migration and pipeline-parallel activations over HMC.

vLLM finds the connector through the `vllm.general_plugins` entry point (`hmc_vllm.plugin.register`),
or directly with `kv_connector_module_path="hmc_vllm.connector"`.
"""

from __future__ import annotations

#: vLLM releases HMCConnector is tested against; others are refused at registration with a warning.
SUPPORTED_VLLM: tuple[str, ...] = ("0.32.0",)

#: Bumped whenever the handshake or the messages between connectors change; part of the compatibility check.
HMC_CONNECTOR_VERSION = 2  # 2: pull mode claims its blocks and reads only once granted

__all__ = ["HMC_CONNECTOR_VERSION", "SUPPORTED_VLLM"]
