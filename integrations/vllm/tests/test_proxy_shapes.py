"""What the proxy sends P and D for each request shape, without servers (test_proxy.py runs them end to end).

The field lists are checked against vLLM's own request models, so a field renamed or added upstream shows
up here instead of as a prefill that generates, streams or is refused.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from hmc_vllm.proxy import OUTPUT_ONLY_FIELDS, PREFILL_KV_TRANSFER_PARAMS, decode_params, prefill_bodies, release_body

MODEL = "m"


def prefill_params(loads: int) -> dict[str, Any]:
    return {**PREFILL_KV_TRANSFER_PARAMS, "hmc_loads": loads}


def test_one_prompt_is_one_prefill_without_output_options() -> None:
    body = {
        "model": MODEL, "prompt": "the fox", "n": 3, "best_of": 4, "echo": True, "logprobs": 2, "stop": ["x"],
        "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 5, "logit_bias": {"7": 1.0},
        "max_tokens": 40, "temperature": 0.5, "seed": 1, "add_special_tokens": False, "cache_salt": "s",
        "kv_transfer_params": {"from": "the client"},
    }
    assert prefill_bodies(body) == [{
        "model": MODEL, "prompt": "the fox", "stream": False, "max_tokens": 1, "temperature": 0.5, "seed": 1,
        "add_special_tokens": False, "cache_salt": "s", "kv_transfer_params": prefill_params(3),
    }]


@pytest.mark.parametrize(("prompt", "prompts"), [
    ("a string", ["a string"]),
    ([1, 2, 3], [[1, 2, 3]]),  # token ids: one prompt
    (["short", "a much longer prompt"], ["short", "a much longer prompt"]),
    ([[1, 2], [3, 4, 5, 6]], [[1, 2], [3, 4, 5, 6]]),
    (["alone"], ["alone"]),
])
def test_prompt_lists_are_split_one_prefill_each(prompt: Any, prompts: list[Any]) -> None:
    bodies = prefill_bodies({"model": MODEL, "prompt": prompt, "n": 2})
    assert [body["prompt"] for body in bodies] == prompts
    assert all(body["kv_transfer_params"] == prefill_params(2) and "n" not in body for body in bodies)


def test_chat_is_one_prefill_that_keeps_what_shapes_the_prompt() -> None:
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = {
        "model": MODEL, "messages": messages, "tools": tools, "chat_template_kwargs": {"x": 1}, "n": None,
        "max_completion_tokens": 30, "logprobs": True, "top_logprobs": 3, "response_format": {"type": "json_object"},
    }
    assert prefill_bodies(body) == [{
        "model": MODEL, "messages": messages, "tools": tools, "chat_template_kwargs": {"x": 1}, "stream": False,
        "max_tokens": 1, "max_completion_tokens": 1, "kv_transfer_params": prefill_params(1),
    }]


def test_decode_params_one_prefill_unchanged_several_batched_in_prompt_order() -> None:
    first, second = {"remote_request_id": "1", "hmc": {"loads": 2}}, {"remote_request_id": "2"}
    assert decode_params([first]) is first
    assert decode_params([first, second]) == {"do_remote_prefill": True, "hmc_batch": [first, second]}
    assert decode_params([None, second]) == {"do_remote_prefill": True, "hmc_batch": [second]}
    assert decode_params([None]) is None and decode_params([None, None]) is None and decode_params([]) is None


def test_release_body_is_the_contracts() -> None:
    params = {"remote_request_id": "r", "remote_block_ids": [3]}
    assert release_body(MODEL, params) == {
        "model": MODEL, "prompt": "release", "max_tokens": 1,
        "kv_transfer_params": {"remote_request_id": "r", "remote_block_ids": [3], "hmc_release": True},
    }
    assert "hmc_release" not in params


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_output_only_fields_are_vllm_request_fields() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    known = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    # best_of is in neither model in vLLM 0.32: it is accepted as an extra field and ignored.
    assert "best_of" not in known
    assert OUTPUT_ONLY_FIELDS - known == {"best_of"}
    assert not OUTPUT_ONLY_FIELDS & {"prompt", "messages", "model", "tools", "add_special_tokens", "truncate_prompt_tokens", "cache_salt"}
