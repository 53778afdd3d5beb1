"""HMC's UCP binding (`hmc.transport._ucx_engine`) and the thread that drives a worker (`_ucx_progress`), for real: two processes, UCX from the libucx wheel, over tcp
and over shared memory with cma; scattered ranges posted in one call, random bytes, poisoned destinations, every
byte compared (the owner shows its bytes once the flush returned); a dead peer fails within the deadline. Skipped, with the reason,
where the binding is not built (UCX not installed)."""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection

import numpy as np
import pytest
from ucx_support import requires_ucx

from hmc.errors import ArgumentError, BrokenResourceError, ClosedResourceError, HMCError, TimeoutError
from hmc.transport import _ucx_engine as ucx

pytestmark = requires_ucx

SIZE = 4 << 20
POISON = 0xA5
TRANSPORTS = ["tcp", "sm,cma"]


def _target(conn: Connection, tls: str, seed: int) -> None:
    """The owner: map a poisoned buffer and a random one, hand over address and keys, progress until told (and show
    its poisoned buffer's bytes when asked)."""
    os.environ["UCX_TLS"] = tls
    from hmc.transport import _ucx_engine as engine

    worker = engine.Worker()
    poisoned = np.full(SIZE, POISON, dtype=np.uint8)
    pattern = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)
    maps = [worker.map(a.ctypes.data, SIZE) for a in (poisoned, pattern)]
    conn.send((worker.address, [(m.address, m.rkey) for m in maps]))
    while True:
        worker.progress()
        if conn.poll():
            command = conn.recv()
            if command == "stop":
                break
            conn.send(("landed", poisoned.tobytes()))
    for m in maps:
        m.unmap()
    worker.close()
    conn.send("closed")


@pytest.fixture(params=TRANSPORTS)
def peer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[object, Connection, multiprocessing.process.BaseProcess]]:
    monkeypatch.setenv("UCX_TLS", request.param)
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    process = context.Process(target=_target, args=(child_conn, request.param, 1234), daemon=True)
    process.start()
    assert conn.poll(60), "the UCX target did not start"
    yield conn.recv(), conn, process
    if process.is_alive():
        conn.send("stop")
        process.join(10)
    if process.is_alive():
        process.kill()
        process.join(10)


def test_scattered_puts_and_gets_in_one_call(peer: tuple) -> None:
    (address, keys), conn, _ = peer
    (poisoned_base, poisoned_key), (pattern_base, pattern_key) = keys
    worker = ucx.Worker()
    try:
        rng = np.random.default_rng(99)
        source = rng.integers(0, 256, SIZE, dtype=np.uint8)
        sink = np.full(SIZE, POISON ^ 0xFF, dtype=np.uint8)
        local_src, local_sink = worker.map(source.ctypes.data, SIZE), worker.map(sink.ctypes.data, SIZE)
        endpoint = worker.connect(address)
        to_poisoned, from_pattern = endpoint.unpack(poisoned_key), endpoint.unpack(pattern_key)
        # another process's host memory: no transport here maps it (tcp sends, cma copies), so ranges go as puts and gets
        assert to_poisoned.pointer(poisoned_base) is None
        # 512 ranges of 4 KiB, in random order, to random disjoint places
        count, length = 512, 4096
        src_slots = rng.permutation(SIZE // length)[:count].astype(np.uint64) * length
        dst_slots = rng.permutation(SIZE // length)[:count].astype(np.uint64) * length
        lengths = np.full(count, length, dtype=np.uint64)
        endpoint.post("write", local_src, source.ctypes.data + src_slots, poisoned_base + dst_slots, lengths, to_poisoned)
        endpoint.flush(10.0)  # every put has landed at the owner once this returns
        conn.send("show")
        assert conn.poll(30), "the target did not answer"
        tag, landed = conn.recv()
        assert tag == "landed"
        expected = np.full(SIZE, POISON, dtype=np.uint8)
        for s, d in zip(src_slots.tolist(), dst_slots.tolist()):
            expected[d : d + length] = source[s : s + length]
        assert np.array_equal(np.frombuffer(landed, dtype=np.uint8), expected)  # every byte: written ones and untouched ones

        endpoint.post("read", local_sink, sink.ctypes.data + dst_slots, pattern_base + src_slots, lengths, from_pattern)
        endpoint.flush(10.0)
        pattern = np.random.default_rng(1234).integers(0, 256, SIZE, dtype=np.uint8)
        expected = np.full(SIZE, POISON ^ 0xFF, dtype=np.uint8)
        for s, d in zip(src_slots.tolist(), dst_slots.tolist()):
            expected[d : d + length] = pattern[s : s + length]
        assert np.array_equal(sink, expected)
        for key in (to_poisoned, from_pattern):
            key.destroy()
        with pytest.raises(ClosedResourceError):
            to_poisoned.pointer(poisoned_base)
        endpoint.close()
        local_src.unmap()
        local_sink.unmap()
    finally:
        worker.close()


def test_a_dead_peer_fails_the_flush_within_its_deadline(peer: tuple) -> None:
    (address, keys), _, process = peer
    (poisoned_base, poisoned_key), _ = keys
    worker = ucx.Worker()
    try:
        source = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
        local = worker.map(source.ctypes.data, SIZE)
        endpoint = worker.connect(address)
        key = endpoint.unpack(poisoned_key)
        endpoint.post("write", local, np.array([source.ctypes.data], dtype=np.uint64), np.array([poisoned_base], dtype=np.uint64), np.array([4096], dtype=np.uint64), key)
        endpoint.flush(10.0)
        process.kill()
        process.join(10)
        with pytest.raises((BrokenResourceError, TimeoutError)) as failed:  # the reset seen, or the deadline: never a hang
            for _ in range(3):
                endpoint.post("write", local, np.array([source.ctypes.data], dtype=np.uint64), np.array([poisoned_base], dtype=np.uint64), np.array([SIZE], dtype=np.uint64), key)
                endpoint.flush(2.0)
        assert "UCX says" in str(failed.value)
        endpoint.close(0.5)
    finally:
        worker.close()


def test_bad_arguments_are_refused_before_anything_is_posted() -> None:
    worker = ucx.Worker()
    try:
        with pytest.raises(ArgumentError):
            worker.map(0, 4096)
        with pytest.raises(ArgumentError):
            worker.map(4096, -1)
        buffer = np.zeros(4096, dtype=np.uint8)
        with pytest.raises(ArgumentError, match="memory kind"):
            worker.map(buffer.ctypes.data, 4096, "tpu")
        with pytest.raises(ArgumentError):
            worker.connect(b"")
        with pytest.raises(HMCError):
            worker.connect(b"\x00" * 64)  # not a worker address
        mapping = worker.map(buffer.ctypes.data, 4096)
        endpoint = worker.connect(worker.address)  # a worker may reach itself
        with pytest.raises(ArgumentError):
            endpoint.unpack(b"")
        key = endpoint.unpack(mapping.rkey)
        with pytest.raises(ArgumentError, match="op"):
            endpoint.post("copy", mapping, np.zeros(1), np.zeros(1), np.zeros(1), key)
        with pytest.raises(ArgumentError, match="one entry per range"):
            endpoint.post("write", mapping, np.zeros(2), np.zeros(1), np.zeros(1), key)
        for timeout in (float("nan"), float("inf"), -1.0, 0.0, "1"):
            with pytest.raises(ArgumentError, match="timeout_s"):
                endpoint.flush(timeout)  # type: ignore[arg-type]
            with pytest.raises(ArgumentError, match="timeout_s"):
                worker.flush(timeout)  # type: ignore[arg-type]
        key.destroy()
        with pytest.raises(ClosedResourceError, match="remote key"):
            endpoint.post("write", mapping, np.zeros(1), np.zeros(1), np.zeros(1), key)
        second = worker.connect(worker.address)
        second_key = second.unpack(mapping.rkey)
    finally:
        worker.close()  # releases the endpoints, keys and mappings still open
    with pytest.raises(ClosedResourceError):
        worker.map(buffer.ctypes.data, 4096)
    for use in (lambda: second.flush(1.0), lambda: second.flush_start(), lambda: second.unpack(mapping.rkey)):
        with pytest.raises(ClosedResourceError):
            use()
    with pytest.raises(ClosedResourceError):
        endpoint.post("write", mapping, np.zeros(1), np.zeros(1), np.zeros(1), second_key)
    second_key.destroy()  # nothing left to release: a no-op, never a use of freed memory
    mapping.unmap()
    endpoint.close()
    assert ucx.version().startswith("1.")


def test_hmc_settings_on_a_context_yield_to_the_environment() -> None:
    """HMC sets two rails (split from 128 KiB where sockets may carry the bytes), no adaptive progress and IPC gets,
    unless the user's `UCX_<name>` says otherwise."""
    ours = {"CUDA_IPC_ENABLE_GET_ZCOPY": "y", "ADAPTIVE_PROGRESS": "n", "MAX_RMA_RAILS": "2"}
    assert ucx.tuning({}) == ours | {"MIN_RMA_CHUNK_SIZE": "64K"}
    assert ucx.tuning({}, sockets=False) == ours  # verbs NICs (the rdma path) keep UCX's own split
    assert ucx.tuning({"UCX_MAX_RMA_RAILS": "1", "UCX_TLS": "tcp"}) == {"CUDA_IPC_ENABLE_GET_ZCOPY": "y", "ADAPTIVE_PROGRESS": "n", "MIN_RMA_CHUNK_SIZE": "64K"}
    everything = {"UCX_ADAPTIVE_PROGRESS": "y", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n", "UCX_MAX_RMA_RAILS": "4", "UCX_MIN_RMA_CHUNK_SIZE": "8K"}
    assert ucx.tuning(everything) == {}


def test_ucx_logs_go_to_stderr_not_into_what_the_cli_prints_on_stdout() -> None:
    """UCX writes its log to stdout unless told otherwise; HMC tells it stderr (where the user has not said)."""
    import subprocess
    import sys

    code = "from hmc.transport import _ucx_engine as e; c = e.Context(); w = e.Worker(c); w.close(); c.close(); print('done')"
    env = {k: v for k, v in os.environ.items() if k != "UCX_LOG_FILE"} | {"UCX_LOG_LEVEL": "info"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "done\n"
    assert "UCX  INFO" in done.stderr


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
