"""A real etcd server for tests: Debian's `etcd` (package etcd-server), one member, in a scratch directory.

`EtcdServer.start()` runs it on free ports of `host` and waits (bounded) until it
answers; `kill()` and `start()` again restart it on the same data and ports (nothing
is lost), `paused()` freezes it (SIGSTOP: a partition in which every call hangs).

Concurrency: driven by one test thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from hmc.agent._peer_process import wait_stopped
from hmc.errors import HMCError, UnavailableError

__all__ = ["EtcdServer", "etcd_available"]

_START_S = 20.0


def etcd_available() -> tuple[bool, str]:
    """Whether an etcd binary is on PATH, and if not, what to install."""
    if shutil.which("etcd") is None:
        return False, "no etcd binary (install Debian's etcd-server; .ci/run does)"
    return True, ""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class EtcdServer:
    """One etcd member on `host`, its data in a temporary directory removed by `close()`."""

    def __init__(self, host: str = "127.0.0.1", *, tls: tuple[str, str, str] | None = None) -> None:
        """`tls`: (certificate, key, CA) files: clients must speak TLS, trust the CA and show a certificate it
        signed (the tests' own client uses the server's pair)."""
        self.host = host
        self.tls = tls
        self.client_port = _free_port(host)
        self.peer_port = _free_port(host)
        self.directory = Path(tempfile.mkdtemp(prefix="hmc-etcd-"))
        self.log = self.directory / "etcd.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"

    def start(self) -> EtcdServer:
        """Start (or start again, on the same data) and wait until it answers."""
        if self.process is not None and self.process.poll() is None:
            raise HMCError("etcd is already running")
        args = [
            "etcd",
            "--name", "hmc-test",
            "--data-dir", str(self.directory / "data"),
            "--listen-client-urls", self.endpoint,
            "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", f"http://{self.host}:{self.peer_port}",
            "--initial-advertise-peer-urls", f"http://{self.host}:{self.peer_port}",
            "--initial-cluster", f"hmc-test=http://{self.host}:{self.peer_port}",
        ]  # fmt: skip
        if self.tls:
            args += ["--cert-file", self.tls[0], "--key-file", self.tls[1], "--trusted-ca-file", self.tls[2]]
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_S
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise UnavailableError(f"etcd did not start on {self.endpoint}:\n{self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        return self

    def _answers(self) -> bool:
        from hmc.control._etcd import EtcdClient, EtcdSettings

        async def ask() -> None:
            cert, key, ca = self.tls or ("", "", "")
            client = EtcdClient(EtcdSettings([self.endpoint], ca=ca, cert=cert, key=key))
            try:
                await client.status(1.0)
            finally:
                await client.close()

        try:
            asyncio.run(ask())
        except HMCError:
            return False
        return True

    def kill(self) -> None:
        """SIGKILL, and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=10)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP for the block: every call to etcd hangs until its deadline."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        try:
            wait_stopped(self.process.pid, time.monotonic() + 10.0)
            yield
        finally:
            self.process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
