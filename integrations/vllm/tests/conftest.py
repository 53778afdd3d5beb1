"""vLLM and torch warn on import about things that are not ours (deprecated torch.jit APIs, pynvml):
import what the in-process tests use once here, with those warnings silenced, so that the suite's
warnings-are-errors rule applies to our code only."""

from __future__ import annotations

import importlib
import importlib.util
import warnings

if importlib.util.find_spec("vllm") is not None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in ("vllm", "vllm.engine.arg_utils", "vllm.v1.request", "vllm.v1.core.kv_cache_manager", "hmc_vllm.connector"):
            importlib.import_module(module)
