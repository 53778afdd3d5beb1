"""The one configuration object: a frozen dataclass loaded from a TOML file and `HMC_*` variables.

Precedence: defaults < TOML file < environment. Nothing here runs at import time;
callers build a `Config` once (`Config.load()`) and pass it down.

TOML layout (every key optional)::

    node = "node-a"
    socket = "/run/hmc/hmcd.sock"
    listen = "0.0.0.0:7710"
    token = "secret"
    static_peers = ["10.0.0.2:7710"]
    [transfer]
    timeout_s = 30.0
    staged_streams = 4
    [paths]
    allow = ["ipc", "staged"]
    deny = []
    prefer = []
    [devices]
    vendor_override = { "cuda:1" = "amd" }
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hmc.errors import ArgumentError

__all__ = ["Config", "PathPolicy", "default_socket_path"]

PATH_NAMES: tuple[str, ...] = ("local", "ipc", "rdma", "ucx", "staged")


def default_socket_path() -> str:
    """hmcd's unix socket: $XDG_RUNTIME_DIR/hmc/hmcd.sock, else /tmp/hmc-$UID/hmcd.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "hmc" if runtime else Path(f"/tmp/hmc-{os.getuid()}")
    return str(base / "hmcd.sock")


@dataclasses.dataclass(frozen=True)
class PathPolicy:
    """User policy over negotiation."""

    allow: tuple[str, ...] = PATH_NAMES
    """Paths that may be chosen at all."""
    deny: tuple[str, ...] = ()
    """Paths that are never chosen (wins over allow)."""
    prefer: tuple[str, ...] = ()
    """Paths tried first, in this order, before the built-in preference order."""

    def __post_init__(self) -> None:
        for name in (*self.allow, *self.deny, *self.prefer):
            if name not in PATH_NAMES:
                raise ArgumentError(f"unknown path {name!r} in path policy; known: {', '.join(PATH_NAMES)}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings for hmcd, agents, the client and the CLI."""

    node: str = dataclasses.field(default_factory=lambda: os.uname().nodename)
    """Node name; one hmcd per node."""
    socket: str = dataclasses.field(default_factory=default_socket_path)
    """hmcd's unix socket, for local agents and clients."""
    listen: str = ""
    """hmcd's TCP address (host:port, port 0 picks one); empty: no TCP listener."""
    token: str = ""
    """Shared secret required on every TCP call (metadata `authorization: Bearer <token>`)."""
    static_peers: tuple[str, ...] = ()
    """Other hmcd TCP addresses (static directory)."""
    agent_host: str = "127.0.0.1"
    """Address an agent's peer listener binds and advertises."""
    timeout_s: float = 30.0
    """Default deadline of a transfer and of every control call."""
    staged_streams: int = 4
    """TCP data streams per peer pair on the staged path."""
    staged_chunk_bytes: int = 4 << 20
    """Smallest chunk of the staged path's pipeline over TCP: a larger transfer is cut into one chunk per stream (up to 64 MiB)."""
    socket_buffer_bytes: int = 8 << 20
    """SO_SNDBUF / SO_RCVBUF of data sockets."""
    ipc_threads: int = 2
    """Threads that split a large ipc (cross-memory attach) copy."""
    policy: PathPolicy = PathPolicy()
    """Which paths negotiation may choose."""
    vendor_override: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Declare a device to be of another vendor (e.g. {"cuda:1": "amd"}) to test cross-vendor paths."""
    peer_check_interval_s: float = 2.0
    """How often hmcd checks its static peers."""
    metrics: bool = True
    """Serve Prometheus metrics from hmcd."""
    tls_cert: str = ""
    """PEM certificate chain of hmcd's TCP listener; with `tls_key`, TCP is served over TLS."""
    tls_key: str = ""
    """PEM private key of hmcd's TCP listener."""
    tls_ca: str = ""
    """PEM CA bundle that clients and peer daemons use to verify hmcd's certificate (TLS on when set)."""
    peer_max_connections: int = 1024
    """Inbound connections an agent's peer port serves at once; further ones are refused until one closes."""
    keepalive_s: float = 5.0
    """Idle peer connections are probed this often (TCP keepalive), so a silent peer is detected."""

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
        """Build a Config from defaults, then the TOML file (path or $HMC_CONFIG), then HMC_* variables."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        file = path or env.get("HMC_CONFIG")
        if file:
            try:
                with open(file, "rb") as fh:
                    values.update(_from_toml(tomllib.load(fh)))
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ArgumentError(f"cannot read config file {file}: {exc}") from exc
        values.update(_from_env(env))
        return cls(**values)

    def replace(self, **changes: Any) -> Config:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def _policy(data: Mapping[str, Any]) -> PathPolicy:
    return PathPolicy(
        allow=tuple(data.get("allow", PATH_NAMES)),
        deny=tuple(data.get("deny", ())),
        prefer=tuple(data.get("prefer", ())),
    )


def _from_toml(data: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    simple = {f.name for f in dataclasses.fields(Config)} - {"policy", "vendor_override", "static_peers"}
    for key, value in data.items():
        if key in simple:
            out[key] = value
        elif key == "static_peers":
            out[key] = tuple(value)
        elif key == "transfer":
            for sub, sub_value in value.items():
                name = sub if sub in simple else f"staged_{sub}"
                if name not in simple:
                    raise ArgumentError(f"unknown config key transfer.{sub}")
                out[name] = sub_value
        elif key == "paths":
            out["policy"] = _policy(value)
        elif key == "devices":
            out["vendor_override"] = dict(value.get("vendor_override", {}))
        else:
            raise ArgumentError(f"unknown config key {key!r}")
    return out


_ENV_SCALARS: dict[str, tuple[str, type]] = {
    "HMC_NODE": ("node", str),
    "HMC_SOCKET": ("socket", str),
    "HMC_LISTEN": ("listen", str),
    "HMC_TOKEN": ("token", str),
    "HMC_AGENT_HOST": ("agent_host", str),
    "HMC_TIMEOUT_S": ("timeout_s", float),
    "HMC_STAGED_STREAMS": ("staged_streams", int),
    "HMC_STAGED_CHUNK_BYTES": ("staged_chunk_bytes", int),
    "HMC_SOCKET_BUFFER_BYTES": ("socket_buffer_bytes", int),
    "HMC_IPC_THREADS": ("ipc_threads", int),
    "HMC_PEER_CHECK_INTERVAL_S": ("peer_check_interval_s", float),
    "HMC_TLS_CERT": ("tls_cert", str),
    "HMC_TLS_KEY": ("tls_key", str),
    "HMC_TLS_CA": ("tls_ca", str),
    "HMC_PEER_MAX_CONNECTIONS": ("peer_max_connections", int),
    "HMC_KEEPALIVE_S": ("keepalive_s", float),
}


def _split(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """HMC_* variables; lists are comma-separated, HMC_DEVICE_VENDOR_OVERRIDE is `cuda:1=amd,...`."""
    out: dict[str, Any] = {}
    for var, (name, kind) in _ENV_SCALARS.items():
        if var in env:
            try:
                out[name] = kind(env[var])
            except ValueError as exc:
                raise ArgumentError(f"{var}={env[var]!r} is not a valid {kind.__name__}") from exc
    if "HMC_STATIC_PEERS" in env:
        out["static_peers"] = _split(env["HMC_STATIC_PEERS"])
    policy_env = {key: _split(env[f"HMC_PATHS_{key.upper()}"]) for key in ("allow", "deny", "prefer") if f"HMC_PATHS_{key.upper()}" in env}
    if policy_env:
        out["policy"] = _policy(policy_env)
    if "HMC_DEVICE_VENDOR_OVERRIDE" in env:
        pairs = [item.split("=", 1) for item in _split(env["HMC_DEVICE_VENDOR_OVERRIDE"])]
        if any(len(pair) != 2 for pair in pairs):
            raise ArgumentError("HMC_DEVICE_VENDOR_OVERRIDE must look like 'cuda:1=amd,cuda:2=nvidia'")
        out["vendor_override"] = {device: vendor for device, vendor in pairs}
    return out
