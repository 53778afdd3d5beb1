"""Pipeline-parallel intermediate tensors over HMC instead of the PP group's device communicator.

What vLLM 0.32.0 really calls (read, then confirmed by the end-to-end test). `Worker.execute_model`
(v1/worker/gpu_worker.py:1302-1356; `CPUWorker` inherits it, v1/worker/cpu_worker.py:32) receives with
`get_pp_group().irecv_tensor_dict(...)` and sends with `isend_tensor_dict(...)`; the model runner's rare
path (v1/worker/gpu_model_runner.py:4249) calls `send_tensor_dict`, which is `isend_tensor_dict` plus
waits (distributed/parallel_state.py:1109). On CPU neither reaches torch.distributed:
`GroupCoordinator.use_cpu_custom_send_recv` (parallel_state.py:574) sends the whole dict through the SHM
communicator (`CpuCommunicator.send_tensor_dict`, device_communicators/cpu_communicator.py:148-170)
whenever the PP ranks share an SHM group, else to torch.distributed (gloo for CPU tensors). On the test
box the workers log "CPU SHM communicator disabled for group pp:0" (cpu_communicator.py:47, the branch
taken whenever any condition of :36-44 fails), so unpatched PP runs there over gloo. Replacing the two
`GroupCoordinator` methods for groups named "pp*" takes over both routes; every other group and
collective (the last stage's `broadcast_tensor_dict`, barriers) stays on torch.distributed.

Wire. One message is one `agent.write` of a batch of ranges (one per tensor, 64-byte aligned) from a
registered staging slot of the sender into the same slot of the receiver's ring, with `notify=` a
msgpack header: protocol version, sequence number, slot, and per item its key and either (dtype, shape,
offset, length) or a plain msgpack value. The notification arrives after the last byte, exactly once.

Ring and credits. Each stage registers a receive ring (`slots` host slots of `slot_bytes`) and a small
control buffer. The sender owns one credit per slot; a send takes the next free slot (waiting, up to the
deadline, for an ack when none is free). The receiver copies the tensors out of the slot, then acks it
with a 1-byte write into the sender's control buffer whose notification names the slot. An ack implies
the data landed, so the sender's staging slot is free with it: no slot is ever overwritten unread.

Handshake and growth. On its first PP call each rank of the group builds one `hmc.Agent()` (attached to
hmcd when one runs, else embedded), then all ranks swap hellos (ring and control descriptors, protocol
version) with `all_gather_object` on the group's existing CPU process group, once, after a
`monitored_barrier` that bounds the wait. Slots start at 1 MiB and grow on demand: a sender whose message
does not fit waits for every credit, asks for a larger ring in-band (a 1-byte write on the ring), and the
receiver re-registers its ring and answers with the new descriptor as a notification; no torch.distributed.

Vendors. Both ends use host ConnBuffers and tensors are copied through them (`Tensor.copy_` does the
device-to-host and host-to-device hops), so the two stages may run on different vendors' GPUs or on CPU.
Device tensors could skip the host hop by registering device rings and staging (`agent.register(tensor)`
accepts CUDA/HIP memory): the agent negotiates each pair's path from both ends' declarations (cuda_ipc
on one node and vendor, staged through host across vendors), and nothing here would change but the
allocation.

Errors. Every wait has a deadline (the agent's `timeout_s`, `handshake_timeout_s` for the handshake) and
fails with a typed `hmc.errors` error saying what was awaited; setup failures raise, never fall back.

Concurrency. A `StageLink` serves one rank's PP calls, which vLLM makes from its worker thread; the
inbox lock only keeps notifications drained by one waiter from being lost by another.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

import hmc
from hmc.errors import (
    ArgumentError,
    BrokenResourceError,
    ClosedResourceError,
    HMCError,
    ProtocolError,
    TimeoutError,
    UnsupportedError,
    VersionMismatchError,
)

__all__ = ["PP_PROTOCOL_VERSION", "STATS_ENV", "LinkStats", "StageLink", "install_pp_transport"]

_log = logging.getLogger(__name__)

PP_PROTOCOL_VERSION = 1
"""Bumped whenever the hello or the message headers change; peers refuse other versions at handshake."""

STATS_ENV = "HMC_VLLM_PP_STATS"
"""A directory: each PP rank keeps `pp-rank{N}.json` there with its `LinkStats` (a test and debug aid)."""

_HANDSHAKE_TIMEOUT_S = 300.0
"""How long the first PP call of a rank waits for every rank of the group (the first stage's first forward pass included)."""
_ALIGN = 64
_CTL_BYTES = 64
_LINK_ATTR = "_hmc_pp_link"
_INSTALLED_ATTR = "_hmc_pp_installed"


@dataclasses.dataclass
class LinkStats:
    """What one stage moved over HMC."""

    rank: int
    agent: str
    sent_messages: int = 0
    sent_bytes: int = 0
    received_messages: int = 0
    received_bytes: int = 0
    grows: int = 0
    paths: list[str] = dataclasses.field(default_factory=list)
    """The HMC paths data writes took (e.g. "ipc")."""


@dataclasses.dataclass(frozen=True)
class _Item:
    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _encode(kind: str, **fields: Any) -> bytes:
    return msgpack.packb({"v": PP_PROTOCOL_VERSION, "kind": kind, **fields})


def _decode(payload: bytes, expect: tuple[str, ...]) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(payload, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"HMC PP: undecodable message ({len(payload)} bytes)") from exc
    if not isinstance(message, dict):
        raise ProtocolError(f"HMC PP: expected a message map, got {type(message).__name__}")
    if message.get("v") != PP_PROTOCOL_VERSION:
        raise VersionMismatchError(f"HMC PP: peer speaks protocol {message.get('v')}, this rank {PP_PROTOCOL_VERSION}")
    if message.get("kind") not in expect:
        raise ProtocolError(f"HMC PP: expected {'/'.join(expect)}, got {message.get('kind')!r}")
    return message


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ProtocolError(f"HMC PP: unknown dtype {name!r} in header")
    return dtype


def _layout(tensors: dict[str, Any]) -> tuple[list[_Item | tuple[str, Any]], int]:
    """Where each tensor goes in a slot (64-byte aligned, in dict order) and the bytes it needs."""
    items: list[_Item | tuple[str, Any]] = []
    end = 0
    for key, value in tensors.items():
        if isinstance(value, torch.Tensor):
            offset = -(-end // _ALIGN) * _ALIGN
            nbytes = value.numel() * value.element_size()
            items.append(_Item(key, str(value.dtype).removeprefix("torch."), tuple(value.shape), offset, nbytes))
            end = offset + nbytes
        elif value is None or isinstance(value, (bool, int, float, str, bytes, list, tuple, dict)):
            items.append((key, value))
        else:
            raise UnsupportedError(f"HMC PP: cannot send {key!r} of type {type(value).__name__} (tensors and msgpack values only)")
    return items, end


class _Inbox:
    """The agent's notifications sorted by the buffer they landed in."""

    def __init__(self, agent: hmc.Agent) -> None:
        self._agent = agent
        self._lock = threading.Lock()  # guards _queues
        self._queues: dict[str, collections.deque[hmc.Notification]] = collections.defaultdict(collections.deque)

    def take(self, buffer_id: str, deadline: float, waiting_for: str) -> hmc.Notification:
        """The next notification into `buffer_id`; TimeoutError naming `waiting_for` at `deadline`."""
        while True:
            with self._lock:
                queue = self._queues.get(buffer_id)
                if queue:
                    return queue.popleft()
            left = deadline - time.monotonic()
            arrived = self._agent.notifications(timeout=min(max(left, 0.0), 0.5))
            if not arrived and left <= 0:
                raise TimeoutError(f"HMC PP: {waiting_for}: nothing arrived before the deadline")
            with self._lock:
                for notification in arrived:
                    self._queues[notification.buffer_id].append(notification)


class StageLink:
    """One PP rank's HMC endpoint: a receive ring from the previous stage, credits and staging toward the next."""

    def __init__(self, agent: hmc.Agent, *, rank: int = 0, slots: int = 4, slot_bytes: int = 1 << 20, device: torch.device | str = "cpu") -> None:
        if slots < 1 or slot_bytes < _ALIGN or slot_bytes % _ALIGN:
            raise ArgumentError(f"HMC PP: need at least one slot of a multiple of {_ALIGN} bytes, got {slots} x {slot_bytes}")
        self.agent = agent
        self.device = torch.device(device)
        self.stats = LinkStats(rank=rank, agent=agent.id)
        self.timeout_s = agent.config.timeout_s
        self._slots = slots
        self._inbox = _Inbox(agent)
        self._memory: dict[str, np.ndarray] = {}  # keeps registered arrays alive, by buffer id
        self._ctl = self._register(_CTL_BYTES, "ctl")
        self._ring, self._ring_slot = self._register(slots * slot_bytes, "ring"), slot_bytes
        self._next_ring: hmc.BufferDescriptor | None = None
        self._prev_ctl: hmc.BufferDescriptor | None = None
        self._next_slot_bytes = 0
        self._staging: hmc.ConnBuffer | None = None
        self._next_slot = 0
        self._free: collections.deque[int] = collections.deque()
        self._sent = 0
        self._tickets = 0
        self._arrived: dict[int, dict[str, Any]] = {}
        self._acks: list[hmc.TransferHandle] = []
        self._on_update: Callable[[LinkStats], None] | None = None
        self._closed = False

    def _register(self, nbytes: int, role: str) -> hmc.ConnBuffer:
        array = np.zeros(nbytes, np.uint8)
        buffer = self.agent.register(array)
        self._memory[buffer.id] = array
        _log.debug("HMC PP rank %d: registered %s %s", self.stats.rank, role, buffer)
        return buffer

    def _unregister(self, buffer: hmc.ConnBuffer) -> None:
        self.agent.unregister(buffer)
        self._memory.pop(buffer.id, None)

    # -- handshake ------------------------------------------------------------------

    def hello(self) -> bytes:
        """What peers need to reach this rank: protocol version, ring and control descriptors."""
        return _encode("hello", ring=self._ring.descriptor.SerializeToString(), slot_bytes=self._ring_slot,
                       slots=self._slots, ctl=self._ctl.descriptor.SerializeToString())

    def connect(self, prev_hello: bytes | None, next_hello: bytes | None) -> None:
        """Take the hellos of the stage this rank receives from and of the one it sends to (None: none)."""
        if prev_hello is not None:
            self._prev_ctl = hmc.BufferDescriptor.FromString(_decode(prev_hello, ("hello",))["ctl"])
        if next_hello is not None:
            peer = _decode(next_hello, ("hello",))
            self._use_next_ring(hmc.BufferDescriptor.FromString(peer["ring"]), int(peer["slot_bytes"]), int(peer["slots"]))

    def _use_next_ring(self, ring: hmc.BufferDescriptor, slot_bytes: int, slots: int) -> None:
        """Send into `ring` from now on; the staging slots that mirror it are registered on the first send."""
        if self._staging is not None:
            self._unregister(self._staging)
            self._staging = None
        if slots != self._slots:
            raise ProtocolError(f"HMC PP: next stage's ring has {slots} slots, this rank uses {self._slots}")
        self._next_ring, self._next_slot_bytes = ring, slot_bytes
        self._free = collections.deque(range(slots))
        self._next_slot = 0

    # -- sending --------------------------------------------------------------------

    def send(self, tensors: dict[str, Any], timeout: float | None = None) -> hmc.TransferHandle:
        """Write `tensors` into the next stage's ring with one `agent.write`; the handle finishes once the header is delivered."""
        self._check_open()
        if self._next_ring is None:
            raise ClosedResourceError("HMC PP: this rank has no next stage to send to (connect() first)")
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        items, nbytes = _layout(tensors)
        if nbytes > self._next_slot_bytes:
            self._grow(nbytes, deadline)
        if self._staging is None:
            self._staging = self._register(self._slots * self._next_slot_bytes, "staging")
        slot = self._credit(deadline)
        base = slot * self._next_slot_bytes
        staging = torch.from_numpy(self._memory[self._staging.id])
        offsets, lengths, header = [], [], []
        for item in items:
            if isinstance(item, _Item):
                if item.nbytes:
                    source = tensors[item.key].detach().contiguous().view(-1).view(torch.uint8)
                    staging[base + item.offset: base + item.offset + item.nbytes].copy_(source)
                    offsets.append(base + item.offset)
                    lengths.append(item.nbytes)
                header.append([item.key, item.dtype, list(item.shape), item.offset, item.nbytes])
            else:
                header.append([item[0], item[1]])
        if not lengths:  # the header alone still needs a write to ride on
            offsets, lengths = [base], [1]
        src = np.asarray(offsets, np.int64)
        handle = self.agent.write(self._staging, self._next_ring, src, src, np.asarray(lengths, np.int64),
                                  notify=_encode("data", seq=self._sent, slot=slot, items=header), timeout=timeout)
        self._sent += 1
        self.stats.sent_messages += 1
        self.stats.sent_bytes += nbytes
        if handle.path not in self.stats.paths:
            self.stats.paths.append(handle.path)
        self._updated()
        return handle

    def _credit(self, deadline: float) -> int:
        """A free slot of the next stage's ring, waiting for its ack until `deadline`."""
        self._drain_ctl(0.0)
        while not self._free:
            self._drain_ctl(deadline, waiting_for=f"an ack freeing one of the next stage's {self._slots} slots")
        if self._next_slot in self._free:
            self._free.remove(self._next_slot)
            slot = self._next_slot
        else:
            slot = self._free.popleft()
        self._next_slot = (slot + 1) % self._slots
        return slot

    def _drain_ctl(self, deadline: float, waiting_for: str = "") -> dict[str, Any] | None:
        """Apply acks that landed in the control buffer; wait for one message until `deadline` when asked to."""
        while True:
            try:
                note = self._inbox.take(self._ctl.id, deadline, waiting_for)
            except TimeoutError:
                if waiting_for:
                    raise
                return None
            message = _decode(note.payload, ("ack", "ring"))
            if message["kind"] == "ring":
                return message
            self._free.append(int(message["slot"]))
            if waiting_for:
                return message

    def _grow(self, nbytes: int, deadline: float) -> None:
        """Ask the next stage for slots of at least `nbytes` and switch to the ring it answers with."""
        assert self._next_ring is not None
        while len(self._free) < self._slots:
            self._drain_ctl(deadline, waiting_for="every ack before growing the next stage's ring")
        want = 1 << (nbytes - 1).bit_length()
        self.agent.write(self._ctl, self._next_ring, 0, 0, 1, notify=_encode("grow", slot_bytes=want)).wait()
        reply = self._drain_ctl(deadline, waiting_for=f"the next stage's ring of {want}-byte slots")
        while reply is None or reply["kind"] != "ring":
            reply = self._drain_ctl(deadline, waiting_for=f"the next stage's ring of {want}-byte slots")
        self._use_next_ring(hmc.BufferDescriptor.FromString(reply["ring"]), int(reply["slot_bytes"]), self._slots)
        self.stats.grows += 1
        _log.info("HMC PP rank %d: next stage's ring grew to %d x %d bytes", self.stats.rank, self._slots, want)

    # -- receiving ------------------------------------------------------------------

    def ticket(self) -> int:
        """The sequence number the next `recv` of this caller must return (irecv order, not wait order)."""
        ticket, self._tickets = self._tickets, self._tickets + 1
        return ticket

    def recv(self, ticket: int | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Wait for message `ticket` (the next one by default), copy its tensors out of the ring and ack the slot."""
        self._check_open()
        if self._prev_ctl is None:
            raise ClosedResourceError("HMC PP: this rank has no previous stage to receive from (connect() first)")
        seq = self.ticket() if ticket is None else ticket
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        self._reap_acks()
        while seq not in self._arrived:
            note = self._inbox.take(self._ring.id, deadline, f"message {seq} from the previous stage")
            message = _decode(note.payload, ("data", "grow"))
            if message["kind"] == "grow":
                self._regrow(int(message["slot_bytes"]))
            else:
                self._arrived[int(message["seq"])] = message
        message = self._arrived.pop(seq)
        tensors = self._unpack(message)
        slot = int(message["slot"])
        self._acks.append(self.agent.write(self._ctl, self._prev_ctl, 0, 0, 1, notify=_encode("ack", slot=slot)))
        return tensors

    def _unpack(self, message: dict[str, Any]) -> dict[str, Any]:
        slot = int(message["slot"])
        if not 0 <= slot < self._slots:
            raise ProtocolError(f"HMC PP: header names slot {slot} of {self._slots}")
        ring = torch.from_numpy(self._memory[self._ring.id])
        base = slot * self._ring_slot
        out: dict[str, Any] = {}
        received = 0
        for entry in message["items"]:
            if len(entry) == 2:
                out[entry[0]] = entry[1]
                continue
            key, dtype_name, shape, offset, nbytes = entry
            if offset < 0 or offset + nbytes > self._ring_slot:
                raise ProtocolError(f"HMC PP: {key!r} [{offset}, {offset + nbytes}) overflows a {self._ring_slot}-byte slot")
            dtype = _dtype(dtype_name)
            if nbytes == 0:
                out[key] = torch.empty(shape, dtype=dtype, device=self.device)
                continue
            raw = ring[base + offset: base + offset + nbytes]
            out[key] = raw.view(dtype).reshape(shape).to(self.device, copy=True)
            received += nbytes
        self.stats.received_messages += 1
        self.stats.received_bytes += received
        self._updated()
        return out

    def _regrow(self, slot_bytes: int) -> None:
        """Replace the ring with one of `slot_bytes` slots and send its descriptor back to the previous stage."""
        assert self._prev_ctl is not None
        if self._arrived:
            raise ProtocolError(f"HMC PP: previous stage asked to grow the ring with {len(self._arrived)} unread message(s) in it")
        self._unregister(self._ring)
        self._ring, self._ring_slot = self._register(self._slots * slot_bytes, "ring"), slot_bytes
        reply = _encode("ring", ring=self._ring.descriptor.SerializeToString(), slot_bytes=slot_bytes)
        self.agent.write(self._ctl, self._prev_ctl, 0, 0, 1, notify=reply).wait()
        self.stats.grows += 1
        _log.info("HMC PP rank %d: ring grew to %d x %d bytes", self.stats.rank, self._slots, slot_bytes)

    def _reap_acks(self) -> None:
        pending = []
        for handle in self._acks:
            if not handle.done():
                pending.append(handle)
            elif handle.error is not None:
                raise BrokenResourceError(f"HMC PP: acking a slot to the previous stage failed: {handle.error}") from handle.error
        self._acks = pending

    # -- lifecycle ------------------------------------------------------------------

    def on_update(self, callback: Callable[[LinkStats], None] | None) -> None:
        """Call `callback(stats)` after every message (the stats file of `install_pp_transport`)."""
        self._on_update = callback

    def _updated(self) -> None:
        if self._on_update is not None:
            self._on_update(self.stats)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError("HMC PP: link is closed")

    def close(self) -> None:
        """Log the counters and close the agent; idempotent."""
        if self._closed:
            return
        self._closed = True
        _log.info("HMC PP rank %d: %s", self.stats.rank, self.stats)
        self.agent.close()


# -- vLLM glue ------------------------------------------------------------------------


def install_pp_transport() -> None:
    """Route the PP group's `isend_tensor_dict`/`irecv_tensor_dict` through HMC (idempotent)."""
    from vllm.distributed.parallel_state import GroupCoordinator

    if getattr(GroupCoordinator, _INSTALLED_ATTR, False):
        return
    original_isend, original_irecv = GroupCoordinator.isend_tensor_dict, GroupCoordinator.irecv_tensor_dict
    stats_dir = os.environ.get(STATS_ENV) or None

    def isend_tensor_dict(self: GroupCoordinator, tensor_dict: dict[str, Any], dst: int | None = None,
                          all_gather_group: GroupCoordinator | None = None,
                          all_gather_tensors: dict[str, bool] | None = None) -> list[Any]:
        if not self.unique_name.startswith("pp"):
            return original_isend(self, tensor_dict, dst, all_gather_group, all_gather_tensors)
        if self.world_size <= 1:
            return []
        _check_neighbour(self, dst, +1, "send to")
        handle = _link_of(self, stats_dir).send(tensor_dict)
        return [handle, handle]  # [header, data]: the header rides on the data write's notification

    def irecv_tensor_dict(self: GroupCoordinator, src: int | None = None,
                          all_gather_group: GroupCoordinator | None = None,
                          all_gather_tensors: dict[str, bool] | None = None) -> tuple[dict[str, Any] | None, list[Any], list[Callable[[], None]]]:
        if not self.unique_name.startswith("pp"):
            return original_irecv(self, src, all_gather_group, all_gather_tensors)
        if not torch.distributed.is_initialized() or self.world_size == 1:
            return None, [], []
        _check_neighbour(self, src, -1, "receive from")
        link = _link_of(self, stats_dir)
        tensor_dict: dict[str, Any] = {}
        return tensor_dict, [_Receive(link, link.ticket(), tensor_dict)], []

    GroupCoordinator.isend_tensor_dict = isend_tensor_dict  # type: ignore[method-assign]
    GroupCoordinator.irecv_tensor_dict = irecv_tensor_dict  # type: ignore[method-assign]
    setattr(GroupCoordinator, _INSTALLED_ATTR, True)
    _log.info("HMC PP transport installed (pid %d)", os.getpid())


class _Receive:
    """The handle `irecv_tensor_dict` returns: `wait()` receives the message and fills the dict vLLM holds."""

    def __init__(self, link: StageLink, ticket: int, tensor_dict: dict[str, Any]) -> None:
        self._link, self._ticket, self._dict = link, ticket, tensor_dict
        self._done = False

    def wait(self, timeout: float | None = None) -> None:
        if not self._done:
            self._dict.update(self._link.recv(self._ticket, timeout))
            self._done = True

    def is_completed(self) -> bool:
        return self._done


def _check_neighbour(group: Any, peer: int | None, step: int, verb: str) -> None:
    expected = (group.rank_in_group + step) % group.world_size
    if peer is not None and peer != expected:
        raise UnsupportedError(f"HMC PP: rank {group.rank_in_group} of {group.unique_name} can only {verb} rank {expected}, not {peer}")


def _link_of(group: Any, stats_dir: str | None) -> StageLink:
    """The group's StageLink, built and handshaken on first use by every rank of the group."""
    link = group.__dict__.get(_LINK_ATTR)
    if link is None:
        link = _connect(group, stats_dir)
        setattr(group, _LINK_ATTR, link)
    return link


def _connect(group: Any, stats_dir: str | None) -> StageLink:
    """Build this rank's StageLink and swap hellos with every rank of `group` over its CPU process group."""
    rank, size = group.rank_in_group, group.world_size
    link = StageLink(hmc.Agent(), rank=torch.distributed.get_rank(), device=group.device)
    atexit.register(link.close)
    if stats_dir is not None:
        path = Path(stats_dir) / f"pp-rank{link.stats.rank}.json"
        link.on_update(lambda stats: path.write_text(json.dumps(dataclasses.asdict(stats))))
    hellos: list[bytes | None] = [None] * size
    try:
        torch.distributed.monitored_barrier(group=group.cpu_group, timeout=datetime.timedelta(seconds=_HANDSHAKE_TIMEOUT_S))
        torch.distributed.all_gather_object(hellos, link.hello(), group=group.cpu_group)
    except RuntimeError as exc:
        link.close()
        raise TimeoutError(f"HMC PP: handshake of {group.unique_name} failed (every rank must join within {_HANDSHAKE_TIMEOUT_S:g}s): {exc}") from exc
    try:
        link.connect(prev_hello=hellos[(rank - 1) % size], next_hello=hellos[(rank + 1) % size])
    except HMCError:
        link.close()
        raise
    _log.info("HMC PP rank %d (%d of %s): linked over agent %s", link.stats.rank, rank, group.unique_name, link.agent.id)
    return link
