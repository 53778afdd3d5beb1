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


def test_an_instruction_read_past_hmcds_deadline_is_refused_and_one_before_it_gets_what_is_left() -> None:
    """hmcd's deadline is on the host's monotonic clock: an agent that was stopped while the instruction waited must
    not start it with a timeout of its own (it would move bytes after hmcd reported the transfer timed out)."""
    import time

    reports: list[daemon_pb2.TransferReport] = []
    reported = threading.Event()
    timeouts: list[float | None] = []

    class _Done:
        path, bytes_done = "ipc", 8

        def wait(self) -> None:
            pass

    def submit(op: object, local: object, remote: object, ranges: object, notify: object, timeout: float | None, transfer_id: str) -> _Done:
        timeouts.append(timeout)
        return _Done()

    def report(r: daemon_pb2.TransferReport) -> None:
        reports.append(r)
        if len(reports) == 2:
            reported.set()

    instructions = Instructions(submit, _Buffers(), report)  # type: ignore[arg-type]
    late, timely = _instruction("t-late"), _instruction("t-timely")
    late.timeout_s = timely.timeout_s = 30.0
    late.deadline_monotonic_s = time.monotonic() - 0.001
    timely.deadline_monotonic_s = time.monotonic() + 5.0
    instructions.on_instruction(late)
    instructions.on_instruction(timely)
    assert reported.wait(10)
    by_id = {r.transfer_id: r for r in reports}
    assert by_id["t-late"].state == common_pb2.TRANSFER_STATE_FAILED and by_id["t-late"].error.code == ErrorCode.TIMEOUT
    assert by_id["t-timely"].state == common_pb2.TRANSFER_STATE_DONE
    (timeout,) = timeouts  # the late one never reached submit
    assert timeout is not None and 0 < timeout <= 5.0
    instructions.close()


def test_losing_hmcd_cancels_the_running_instruction_and_refuses_the_queued_one() -> None:
    """hmcd fails its transfers when it goes: an instruction running for it must stop, and one queued behind it
    must never start (each would land bytes after the verdict). One received after the loss runs."""
    reports: dict[str, daemon_pb2.TransferReport] = {}
    reported = {tid: threading.Event() for tid in ("t-running", "t-queued", "t-after")}
    started = threading.Event()
    handle = _Handle()
    submitted: list[str] = []

    class _Done:
        path, bytes_done = "ipc", 8

        def wait(self) -> None:
            pass

    def submit(*args: object) -> object:
        submitted.append(str(args[-1]))
        if args[-1] == "t-running":
            started.set()
            return handle
        return _Done()

    def report(r: daemon_pb2.TransferReport) -> None:
        reports[r.transfer_id] = r
        reported[r.transfer_id].set()

    instructions = Instructions(submit, _Buffers(), report, workers=1)  # type: ignore[arg-type]
    instructions.on_instruction(_instruction("t-running"))
    assert started.wait(10)
    instructions.on_instruction(_instruction("t-queued"))  # waits for the one worker
    instructions.abandon()
    assert reported["t-running"].wait(10) and reported["t-queued"].wait(10)
    assert handle.stopped.is_set() and reports["t-running"].state == common_pb2.TRANSFER_STATE_CANCELLED
    assert reports["t-queued"].state == common_pb2.TRANSFER_STATE_CANCELLED and reports["t-queued"].error.code == ErrorCode.CANCELLED
    instructions.on_instruction(_instruction("t-after"))
    assert reported["t-after"].wait(10) and reports["t-after"].state == common_pb2.TRANSFER_STATE_DONE
    assert submitted == ["t-running", "t-after"]
    instructions.close()
