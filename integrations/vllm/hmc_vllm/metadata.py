"""The data HMCConnector's halves exchange: worker handshakes, per-step metadata, and peer messages.

Client -> decode travels in kv_transfer_params: one prefill reply ("an offer"), or
`{"do_remote_prefill": true, "hmc_batch": [offer, ...]}` for a request of several prompts; each offer
names the prompt it holds by digest and how many decode sub-requests may load it (`loads`).
Scheduler -> worker travels in `HMCConnectorMetadata` (one per step). Worker -> peer worker travels
as HMC notifications (JSON, small), which arrive after the data of the transfer they ride on:
  want    decode -> prefill (push): "write request R's blocks, holding prompt P, into these blocks of mine,
          within `budget` seconds" (the decode side's time left, counted from before the want arrives)
  claim   decode -> prefill (pull): "may decode request D read these of R's blocks (rblocks), holding prompt
          P, into these blocks of mine, within `budget` seconds?" (the fields of a want)
  grant   prefill -> decode: "D may read R's blocks rblocks, holding prompt P" (checked as a want is; the
          blocks stay held until D's release or the claim's budget ends)
  release decode -> prefill: "one of R's loads is done (or never comes)"; with all=true: "free R"; with
          dreq=D: "decode request D is over: stop its push, end its grant" (its load is counted once, by
          the push, the grant or the refusal)
  kv      prefill -> decode: one part of request R's blocks, holding prompt P, has landed
  err     prefill -> decode: request R's blocks will not come (a want or claim refused), and why
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from hmc.errors import ProtocolError
from hmc_vllm.bodies import BATCH_KEY
from hmc_vllm.layout import KVLayout

#: The key under which HMCConnector's part of kv_transfer_params travels.
PARAMS_KEY = "hmc"

#: Most decode sub-requests one prefill request's blocks may serve (vLLM's own `n` is far below).
MAX_LOADS = 1024

#: Block ids an offer may name (vLLM's block ids are indices into a pool far smaller).
MAX_BLOCK_ID = (1 << 31) - 1


@dataclass(frozen=True)
class Offer:
    """One prefill request's blocks as offered in kv_transfer_params, for one prompt."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    prompt: str  # digest of the prompt's token ids (hmc_vllm.identity.prompt_digest)
    loads: int
    factors: Mapping[str, Any]
    workers: Mapping[str, Any]  # tp rank (str) -> WorkerHandshake.to_wire()
    expiry: float | None = None  # time.time() at the prefill instance when its lease ends

    @property
    def key(self) -> tuple[str, str]:
        return (self.engine_id, self.request_id)

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> Offer:
        """ProtocolError unless `params` is one well-formed prefill reply of ours."""
        hmc = params.get(PARAMS_KEY)
        try:
            if not isinstance(hmc, Mapping):
                raise TypeError(f"no {PARAMS_KEY!r} object")
            blocks = params.get("remote_block_ids")
            if not isinstance(blocks, list) or not all(type(b) is int and 0 <= b <= MAX_BLOCK_ID for b in blocks):
                raise TypeError("remote_block_ids is not a list of block ids")
            if len(set(blocks)) != len(blocks):  # a block named twice would load one block's KV into two positions
                raise ValueError("remote_block_ids names a block more than once")
            loads = hmc.get("loads", 1)
            if type(loads) is not int or not 1 <= loads <= MAX_LOADS:
                raise ValueError(f"loads must be an integer in 1..{MAX_LOADS}, not {loads!r}")
            factors, workers, prompt = hmc.get("factors"), hmc.get("workers"), hmc.get("prompt")
            if not isinstance(factors, Mapping) or not isinstance(workers, Mapping) or not isinstance(prompt, str):
                raise TypeError("factors, workers or prompt digest missing")
            for wire in workers.values():
                WorkerHandshake.from_wire(wire)
            expiry = params.get("remote_lease_expiry")
            if expiry is not None and (type(expiry) not in (int, float) or not math.isfinite(expiry)):
                raise TypeError(f"remote_lease_expiry is not a time: {expiry!r}")
            return cls(
                str(params.get("remote_engine_id")), str(params.get("remote_request_id")), tuple(blocks), prompt, loads, factors, workers,
                float(expiry) if expiry is not None else None,
            )
        except (TypeError, ValueError, ProtocolError) as exc:
            raise ProtocolError(f"malformed HMCConnector kv_transfer_params: {exc}") from exc


def offers(params: Mapping[str, Any] | None) -> list[Offer]:
    """The offers in a decode request's kv_transfer_params ([] when it asks for no remote prefill of ours)."""
    if not params or not params.get("do_remote_prefill"):
        return []
    if BATCH_KEY in params:
        batch = params[BATCH_KEY]
        if not isinstance(batch, list) or not all(isinstance(p, Mapping) for p in batch):
            raise ProtocolError(f"malformed HMCConnector kv_transfer_params: {BATCH_KEY} is not a list of objects")
        return [Offer.parse(p) for p in batch]
    return [Offer.parse(params)] if PARAMS_KEY in params else []


@dataclass(frozen=True)
class WorkerHandshake(KVConnectorHandshakeMetadata):
    """One worker's KV caches as peers see them: registered buffers (descriptors) and block layout."""

    buffers: tuple[bytes, ...]
    layout: KVLayout

    def to_wire(self) -> dict[str, Any]:
        return {"buffers": [base64.b64encode(b).decode() for b in self.buffers], **self.layout.to_wire()}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> WorkerHandshake:
        try:
            buffers = tuple(base64.b64decode(b, validate=True) for b in data["buffers"])
            if not buffers:
                raise ValueError("no buffers")
            return cls(buffers, KVLayout.from_wire(data))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"malformed HMCConnector worker handshake: {exc}") from exc


@dataclass(frozen=True)
class RecvTask:
    """Decode side: load `local_blocks` of `request_id` from the prefill instance's `remote_blocks`."""

    request_id: str
    remote_request_id: str
    remote_engine_id: str
    remote_workers: Mapping[str, Any]  # tp rank (str) -> WorkerHandshake.to_wire()
    local_blocks: tuple[int, ...]  # empty: nothing to load, only tell the prefill instance (a release)
    remote_blocks: tuple[int, ...]
    deadline: float  # time.time() after which the load counts as failed
    prompt: str = ""  # digest of this request's prompt: the blocks must hold exactly this prompt
    refused: str | None = None  # set by the scheduler when the blocks must not be loaded, and why
    release_all: bool = False  # the release frees the prefill request whatever loads it still expects


@dataclass(frozen=True)
class SendTask:
    """Prefill side: hold `block_ids` of `request_id` (prompt digest `prompt`) for `loads` decode loads until `expiry` (time.time())."""

    request_id: str
    block_ids: tuple[int, ...]
    expiry: float
    prompt: str = ""
    loads: int = 1


@dataclass
class HMCConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step."""

    recvs: list[RecvTask] = field(default_factory=list)
    sends: list[SendTask] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)  # prefill: held requests to free now (hmc_release)


def encode(kind: str, **fields: Any) -> bytes:
    """A peer message: `kind` is want, claim, grant, release, kv or err."""
    return json.dumps({"t": kind, **fields}, separators=(",", ":")).encode()


def decode(payload: bytes) -> dict[str, Any]:
    """Parse a peer message; ProtocolError if it isn't one of ours."""
    try:
        message = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"not an HMCConnector message: {payload[:40]!r}") from exc
    if not isinstance(message, dict) or message.get("t") not in ("want", "claim", "grant", "release", "kv", "err"):
        raise ProtocolError(f"not an HMCConnector message: {payload[:40]!r}")
    return message
