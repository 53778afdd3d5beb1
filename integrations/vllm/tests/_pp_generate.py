"""Run one offline vLLM engine on the tiny model and write the greedy token ids of every prompt as JSON.

    python _pp_generate.py MODEL_DIR PP_SIZE OUT.json

Run by test_pp.py in a subprocess (vLLM in-process in pytest is fragile); the caller sets the environment.

vLLM 0.32.0 cannot run pipeline parallelism on CPU with `enforce_eager=True` as shipped: a non-first stage
copies received activations into `GPUModelRunner.intermediate_tensors`, a buffer only `_dummy_run` allocates
(v1/worker/gpu_model_runner.py:5801), and the CPU worker's warm-up, the only caller, returns at once in eager
mode (v1/worker/cpu_model_runner.py:84-86), so the first step fails at gpu_model_runner.py:3174
(`assert self.intermediate_tensors is not None`). `_allocate_pp_buffer` does what `_dummy_run` would have
done, on every worker, before the first request.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from hmc_vllm.testing import PROMPTS

_log = logging.getLogger("hmc_vllm.tests.pp_generate")


def _allocate_pp_buffer(worker: Any) -> bool:
    """On a non-first PP stage, allocate the runner's receive buffer as `_dummy_run` does; True if it did."""
    from vllm.distributed import get_pp_group

    runner = worker.model_runner
    if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
        return False
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device,
    )
    return True


def main(model: str, pp_size: int, out: Path) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model, pipeline_parallel_size=pp_size, distributed_executor_backend="mp", enforce_eager=True,
        dtype="float32", block_size=32, max_model_len=512, max_num_seqs=8, seed=0,
    )
    if pp_size > 1:
        _log.info("allocated the PP receive buffer on %d worker(s)", sum(llm.collective_rpc(_allocate_pp_buffer)))
    outputs = llm.generate(list(PROMPTS), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    out.write_text(json.dumps({"pp": pp_size, "tokens": tokens}))
    _log.info("pp=%d wrote %d sequences to %s", pp_size, len(tokens), out)
    del llm


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
