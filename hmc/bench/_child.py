"""Control messages between `hmc bench` and the child processes it spawns.

Every child is a multiprocessing "spawn" process talking tuples over a Pipe:
`(kind, *fields)`, or `("error", traceback)` when it failed. Every receive is
bounded, and notices a child that died without a word.

Concurrency: each pipe end is used by one thread of one process.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from hmc.errors import BrokenResourceError, TimeoutError

__all__ = ["MESSAGE_TIMEOUT_S", "RUN_TIMEOUT_S", "receive", "reap", "send_error"]

MESSAGE_TIMEOUT_S = 60.0
"""One iteration batch or one control message."""
RUN_TIMEOUT_S = 900.0
"""A child idling between commands."""


def receive(conn: Connection, kind: str, timeout: float = MESSAGE_TIMEOUT_S, procs: Sequence[BaseProcess] = ()) -> tuple[Any, ...]:
    """The next message, which must be of `kind` ('' accepts any); typed errors otherwise."""
    deadline = time.monotonic() + timeout
    try:
        while not conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
            dead = [p.exitcode for p in procs if p.exitcode is not None]
            if dead and not conn.poll(0):
                raise BrokenResourceError(f"benchmark child exited (exit codes {dead}) before sending {kind or 'a reply'!r}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no {kind or 'reply'!r} from the benchmark child within {timeout:.0f} s")
        message = conn.recv()
    except (EOFError, OSError) as exc:
        raise BrokenResourceError(f"benchmark child closed its pipe: {exc}") from exc
    if message[0] == "error":
        raise BrokenResourceError(f"benchmark child failed:\n{message[1]}")
    if kind and message[0] != kind:
        raise BrokenResourceError(f"benchmark child sent {message[0]!r}, expected {kind!r}")
    return tuple(message)


def send_error(*conns: Connection) -> None:
    """In a child's `except BaseException`: tell the parent(s) what went wrong (best effort)."""
    text = traceback.format_exc()
    for conn in conns:
        try:
            conn.send(("error", text))
        except OSError:
            pass


def reap(*procs: BaseProcess, timeout: float = 10.0) -> None:
    """Join each child; kill the ones that do not exit in time."""
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
