"""Which facts two vLLM instances must agree on before KV blocks may move between them.

Each side computes its factors; the prefill side ships them in kv_transfer_params and the decode side
compares them field by field, so a refusal says exactly what differs. The attention backend and the
GPU vendor are deliberately absent: a pair is compatible whenever the bytes of a block mean the same
thing on both sides (same model weights, dtype, heads, head size, block size and block layout in
bytes) and a prompt's text becomes the same token ids on both sides (same vocabulary and chat
template). The model is its identity (config and weights, `hmc_vllm.identity`), never its path.
The transfer mode is not a factor either: a prefill instance serves push, pull and hmcd decoders alike.
The front end (API server process) knows every factor but the two a worker measures (block_bytes,
segments); comparisons cover the factors the local side knows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hmc_vllm import HMC_CONNECTOR_VERSION
from hmc_vllm.identity import chat_template_digest, load_tokenizer, model_identity, vocab_digest

#: Factors whose difference makes a pair incompatible, in the order refusals list them.
FACTORS: tuple[str, ...] = (
    "connector_version",
    "model",
    "tokenizer",
    "chat_template",
    "dtype",
    "cache_dtype",
    "num_layers",
    "num_kv_heads",
    "head_size",
    "block_size",
    "tp_size",
    "block_bytes",
    "segments",
)


def engine_factors(vllm_config: Any, tokenizer: Any = None) -> dict[str, Any]:
    """The factors known from the engine's configuration and tokenizer (loaded here when not given)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if tokenizer is None and not model.skip_tokenizer_init:
        tokenizer = load_tokenizer(model)
    return {
        "connector_version": HMC_CONNECTOR_VERSION,
        "model": model_identity(model),
        "tokenizer": vocab_digest(tokenizer) if tokenizer is not None else None,
        "chat_template": chat_template_digest(tokenizer) if tokenizer is not None else None,
        "dtype": str(model.dtype).removeprefix("torch."),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "num_layers": int(model.get_num_layers(parallel)),
        "num_kv_heads": int(model.get_num_kv_heads(parallel)),
        "head_size": int(model.get_head_size()),
        "block_size": int(vllm_config.cache_config.block_size),
        "tp_size": int(parallel.tensor_parallel_size),
    }


def differences(local: Mapping[str, Any], peer: Mapping[str, Any]) -> list[str]:
    """Human-readable differences, one per factor `local` knows, e.g. "block_size: peer 64, here 32"."""
    return [f"{name}: peer {peer.get(name)!r}, here {local.get(name)!r}" for name in FACTORS if name in local and local.get(name) != peer.get(name)]


def refusal(local: Mapping[str, Any], peer: Mapping[str, Any]) -> str | None:
    """None when compatible, else the message a refused transfer reports."""
    diff = differences(local, peer)
    if not diff:
        return None
    return "HMCConnector: incompatible KV caches (" + "; ".join(diff) + ")"
