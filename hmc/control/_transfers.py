"""Third-party transfers: a client asks hmcd; the agent that owns the source moves the bytes.

Submit resolves both buffers (locally, then at peers), checks the ranges against
both sizes, negotiates the path (so NoPathError comes back at once), and picks
the executor:

- src is local: its owner WRITEs to dst (the default; pushes are never slower);
- the pair prefers reads (measured: dst's agent gets faster than src's pushes) and dst is
  local: dst's owner READs from src;
- src lives under a peer hmcd: the Submit is forwarded there (`local_only`, same
  transfer id) and Wait/Cancel follow it.

The executor gets a `TransferInstruction` on its Attach stream and answers with
`TransferReport`s. hmcd enforces the deadline (timeout_s plus a grace period),
fails pending transfers with PEER_LOST when their executor's stream ends, and keeps
finished transfers (bounded) so a late Wait still sees the outcome.

Concurrency: owned by hmcd's event loop; each transfer has an asyncio.Event set
once, when it reaches a final state.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from hmc.config import Config
from hmc.control._directory import Peer
from hmc.control._errors import error_to_proto
from hmc.control._metrics import DaemonMetrics
from hmc.control._registry import AgentSession, Registry, describe_ref
from hmc.errors import (
    ArgumentError,
    BrokenResourceError,
    BufferWithdrawnError,
    BusyResourceError,
    CancelledError,
    HMCError,
    TimeoutError,
    UnavailableError,
)
from hmc.transport._negotiate import PathChoice
from hmc.transport._ranges import RangeList, check_timeout, past_notify_bounds
from hmc.v1 import common_pb2, daemon_pb2

__all__ = ["Resolver", "TransferTable"]

log = logging.getLogger("hmc.hmcd")

Resolver = Callable[[daemon_pb2.BufferRef, bool, float], Awaitable[tuple[common_pb2.BufferDescriptor, Peer | None]]]
Choose = Callable[[common_pb2.BufferDescriptor, common_pb2.BufferDescriptor], PathChoice]
"""(ref, local_only, timeout) -> (descriptor, peer that has it or None when local); raises UnknownBufferError."""

_FINAL = frozenset({common_pb2.TRANSFER_STATE_DONE, common_pb2.TRANSFER_STATE_FAILED, common_pb2.TRANSFER_STATE_CANCELLED})


def _minted_epoch(transfer_id: str) -> int | None:
    """The registry epoch of the hmcd that minted `transfer_id` ("<epoch hex>-<uuid hex>"), None for any other id: an
    hmcd that restarted tells a Wait for a transfer of its earlier life from an id it never gave out."""
    epoch, dash, rest = transfer_id.partition("-")
    if not dash or len(rest) != 32 or not 0 < len(epoch) <= 16:
        return None
    try:
        int(rest, 16)
        return int(epoch, 16)
    except ValueError:
        return None
_CANCEL_MARGIN_S = 0.2
"""A Cancel call answers this long before its deadline when the executor has not confirmed yet."""

def _grace(timeout_s: float) -> float:
    """How long after its deadline hmcd waits for the executor's own (more precise) report."""
    return min(2.0, 0.5 + timeout_s / 4)



@dataclasses.dataclass(eq=False)
class _Transfer:
    status: daemon_pb2.TransferStatus
    executor: AgentSession | None = None
    peer: Peer | None = None
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None

    @property
    def final(self) -> bool:
        return self.status.state in _FINAL


class TransferTable:
    """Every third-party transfer this hmcd started or forwarded."""

    def __init__(self, config: Config, registry: Registry, resolve: Resolver, metrics: DaemonMetrics, choose: Choose, *, keep_finished: int = 10_000) -> None:
        """`choose`: negotiation for a pair of buffers, src then dst (hmcd's, with what agents measured)."""
        self._config = config
        self._choose = choose
        self._registry = registry
        self._resolve = resolve
        self._metrics = metrics
        self._keep_finished = keep_finished
        self._active: dict[str, _Transfer] = {}
        self._finished: collections.OrderedDict[str, _Transfer] = collections.OrderedDict()
        self._closing = False
        """Set by close(): a CANCELLED report from now on is hmcd's stop at work, not a client's cancel."""

    # -- submit -------------------------------------------------------------------

    async def submit(self, request: daemon_pb2.SubmitTransferRequest, call_timeout: float) -> daemon_pb2.TransferStatus:
        """Start a transfer (instruct its executor, or forward it to the hmcd owning its source); refused once hmcd
        is stopping, also when the stop began while the buffers were being resolved."""
        self._refuse_if_closing()
        describe_ref(request.src), describe_ref(request.dst)
        ranges = RangeList.from_proto(request.ranges)
        if not len(ranges):
            raise ArgumentError("transfer has no ranges")
        timeout_s = check_timeout(request.timeout_s or self._config.timeout_s, "timeout_s")
        if past := past_notify_bounds(request.notification, request.transfer_id):
            raise ArgumentError(past)
        src, src_peer = await self._resolve(request.src, request.local_only, call_timeout)
        if request.local_only and request.HasField("dst_descriptor"):
            dst = self._registry.current(request.dst_descriptor)  # resolved by the forwarding hmcd; a stale one of this node is refused
        else:
            dst, _ = await self._resolve(request.dst, False, call_timeout)
        ranges.check(src.size, dst.size)
        ranges.check_disjoint_dst()
        choice = self._choose(src, dst)
        transfer_id = request.transfer_id or f"{self._registry.epoch:x}-{uuid.uuid4().hex}"
        if transfer_id in self._active or transfer_id in self._finished:
            raise ArgumentError(f"transfer id {transfer_id!r} is already in use")
        status = daemon_pb2.TransferStatus(transfer_id=transfer_id, state=common_pb2.TRANSFER_STATE_PENDING, bytes_total=ranges.total, path=choice.path.value)

        src_local, dst_local = src_peer is None, self._registry.owner(dst.id) is not None
        read_here = choice.preferred_op == "read" and dst_local
        if read_here:
            op, local, remote = common_pb2.TRANSFER_OP_READ, dst, src
        elif src_local:
            op, local, remote = common_pb2.TRANSFER_OP_WRITE, src, dst
        else:  # src lives under a peer (never with local_only, which resolved src here)
            assert src_peer is not None
            self._refuse_if_closing()
            return await self._forward(_forwarded(request, transfer_id, dst), src_peer, status, call_timeout)

        session = self._registry.owner(local.id)
        if session is None:  # withdrawn while the other buffer was being resolved
            raise BufferWithdrawnError(f"buffer {local.id!r} was withdrawn while the transfer was being submitted")
        instruction = daemon_pb2.TransferInstruction(
            transfer_id=transfer_id, op=op, local_buffer_id=local.id, remote=remote, ranges=request.ranges, notification=request.notification, timeout_s=timeout_s
        )
        if session.process is not None or session.reads_daemon_clock:  # one clock with hmcd, or an agent that reads it on its own
            instruction.deadline_monotonic_s = time.monotonic() + timeout_s
        status.executor_agent = session.agent_id
        self._refuse_if_closing()  # close() has told the executors it knows of to stop: none may start now
        if not session.send(daemon_pb2.DaemonMessage(instruction=instruction)):
            raise BusyResourceError(f"agent {session.agent_id!r} has too many queued instructions")
        record = _Transfer(status=status, executor=session)
        self._track(record, timeout_s)
        log.debug("transfer %s: %s executes %s of %d bytes over %s", transfer_id, session.agent_id, common_pb2.TransferOp.Name(op), ranges.total, choice.path.value)
        return _copy(status)

    def _refuse_if_closing(self) -> None:
        if self._closing:
            raise UnavailableError("hmcd is stopping: it starts no new transfers")

    async def _forward(self, request: daemon_pb2.SubmitTransferRequest, peer: Peer, status: daemon_pb2.TransferStatus, call_timeout: float) -> daemon_pb2.TransferStatus:
        reply = await peer.submit(request, call_timeout)
        status.MergeFrom(reply)
        record = _Transfer(status=status, peer=peer)
        self._active[request.transfer_id] = record  # the peer enforces the deadline; this is a pointer to it
        log.debug("transfer %s forwarded to peer %s", request.transfer_id, peer.address)
        return _copy(status)

    def _track(self, record: _Transfer, timeout_s: float) -> None:
        self._active[record.status.transfer_id] = record
        self._metrics.transfer_moved(None, record.status.state)
        loop = asyncio.get_running_loop()
        record.timer = loop.call_later(timeout_s + _grace(timeout_s), self._expire, record, timeout_s)

    # -- reports and endings --------------------------------------------------------

    def report(self, session: AgentSession, report: daemon_pb2.TransferReport) -> None:
        """A TransferReport arrived on `session`'s stream."""
        record = self._active.get(report.transfer_id)
        if record is None or record.executor is not session:
            log.debug("ignoring report for transfer %r from agent %s (unknown, finished or not its executor)", report.transfer_id, session.agent_id)
            return
        if report.bytes_done:
            record.status.bytes_done = report.bytes_done
        if report.path:
            record.status.path = report.path
        if report.state == common_pb2.TRANSFER_STATE_CANCELLED and self._closing:
            self._finish(record, common_pb2.TRANSFER_STATE_FAILED, error_to_proto(UnavailableError("hmcd stopped (the executor stopped the transfer)")))
        elif report.state in _FINAL:
            self._finish(record, report.state, report.error if report.HasField("error") else None)
        elif report.state == common_pb2.TRANSFER_STATE_RUNNING and record.status.state != report.state:
            self._metrics.transfer_moved(record.status.state, report.state)
            record.status.state = report.state

    def agent_lost(self, session: AgentSession) -> None:
        """`session`'s stream ended: its unfinished transfers fail with PEER_LOST."""
        for record in [r for r in self._active.values() if r.executor is session]:
            error = BrokenResourceError(f"agent {session.agent_id!r} disconnected before finishing transfer {record.status.transfer_id}")
            self._finish(record, common_pb2.TRANSFER_STATE_FAILED, error_to_proto(error))

    def _expire(self, record: _Transfer, timeout_s: float) -> None:
        if not record.final:
            error = TimeoutError(f"transfer {record.status.transfer_id} did not finish within {timeout_s:g}s")
            self._tell_executor_cancel(record)
            self._finish(record, common_pb2.TRANSFER_STATE_FAILED, error_to_proto(error))

    def _finish(self, record: _Transfer, state: int, error: common_pb2.Error | None) -> None:
        if record.final:
            return
        if state == common_pb2.TRANSFER_STATE_FAILED and (error is None or error.code == 0):
            error = error_to_proto(HMCError(f"agent reported transfer {record.status.transfer_id} failed without a reason"))
        self._metrics.transfer_moved(record.status.state, state)
        record.status.state = state
        if error is not None:
            record.status.error.CopyFrom(error)
        if state == common_pb2.TRANSFER_STATE_DONE:
            record.status.bytes_done = record.status.bytes_done or record.status.bytes_total
            self._metrics.transfer_bytes.inc(record.status.bytes_done)
        if record.timer is not None:
            record.timer.cancel()
        record.done.set()
        transfer_id = record.status.transfer_id
        self._active.pop(transfer_id, None)
        self._finished[transfer_id] = record
        while len(self._finished) > self._keep_finished:
            self._finished.popitem(last=False)

    def _tell_executor_cancel(self, record: _Transfer) -> None:
        if record.executor is not None:
            record.executor.send(daemon_pb2.DaemonMessage(cancel=daemon_pb2.TransferCancel(transfer_id=record.status.transfer_id)))

    # -- wait and cancel ----------------------------------------------------------------

    def _get(self, transfer_id: str) -> _Transfer:
        if not transfer_id:
            raise ArgumentError("transfer id is empty")
        record = self._active.get(transfer_id) or self._finished.get(transfer_id)
        if record is None:
            epoch = _minted_epoch(transfer_id)
            if epoch is not None and epoch < self._registry.epoch:
                raise BrokenResourceError(
                    f"transfer {transfer_id} was accepted by hmcd on node {self._config.node} before it restarted (registry epoch {epoch}, "
                    f"now {self._registry.epoch}): its executor cancelled it on losing hmcd, or it had ended; its outcome is unknown. "
                    "Its destination ranges hold old bytes, new bytes or a mix; retrying the same ranges is safe"
                )
            raise ArgumentError(f"no transfer {transfer_id!r} on node {self._config.node} (unknown or long finished)")
        return record

    async def wait(self, ref: daemon_pb2.TransferRef, call_timeout: float) -> daemon_pb2.TransferStatus:
        """The status once final, or as it stands when `ref.timeout_s` (0: poll) runs out."""
        record = self._get(ref.transfer_id)
        if ref.timeout_s:  # 0: poll
            check_timeout(ref.timeout_s, "timeout_s")
        timeout = min(ref.timeout_s, call_timeout)
        if record.peer is not None and not record.final:
            forwarded = daemon_pb2.TransferRef(transfer_id=ref.transfer_id, timeout_s=max(timeout - 0.2, 0.0))
            self._update_forwarded(record, await record.peer.wait(forwarded, call_timeout))
        elif not record.final and timeout > 0:
            try:
                await asyncio.wait_for(record.done.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        return _copy(record.status)

    async def cancel(self, ref: daemon_pb2.TransferRef, call_timeout: float) -> daemon_pb2.TransferStatus:
        """Cancel an unfinished transfer (best effort: bytes may already have landed).

        The executor is told, and the transfer ends when it says so (CANCELLED, or DONE or FAILED when it got
        there first): only then has nothing more of it to land. The reply waits for that within the call's
        time; an executor that has not confirmed by then leaves the transfer running, for a later Wait to see
        end (an agent that stopped answering is failed PEER_LOST when its stream ends, or at the deadline).
        """
        record = self._get(ref.transfer_id)
        if record.peer is not None and not record.final:
            self._update_forwarded(record, await record.peer.cancel(ref, call_timeout))
        elif not record.final:
            if record.executor is None:  # never handed to an agent: nothing of it can land
                self._finish(record, common_pb2.TRANSFER_STATE_CANCELLED, error_to_proto(CancelledError(f"transfer {ref.transfer_id} was cancelled")))
            else:
                self._tell_executor_cancel(record)
                try:
                    await asyncio.wait_for(record.done.wait(), max(call_timeout - _CANCEL_MARGIN_S, 0.0))
                except asyncio.TimeoutError:
                    log.info("transfer %s: its executor has not confirmed the cancel yet; it stays %s", ref.transfer_id, common_pb2.TransferState.Name(record.status.state))
        return _copy(record.status)

    def _update_forwarded(self, record: _Transfer, reply: daemon_pb2.TransferStatus) -> None:
        record.status.CopyFrom(reply)
        if record.final:
            record.done.set()
            transfer_id = record.status.transfer_id
            self._active.pop(transfer_id, None)
            self._finished[transfer_id] = record

    async def close(self, grace: float) -> None:
        """hmcd is stopping: every unfinished local transfer fails, once its executor has been told to stop and has
        confirmed (or `grace` seconds passed): the failure must not be reported while bytes of it still land."""
        self._closing = True
        local = [record for record in self._active.values() if record.peer is None]
        for record in local:
            self._tell_executor_cancel(record)
        if local and grace > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(record.done.wait() for record in local)), grace)
        for record in local:
            error = UnavailableError(f"hmcd stopped (its executor had not confirmed it stopped the transfer within {grace:g}s)")
            self._finish(record, common_pb2.TRANSFER_STATE_FAILED, error_to_proto(error))
            log.info("hmcd stopping: transfer %s ended %s: %s", record.status.transfer_id, common_pb2.TransferState.Name(record.status.state), record.status.error.message)


def _forwarded(request: daemon_pb2.SubmitTransferRequest, transfer_id: str, dst: common_pb2.BufferDescriptor) -> daemon_pb2.SubmitTransferRequest:
    """The request as sent to the hmcd owning src: same id, dst already resolved, no further hops."""
    out = daemon_pb2.SubmitTransferRequest()
    out.CopyFrom(request)
    out.local_only = True
    out.transfer_id = transfer_id
    out.dst_descriptor.CopyFrom(dst)
    return out


def _copy(status: daemon_pb2.TransferStatus) -> daemon_pb2.TransferStatus:
    out = daemon_pb2.TransferStatus()
    out.CopyFrom(status)
    return out
