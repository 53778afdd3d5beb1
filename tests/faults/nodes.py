"""Nodes for fault tests: network namespaces joined by a veth pair, and `_node.py` agents running in them."""
from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parents[2]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class NodeProcess:
    """A `_node.py` agent in a namespace, answering one JSON line per command."""

    def __init__(self, namespace: str, host: str, socket: str, *, timeout_s: float, keepalive_s: float) -> None:
        command = [sys.executable, "-m", "tests.faults._node", "--host", host, "--socket", socket]
        command += ["--timeout", str(timeout_s), "--keepalive", str(keepalive_s)]
        self._process = subprocess.Popen(
            ["ip", "netns", "exec", namespace, *command], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def call(self, op: str, within: float = 30.0, **arguments: Any) -> dict[str, Any]:
        """Send a command; its answer within `within` seconds (AssertionError otherwise)."""
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self._process.stdin.flush()
        ready, _, _ = select.select([self._process.stdout], [], [], within)
        assert ready, f"node gave no answer to {op!r} within {within}s"
        line = self._process.stdout.readline()
        assert line, f"node exited while answering {op!r} (rc {self._process.poll()})"
        return json.loads(line)

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait(10)
        for pipe in (self._process.stdin, self._process.stdout):
            if pipe is not None:
                pipe.close()


class TwoNodes:
    """Namespaces a and b, addresses `host_a`/`host_b`, one veth link between them."""

    def __init__(self, tmp: Path) -> None:
        tag = secrets.token_hex(3)
        self.ns = {"a": f"hmc-a-{tag}", "b": f"hmc-b-{tag}"}
        self._veth = {"a": f"va{tag}", "b": f"vb{tag}"}
        octet = int(tag[:2], 16)
        self.host = {"a": f"10.213.{octet}.1", "b": f"10.213.{octet}.2"}
        self._tmp = tmp
        self._nodes: list[NodeProcess] = []
        for side in "ab":
            _ip("netns", "add", self.ns[side])
        _ip("link", "add", self._veth["a"], "type", "veth", "peer", "name", self._veth["b"])
        for side in "ab":
            _ip("link", "set", self._veth[side], "netns", self.ns[side])
            _ip("-n", self.ns[side], "addr", "add", f"{self.host[side]}/30", "dev", self._veth[side])
            _ip("-n", self.ns[side], "link", "set", "lo", "up")
        self.link(up=True)

    def link(self, *, up: bool) -> None:
        """Take the link down (both ends: nothing passes, no error is reported to sockets) or bring it back."""
        for side in "ab":
            _ip("-n", self.ns[side], "link", "set", self._veth[side], "up" if up else "down")

    def throttle(self, side: str, mbit: int) -> None:
        """Limit what leaves `side` to `mbit` Mbit/s (a token bucket on its veth), so transfers are in flight long enough."""
        subprocess.run(
            ["ip", "netns", "exec", self.ns[side], "tc", "qdisc", "replace", "dev", self._veth[side], "root", "tbf",
             "rate", f"{mbit}mbit", "burst", "256kb", "latency", "2s"],
            check=True, capture_output=True, timeout=10,
        )

    def start(self, side: str, *, timeout_s: float, keepalive_s: float = 1.0) -> NodeProcess:
        node = NodeProcess(self.ns[side], self.host[side], str(self._tmp / f"no-hmcd-{side}.sock"), timeout_s=timeout_s, keepalive_s=keepalive_s)
        self._nodes.append(node)
        return node

    def close(self) -> None:
        for node in self._nodes:
            node.close()
        for side in "ab":
            subprocess.run(["ip", "netns", "del", self.ns[side]], capture_output=True, timeout=10)


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    probe = f"hmc-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=10)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def wait_for(predicate: Any, timeout: float, what: str) -> float:
    """Poll `predicate()` until true (AssertionError after `timeout` s); the monotonic time it became true."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.02)  # between polls of another process's state; the deadline above bounds the wait
    return time.monotonic()
