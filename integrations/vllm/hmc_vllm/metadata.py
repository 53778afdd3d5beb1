"""The data HMCConnector's halves exchange: worker handshakes, per-step metadata, and peer messages.

Scheduler -> worker travels in `HMCConnectorMetadata` (one per step). Worker -> peer worker travels
as HMC notifications (JSON, small), which arrive after the data of the transfer they ride on:
  want    decode -> prefill (push): "write request R's blocks into these blocks of mine"
  release decode -> prefill: "I have R's blocks (or need none): free them"
  kv      prefill -> decode: one part of request R's blocks has landed
  err     prefill -> decode: request R's blocks will not come, and why
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from hmc.errors import ProtocolError
from hmc_vllm.layout import KVLayout

#: The key under which HMCConnector's part of kv_transfer_params travels.
PARAMS_KEY = "hmc"


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
            return cls(tuple(base64.b64decode(b) for b in data["buffers"]), KVLayout.from_wire(data))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed HMCConnector worker handshake: {exc}") from exc


@dataclass(frozen=True)
class RecvTask:
    """Decode side: load `local_blocks` of `request_id` from the prefill instance's `remote_blocks`."""

    request_id: str
    remote_request_id: str
    remote_engine_id: str
    remote_workers: Mapping[str, Any]  # tp rank (str) -> WorkerHandshake.to_wire()
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    deadline: float  # time.time() after which the load counts as failed
    refused: str | None = None  # set by the scheduler when the pair is incompatible


@dataclass(frozen=True)
class SendTask:
    """Prefill side: hold `block_ids` of `request_id` for a decode instance until `expiry` (time.time())."""

    request_id: str
    block_ids: tuple[int, ...]
    expiry: float


@dataclass
class HMCConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step."""

    recvs: list[RecvTask] = field(default_factory=list)
    sends: list[SendTask] = field(default_factory=list)


def encode(kind: str, **fields: Any) -> bytes:
    """A peer message: `kind` is want, release, kv or err."""
    return json.dumps({"t": kind, **fields}, separators=(",", ":")).encode()


def decode(payload: bytes) -> dict[str, Any]:
    """Parse a peer message; ProtocolError if it isn't one of ours."""
    try:
        message = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"not an HMCConnector message: {payload[:40]!r}") from exc
    if not isinstance(message, dict) or message.get("t") not in ("want", "release", "kv", "err"):
        raise ProtocolError(f"not an HMCConnector message: {payload[:40]!r}")
    return message
