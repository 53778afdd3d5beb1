"""Third-party transfers: hmcd instructs this agent to move ranges of one of its buffers.

The agent runs each instruction like its own write or read (same validation, path
choice and notification), waits for it, and reports the outcome to hmcd as a
TransferReport carrying the typed error's code. A cancel from hmcd stops the
transfer (the transport's stop: nothing of it lands afterwards) and only then is
it reported CANCELLED; hmcd calls it ended when that report arrives. A cancel for an
instruction still queued here keeps it from starting. Losing hmcd (`abandon`) cancels
every running instruction and refuses those queued before the loss: hmcd has already
given its verdict on them (failed), so none may go on writing after it.

Concurrency: instructions and cancels arrive on the hmcd link's thread and are handed
at once to a small executor ("hmc-instr-N"), or a thread of their own for a cancel
("hmc-instr-cancel": a transport's stop may wait for copies in flight), so the link
never blocks. `_lock` guards the executor's creation, the running handles, the
cancels seen before their transfer started and the count of hmcd losses (`_losses`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable

from hmc.agent._buffers import BufferTable, ConnBuffer
from hmc.agent._transfer import TransferHandle
from hmc.errors import CancelledError, HMCError, TimeoutError
from hmc.transport._base import TransferOp
from hmc.transport._ranges import RangeList
from hmc.v1 import common_pb2, daemon_pb2

__all__ = ["Instructions"]

Submit = Callable[[TransferOp, ConnBuffer, common_pb2.BufferDescriptor, RangeList, "bytes | None", "float | None", str], TransferHandle]
_EARLY_CANCELS = 4096
"""Cancels remembered for transfers that had not started here (oldest forgotten first)."""


class Instructions:
    """Runs hmcd's transfer instructions off the link's thread and reports them back."""

    def __init__(self, submit: Submit, buffers: BufferTable, report: Callable[[daemon_pb2.TransferReport], None], *, workers: int = 2) -> None:
        self._submit = submit
        self._buffers = buffers
        self._report = report
        self._workers = workers
        self._lock = threading.Lock()  # guards _executor, _running, _early and _losses
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._running: dict[str, TransferHandle] = {}
        self._early: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._losses = 0
        """How many times hmcd was lost: an instruction received before the latest loss never starts."""

    def on_instruction(self, instruction: daemon_pb2.TransferInstruction) -> None:
        """The link's callback: queue the instruction and return at once."""
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self._workers, thread_name_prefix="hmc-instr")
            executor, losses = self._executor, self._losses
        executor.submit(self._run, instruction, losses)

    def on_cancel(self, transfer_id: str) -> None:
        """The link's callback: stop the transfer (on a thread of its own) or keep it from starting."""
        with self._lock:
            handle = self._running.get(transfer_id)
            if handle is None:
                self._early[transfer_id] = None
                while len(self._early) > _EARLY_CANCELS:
                    self._early.popitem(last=False)
                return
        _cancel_aside(handle)

    def abandon(self) -> None:
        """The link to hmcd was lost (on the link's thread, before it attaches again: an instruction of the next hmcd
        comes after this): cancel every running instruction, each on a thread of its own, and refuse every one
        received before now when its turn comes."""
        with self._lock:
            self._losses += 1
            handles = list(self._running.values())
        for handle in handles:
            _cancel_aside(handle)

    def _take_early(self, transfer_id: str, losses: int) -> bool:
        """Whether a cancel came for `transfer_id` before its handle was known here (forgetting it), or hmcd was
        lost since the instruction came (`losses`: the count then)."""
        with self._lock:
            if transfer_id not in self._early:
                return losses != self._losses
            del self._early[transfer_id]
            return True

    def _run(self, instruction: daemon_pb2.TransferInstruction, losses: int) -> None:
        transfer_id = instruction.transfer_id
        report = daemon_pb2.TransferReport(transfer_id=transfer_id)
        try:
            if self._take_early(transfer_id, losses):
                raise CancelledError(f"transfer {transfer_id} was cancelled (or hmcd lost) before it started")
            local = self._buffers.get(instruction.local_buffer_id)
            ranges = RangeList.from_proto(instruction.ranges)
            op = TransferOp.READ if instruction.op == common_pb2.TRANSFER_OP_READ else TransferOp.WRITE
            notify = instruction.notification or None
            handle = self._submit(op, local, instruction.remote, ranges, notify, _timeout(instruction), transfer_id)
            report.path = handle.path
            with self._lock:
                self._running[transfer_id] = handle
            try:
                if self._take_early(transfer_id, losses):  # came while it was being submitted
                    handle.cancel()
                handle.wait()
            finally:
                with self._lock:
                    self._running.pop(transfer_id, None)
            report.bytes_done = handle.bytes_done
            report.state = common_pb2.TRANSFER_STATE_DONE
        except HMCError as exc:
            report.state = common_pb2.TRANSFER_STATE_CANCELLED if isinstance(exc, CancelledError) else common_pb2.TRANSFER_STATE_FAILED
            report.error.code = int(exc.code)
            report.error.message = str(exc)
        self._report(report)

    def close(self) -> None:
        """Drop queued instructions; running ones finish on their own deadline."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


def _cancel_aside(handle: TransferHandle) -> None:
    """Cancel `handle` on a thread of its own ("hmc-instr-cancel": a transport's stop may wait for copies in flight)."""
    threading.Thread(target=handle.cancel, name="hmc-instr-cancel", daemon=True).start()


def _timeout(instruction: daemon_pb2.TransferInstruction) -> float | None:
    """The transfer's timeout: what is left until hmcd's deadline where it gave one (an agent stopped while the
    instruction waited finds it passed: TimeoutError, nothing moved), else its own timeout (None: the agent's)."""
    timeout = instruction.timeout_s or None
    if instruction.deadline_monotonic_s:
        left = instruction.deadline_monotonic_s - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"transfer {instruction.transfer_id} reached its deadline before this agent could start it")
        timeout = left if timeout is None else min(timeout, left)
    return timeout
