"""Several nodes on one machine, for real: network namespaces joined by a bridge, etcd, one hmcd per node.

    with NetnsCluster(3) as cluster:         # root only; see `netns_available()`
        a, b, c = cluster.nodes              # each: a namespace, an address, an hmcd
        owner = a.agent()                    # a real Agent (PeerProcess) inside a's namespace
        c.hmcd.client().lookup("kv")         # any node's hmcd, through its unix socket
        b.kill_hmcd(); b.start_hmcd()        # a node that dies and comes back (same state file)
        cluster.etcd.kill(); cluster.etcd.start()
        with b.unplugged(): ...              # b's cable pulled (its veth down), then plugged back in

The bridge and etcd live in the root namespace, at the bridge's address. Each node has
its own host id (HMC_HOST_ID), so HMC treats the nodes as different machines: between
them only network paths apply (staged over TCP), as between real hosts. Names are
unique per cluster, so clusters of concurrent test runs never meet.

Concurrency: driven by one test thread; `close()` removes the namespaces, the bridge,
every process it started and the scratch directory.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hmc.agent._peer_process import PeerProcess
from hmc.config import Config
from hmc.errors import HMCError, UnavailableError
from hmc.testing._etcd import EtcdServer, etcd_available
from hmc.testing._hmcd import HmcdProcess, clean_env

__all__ = ["NetnsCluster", "NetnsNode", "netns_available"]

HMCD_PORT = 7710


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise HMCError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


def netns_available() -> tuple[bool, str]:
    """Whether this process can build namespaced nodes (root, iproute2, etcd), and if not, why."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if shutil.which("ip") is None:
        return False, "no `ip` command (install iproute2)"
    available, why = etcd_available()
    if not available:
        return False, why
    probe = f"hmcprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except HMCError as exc:
        return False, f"cannot create a network namespace here: {exc}"
    _ip("netns", "del", probe)
    return True, ""


def _free_subnet() -> str:
    """A 10.x.y.0/24 that no route or address of this machine uses yet (the bridge's)."""
    taken = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True, timeout=30).stdout
    taken += subprocess.run(["ip", "-4", "addr", "show"], capture_output=True, text=True, timeout=30).stdout
    for _ in range(100):
        candidate = f"10.{100 + secrets.randbelow(150)}.{secrets.randbelow(250)}"
        wider = ("10.0.0.0/8", f"10.{candidate.split('.')[1]}.0.0/16")
        if f"{candidate}." not in taken and not any(route in taken for route in wider):
            return candidate
    raise HMCError("no free 10.x.y.0/24 subnet for the cluster's bridge")


class NetnsNode:
    """One node: a network namespace with one address on the bridge, and its hmcd."""

    def __init__(self, cluster: NetnsCluster, index: int) -> None:
        self.cluster = cluster
        self.name = f"node-{chr(ord('a') + index)}"
        self.netns = f"hmc{cluster.tag}{index}"
        self.host_veth = f"hv{cluster.tag}{index}"
        self.address = f"{cluster.subnet}.{10 + index}"
        self.host_id = f"netns-{cluster.tag}-{self.name}"
        self.hmcd: HmcdProcess | None = None
        self.agents: list[PeerProcess] = []

    def _create(self) -> None:
        inner = f"hn{self.cluster.tag}{self.address.rsplit('.', 1)[1]}"
        _ip("netns", "add", self.netns)
        _ip("link", "add", self.host_veth, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", self.netns)
        _ip("link", "set", self.host_veth, "master", self.cluster.bridge, "up")
        _ip("-n", self.netns, "addr", "add", f"{self.address}/24", "dev", inner)
        _ip("-n", self.netns, "link", "set", inner, "up")
        _ip("-n", self.netns, "link", "set", "lo", "up")

    @property
    def env(self) -> dict[str, str]:
        """What every process of this node starts with: its host id, no other HMC_* variable."""
        return clean_env(HMC_HOST_ID=self.host_id)

    def config(self, **changes: object) -> Config:
        """The Config of an agent or client of this node."""
        assert self.hmcd is not None, f"{self.name} has no hmcd"
        return self.hmcd.config(agent_host=self.address, **changes)

    def start_hmcd(self, *args: str) -> HmcdProcess:
        """Start (or start again, on the same socket and state file) this node's hmcd on the etcd directory."""
        if self.hmcd is not None and self.hmcd.process.poll() is None:
            raise HMCError(f"hmcd of {self.name} is still running")
        cluster = self.cluster
        directory_args = ["--etcd", cluster.etcd.endpoint, "--etcd-lease-ttl", str(cluster.ttl_s), "--etcd-prefix", cluster.prefix, "--log-level", "debug"]
        self.hmcd = HmcdProcess.start(
            cluster.directory,
            self.name,
            token=cluster.token,
            listen=f"{self.address}:{HMCD_PORT}",
            args=[*directory_args, *args],
            env=self.env,
            prefix=["ip", "netns", "exec", self.netns],
        )
        return self.hmcd

    def kill_hmcd(self) -> None:
        """SIGKILL this node's hmcd: nothing says goodbye; its lease runs out."""
        assert self.hmcd is not None
        self.hmcd.kill()

    def agent(self, **changes: object) -> PeerProcess:
        """A real agent in this node's namespace, attached to its hmcd (closed with the cluster). Its UCX uses tcp
        only (`ucx_transports`, unless changed): namespaces share one kernel, and UCX would otherwise move bytes
        between them through shared memory, not over the nodes' network."""
        changes.setdefault("ucx_transports", "tcp")
        agent = PeerProcess(self.config(**changes), daemon=True, env={"HMC_HOST_ID": self.host_id}, netns=self.netns)
        self.agents.append(agent)
        return agent

    @contextlib.contextmanager
    def unplugged(self) -> Iterator[None]:
        """The node's cable pulled for the block (its veth down), plugged back in after."""
        _ip("link", "set", self.host_veth, "down")
        try:
            yield
        finally:
            _ip("link", "set", self.host_veth, "up")

    def close(self) -> None:
        for agent in self.agents:
            with contextlib.suppress(HMCError, OSError):
                agent.close()
        if self.hmcd is not None:
            self.hmcd.stop()
        with contextlib.suppress(HMCError):
            _ip("netns", "del", self.netns)


class NetnsCluster:
    """`count` namespaced nodes on a bridge, etcd on the bridge's address, one hmcd per node (started)."""

    def __init__(self, count: int, *, ttl_s: int = 2, token: str = "netns-cluster-secret", start: bool = True) -> None:
        available, why = netns_available()
        if not available:
            raise UnavailableError(why)
        self.tag = secrets.token_hex(2)
        self.subnet = _free_subnet()
        self.bridge = f"hb{self.tag}"
        self.prefix = f"/hmc-netns-{self.tag}"
        self.ttl_s = ttl_s
        self.token = token
        self.directory = tempfile.mkdtemp(prefix=f"hmc-ns{self.tag}-", dir="/tmp")
        self.nodes = [NetnsNode(self, index) for index in range(count)]
        self.etcd: EtcdServer
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for node in self.nodes:
                node._create()
            self.etcd = EtcdServer(host=f"{self.subnet}.1").start()
            if start:
                for node in self.nodes:
                    node.start_hmcd()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        if hasattr(self, "etcd"):
            self.etcd.close()
        with contextlib.suppress(HMCError):
            _ip("link", "del", self.bridge)
        shutil.rmtree(self.directory, ignore_errors=True)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of every hmcd's log (for a failing test's message)."""
        return "\n".join(f"--- {node.name} ---\n{Path(node.hmcd.log).read_text(errors='replace')[-chars:]}" for node in self.nodes if node.hmcd is not None)

    def __enter__(self) -> NetnsCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
