"""What the proxy sends each instance, and the kv_transfer_params keys the proxy and HMCConnector share.

Pure functions of the client's body (no I/O, no vLLM import): one prefill-only request per prompt,
the decode instance's kv_transfer_params from the prefill replies, and the release of a reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: kv_transfer_params key of a prefill request: how many decode sub-requests will load its KV.
LOADS_KEY = "hmc_loads"

#: kv_transfer_params key holding several prefill replies, one per prompt of a decode request.
BATCH_KEY = "hmc_batch"

#: kv_transfer_params key marking a request to a prefill instance as "free the blocks of this reply".
RELEASE_KEY = "hmc_release"

#: What P is sent: "prefill only, a decode instance will pull or receive the KV" (upstream vLLM's toy proxy),
#: plus `hmc_loads`, set per request.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: Request fields (of vLLM 0.32's completion and chat requests) that only shape the output, removed from
#: the prefill request so P prefills each prompt once and nothing else. Everything else is kept, because it
#: may shape the prompt (`messages`, `tools`, `chat_template_kwargs`, `add_special_tokens`,
#: `truncate_prompt_tokens`, `cache_salt`, ...). `logprob_token_ids` and `min_tokens` would even be refused
#: without `logprobs` or with `max_tokens: 1`.
OUTPUT_ONLY_FIELDS: frozenset[str] = frozenset({
    "n", "best_of", "use_beam_search", "echo", "logprobs", "top_logprobs", "prompt_logprobs", "logprob_token_ids",
    "stop", "stop_token_ids", "include_stop_str_in_output", "stream_options", "stream_interval", "min_tokens",
    "logit_bias", "bad_words", "allowed_token_ids", "structured_outputs", "response_format", "return_token_ids",
    "return_tokens_as_token_ids", "repetition_detection", "thinking_token_budget",
})

#: Client headers passed on to every instance (besides `X-Request-Id`, which the proxy always sets).

#: Where release POSTs go on P, whatever the client's route was.
RELEASE_PATH = "/v1/completions"


def split_prompts(prompt: Any) -> list[Any]:
    """The prompts vLLM makes of a completions `prompt`: each element of a list of strings or of token-id lists, else the one."""
    several = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    return list(prompt) if several else [prompt]


def count_n(n: Any) -> int:
    """The `n` vLLM will use (its pydantic model takes 2, 2.0 and "2" alike); 1 when it is not a positive whole number."""
    try:
        value = float(n)
    except (TypeError, ValueError):
        return 1
    return int(value) if value.is_integer() and value >= 1 else 1


def needs_prefill(body: dict[str, Any]) -> bool:
    """False for requests whose decode computes the prompt itself whatever KV it is offered.

    Beam search drops `kv_transfer_params`; prompt logprobs (`prompt_logprobs`, or completions' `echo`
    with `logprobs`) make vLLM skip every cached or loaded token. A prefill would only pin blocks.
    """
    if body.get("use_beam_search") or body.get("prompt_logprobs") is not None:
        return False
    return not ("prompt" in body and body.get("echo") and body.get("logprobs") is not None)


def prefill_bodies(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The prefill-only requests for the client's `body`, one per prompt: one token, not streamed, output options removed."""
    loads = count_n(body.get("n", 1))
    base = {key: value for key, value in body.items() if key not in OUTPUT_ONLY_FIELDS}
    base.update(stream=False, max_tokens=1, kv_transfer_params={**PREFILL_KV_TRANSFER_PARAMS, LOADS_KEY: loads})
    if "max_completion_tokens" in body:
        base["max_completion_tokens"] = 1
    if "prompt" not in body:
        return [base]
    return [{**base, "prompt": prompt} for prompt in split_prompts(body["prompt"])]


def decode_params(replies: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """D's `kv_transfer_params` from P's replies, in prompt order: the one reply's, or a batch of several (None: recompute)."""
    if len(replies) == 1:
        return replies[0]
    batch = [params for params in replies if params]
    return {"do_remote_prefill": True, BATCH_KEY: batch} if batch else None


def release_body(model: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The request that tells P to free the blocks behind `params` now."""
    return {"model": model, "prompt": "release", "max_tokens": 1, "kv_transfer_params": {**params, RELEASE_KEY: True}}
