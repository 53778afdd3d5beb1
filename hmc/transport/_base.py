"""The transport interface: declared capabilities and one lifecycle for every path.

Lifecycle (after NIXL's backend engine): a transport is created by the agent,
`export()`s handles for each registered ConnBuffer, `withdraw()`s them, `post()`s
transfers, and is `close()`d once. `post()` must never block past the request's
deadline and completes the request's handle exactly once, with an error or not.

Negotiation reads `Capabilities` (carried to peers as `TransportCapability`),
never the transport's class.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from hmc.errors import UnsupportedError
from hmc.memory._base import DeviceKind
from hmc.v1 import common_pb2

if TYPE_CHECKING:
    from hmc.transport._ranges import RangeList

__all__ = ["Capabilities", "Completion", "InlineCopy", "PathName", "Transport", "TransferOp", "TransferRequest", "kind_to_proto"]


class PathName(str, enum.Enum):
    """Paths in order of preference."""

    LOCAL = "local"
    IPC = "ipc"
    RDMA = "rdma"
    UCX = "ucx"
    STAGED = "staged"


class TransferOp(enum.Enum):
    WRITE = "write"
    """Push: local source -> remote destination."""
    READ = "read"
    """Pull: remote source -> local destination."""


_KIND_TO_PROTO = {
    DeviceKind.HOST: common_pb2.DEVICE_KIND_HOST,
    DeviceKind.CUDA: common_pb2.DEVICE_KIND_CUDA,
    DeviceKind.HIP: common_pb2.DEVICE_KIND_HIP,
}
_KIND_FROM_PROTO = {value: key for key, value in _KIND_TO_PROTO.items()}


def kind_to_proto(kind: DeviceKind) -> int:
    """The wire's DeviceKind of a memory kind."""
    return _KIND_TO_PROTO[kind]


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a transport can do, declared up front."""

    path: PathName
    memory_kinds: frozenset[DeviceKind]
    one_sided: bool = False
    same_host_only: bool = False
    same_agent_only: bool = False
    same_vendor_only: bool = False
    detail: str = ""

    def to_proto(self) -> common_pb2.TransportCapability:
        return common_pb2.TransportCapability(
            path=self.path.value,
            memory_kinds=sorted(_KIND_TO_PROTO[k] for k in self.memory_kinds),
            one_sided=self.one_sided,
            same_host_only=self.same_host_only,
            same_agent_only=self.same_agent_only,
            same_vendor_only=self.same_vendor_only,
            detail=self.detail,
        )

    @classmethod
    def from_proto(cls, message: common_pb2.TransportCapability) -> Capabilities:
        return cls(
            path=PathName(message.path),
            memory_kinds=frozenset(_KIND_FROM_PROTO[k] for k in message.memory_kinds if k in _KIND_FROM_PROTO),
            one_sided=message.one_sided,
            same_host_only=message.same_host_only,
            same_agent_only=message.same_agent_only,
            same_vendor_only=message.same_vendor_only,
            detail=message.detail,
        )


class Completion(Protocol):
    """How a transport reports the end of a request (implemented by the transfer handle)."""

    def set_running(self) -> None: ...

    def add_bytes(self, nbytes: int) -> None: ...

    def finish(self, error: BaseException | None = None) -> None: ...

    @property
    def cancelled(self) -> bool: ...

    on_cancel: Callable[[], None] | None
    """Set by a transport that must stop writing when the transfer is cancelled or expires: it runs once,
    before the end is reported, and returns only when nothing of the transfer can land any more."""


@dataclasses.dataclass(frozen=True)
class TransferRequest:
    """One validated, coalesced transfer handed to a transport.

    For WRITE, `ranges.src` are offsets in `local`, `ranges.dst` in `remote`;
    for READ, `ranges.src` are in `remote` and `ranges.dst` in `local`.
    """

    transfer_id: str
    op: TransferOp
    local: Any
    """The local ConnBuffer (hmc.agent ConnBuffer: .region, .descriptor)."""
    remote: common_pb2.BufferDescriptor
    ranges: RangeList
    deadline: float
    """time.monotonic() by which the request must be finished."""
    completion: Completion


@dataclasses.dataclass(frozen=True)
class InlineCopy:
    """A transport's synchronous one-range fast path between two known buffers.

    Both callables take `(local_offset, remote_offset, length)`, already
    bounds-checked by the caller against `local_size` and `remote_size` (and
    `length` against `max_bytes`), copy on the caller's thread and raise a typed
    error on failure.
    """

    write: Callable[[int, int, int], None]
    read: Callable[[int, int, int], None]
    local_size: int
    remote_size: int
    max_bytes: int = 1 << 20
    """Longest range the copy takes."""
    read_max_bytes: int | None = None
    """Longest range `read` takes, where it differs from `max_bytes` (a read that may go as the owner's push)."""
    waits: bool = False
    """True when the copy waits on the peer (a network round trip): it then runs within the transport's
    default deadline, and the agent uses it only for calls that set no timeout of their own."""


class Transport(abc.ABC):
    """A path's implementation inside one agent."""

    capabilities: Capabilities

    def unavailable_reason(self) -> str | None:
        """Why this transport cannot run on this host (None when it can)."""
        return None

    def export(self, buffer: Any) -> dict[str, Any]:
        """Handles to put in the descriptor of a newly registered ConnBuffer."""
        return {}

    def grant(self, buffer: Any) -> common_pb2.TransportHandles:
        """Owner side of a one-sided path: the handles a peer that proved `buffer`'s key gets (OpenBuffer)."""
        raise UnsupportedError(f"the {self.capabilities.path.value} path grants no access to buffer {buffer.id}")

    def push(self, buffer: Any, request: Any, ranges: RangeList, deadline: float, done: Callable[[BaseException | None], None]) -> None:
        """Owner side of a read the owner pushes (a `Push` frame, checked): put `ranges` of `buffer` into the asker's
        memory, then `done(None)`, or `done(error)`; at most once, by `deadline`."""
        raise UnsupportedError(f"the {self.capabilities.path.value} path does not push reads")

    def measured(self, local: Any, remote: common_pb2.BufferDescriptor) -> common_pb2.PathMeasurement | None:
        """What this path measured reading `remote`'s owner's memory into memory of `local`'s kind, if anything."""
        return None

    def measurements(self) -> list[common_pb2.PathMeasurement]:
        """Everything this path measured so far (sent to hmcd again when the agent attaches)."""
        return []

    def withdraw(self, buffer_id: str) -> None:
        """Forget a ConnBuffer that was unregistered (local) or withdrawn (remote)."""
        return None

    def forget_peer(self, agent: common_pb2.AgentInfo) -> None:
        """A peer agent went away: drop connections and grants that lead to it."""
        return None

    def inline(self, local: Any, remote: common_pb2.BufferDescriptor) -> InlineCopy | None:
        """A fast path for tiny single-range transfers once the pair is set up (None: not offered)."""
        return None

    @abc.abstractmethod
    def post(self, request: TransferRequest) -> None:
        """Start (or run) the transfer; completes `request.completion` exactly once."""

    def close(self) -> None:
        """Release sockets, threads and mappings; idempotent."""
        return None
