"""Helpers for the hmcd tests: real hmcd processes on port 0, fake agents built from DaemonLink alone.

Test modules import what they use from here explicitly (`from control_fixtures import ...`).
Every wait is bounded; daemons are stopped with SIGTERM (then SIGKILL) at teardown.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from hmc.config import Config
from hmc.control._errors import rpc_errors
from hmc.testing._etcd import EtcdServer, etcd_available
from hmc.transport import RangeList
from hmc.testing._hmcd import HmcdProcess
from hmc.testing._hmcd import clean_env as hmcd_env
from hmc.control import DaemonLink
from hmc.control._inventory import transports
from hmc.memory._machine import host_id
from hmc.memory import DeviceKind
from hmc.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
PEER_CHECK_INTERVAL_S = 0.25


Hmcd = HmcdProcess


def short_tempdir() -> str:
    """A directory with a short path (unix socket paths are limited to 107 bytes)."""
    return tempfile.mkdtemp(prefix="hmc-", dir="/tmp")


def clean_env(**extra: str) -> dict[str, str]:
    return hmcd_env(HMC_PEER_CHECK_INTERVAL_S=str(PEER_CHECK_INTERVAL_S), **extra)


def start_hmcd(
    directory: str, name: str, *, token: str = "", static_peers: tuple[str, ...] = (), extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Hmcd:
    """Start `python -m hmc.control._hmcd_main` (with `env`'s HMC_* settings added) and wait (bounded) until it serves."""
    args = ["--log-level", "debug", *extra_args, *(f"--static-peer={peer}" for peer in static_peers)]
    return HmcdProcess.start(directory, name, token=token, args=args, env=clean_env(**(env or {})), cwd=str(REPO))


@dataclasses.dataclass
class DaemonSet:
    """Daemons started by one test or module; all stopped at the end."""

    directory: str = dataclasses.field(default_factory=short_tempdir)
    daemons: list[Hmcd] = dataclasses.field(default_factory=list)

    def start(self, name: str, **kwargs: object) -> Hmcd:
        daemon = start_hmcd(self.directory, name, **kwargs)  # type: ignore[arg-type]
        self.daemons.append(daemon)
        return daemon

    def restart(self, old: Hmcd, **kwargs: object) -> Hmcd:
        """Start `old`'s node again, on the same socket and state file, once `old` has exited (stopped or killed)."""
        if old.process.poll() is None:
            raise RuntimeError(f"hmcd {old.name} is still running")
        return self.start(old.name, **kwargs)

    def close(self) -> None:
        for daemon in self.daemons:
            daemon.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def start_peered(daemons: DaemonSet, a: str, b: str, token: str) -> tuple[Hmcd, Hmcd]:
    """Two hmcd with a token, the first listing the second as its static peer, once the first sees it up."""
    node_b = daemons.start(b, token=token)
    node_a = daemons.start(a, token=token, static_peers=(node_b.tcp_address,))
    with node_a.client() as client:
        wait_until(lambda: [p.up for p in client.node_info().peers] == [True], what=f"{a} to see {b} up")
    return node_a, node_b


def daemon_set() -> Iterator[DaemonSet]:
    daemons = DaemonSet()
    try:
        yield daemons
    finally:
        daemons.close()


# -- fake agents ------------------------------------------------------------------------


def agent_info(agent_id: str | None = None, node: str = "") -> common_pb2.AgentInfo:
    caps = [cap.to_proto() for cap in transports(frozenset({DeviceKind.HOST}))]
    return common_pb2.AgentInfo(
        id=agent_id or f"agent-{uuid.uuid4().hex[:8]}", node=node, host_id=host_id(), pid=os.getpid(), transports=caps, protocol_version=1
    )


def descriptor(name: str = "", size: int = 1 << 20, buffer_id: str | None = None) -> common_pb2.BufferDescriptor:
    return common_pb2.BufferDescriptor(
        version=1,
        id=buffer_id or uuid.uuid4().hex,
        name=name,
        size=size,
        access_key=os.urandom(16),
        device=common_pb2.DeviceInfo(name="host", kind=common_pb2.DEVICE_KIND_HOST, vendor=common_pb2.VENDOR_HOST),
    )


class FakeAgent:
    """A DaemonLink plus the instructions and events it received; `auto_report` answers instructions, `confirm_cancels`
    answers each cancel with a CANCELLED report."""

    def __init__(self, config: Config, agent_id: str | None = None, *, auto_report: int | None = None, confirm_cancels: bool = False) -> None:
        self.instructions: list[daemon_pb2.TransferInstruction] = []
        self.events: list[daemon_pb2.Event] = []
        self.cancels: list[str] = []
        self.info = agent_info(agent_id, config.node)
        self._auto_report = auto_report
        self._confirm_cancels = confirm_cancels
        self.link = DaemonLink(config, self.info, self._on_instruction, self.events.append, on_cancel=self._on_cancel)

    def _on_cancel(self, transfer_id: str) -> None:
        self.cancels.append(transfer_id)
        if self._confirm_cancels:
            self.link.report(daemon_pb2.TransferReport(transfer_id=transfer_id, state=common_pb2.TRANSFER_STATE_CANCELLED))

    def _on_instruction(self, instruction: daemon_pb2.TransferInstruction) -> None:
        self.instructions.append(instruction)
        if self._auto_report is not None:
            report = daemon_pb2.TransferReport(transfer_id=instruction.transfer_id, state=self._auto_report, path="ipc")
            self.link.report(report)

    def register(self, name: str = "", size: int = 1 << 20) -> common_pb2.BufferDescriptor:
        desc = descriptor(name, size)
        self.link.register(desc)
        return desc

    def close(self) -> None:
        self.link.close()


def wait_until(predicate: Callable[[], object], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


AGENT_CHILD = """
import sys, time
from hmc.config import Config
from hmc.testing._hmcd import HmcdProcess
from hmc.testing._hmcd import clean_env as hmcd_env
from hmc.control import DaemonLink
sys.path.insert(0, {tests!r})
from control_fixtures import agent_info, descriptor
link = DaemonLink(Config(node={node!r}, socket={socket!r}, timeout_s=5.0), agent_info({agent!r}), lambda instruction: None)
link.register(descriptor({name!r}, buffer_id={buffer_id!r}))
print("ready", flush=True)
time.sleep(60)
"""


def spawn_agent_child(hmcd: Hmcd, agent_id: str, name: str, buffer_id: str) -> subprocess.Popen[str]:
    """A child process holding a DaemonLink with one registered buffer; returns once it is registered."""
    code = AGENT_CHILD.format(tests=str(Path(__file__).parent), node=hmcd.name, socket=hmcd.socket, agent=agent_id, name=name, buffer_id=buffer_id)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(), cwd=REPO)
    assert child.stdout is not None
    line = child.stdout.readline()  # bounded: the child exits (EOF) if it cannot attach within its 5 s timeout
    if line.strip() != "ready":
        rest = child.stdout.read()
        child.kill()
        child.wait(timeout=10)
        child.stdout.close()
        raise RuntimeError(f"agent child failed: {line}{rest}")
    return child


def submit_as_forwarder(hmcd: Hmcd, src: str, dst: common_pb2.BufferDescriptor) -> daemon_pb2.TransferStatus:
    """A Submit as a forwarding hmcd sends it: dst given as an explicit descriptor (4 KiB)."""
    request = daemon_pb2.SubmitTransferRequest(
        src=daemon_pb2.BufferRef(name=src), dst=daemon_pb2.BufferRef(id=dst.id), ranges=RangeList.build(0, 0, 4096).to_proto(), local_only=True, dst_descriptor=dst
    )
    with grpc.insecure_channel(hmcd.unix_address) as channel, rpc_errors(hmcd.unix_address):
        return daemon_pb2_grpc.TransferServiceStub(channel).Submit(request, timeout=5)


def etcd_server() -> Iterator[EtcdServer]:
    """A real etcd for a module's tests (skips them, with the reason, where there is none)."""
    import pytest

    available, why = etcd_available()
    if not available:
        pytest.skip(why)
    with EtcdServer() as server:
        yield server
