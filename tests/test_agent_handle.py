"""Transfer handles: states, deadlines, cancellation, exactly-once completion; the notification inbox."""

from __future__ import annotations

import threading
import time

import pytest

from hmc.agent import Notification, TransferHandle, TransferState
from hmc.agent._transfer import NotificationInbox
from hmc.errors import ArgumentError, BrokenResourceError, BusyResourceError, CancelledError, TimeoutError
from hmc.v1 import common_pb2


def test_states_progress_and_finish_once() -> None:
    handle = TransferHandle("staged", 100, time.monotonic() + 5)
    assert handle.state is TransferState.PENDING and not handle.done()
    handle.set_running()
    handle.add_bytes(40)
    assert handle.state is TransferState.RUNNING and handle.bytes_done == 40
    handle.finish()
    handle.finish(BrokenResourceError("late"))  # ignored: first completion wins
    assert handle.state is TransferState.DONE and handle.bytes_done == 100 and handle.error is None
    handle.wait()
    assert handle.state.to_proto() == common_pb2.TRANSFER_STATE_DONE


def test_failure_is_raised_to_every_waiter() -> None:
    handle = TransferHandle("ipc", 1, time.monotonic() + 5)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            handle.wait()
        except BrokenResourceError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    handle.finish(BrokenResourceError("peer died"))
    for t in threads:
        t.join(5)
    assert len(errors) == 3 and handle.state is TransferState.FAILED


def test_short_wait_timeout_leaves_the_transfer_running() -> None:
    handle = TransferHandle("staged", 1, time.monotonic() + 5)
    with pytest.raises(TimeoutError):
        handle.wait(0.01)
    assert handle.state is TransferState.PENDING
    handle.finish()
    handle.wait(0.01)


def test_deadline_fails_the_transfer_and_runs_the_release_hook() -> None:
    released = []
    handle = TransferHandle("staged", 1, time.monotonic() + 0.05)
    handle.on_cancel = lambda: released.append(True)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        handle.wait()
    assert time.monotonic() - started < 1.0
    assert handle.state is TransferState.FAILED and released == [True]
    handle.finish()  # a transport finishing late changes nothing
    assert handle.state is TransferState.FAILED


def test_cancel() -> None:
    handle = TransferHandle("staged", 1, time.monotonic() + 5)
    handle.cancel()
    assert handle.state is TransferState.CANCELLED and handle.cancelled
    with pytest.raises(CancelledError):
        handle.wait()
    done = TransferHandle.finished("ipc", 4096)
    done.cancel()
    assert done.state is TransferState.DONE and done.done()
    done.wait()


def test_transfer_ids_are_unique_and_stable() -> None:
    ids = {TransferHandle.finished("local", 1).id for _ in range(1000)}
    assert len(ids) == 1000
    handle = TransferHandle("local", 1, 0.0, "given-id")
    assert handle.id == handle.id == "given-id"


def test_inbox_delivers_each_transfer_once_and_drains() -> None:
    inbox = NotificationInbox(1 << 20, remember=4)
    note = Notification("b", "t1", b"p", "a")
    assert inbox.deliver(note) and not inbox.deliver(note)
    assert inbox.drain(0) == [note] and inbox.drain(0) == []
    threading.Timer(0.05, inbox.deliver, args=(Notification("b", "t2", b"", "a"),)).start()
    assert [n.transfer_id for n in inbox.drain(5.0)] == ["t2"]


def test_a_full_inbox_refuses_a_notification_typed_and_takes_it_once_drained() -> None:
    inbox = NotificationInbox(10, remember=3)
    assert inbox.deliver(Notification("b", "t1", b"123456", "a"))
    with pytest.raises(BusyResourceError, match="6 bytes"):  # 6 + 5 bytes > 10
        inbox.deliver(Notification("b", "t2", b"abcde", "a"))
    assert inbox.deliver(Notification("b", "t3", b"wxyz", "a"))  # 6 + 4 fits exactly
    assert [n.transfer_id for n in inbox.drain(0)] == ["t1", "t3"]
    assert inbox.deliver(Notification("b", "t2", b"abcde", "a"))  # nothing was remembered of the refused one
    assert not inbox.deliver(Notification("b", "t1", b"", "a"))  # delivered ones still are
    assert inbox.deliver(Notification("b", "t4", b"", "a")) and inbox.deliver(Notification("b", "t5", b"", "a"))
    with pytest.raises(BusyResourceError, match="3 notifications"):  # empty ones count too: at most `remember` held
        inbox.deliver(Notification("b", "t6", b"", "a"))
    assert [n.payload for n in inbox.drain(0)] == [b"abcde", b"", b""]


def test_wait_and_done_complete_a_driven_transfer_on_the_callers_thread() -> None:
    handle = TransferHandle("ipc", 10, time.monotonic() + 5)
    calls: list[tuple[str, float]] = []

    def drive(deadline: float) -> None:
        calls.append((threading.current_thread().name, deadline))
        if len(calls) == 2:
            handle.finish()

    handle.drive_with(drive)
    assert not handle.done()  # one look, with a deadline already past
    assert calls[0][1] <= time.monotonic()
    handle.wait()
    assert handle.state is TransferState.DONE and handle.bytes_done == 10
    assert [name for name, _ in calls] == [threading.current_thread().name] * 2
    assert handle.done() and len(calls) == 2  # a finished handle drives no more


def test_a_driven_wait_keeps_its_timeout_and_the_deadline() -> None:
    handle = TransferHandle("ipc", 1, time.monotonic() + 0.2)
    seen: list[float] = []

    def drive(deadline: float) -> None:  # never done: returns at the deadline it is given
        seen.append(deadline)
        time.sleep(max(deadline - time.monotonic(), 0.0))

    handle.drive_with(drive)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="still running"):
        handle.wait(0.02)
    assert handle.state is TransferState.PENDING and seen[0] <= started + 0.05
    with pytest.raises(TimeoutError, match="deadline"):
        handle.wait()
    assert handle.state is TransferState.FAILED and time.monotonic() - started < 1.0


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, 0, 0.0, "1", True, 2e6, 10**400, [1.0]], ids=repr)
def test_a_bad_wait_timeout_is_refused_typed_and_the_transfer_left_alone(timeout: object) -> None:
    released: list[bool] = []
    handle = TransferHandle("staged", 1, time.monotonic() + 5)
    handle.on_cancel = lambda: released.append(True)
    with pytest.raises(ArgumentError):
        handle.wait(timeout)  # type: ignore[arg-type]
    assert handle.state is TransferState.PENDING and handle.error is None and not released
    handle.finish()
    handle.wait(0.5)
    with pytest.raises(ArgumentError):  # a finished handle checks too
        handle.wait(timeout)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError):
        TransferHandle.finished("ipc", 1).wait(timeout)  # type: ignore[arg-type]


def test_wait_takes_any_real_number_of_seconds() -> None:
    import fractions

    import numpy as np

    handle = TransferHandle.finished("ipc", 1)
    for timeout in (1, 0.5, np.float32(0.5), np.int64(2), fractions.Fraction(1, 3), 1e6):
        handle.wait(timeout)  # type: ignore[arg-type]
    pending = TransferHandle("staged", 1, time.monotonic() + 5)
    with pytest.raises(TimeoutError, match="still running"):
        pending.wait(np.float64(0.01))  # type: ignore[arg-type]


def test_the_cancel_hook_runs_once_and_before_the_end_is_visible() -> None:
    seen: list[TransferState] = []
    handle = TransferHandle("staged", 1, time.monotonic() + 5)

    def hook() -> None:
        seen.append(handle.state)  # the transport stops the transfer while it still counts as running
        handle.cancel()  # a transport that cancels from inside its own hook does not run it again

    handle.on_cancel = hook
    handle.cancel()
    handle.cancel()
    assert seen == [TransferState.PENDING] and handle.state is TransferState.CANCELLED and handle.on_cancel is None
