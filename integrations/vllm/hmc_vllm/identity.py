"""What identifies a model, a tokenizer and a prompt across vLLM instances.

KV blocks mean the same thing on two instances only if both run the same weights, split text into the
same token ids and computed the blocks for the same prompt. These digests are what the instances
compare: the model by its config and weights (never by its path: the same files through another path
or a symlink are the same model), the tokenizer by its vocabulary and chat template, a prompt by its
token ids. All are sha256 hex strings except the fallback identity of a hub model that is not on disk.

Concurrency: every function is pure apart from `model_identity`'s per-directory cache (a
`functools.lru_cache`, which is thread-safe); call them from any thread.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_log = logging.getLogger(__name__)

#: Files whose name, size and ends identify a model's weights (vLLM's loaders read these formats).
WEIGHT_SUFFIXES: tuple[str, ...] = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

#: How much of each end of a weight file is hashed: the header, the start of the first tensor and the end
#: of the last, cheap for multi-GB files (two reads of 1 MiB instead of the whole file).
SAMPLE_BYTES = 1 << 20

#: config.json keys that record where and with what a model was saved, not what it is.
PROVENANCE_KEYS: frozenset[str] = frozenset({"_name_or_path", "transformers_version"})


def prompt_digest(token_ids: Sequence[int]) -> str:
    """sha256 hex of a prompt: its token count, then each id, all as little-endian int64.

    Any token differing, added or removed changes it; 100k tokens take a few milliseconds.
    """
    ids = np.asarray(token_ids, dtype="<i8")
    digest = hashlib.sha256(np.array([ids.size], dtype="<i8").tobytes())
    digest.update(ids.tobytes())
    return digest.hexdigest()


def model_identity(model_config: Any) -> str:
    """The identity of vLLM's model (a `vllm.config.ModelConfig`), the same for the same weights anywhere.

    A sha256 over config.json (parsed, without provenance keys such as `_name_or_path`, re-serialised
    with sorted keys) and, for each weight file in the model directory (`WEIGHT_SUFFIXES`, sorted by
    name), its name, its size and its first and last MiB. Weight files are not hashed whole: that would
    read every byte of multi-GB checkpoints at each start; a same-sized file that differs only in its
    middle therefore goes unnoticed. The directory is `model_config.model` with symlinks resolved, or,
    for a Hugging Face hub id, its local snapshot at `model_config.revision`; a hub id with no local
    snapshot is identified as "<id>@<revision>". Cached per resolved directory for the process's life.
    """
    root = _local_model(str(model_config.model), model_config.revision)
    if root is None:
        identity = f"{model_config.model}@{model_config.revision or 'main'}"
        _log.warning("model %s is not on this machine: identified by its name and revision (%s)", model_config.model, identity)
        return identity
    return _files_identity(root)


def vocab_digest(tokenizer: Any) -> str:
    """sha256 hex of the vocabulary as `tokenizer` (a vLLM TokenizerLike) maps it: every token and id,
    which of them are added tokens, the special tokens and the BOS/EOS/PAD ids.

    Two saves of one tokenizer agree; adding, removing or renumbering a token changes it.
    """
    facts = {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0])),
        "added": sorted(tokenizer.get_added_vocab().items(), key=lambda item: (item[1], item[0])),
        "special": sorted(tokenizer.all_special_tokens),
        "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
    }
    return hashlib.sha256(_canonical(facts)).hexdigest()


def chat_template_digest(tokenizer: Any) -> str | None:
    """sha256 hex of the tokenizer's chat template (of its text, or of a dict of named templates); None without one."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    return hashlib.sha256(template.encode() if isinstance(template, str) else _canonical(template)).hexdigest()


def load_tokenizer(model_config: Any) -> Any:
    """The tokenizer vLLM's front end uses for `model_config` (vLLM's own cached loader), for processes
    that have none of their own, such as the engine core; None when the config skips the tokenizer."""
    from vllm.tokenizers import cached_tokenizer_from_config

    return cached_tokenizer_from_config(model_config)


def _local_model(model: str, revision: str | None) -> Path | None:
    """The model's directory (or single weight file) on this machine, symlinks resolved; None if not here."""
    path = Path(model).expanduser()
    if path.exists():
        return path.resolve()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=model, revision=revision, local_files_only=True)).resolve()
    except (OSError, ValueError) as exc:  # not in the local cache, or not a valid hub id
        _log.debug("no local snapshot of %s@%s: %s", model, revision, exc)
        return None


@functools.lru_cache(maxsize=None)
def _files_identity(root: Path) -> str:
    """The digest `model_identity` describes, of a resolved directory or single weight file."""
    digest = hashlib.sha256()
    if root.is_dir():
        config = root / "config.json"
        if config.is_file():
            content = {k: v for k, v in json.loads(config.read_text()).items() if k not in PROVENANCE_KEYS}
            digest.update(_canonical(content))
        weights = sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    else:
        weights = [root]
    for weight in weights:
        size = weight.stat().st_size
        digest.update(_canonical([weight.name, size, _ends_digest(weight, size)]))
    return digest.hexdigest()


def _ends_digest(path: Path, size: int) -> str:
    """sha256 hex of a file's first and last `SAMPLE_BYTES` (of all of it when it is no longer than both)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(SAMPLE_BYTES))
        if size > SAMPLE_BYTES:
            f.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
            digest.update(f.read())
    return digest.hexdigest()


def _canonical(value: Any) -> bytes:
    """One byte string per JSON value, whatever its key order."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

