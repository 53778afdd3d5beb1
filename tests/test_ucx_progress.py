"""The thread that drives a UCX worker (`hmc.transport._ucx_progress.Progress`), on a real UCP worker of the libucx
wheel: a command queued while the path closes is run, and its wake-up never reaches a closed descriptor. Skipped,
with the reason, where the binding is not built."""

from __future__ import annotations

import os
import threading

import pytest

from hmc.errors import ClosedResourceError, UnsupportedError

try:
    from hmc.transport import _ucx_engine as ucx

    ucx.load()
    WHY = ""
except UnsupportedError as exc:
    WHY = str(exc)

pytestmark = pytest.mark.skipif(bool(WHY), reason=f"UCX binding: {WHY}")


def test_a_command_queued_as_the_path_closes_runs_and_its_wake_up_finds_the_eventfd_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """submit() stalls between queueing its command and waking the thread while close() runs on another thread. The
    wake-up is written under the lock the thread closes the eventfd under, so close() waits for it: no EBADF, and no
    write to whatever file took the descriptor's number. (Before, close() finished meanwhile and the write failed.)"""
    from hmc.transport._ucx_progress import Progress

    progress = Progress(ucx.Worker(wakeup=True), "hmc-ucx-test")
    caller = threading.current_thread()
    closer = threading.Thread(target=progress.close, name="hmc-test-closer", daemon=True)
    write = os.eventfd_write

    def stalled_write(fd: int, value: int) -> None:
        if threading.current_thread() is caller and closer.ident is None:
            closer.start()
            closer.join(0.5)  # a close that could finish now would close the eventfd under this write
        write(fd, value)

    monkeypatch.setattr(os, "eventfd_write", stalled_write)
    ran = threading.Event()
    progress.submit(ran.set)
    closer.join(10.0)
    assert not closer.is_alive(), "close() did not finish"
    assert ran.is_set(), "a command queued before close() was dropped"
    with pytest.raises(ClosedResourceError):
        progress.submit(ran.set)
    progress.close()  # idempotent
