"""A real peer agent in another process, driven over a pipe (tests, `hmc demo` and `hmc bench` use it).

`PeerProcess` starts a fresh interpreter (multiprocessing "spawn"), builds an
`Agent` there from the given Config, and answers commands: register (host
memory, or device memory on a named device), fill and read back buffers (device
memory through a host copy), unregister, drain notifications, and run transfers
that the peer itself initiates. Descriptors cross the pipe serialized, exactly as users
pass them between processes. It also exposes the process for fault injection:
`kill()` (SIGKILL) and `stalled()` (SIGSTOP ... SIGCONT).

It implements the `BufferOwner` protocol of `check_transport`, and hmcd tests
use it to put agents under a running hmcd (`daemon=True`).

Concurrency: one test thread drives a PeerProcess; commands are serialized by
`_lock`. The child runs its command loop on its main thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from hmc import memory
from hmc.agent._transfer import Notification
from hmc.config import Config
from hmc.errors import BrokenResourceError, HMCError, TimeoutError, error_from_code
from hmc.memory import MemoryKind
from hmc.v1 import common_pb2

__all__ = ["PeerProcess", "ranges_digest", "wait_stopped"]

_START_S = 60.0


def ranges_digest(data: np.ndarray, offsets: Any = None, lengths: Any = None) -> bytes:
    """BLAKE2b of the bytes at `offsets`/`lengths` of `data`, in range order (all of `data` by default)."""
    digest = hashlib.blake2b(digest_size=32)
    if offsets is None:
        digest.update(data)
    else:
        for offset, length in zip(np.asarray(offsets).tolist(), np.broadcast_to(np.asarray(lengths), np.shape(offsets)).tolist()):
            digest.update(data[offset : offset + length])
    return digest.digest()


_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 0x80000, 2


def _enter_netns(name: str) -> None:
    """Move this (single-threaded, just started) process into the named network namespace, with /sys showing
    that namespace's interfaces, as `ip netns exec` does (UCX reads them there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name!r} failed")
    finally:
        os.close(fd)
    steps = (
        lambda: libc.unshare(_CLONE_NEWNS),
        lambda: libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None),  # our mounts stay ours
        lambda: libc.umount2(b"/sys", _MNT_DETACH),
        lambda: libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None),
    )
    for step in steps:
        if step() != 0:
            raise OSError(ctypes.get_errno(), f"remounting /sys for network namespace {name!r} failed")


def _serve(conn: Connection, config: Config, daemon: bool | None, netns: str | None) -> None:
    """The child's command loop."""
    from hmc.agent import Agent

    if netns:
        _enter_netns(netns)

    with Agent(config, daemon=daemon) as agent:
        buffers: dict[str, Any] = {}
        conn.send(("ok", agent.info.SerializeToString()))
        while True:
            try:
                command, args = conn.recv()
            except EOFError:
                return
            if command == "close":
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", _COMMANDS[command](agent, buffers, *args)))
            except HMCError as exc:
                conn.send(("error", (int(exc.code), str(exc))))


def _register(agent: Any, buffers: dict[str, Any], size: int, name: str | None, fill: int, device: str, readonly: bool) -> bytes:
    if device == "host":
        data = np.full(size, fill, dtype=np.uint8)
        buffer = agent.register(data.tobytes() if readonly else data, name=name)  # bytes: read-only memory
    else:  # device memory HMC allocates; freed when the buffer is unregistered
        region = memory.allocate(size, device)
        memory.fill(region, fill)
        try:
            buffer = agent.register(region, name=name)
        except BaseException:
            region.free()
            raise
    buffers[buffer.id] = buffer
    return buffer.descriptor.SerializeToString()


def _host_bytes(buffer: Any) -> np.ndarray:
    """The buffer's bytes: a zero-copy view of host memory, a fresh host copy of device memory."""
    if buffer.region.kind is not MemoryKind.DEVICE:
        return buffer.numpy()
    out = np.empty(buffer.size, np.uint8)
    memory.copy(out, buffer.region)
    return out


def _fill(agent: Any, buffers: dict[str, Any], buffer_id: str, offset: int, data: bytes) -> None:
    buffer = buffers[buffer_id]
    if buffer.region.kind is MemoryKind.DEVICE:
        memory.copy(buffer.region, np.frombuffer(data, np.uint8), len(data), dst_offset=offset)
    else:
        buffer.numpy()[offset : offset + len(data)] = np.frombuffer(data, np.uint8)


def _contents(agent: Any, buffers: dict[str, Any], buffer_id: str) -> bytes:
    return _host_bytes(buffers[buffer_id]).tobytes()


def _poison(agent: Any, buffers: dict[str, Any], buffer_id: str, value: int) -> None:
    buffer = buffers[buffer_id]
    if buffer.region.kind is MemoryKind.DEVICE:
        memory.fill(buffer.region, value)
    else:
        buffer.numpy().fill(value)


def _digest(agent: Any, buffers: dict[str, Any], buffer_id: str, offsets: Any, lengths: Any) -> bytes:
    return ranges_digest(_host_bytes(buffers[buffer_id]), offsets, lengths)


def _unregister(agent: Any, buffers: dict[str, Any], buffer_id: str) -> None:
    agent.unregister(buffer_id)
    buffer = buffers[buffer_id]
    if buffer.region.kind is MemoryKind.DEVICE:
        buffer.region.free()  # HMC allocated it (_register); peers were told and have let go


def _notifications(agent: Any, buffers: dict[str, Any], timeout: float) -> list[tuple[tuple[str, str, bytes, str], bytes]]:
    """Each notification with the bytes of its buffer as they were when it was drained."""
    out = []
    for n in agent.notifications(timeout):
        snapshot = _host_bytes(buffers[n.buffer_id]).tobytes() if n.buffer_id in buffers else b""
        out.append(((n.buffer_id, n.transfer_id, n.payload, n.sender_agent), snapshot))
    return out


def _transfer(agent: Any, buffers: dict[str, Any], op: str, local_id: str, remote: bytes, a: Any, b: Any, lengths: Any, notify: bytes | None, timeout: float | None) -> str:
    descriptor = common_pb2.BufferDescriptor.FromString(remote)
    run = agent.write if op == "write" else agent.read
    handle = run(buffers[local_id], descriptor, a, b, lengths, notify=notify, timeout=timeout)
    handle.wait()
    return handle.path


_COMMANDS = {
    "register": _register,
    "fill": _fill,
    "contents": _contents,
    "poison": _poison,
    "digest": _digest,
    "unregister": _unregister,
    "notifications": _notifications,
    "transfer": _transfer,
}


def wait_stopped(pid: int, deadline: float) -> None:
    """Return once every thread of `pid` is stopped (state T in /proc), or it is gone; TimeoutError at `deadline`.
    `kill(SIGSTOP)` returns before the stop takes hold: a test that freezes a process waits for this first."""
    while True:
        states = _thread_states(pid)
        if states is None or all(state in ("T", "t", "Z", "X") for state in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop: thread states {states}")
        os.sched_yield()


def _thread_states(pid: int) -> list[str] | None:
    """The /proc state letter of each thread of `pid`; None once the process is gone (a thread that ends while
    they are read is left out: the others still count)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return None
    states = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return states


class PeerProcess:
    """A peer agent running in its own process."""

    def __init__(
        self, config: Config | None = None, *, daemon: bool | None = False, timeout: float = 30.0, env: Mapping[str, str] | None = None, netns: str | None = None
    ) -> None:
        """`env`: variables the child starts with besides this process's (set here while it starts: HMC_HIP_ON_CUDA=1
        makes it an AMD process on the HIP-on-CUDA runtime). `netns`: a network namespace (`ip netns` name) the
        child enters before anything else (a node of `hmc.testing.NetnsCluster`; needs root)."""
        self._timeout = timeout
        self._lock = threading.Lock()  # one command at a time on the pipe
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, config or Config(), daemon, netns), name="hmc-test-peer", daemon=True)
        saved = {name: os.environ.get(name) for name in env or {}}
        os.environ.update(env or {})
        try:
            self._process.start()
        finally:
            for name, value in saved.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value
        child.close()
        self.info = common_pb2.AgentInfo.FromString(self._reply(_START_S))

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    def _reply(self, timeout: float) -> Any:
        try:
            if not self._conn.poll(timeout):
                raise TimeoutError(f"peer process {self._process.pid} did not answer within {timeout}s")
            status, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise BrokenResourceError(f"peer process {self._process.pid} is gone") from exc
        if status == "error":
            raise error_from_code(*value)
        return value

    def _call(self, command: str, *args: Any) -> Any:
        with self._lock:
            try:
                self._conn.send((command, args))
            except OSError as exc:
                raise BrokenResourceError(f"peer process {self._process.pid} is gone") from exc
            return self._reply(self._timeout)

    def register(
        self, size: int, *, name: str | None = None, fill: int = 0, device: str = "host", readonly: bool = False
    ) -> common_pb2.BufferDescriptor:
        """A new ConnBuffer in the peer, every byte set to `fill`: numpy memory (`readonly`: bytes), or
        `hmc.memory.allocate(size, device)`."""
        if readonly and device != "host":
            raise ValueError("only host memory is registered read-only here")
        return common_pb2.BufferDescriptor.FromString(self._call("register", size, name, fill, device, readonly))

    def fill(self, buffer_id: str, data: bytes, offset: int = 0) -> None:
        self._call("fill", buffer_id, offset, bytes(data))

    def contents(self, buffer_id: str) -> bytes:
        return bytes(self._call("contents", buffer_id))

    def poison(self, buffer_id: str, value: int) -> None:
        """Set every byte of the peer's buffer to `value`."""
        self._call("poison", buffer_id, value)

    def digest(self, buffer_id: str, offsets: Any = None, lengths: Any = None) -> bytes:
        """`ranges_digest` of the peer's buffer (the whole buffer when no ranges are given)."""
        return bytes(self._call("digest", buffer_id, offsets, lengths))

    def unregister(self, buffer_id: str) -> None:
        self._call("unregister", buffer_id)

    def notifications(self, timeout: float = 0.0) -> list[tuple[Notification, bytes]]:
        """Drained notifications, each with its buffer's bytes at the moment it was seen."""
        return [(Notification(*fields), snapshot) for fields, snapshot in self._call("notifications", timeout)]

    def transfer(self, op: str, local_id: str, remote: common_pb2.BufferDescriptor, a: Any, b: Any, lengths: Any, *, notify: bytes | None = None, timeout: float | None = None) -> str:
        """Make the peer run write/read (it is the initiator) and wait; returns the path taken."""
        return str(self._call("transfer", op, local_id, remote.SerializeToString(), a, b, lengths, notify, timeout))

    @contextlib.contextmanager
    def stalled(self) -> Iterator[None]:
        """Freeze the process (SIGSTOP) for the duration of the block (a peer killed inside stays dead); the block
        starts once every thread of it has stopped (a signal takes effect a little after `kill` returns)."""
        os.kill(self.pid, signal.SIGSTOP)
        try:
            wait_stopped(self.pid, time.monotonic() + 10.0)
            yield
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the peer and reap it."""
        if self._process.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self._process.join(10.0)

    def close(self) -> None:
        """Ask the peer to exit; kill it if it does not within a few seconds. Idempotent."""
        if self._process.is_alive():
            with contextlib.suppress(HMCError, OSError):
                with self._lock:
                    self._conn.send(("close", ()))
                    self._reply(5.0)
            self._process.join(5.0)
            if self._process.is_alive():
                self.kill()
        self._conn.close()
        self._process.join(1.0)

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
