"""Third-party transfers: hmcd instructs this agent to move ranges of one of its buffers.

The agent runs each instruction like its own write or read (same validation, path
choice and notification), waits for it, and reports the outcome to hmcd as a
TransferReport carrying the typed error's code.

Concurrency: instructions arrive on the hmcd link's thread and are handed at once
to a small executor ("hmc-instr-N"), so the link never blocks on a transfer.
`_lock` guards the executor's creation.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

from hmc.agent._buffers import BufferTable, ConnBuffer
from hmc.agent._transfer import TransferHandle
from hmc.errors import HMCError
from hmc.transport._base import TransferOp
from hmc.transport._ranges import RangeList
from hmc.v1 import common_pb2, daemon_pb2

__all__ = ["Instructions"]

Submit = Callable[[TransferOp, ConnBuffer, common_pb2.BufferDescriptor, RangeList, "bytes | None", "float | None", str], TransferHandle]


class Instructions:
    """Runs hmcd's transfer instructions off the link's thread and reports them back."""

    def __init__(self, submit: Submit, buffers: BufferTable, report: Callable[[daemon_pb2.TransferReport], None], *, workers: int = 2) -> None:
        self._submit = submit
        self._buffers = buffers
        self._report = report
        self._workers = workers
        self._lock = threading.Lock()  # guards _executor
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def on_instruction(self, instruction: daemon_pb2.TransferInstruction) -> None:
        """The link's callback: queue the instruction and return at once."""
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self._workers, thread_name_prefix="hmc-instr")
            executor = self._executor
        executor.submit(self._run, instruction)

    def _run(self, instruction: daemon_pb2.TransferInstruction) -> None:
        report = daemon_pb2.TransferReport(transfer_id=instruction.transfer_id)
        try:
            local = self._buffers.get(instruction.local_buffer_id)
            ranges = RangeList.from_proto(instruction.ranges)
            op = TransferOp.READ if instruction.op == common_pb2.TRANSFER_OP_READ else TransferOp.WRITE
            notify = instruction.notification or None
            handle = self._submit(op, local, instruction.remote, ranges, notify, instruction.timeout_s or None, instruction.transfer_id)
            report.path = handle.path
            handle.wait()
            report.bytes_done = handle.bytes_done
            report.state = common_pb2.TRANSFER_STATE_DONE
        except HMCError as exc:
            report.state = common_pb2.TRANSFER_STATE_FAILED
            report.error.code = int(exc.code)
            report.error.message = str(exc)
        self._report(report)

    def close(self) -> None:
        """Drop queued instructions; running ones finish on their own deadline."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
