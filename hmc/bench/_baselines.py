"""Two baselines for `hmc bench`: single-process memcpy and a plain Python TCP socket.

`memcpy_rows`: one process, `np.copyto` per range between two preallocated
arrays (the ceiling for any host path). `socket_rows`: this process sends
(`sendall` of memoryviews of the source ranges) over 127.0.0.1 to a spawned
receiver that `recv_into`s each destination range and acks one byte per
iteration, so an iteration ends when every byte has landed. Both are WRITE only
(READ would be the same reversed). Sources are random, destinations poisoned per
workload; after the timed loop the destination ranges are checked (directly, or
by digest computed in the receiver).

Concurrency: the caller's thread; the socket receiver is a child process.
"""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

import numpy as np

from hmc.bench._child import MESSAGE_TIMEOUT_S, RUN_TIMEOUT_S, reap, receive, send_error
from hmc.bench._timing import Row, Timing, make_row, measure
from hmc.bench._workloads import POISON, SEED, Workload, make_ranges, random_bytes
from hmc.errors import BrokenResourceError
from hmc.agent._peer_process import ranges_digest

__all__ = ["memcpy_rows", "socket_rows"]

OnRow = Callable[[Row], None]
_SOCKET_BUFFER = 64 << 20
"""Requested SO_SNDBUF/SO_RCVBUF; Linux clamps it to 2 * net.core.{w,r}mem_max."""


def memcpy_rows(workloads: Sequence[Workload], timing: Timing, on_row: OnRow) -> list[Row]:
    """Single-process `np.copyto` of every range (one call per range); WRITE rows."""
    size = max(w.total_size for w in workloads)
    src, dst = random_bytes(size, SEED), np.empty(size, dtype=np.uint8)
    rows = []
    for w in workloads:
        so, do, ln = make_ranges(w)
        dst[: w.total_size].fill(POISON)
        pairs = [(dst[d : d + n], src[s : s + n]) for s, d, n in zip(so.tolist(), do.tolist(), ln.tolist())]
        copyto = np.copyto

        def step() -> None:
            for d_view, s_view in pairs:
                copyto(d_view, s_view)

        times = measure(step, timing)
        verified = all(np.array_equal(d_view, s_view) for d_view, s_view in pairs)
        rows.append(make_row("memcpy", "np.copyto", "WRITE", w, times, verified))
        on_row(rows[-1])
    return rows


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _receive_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the sender closed the socket")
        got += n


def _socket_receiver(conn: Connection, port: int, size: int) -> None:
    """Child: receive each announced batch of iterations into a poisoned buffer, ack each."""
    try:
        dst = np.empty(size, dtype=np.uint8)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            _tune(sock)
            sock.settimeout(MESSAGE_TIMEOUT_S)
            sock.connect(("127.0.0.1", port))
            views: list[memoryview] = []
            do = ln = np.zeros(0, dtype=np.int64)
            while (message := receive(conn, "", RUN_TIMEOUT_S))[0] != "quit":
                if message[0] == "workload":
                    _, do, ln = make_ranges(message[1])
                    dst[: message[1].total_size].fill(POISON)
                    views = [memoryview(dst[d : d + n]) for d, n in zip(do.tolist(), ln.tolist())]
                    conn.send(("ready",))
                elif message[0] == "iters":
                    for _ in range(message[1]):
                        for view in views:
                            _receive_exactly(sock, view)
                        sock.sendall(b"\x01")
                elif message[0] == "digest":
                    conn.send(("digest", ranges_digest(dst, do, ln)))
    except BaseException:
        send_error(conn)


def socket_rows(workloads: Sequence[Workload], timing: Timing, on_row: OnRow) -> list[Row]:
    """Python TCP over 127.0.0.1 from this process (sender) to a spawned receiver; WRITE rows."""
    context = multiprocessing.get_context("spawn")
    size = max(w.total_size for w in workloads)
    conn, child_conn = context.Pipe()
    listener = socket.create_server(("127.0.0.1", 0))
    _tune(listener)
    listener.settimeout(MESSAGE_TIMEOUT_S)
    proc = context.Process(target=_socket_receiver, args=(child_conn, listener.getsockname()[1], size), name="hmc-bench-socket", daemon=True)
    proc.start()
    child_conn.close()
    rows: list[Row] = []
    try:
        try:
            sock, _ = listener.accept()
        except OSError as exc:
            raise BrokenResourceError(f"socket baseline receiver did not connect: {exc}") from exc
        with sock:
            _tune(sock)
            sock.settimeout(MESSAGE_TIMEOUT_S)
            src, ack = random_bytes(size, SEED), bytearray(1)
            for w in workloads:
                so, _, ln = make_ranges(w)
                views = [memoryview(src[s : s + n]) for s, n in zip(so.tolist(), ln.tolist())]
                conn.send(("workload", w))
                receive(conn, "ready", procs=[proc])
                sendall, recv_into = sock.sendall, sock.recv_into

                def step() -> None:
                    for view in views:
                        sendall(view)
                    if recv_into(ack, 1) != 1:
                        raise BrokenResourceError("socket baseline receiver closed the socket")

                times = measure(step, timing, announce=lambda n: conn.send(("iters", n)))
                conn.send(("digest",))
                verified = receive(conn, "digest", procs=[proc])[1] == ranges_digest(src, so, ln)
                rows.append(make_row("socket", "tcp 127.0.0.1", "WRITE", w, times, verified))
                on_row(rows[-1])
            conn.send(("quit",))
    finally:
        listener.close()
        conn.close()
        reap(proc)
    return rows
