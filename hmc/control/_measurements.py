"""What agents measured between them, for negotiation as hmcd runs it (`hmc path`, third-party transfers).

The ucx and rdma paths time a get against the owner's push the first time an agent reads another agent's
memory (`hmc.transport._ucx`). The agent sends that PathMeasurement on its Attach stream, to an hmcd whose
hello says it takes them, and again after every re-attach. hmcd keeps the latest per (measuring agent, path,
owner agent, kinds of memory), at most `per_agent` per agent, in the order they came (the oldest goes first),
and forgets an agent's when its stream ends. The measuring agent is the stream's, whatever the message says.

`choose()` is negotiation with them: declared capabilities and policy first, then, for the chosen path, the
measurement of bytes flowing src -> dst (dst's agent reading src's memory), which names the figures and the
faster direction (a read where gets beat the owner's pushes: hmcd then has dst's agent read).

Concurrency: hmcd's event loop only.
"""

from __future__ import annotations

import math

from hmc.config import PathPolicy
from hmc.errors import ProtocolError
from hmc.transport._base import PathName
from hmc.transport._negotiate import Endpoint, PathChoice, negotiate
from hmc.v1 import common_pb2

__all__ = ["Measurements"]

_MEASURED_PATHS = frozenset({PathName.UCX.value, PathName.RDMA.value})
"""The paths that measure a pair (an agent naming another is refused)."""
_KINDS = frozenset({common_pb2.DEVICE_KIND_HOST, common_pb2.DEVICE_KIND_CUDA, common_pb2.DEVICE_KIND_HIP})
_MAX_ID = 128
_MAX_PROBE_BYTES = 1 << 40
_MAX_BPS = 1e15
"""1 PB/s: beyond any link, so a figure above it is a lie or a broken clock."""

_Key = tuple[str, str, int, int]


class Measurements:
    """The pairs' measurements agents sent, and negotiation with them (see the module doc)."""

    def __init__(self, policy: PathPolicy, *, per_agent: int = 256) -> None:
        self._policy = policy
        self._per_agent = per_agent
        self._by_agent: dict[str, dict[_Key, common_pb2.PathMeasurement]] = {}

    def record(self, agent_id: str, measured: common_pb2.PathMeasurement) -> None:
        """Keep what agent `agent_id` measured; ProtocolError (the stream ends) for a message no agent sends."""
        _check(measured)
        kept = common_pb2.PathMeasurement()
        kept.CopyFrom(measured)
        kept.measured_by = agent_id
        table = self._by_agent.setdefault(agent_id, {})
        key = (kept.path, kept.owner_agent, kept.local_kind, kept.remote_kind)
        table.pop(key, None)
        while len(table) >= self._per_agent:
            del table[next(iter(table))]
        table[key] = kept

    def forget(self, agent_id: str) -> None:
        """Agent `agent_id`'s stream ended: what it measured goes (it sends it again when it attaches again)."""
        self._by_agent.pop(agent_id, None)

    def __len__(self) -> int:
        return sum(len(table) for table in self._by_agent.values())

    def choose(self, src: common_pb2.BufferDescriptor, dst: common_pb2.BufferDescriptor) -> PathChoice:
        """The path for bytes from `src` to `dst` (NoPathError when none), with the pair's measurement on it."""
        choice = negotiate(Endpoint.of(src), Endpoint.of(dst), self._policy)
        key = (choice.path.value, src.owner.id, _kind(dst.device.kind), _kind(src.device.kind))
        measured = self._by_agent.get(dst.owner.id, {}).get(key)
        return choice if measured is None else choice.with_measurement(measured)


def _kind(kind: int) -> int:
    return common_pb2.DEVICE_KIND_HOST if kind == common_pb2.DEVICE_KIND_UNSPECIFIED else kind


def _check(measured: common_pb2.PathMeasurement) -> None:
    if measured.path not in _MEASURED_PATHS:
        raise ProtocolError(f"a measurement of path {measured.path[:32]!r}, which measures nothing")
    if not 0 < len(measured.owner_agent) <= _MAX_ID or not measured.owner_agent.isprintable():
        raise ProtocolError("a measurement naming no owner agent, or an absurd one")
    if measured.local_kind not in _KINDS or measured.remote_kind not in _KINDS:
        raise ProtocolError("a measurement of unknown kinds of memory")
    if not 0 < measured.nbytes <= _MAX_PROBE_BYTES:
        raise ProtocolError(f"a measurement over {measured.nbytes} bytes")
    if not (math.isfinite(measured.get_bps) and 0 < measured.get_bps <= _MAX_BPS and math.isfinite(measured.push_bps) and 0 <= measured.push_bps <= _MAX_BPS):
        raise ProtocolError("a measurement with rates that are not finite, positive figures")
