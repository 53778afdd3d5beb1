"""The agent's side of hmcd's third-party transfers (`hmc.agent._instructions`): a cancel stops the running transfer
before its end is reported, and a cancel that comes before the instruction started keeps it from starting."""

from __future__ import annotations

import threading

from hmc.agent._instructions import Instructions
from hmc.errors import CancelledError, ErrorCode
from hmc.v1 import common_pb2, daemon_pb2


class _Handle:
    """A transfer that runs until cancelled (bounded: it fails the test rather than hang)."""

    path = "ipc"
    bytes_done = 0

    def __init__(self) -> None:
        self.stopped = threading.Event()

    def cancel(self) -> None:
        self.stopped.set()

    def wait(self) -> None:
        assert self.stopped.wait(10), "the cancel never reached the running transfer"
        raise CancelledError("cancelled")


class _Buffers:
    def get(self, buffer_id: str) -> object:
        return object()


def _instruction(transfer_id: str) -> daemon_pb2.TransferInstruction:
    ranges = common_pb2.RangeList(src_offsets=(0).to_bytes(8, "little"), dst_offsets=(0).to_bytes(8, "little"), lengths=(8).to_bytes(8, "little"))
    return daemon_pb2.TransferInstruction(transfer_id=transfer_id, op=common_pb2.TRANSFER_OP_WRITE, ranges=ranges)


def test_a_cancel_stops_the_running_transfer_before_it_is_reported_cancelled() -> None:
    reports: list[daemon_pb2.TransferReport] = []
    reported = threading.Event()
    started = threading.Event()
    handle = _Handle()

    def submit(*args: object) -> _Handle:
        started.set()
        return handle

    instructions = Instructions(submit, _Buffers(), lambda r: (reports.append(r), reported.set()))  # type: ignore[arg-type]
    instructions.on_instruction(_instruction("t-run"))
    assert started.wait(10)
    instructions.on_cancel("t-run")
    assert reported.wait(10)
    (report,) = reports
    assert handle.stopped.is_set() and report.state == common_pb2.TRANSFER_STATE_CANCELLED and report.error.code == ErrorCode.CANCELLED
    instructions.close()


def test_a_cancel_before_the_instruction_started_keeps_it_from_starting() -> None:
    reports: list[daemon_pb2.TransferReport] = []
    reported = threading.Event()
    submitted: list[object] = []
    instructions = Instructions(lambda *a: submitted.append(a), _Buffers(), lambda r: (reports.append(r), reported.set()))  # type: ignore[arg-type]
    instructions.on_cancel("t-early")
    instructions.on_instruction(_instruction("t-early"))
    assert reported.wait(10)
    assert not submitted and reports[0].state == common_pb2.TRANSFER_STATE_CANCELLED and reports[0].error.code == ErrorCode.CANCELLED
    instructions.close()
