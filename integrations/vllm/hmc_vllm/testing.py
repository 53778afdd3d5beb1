"""Test and benchmark support: a tiny random Llama written offline, and real vLLM servers in subprocesses.

Nothing here is a stand-in: the model is a real (random) Llama checkpoint with a real tokenizer,
and `VllmServer` runs `python -m vllm.entrypoints.openai.api_server` on loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

#: Prompts whose greedy continuations the end-to-end tests compare.
PROMPTS: tuple[str, ...] = (
    "the quick brown fox",
    "jumps over the lazy dog 17 and the quick brown fox jumps over the lazy dog 42 the quick",
    "dog fox dog fox the the the quick quick brown",
    "over the lazy dog 3 over the lazy dog 4 over the lazy dog 5 over the lazy dog 6 over the lazy dog 7 over",
)


#: The recipe of `make_tiny_llama`, recorded in its config.json: a directory written by another recipe is rewritten.
TINY_LLAMA_RECIPE = 2

#: A plain chat template for the test model (a base model has none, and vLLM's chat endpoint needs one).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_tiny_llama(path: str | Path, *, seed: int = 0) -> Path:
    """Write a 4-layer random Llama (hidden 128, 4 heads / 2 KV heads of 32, fp32) and a byte-level BPE tokenizer with a chat template to `path`.

    The weights are chosen so that the greedy output depends on every prompt token: with the usual small
    init (0.02) attention is nearly uniform and one changed token among hundreds moves the logits by less
    than their top-2 margin, so a test could not tell whose KV a decode instance used. Here the init is
    0.1, the first layer keeps broad attention (it mixes every token into every position) and the later
    layers' queries and keys are scaled by 3, so their attention is sharp and content-dependent and a
    small change there selects other positions. Measured over 6 seeds and 576 prompts of 20-400 tokens,
    one changed middle token changed the 12-token greedy continuation every time, while fp32 and fp64
    give the same continuations (the sensitivity is to tokens, not to rounding).
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    if (out / "tokenizer.json").exists() and (out / "config.json").exists():
        if json.loads((out / "config.json").read_text()).get("hmc_tiny_llama") == TINY_LLAMA_RECIPE:
            return out
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [f"the quick brown fox jumps over the lazy dog {i}" for i in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=max(fast.vocab_size, 512), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        initializer_range=0.1, bos_token_id=0, eos_token_id=1, torch_dtype="float32", hmc_tiny_llama=TINY_LLAMA_RECIPE,
    )
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.self_attn.q_proj.weight.mul_(3.0)
            layer.self_attn.k_proj.weight.mul_(3.0)
    model.save_pretrained(out)
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(**extra: str) -> dict[str, str]:
    """The environment vLLM servers run with here: CPU, small KV space, quiet, no hub access."""
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        # Several servers share this machine's cores: vLLM's automatic binding would pin every one
        # of them to the same core (it assumes one instance per machine).
        VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
    )
    env.update(extra)
    return env


class Service:
    """A loopback HTTP service in its own process group (logging to `log`), ready once /health answers 200."""

    def __init__(self, name: str, args: list[str], port: int, *, log: str | Path | None = None, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log) if log else None
        self._log_file = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - closed in stop()
        out = self._log_file or subprocess.DEVNULL
        self.process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 240.0, status: int = 200) -> Service:
        """Block until /health answers `status`; RuntimeError (with the log's tail) if the process dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} on port {self.port} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == status:
                        return self
            except urllib.error.HTTPError as exc:
                if exc.code == status:
                    return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} on port {self.port} not ready after {timeout:g}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the log, for failure messages."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the whole process group (for vLLM: the API server, its engine core and workers)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, sig)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; always reaps the process group."""
        try:
            self.kill(signal.SIGTERM)
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.process.wait(timeout)
        except ProcessLookupError:
            pass
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            if self._log_file is not None:
                self._log_file.close()

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VllmServer(Service):
    """One `vllm.entrypoints.openai.api_server` on the tiny model's settings (CPU, fp32, block 32, eager)."""

    def __init__(
        self, model: str | Path, *, kv_transfer_config: dict[str, Any] | None = None, port: int | None = None,
        log: str | Path | None = None, env: dict[str, str] | None = None, extra_args: tuple[str, ...] = (),
    ) -> None:
        port = port or free_port()
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--block-size", "32",
            "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "8", "--seed", "0", *extra_args,
        ]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        super().__init__("vLLM server", args, port, log=log, env=env or server_env())


class ProxyProcess(Service):
    """`python -m hmc_vllm.proxy` in front of the given prefill and decode instances."""

    def __init__(self, prefill: list[str], decode: list[str], *, log: str | Path | None = None, options: tuple[str, ...] = ()) -> None:
        port = free_port()
        args = [sys.executable, "-m", "hmc_vllm.proxy", "--prefill", *prefill, "--decode", *decode, "--port", str(port), *options]
        super().__init__("proxy", args, port, log=log)


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
    """POST a JSON body; returns (status, decoded JSON body), also for error statuses."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        payload = exc.read()
        try:
            return exc.code, json.loads(payload)
        except json.JSONDecodeError:
            return exc.code, {"error": payload.decode(errors="replace")}
