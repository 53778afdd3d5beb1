"""What identifies a model, a tokenizer and a prompt (`hmc_vllm.identity`), the test model those checks
rely on (its output depends on every prompt token), and the names the plugin registers the connector under.

Models are real checkpoints written by `make_tiny_llama`, read through vLLM's own ModelConfig and
tokenizer loader; the hub case runs in a subprocess with its own Hugging Face cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hmc_vllm.identity import chat_template_digest, load_tokenizer, model_identity, prompt_digest, vocab_digest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(300),
    # vLLM's and transformers' own imports warn about things that are not ours (pynvml, torch internals).
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"),
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hmc_vllm.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def model_config(model: str | Path, **kwargs: Any) -> Any:
    """vLLM's ModelConfig for `model`, as an instance started with `--model model` builds it."""
    from vllm.config import ModelConfig

    return ModelConfig(model=str(model), dtype="float32", **kwargs)


# -- prompts ------------------------------------------------------------------------------------------


def test_prompt_digest_is_sha256_of_count_and_little_endian_int64_ids() -> None:
    expected = hashlib.sha256((3).to_bytes(8, "little") + b"".join(t.to_bytes(8, "little") for t in (5, 0, 70000))).hexdigest()
    assert prompt_digest([5, 0, 70000]) == expected
    assert prompt_digest([]) == hashlib.sha256(bytes(8)).hexdigest()


def test_prompt_digest_changes_with_any_token_and_is_fast() -> None:
    import numpy as np

    prompt = [random.Random(0).randrange(150_000) for _ in range(100_000)]
    started = time.perf_counter()
    digest = prompt_digest(prompt)
    elapsed = time.perf_counter() - started
    assert elapsed < 0.5, f"{elapsed:.3f} s for 100k tokens"
    assert prompt_digest(tuple(prompt)) == prompt_digest(np.array(prompt, dtype=np.int32)) == digest
    one_differs = list(prompt)
    one_differs[50_000] += 1
    assert prompt_digest(one_differs) != digest
    assert prompt_digest(prompt + [0]) != digest
    assert prompt_digest(prompt[:-1]) != digest
    assert prompt_digest([1, 2]) != prompt_digest([1, 2, 0])


# -- models -------------------------------------------------------------------------------------------


def copy_of(model: Path, where: Path, change: Callable[[Path], None] | None = None) -> Path:
    """A copy of the model directory at `where`, then `change(copy)`."""
    shutil.copytree(model, where)
    if change is not None:
        change(where)
    return where


def flip_weight_byte(model: Path) -> None:
    """Change one byte of the first tensor (inside the first MiB, after the safetensors header)."""
    weights = model / "model.safetensors"
    with weights.open("r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header + 100)
        byte = f.read(1)
        f.seek(8 + header + 100)
        f.write(bytes([byte[0] ^ 0x01]))


def edit_config(model: Path, **values: Any) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **values}))


def test_the_same_weights_anywhere_are_the_same_model(tiny_model: Path, tmp_path: Path) -> None:
    identity = model_identity(model_config(tiny_model))
    assert len(identity) == 64 and str(tiny_model) not in identity
    assert model_identity(model_config(copy_of(tiny_model, tmp_path / "copy"))) == identity
    (tmp_path / "link").symlink_to(tiny_model, target_is_directory=True)
    assert model_identity(model_config(tmp_path / "link")) == identity

    def resaved(model: Path) -> None:  # the config written again: other key order, layout and provenance
        config = json.loads((model / "config.json").read_text())
        config.update(transformers_version="0.0.1", _name_or_path="/elsewhere/model")
        (model / "config.json").write_text(json.dumps(dict(reversed(config.items()))))

    assert model_identity(model_config(copy_of(tiny_model, tmp_path / "resaved", resaved))) == identity


def test_other_weights_config_or_files_are_another_model(tiny_model: Path, tmp_path: Path) -> None:
    def renamed(model: Path) -> None:
        (model / "model.safetensors").rename(model / "weights.safetensors")

    def extra_weights(model: Path) -> None:
        shutil.copy(model / "model.safetensors", model / "more.safetensors")

    changes = {
        "weight byte": flip_weight_byte,
        "config value": lambda model: edit_config(model, rms_norm_eps=1e-5),
        "renamed weights": renamed,
        "another weight file": extra_weights,
    }
    identities = {"original": model_identity(model_config(tiny_model))}
    for name, change in changes.items():
        identities[name] = model_identity(model_config(copy_of(tiny_model, tmp_path / name.replace(" ", "_"), change)))
    assert len(set(identities.values())) == len(identities), identities


def test_a_hub_model_is_its_local_snapshot_and_an_absent_one_its_name(tiny_model: Path, tmp_path: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--hmc-test--tiny"
    copy_of(tiny_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    script = (
        "from vllm.config import ModelConfig\n"
        "from hmc_vllm.identity import model_identity\n"
        "print(model_identity(ModelConfig(model='hmc-test/tiny', dtype='float32')))\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == model_identity(model_config(tiny_model))
    # No snapshot on this machine (vLLM could not build a ModelConfig for it offline: the two fields read).
    absent = SimpleNamespace(model="hmc-test/absent", revision="v2")
    assert model_identity(absent) == "hmc-test/absent@v2"


# -- tokenizers ---------------------------------------------------------------------------------------


def test_vocabulary_digest_is_the_vocabulary(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = load_tokenizer(model_config(tiny_model))
    digest = vocab_digest(tokenizer)
    tokenizer.save_pretrained(tmp_path / "saved")
    resaved = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert vocab_digest(resaved) == digest
    resaved.add_tokens(["<extra>"])
    assert vocab_digest(resaved) != digest
    renumbered = AutoTokenizer.from_pretrained(tmp_path / "saved", eos_token="<s>")
    assert vocab_digest(renumbered) != digest


def test_chat_template_digest(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from hmc_vllm.testing import CHAT_TEMPLATE

    tokenizer = load_tokenizer(model_config(tiny_model))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    digest = chat_template_digest(tokenizer)
    assert digest == hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()
    tokenizer.save_pretrained(tmp_path / "saved")
    other = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert chat_template_digest(other) == digest
    other.chat_template = CHAT_TEMPLATE.replace(": ", " > ")
    assert chat_template_digest(other) not in (digest, None)
    other.chat_template = None
    assert chat_template_digest(other) is None


# -- the test model -----------------------------------------------------------------------------------


def test_the_test_model_answers_chat_and_every_prompt_token_matters(tiny_model: Path) -> None:
    """Changing one middle token of prompts of 20-400 tokens changes every greedy continuation of 12
    tokens; continuations differ between prompts; float64 gives the same ones (so rounding does not)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    chat = [{"role": "user", "content": "the quick brown fox"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == "user: the quick brown fox\nassistant:"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def greedy(prompt: list[int]) -> tuple[int, ...]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        return tuple(out[0, len(prompt):].tolist())

    rng = random.Random(7)
    words = "the quick brown fox jumps over the lazy dog and a cat 1 2 3 17 42".split()
    prompts: list[list[int]] = []
    for length in (20, 47, 100, 200, 300, 400):
        prompts.append([rng.randrange(2, 512) for _ in range(length)])
        text = tokenizer.encode(" ".join(rng.choice(words) for _ in range(length)), add_special_tokens=False)
        prompts.append(text[:length])
    continuations = [greedy(prompt) for prompt in prompts]
    for prompt, continuation in zip(prompts, continuations, strict=True):
        middle = len(prompt) // 2
        changed = prompt[:middle] + [prompt[middle] % 500 + 3] + prompt[middle + 1:]
        assert greedy(changed) != continuation, f"a {len(prompt)}-token prompt ignores its token {middle}"
    assert len(set(continuations)) == len(prompts)
    model.double()
    assert [greedy(prompt) for prompt in prompts[::3]] == continuations[::3]


def test_the_test_model_is_reused_only_when_written_by_this_recipe(tiny_model: Path, tmp_path: Path) -> None:
    from hmc_vllm.testing import TINY_LLAMA_RECIPE, make_tiny_llama

    written = (tiny_model / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_llama(tiny_model) == tiny_model and (tiny_model / "model.safetensors").stat().st_mtime_ns == written
    stale = copy_of(tiny_model, tmp_path / "stale", lambda model: edit_config(model, hmc_tiny_llama=TINY_LLAMA_RECIPE - 1, num_hidden_layers=2))
    make_tiny_llama(stale)
    config = json.loads((stale / "config.json").read_text())
    assert (config["hmc_tiny_llama"], config["num_hidden_layers"]) == (TINY_LLAMA_RECIPE, 4)


# -- registration -------------------------------------------------------------------------------------


def test_every_connector_name_resolves_to_hmc_connector() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from hmc_vllm.connector import HMCConnector
    from hmc_vllm.plugin import CONNECTOR_NAMES, register

    register()
    register()  # vLLM runs every plugin in every process, some more than once
    assert "hmc" in CONNECTOR_NAMES
    for name in CONNECTOR_NAMES:
        assert KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector=name, kv_role="kv_both")) is HMCConnector
    with pytest.raises(ValueError, match="Unsupported connector type: hmcc"):
        KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="hmcc", kv_role="kv_both"))
