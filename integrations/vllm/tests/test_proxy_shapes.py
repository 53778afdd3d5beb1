"""What the proxy sends P and D for each request shape, without servers (test_proxy.py runs them end to end).

The field lists are checked against vLLM's own request models, so a field renamed or added upstream shows
up here instead of as a prefill that generates, streams or is refused.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from hmc_vllm.bodies import OUTPUT_ONLY_FIELDS, PREFILL_KV_TRANSFER_PARAMS, decode_params, needs_prefill, prefill_bodies, release_body

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


@pytest.mark.parametrize(("n", "loads"), [(2, 2), (2.0, 2), ("2", 2), (0, 1), (-3, 1), (2.5, 1), ("two", 1), (None, 1), (float("nan"), 1), (True, 1)])
def test_loads_follow_the_n_vllm_will_use(n: Any, loads: int) -> None:
    """vLLM's pydantic model reads 2, 2.0 and "2" as n = 2: each child must find a load waiting."""
    [body] = prefill_bodies({"model": MODEL, "prompt": "p", "n": n})
    assert body["kv_transfer_params"]["hmc_loads"] == loads


@pytest.mark.parametrize(("body", "needed"), [
    ({"prompt": "p"}, True),
    ({"prompt": "p", "echo": True}, True),
    ({"prompt": "p", "logprobs": 2}, True),
    ({"prompt": "p", "echo": True, "logprobs": 2}, False),  # prompt logprobs: D computes the prompt anyway
    ({"prompt": "p", "prompt_logprobs": 1}, False),
    ({"prompt": "p", "use_beam_search": True}, False),
    ({"messages": [], "echo": True, "logprobs": True}, True),  # chat's echo repeats the last message
])
def test_requests_whose_decode_recomputes_the_prompt_run_no_prefill(body: dict[str, Any], needed: bool) -> None:
    assert needs_prefill(body) is needed
