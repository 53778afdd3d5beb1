"""A real hmcd process for tests: started with `python -m hmc.control._hmcd_main`, waited for (bounded), stopped.

`HmcdProcess.start()` writes the log beside the socket and returns once hmcd wrote its
TCP port (it always listens: `listen` defaults to 127.0.0.1:0). `prefix` runs it
under another command (`ip netns exec <ns>` for a namespaced node).

Concurrency: driven by one test thread.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from hmc.config import Config
from hmc.control import Client
from hmc.errors import UnavailableError

__all__ = ["HmcdProcess", "clean_env"]

_START_S = 20.0


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any HMC_* variable, plus `extra`."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("HMC_")}
    env.update(extra)
    return env


@dataclasses.dataclass
class HmcdProcess:
    """A running hmcd process."""

    name: str
    socket: str
    port: int
    token: str
    process: subprocess.Popen[bytes]
    log: Path
    host: str = "127.0.0.1"

    @classmethod
    def start(
        cls,
        directory: str | os.PathLike[str],
        name: str,
        *,
        token: str = "",
        listen: str = "127.0.0.1:0",
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        prefix: Sequence[str] = (),
        cwd: str | None = None,
    ) -> HmcdProcess:
        """Start hmcd for node `name` (socket `<directory>/<name>.sock`) and wait until it serves."""
        socket = os.path.join(directory, f"{name}.sock")
        port_file = Path(directory, f"{name}.port")
        port_file.unlink(missing_ok=True)
        log = Path(directory, f"{name}.log")
        argv = [*prefix, sys.executable, "-m", "hmc.control._hmcd_main", "--socket", socket, "--listen", listen, "--port-file", str(port_file), "--node", name, *args]
        if token:
            argv += ["--token", token]
        with open(log, "ab") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(env) if env is not None else clean_env(), cwd=cwd)
        deadline = time.monotonic() + _START_S
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait(timeout=10)
                raise UnavailableError(f"hmcd {name} did not start:\n{log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.05)
        return cls(name=name, socket=socket, port=int(port_file.read_text()), token=token, process=process, log=log, host=listen.rsplit(":", 1)[0])

    @property
    def unix_address(self) -> str:
        return f"unix:{self.socket}"

    @property
    def tcp_address(self) -> str:
        return f"{self.host}:{self.port}"

    def config(self, **changes: object) -> Config:
        base = Config(node=self.name, socket=self.socket, token=self.token, timeout_s=5.0)
        return base.replace(**changes) if changes else base

    def client(self, tcp: bool = False, **kwargs: object) -> Client:
        return Client(self.tcp_address if tcp else None, config=self.config(), **kwargs)  # type: ignore[arg-type]

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL (no goodbye: its etcd lease expires on its own), and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
