"""Lending pages to TCP: a payload's pages reach a socket without being copied (vmsplice + splice).

A plain send copies every byte into socket buffers before the peer's receive
copies it again. Lent instead, the pages of a payload are mapped into a pipe
(vmsplice) and handed from there to the socket (splice): TCP sends straight
from them, and the only copy left is the receiver's (docs/decisions.md has the
measurements).

The price is that the kernel reads the pages after the call returns, until the
peer has the bytes. Only callers that keep the memory unchanged until the peer
acknowledged it may lend: a staged WRITE, whose transfer completes on the
owner's replies. Memory the kernel cannot lend (pages a device driver mapped,
say) is left to the caller to send with a copy, from the first byte not lent.

Concurrency: one Lender per stream, used under the stream's send lock.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import select
import socket
import time

import numpy as np

__all__ = ["LEND_MIN_BYTES", "Lender"]

LEND_MIN_BYTES = 256 << 10
"""Payloads below this are sent with a copy: a few more syscalls cost more than copying a few pages."""
_PIPE_BYTES = 1 << 20
"""Asked-for pipe capacity (the unprivileged maximum by default); what the kernel grants is used."""
_IOV_MAX = os.sysconf("SC_IOV_MAX")
_F_SETPIPE_SZ = 1031
_SPLICE_F_NONBLOCK = 2
_SPLICE_F_MORE = 4
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EBADF)

_libc = ctypes.CDLL(None, use_errno=True)
_vmsplice = getattr(_libc, "vmsplice", None)
if _vmsplice is not None:
    _vmsplice.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_uint)
    _vmsplice.restype = ctypes.c_ssize_t


class Lender:
    """Lends the pages of iovec rows to one socket, through a pipe of its own."""

    def __init__(self) -> None:
        self._pipe: tuple[int, int] | None = None
        self.usable = _vmsplice is not None and hasattr(os, "splice")
        """False once the kernel refused to lend (or cannot): every payload is then sent with a copy."""

    def send(self, sock: socket.socket, rows: np.ndarray, deadline: float) -> int:
        """Lend the bytes of `rows` (C-ordered uint64 (address, length) pairs) to `sock` in order; returns how many were
        lent: all of them, or fewer where the kernel would not lend the rest (the caller sends that with a copy).

        `sock` must be non-blocking (a socket with a timeout is). Raises OSError,
        socket.timeout once `deadline` (monotonic) passes, as a send would; the
        stream is then mid-frame and must be dropped.
        """
        if not self.usable or not self._open():
            return 0
        assert self._pipe is not None
        ends = np.cumsum(rows[:, 1], dtype=np.int64)
        total = int(ends[-1]) if ends.size else 0
        done = row = 0
        while done < total:
            skip = done - (int(ends[row]) - int(rows[row, 1]))
            address, length = int(rows[row, 0]), int(rows[row, 1])
            rows[row, 0], rows[row, 1] = address + skip, length - skip
            try:
                lent = _vmsplice(self._pipe[1], rows.ctypes.data + 16 * row, min(_IOV_MAX, len(rows) - row), _SPLICE_F_NONBLOCK)  # type: ignore[misc]
            finally:
                rows[row, 0], rows[row, 1] = address, length
            if lent <= 0:
                if lent < 0 and ctypes.get_errno() in _UNSUPPORTED:
                    self.usable = False
                return done
            done += lent
            self._drain(sock, lent, deadline, more=done < total)
            row = int(np.searchsorted(ends, done, side="right"))
        return done

    def _open(self) -> bool:
        if self._pipe is not None:
            return True
        try:
            self._pipe = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            self.usable = False
            return False
        try:
            fcntl.fcntl(self._pipe[1], _F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:
            pass  # over the user's pipe quota: the default capacity lends too, in smaller steps
        return True

    def _drain(self, sock: socket.socket, nbytes: int, deadline: float, *, more: bool) -> None:
        """Splice `nbytes` from the pipe into the socket, waiting for room until `deadline`."""
        assert self._pipe is not None
        flags = _SPLICE_F_MORE if more else 0
        poller: select.poll | None = None
        while nbytes:
            try:
                nbytes -= os.splice(self._pipe[0], sock.fileno(), nbytes, flags=flags)
                continue
            except BlockingIOError:
                pass
            if poller is None:
                poller = select.poll()
                poller.register(sock.fileno(), select.POLLOUT)
            wait_ms = (deadline - time.monotonic()) * 1000
            if wait_ms <= 0:
                raise socket.timeout("timed out lending pages to the socket")
            poller.poll(max(1, int(wait_ms)))

    def close(self) -> None:
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None
