"""`hmc demo`'s timed wait: it ends with the transfer, not at the next look, and it never outlives the deadline."""

from __future__ import annotations

import io
import time

import pytest

from hmc.agent._transfer import TransferHandle, TransferState
from hmc.cli import _demo
from hmc.cli._output import Progress
from hmc.errors import BrokenResourceError, TimeoutError


class _Recorder(Progress):
    """A progress display that runs `hook` on each redraw (the transfer moves on while the demo waits)."""

    def __init__(self, hook: object = None) -> None:
        super().__init__(1 << 20, "test", out=io.StringIO(), enabled=False)
        self.redraws = 0
        self._hook = hook

    def update(self, done: int, note: str = "") -> None:
        super().update(done, note)
        self.redraws += 1
        if callable(self._hook):
            self._hook()


def _no_sleep(seconds: float) -> None:
    raise AssertionError(f"the demo slept {seconds} s between looks at a transfer")


def test_the_wait_is_on_the_handle_and_returns_with_the_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Old behaviour: done(), then time.sleep(0.02): a transfer that ended meanwhile was timed a whole interval long
    (a 1 GiB ipc write of 0.5 ms read as 20.8 ms). Now each look waits on the handle itself."""
    monkeypatch.setattr(time, "sleep", _no_sleep)
    handle = TransferHandle("ipc", 1 << 20, time.monotonic() + 60)
    handle.set_running()

    def move_on() -> None:  # the first redraw sees half of it moved, the second its end
        if progress.redraws == 1:
            handle.add_bytes(1 << 19)
        else:
            handle.finish()

    progress = _Recorder(hook=move_on)
    _demo._wait(handle, progress)
    assert handle.state is TransferState.DONE and handle.bytes_done == 1 << 20
    assert progress.redraws == 2 and progress.done == 1 << 19  # redrawn while it ran; the demo draws the end itself


def test_a_finished_transfer_returns_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "sleep", _no_sleep)
    progress = _Recorder()
    _demo._wait(TransferHandle.finished("ucx", 4096), progress)
    assert progress.redraws == 0


def test_a_failed_transfer_raises_its_own_error() -> None:
    handle = TransferHandle("staged", 1 << 20, time.monotonic() + 60)
    progress = _Recorder(hook=lambda: handle.finish(BrokenResourceError("the peer left")))
    with pytest.raises(BrokenResourceError, match="the peer left"):
        _demo._wait(handle, progress)
    assert handle.state is TransferState.FAILED


def test_a_transfer_nobody_finishes_fails_at_its_deadline() -> None:
    """The loop's looks are shorter than the deadline; the last one reaches it, fails the transfer and raises."""
    handle = TransferHandle("staged", 1 << 20, time.monotonic() + 5 * _demo._PROGRESS_S)
    progress = _Recorder()
    with pytest.raises(TimeoutError, match="missed its deadline"):
        _demo._wait(handle, progress)
    assert handle.state is TransferState.FAILED and progress.redraws >= 1
