"""The one configuration object: a frozen, validated `Config` loaded from a TOML file and `HMC_*` variables.

Precedence: defaults < TOML file (`path` or $HMC_CONFIG) < environment. Nothing here runs at
import time; callers build a `Config` once (`Config.load()`) and pass it down. `Config(...)`
and `Config.replace(...)` take keyword arguments only and never read the file or the environment.

TOML layout (every key optional; each key has exactly one home)::

    node = "node-a"                     # HMC_NODE
    socket = "/run/hmc/hmcd.sock"       # HMC_SOCKET
    listen = "0.0.0.0:7710"             # HMC_LISTEN
    token = "secret"                    # HMC_TOKEN
    static_peers = ["10.0.0.2:7710"]    # HMC_STATIC_PEERS="10.0.0.2:7710,10.0.0.3:7710"
    agent_host = "10.0.0.1"             # HMC_AGENT_HOST
    peer_check_interval_s = 2.0         # HMC_PEER_CHECK_INTERVAL_S
    metrics = true                      # HMC_METRICS
    tls_cert = "" / tls_key = "" / tls_ca = ""   # HMC_TLS_CERT, HMC_TLS_KEY, HMC_TLS_CA
    peer_max_connections = 1024         # HMC_PEER_MAX_CONNECTIONS
    keepalive_s = 5.0                   # HMC_KEEPALIVE_S
    notify_inbox_bytes = 67108864       # HMC_NOTIFY_INBOX_BYTES
    [transfer]
    timeout_s = 30.0                    # HMC_TIMEOUT_S
    streams = 4                         # HMC_STAGED_STREAMS
    chunk_bytes = 4194304               # HMC_STAGED_CHUNK_BYTES
    socket_buffer_bytes = 8388608       # HMC_SOCKET_BUFFER_BYTES
    ipc_threads = 2                     # HMC_IPC_THREADS
    [ucx]
    transports = ""                     # HMC_UCX_TRANSPORTS (UCX_TLS syntax, e.g. "tcp" or "sm,cma"; "": UCX's choice)
    library = ""                        # HMC_UCX_LIBRARY (a system UCX's library directory; "": the libucx wheel)
    workers = 2                         # HMC_UCX_WORKERS
    map_peers = true                    # HMC_UCX_MAP_PEERS
    [paths]
    allow = ["ipc", "staged"]           # HMC_PATHS_ALLOW="ipc,staged" (and _DENY, _PREFER)
    deny = []
    prefer = []
    [devices]
    vendor_override = { "cuda:1" = "amd" }   # HMC_DEVICE_VENDOR_OVERRIDE="cuda:1=amd,cuda:2=nvidia"
    [directory]
    kind = "static"                     # HMC_DIRECTORY ("static" or "etcd")
    endpoints = ["http://10.0.0.1:2379"]  # HMC_ETCD_ENDPOINTS="http://10.0.0.1:2379,https://10.0.0.2:2379"
    prefix = "/hmc"                     # HMC_ETCD_PREFIX
    lease_ttl_s = 5                     # HMC_ETCD_LEASE_TTL_S
    ca = "" / cert = "" / key = ""      # HMC_ETCD_CA, HMC_ETCD_CERT, HMC_ETCD_KEY (TLS to etcd)

Validation (pydantic models; the environment is read by pydantic-settings): types are strict
in the file and in `Config(...)` (`timeout_s = "30"` is refused), environment strings are
parsed; values are range-checked (seconds finite, > 0 and <= 1e6; 1..64 staged streams and
ipc threads; 1..64 UCX workers; chunks >= 4096 bytes; 1..65536 peer connections; 1 MiB..1 TiB of notifications); unknown keys are refused in
every table, unknown `HMC_*` variables are left alone (other parts read a few, e.g.
HMC_HOST_ID). Every refusal is an `ArgumentError` naming the key (`transfer.streams`,
`HMC_TIMEOUT_S`); no pydantic error leaves this module.

Concurrency: instances are immutable values, safe to share between threads and to pickle
into spawned processes; the module holds no state.
"""

from __future__ import annotations

import contextlib
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from hmc.errors import ArgumentError
from hmc.memory._base import Vendor

__all__ = ["Config", "PathPolicy", "default_socket_path"]

_PathName = Literal["local", "ipc", "rdma", "ucx", "staged"]
DirectoryKind = Literal["static", "etcd"]
PATH_NAMES: tuple[str, ...] = get_args(_PathName)


def default_socket_path() -> str:
    """hmcd's unix socket: $XDG_RUNTIME_DIR/hmc/hmcd.sock, else /tmp/hmc-$UID/hmcd.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "hmc" if runtime else Path(f"/tmp/hmc-{os.getuid()}")
    return str(base / "hmcd.sock")


# -- constrained types, shared by Config, the file layout and the environment ------------------


def _host_port(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT with a port in 1..65535")
    return text


def _etcd_prefix(text: str) -> str:
    if not text.startswith("/") or text.endswith("/") or "//" in text:
        raise ValueError(f"{text!r} must start with '/', not end with one, and have no empty part (e.g. '/hmc' or '/prod/hmc')")
    return text


def _ucx_transports(text: str) -> str:
    names = text.split(",") if text else []
    if any(not re.fullmatch(r"\^?[a-z][a-z0-9_]*", name) for name in names):
        raise ValueError(f"{text!r} is not a UCX transport list (comma-separated names such as 'tcp' or 'sm,cma')")
    return text


def _vendor(text: str) -> str:
    return Vendor.parse(text).value  # ArgumentError is a ValueError: pydantic reports it with the key


Seconds = Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)]
NonEmpty = Annotated[str, Field(min_length=1)]
HostPort = Annotated[str, AfterValidator(_host_port)]
VendorName = Annotated[str, AfterValidator(_vendor)]
PathNames = Annotated[tuple[_PathName, ...], Field(strict=False)]
"""Any sequence of path names (a TOML array, a list), kept as a tuple."""


# -- the one boundary where pydantic's errors become ours -----------------------------------------

_SECRET_KEYS = frozenset({"token", "HMC_TOKEN"})


@contextlib.contextmanager
def _refusals(where: str) -> Iterator[None]:
    """Turn a pydantic refusal into an ArgumentError naming every refused key."""
    try:
        yield
    except ValidationError as exc:
        raise ArgumentError(f"{where}: " + "; ".join(_describe(error) for error in exc.errors())) from exc


def _describe(error: Any) -> str:
    loc = error["loc"]
    key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    if error["type"] == "extra_forbidden":
        return f"unknown key {key}"
    message = str(error["msg"]).removeprefix("Value error, ")
    shown = "" if not loc or error["type"] == "value_error" or _SECRET_KEYS & set(map(str, loc)) else f" (got {_short(error['input'])})"
    return f"{key}: {message}{shown}" if key else message


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Frozen(BaseModel):
    """Immutable, validated on construction; a refusal is an ArgumentError naming the field."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, use_attribute_docstrings=True)

    def __init__(self, **values: Any) -> None:
        with _refusals(type(self).__name__):
            super().__init__(**values)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen; use replace() to change {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen; cannot delete {name!r}")


class PathPolicy(_Frozen):
    """User policy over negotiation."""

    allow: PathNames = PATH_NAMES
    """Paths that may be chosen at all."""
    deny: PathNames = ()
    """Paths that are never chosen (wins over allow)."""
    prefer: PathNames = ()
    """Paths tried first, in this order, before the built-in preference order."""


class Config(_Frozen):
    """Settings for hmcd, agents, the client and the CLI."""

    node: NonEmpty = Field(default_factory=lambda: os.uname().nodename)
    """Node name; one hmcd per node."""
    socket: NonEmpty = Field(default_factory=default_socket_path)
    """hmcd's unix socket, for local agents and clients."""
    listen: str = ""
    """hmcd's TCP address (host:port, port 0 picks one); empty: no TCP listener."""
    token: str = ""
    """Shared secret required on every TCP call (metadata `authorization: Bearer <token>`)."""
    static_peers: Annotated[tuple[HostPort, ...], Field(strict=False)] = ()
    """Other hmcd TCP addresses, HOST:PORT each (static directory)."""
    agent_host: NonEmpty = "127.0.0.1"
    """Address an agent's peer listener binds and advertises."""
    timeout_s: Seconds = 30.0
    """Default deadline of a transfer and of every control call."""
    staged_streams: Annotated[int, Field(ge=1, le=64)] = 4
    """TCP data streams per peer pair on the staged path."""
    staged_chunk_bytes: Annotated[int, Field(ge=4096)] = 4 << 20
    """Smallest chunk of the staged path's pipeline over TCP: a larger transfer is cut into one chunk per stream (up to 64 MiB)."""
    socket_buffer_bytes: Annotated[int, Field(ge=0, le=(1 << 31) - 1)] = 8 << 20
    """SO_SNDBUF / SO_RCVBUF of data sockets (a C int; 0 leaves the kernel's default)."""
    ipc_threads: Annotated[int, Field(ge=1, le=64)] = 2
    """Threads that split a large ipc (cross-memory attach) copy."""
    ucx_transports: Annotated[str, AfterValidator(_ucx_transports)] = ""
    """The UCX transports the `ucx` path may use (UCX_TLS syntax, e.g. "tcp" or "sm,cma"); empty: UCX_TLS, else
    UCX's own choice. The `rdma` path always uses UCX's verbs transports (rc, dc, ud)."""
    ucx_workers: Annotated[int, Field(ge=1, le=64)] = 2
    """UCX workers per path, each on its own progress thread: a large transfer is split across them."""
    ucx_map_peers: bool = True
    """Where UCX maps a peer's GPU memory into this process (cuda_ipc, GPUs of one host), move ranges through that
    mapping with the ipc path's batched copy (one kernel launch a batch) instead of one UCX put or get per range."""
    ucx_library: str = ""
    """Directory of a UCX installation to load instead of the libucx wheel's (a verbs-enabled system UCX for
    InfiniBand/RoCE, e.g. /usr/lib/x86_64-linux-gnu); empty: the wheel."""
    policy: PathPolicy = PathPolicy()
    """Which paths negotiation may choose."""
    vendor_override: Mapping[NonEmpty, VendorName] = Field(default_factory=dict)
    """Declare a device to be of another vendor (e.g. {"cuda:1": "amd"}; host, nvidia or amd) to test cross-vendor paths."""
    peer_check_interval_s: Seconds = 2.0
    """How often hmcd checks its static peers."""
    metrics: bool = True
    """Serve Prometheus metrics from hmcd."""
    tls_cert: str = ""
    """PEM certificate chain of hmcd's TCP listener; with `tls_key`, TCP is served over TLS."""
    tls_key: str = ""
    """PEM private key of hmcd's TCP listener."""
    tls_ca: str = ""
    """PEM CA bundle that clients and peer daemons use to verify hmcd's certificate (TLS on when set)."""
    peer_max_connections: Annotated[int, Field(ge=1, le=65536)] = 1024
    """Inbound connections an agent's peer port serves at once; further ones are refused until one closes."""
    keepalive_s: Seconds = 5.0
    """Idle peer connections are probed this often (TCP keepalive), so a silent peer is detected."""
    notify_inbox_bytes: Annotated[int, Field(ge=1 << 20, le=1 << 40)] = 64 << 20
    """Notification payload an agent holds for `notifications()` to drain: a notification beyond it is refused (its
    sender's transfer fails BUSY; the data has landed), so an owner that stops draining cannot run out of memory."""
    directory: DirectoryKind = "static"
    """How nodes find each other: `static` (static_peers) or `etcd` (a cluster on etcd_endpoints)."""
    etcd_endpoints: Annotated[tuple[NonEmpty, ...], Field(strict=False)] = ()
    """etcd endpoints (host:port, http://host:port or https://host:port), tried in turn."""
    etcd_prefix: Annotated[str, AfterValidator(_etcd_prefix)] = "/hmc"
    """Namespace of this cluster's keys in etcd (several clusters may share one etcd)."""
    etcd_lease_ttl_s: Annotated[int, Field(ge=2, le=3600)] = 5
    """TTL of each hmcd's etcd lease: a node that stops renewing it vanishes from the others' view within this."""
    etcd_ca: str = ""
    """PEM CA bundle to verify etcd's certificate (TLS on when set, or with https endpoints)."""
    etcd_cert: str = ""
    """PEM client certificate for etcd (with `etcd_key`)."""
    etcd_key: str = ""
    """PEM private key of the client certificate for etcd."""

    def __hash__(self) -> int:
        return hash(tuple(frozenset(value.items()) if isinstance(value, Mapping) else value for _, value in self))

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
        """Build a Config from defaults, then the TOML file (path or $HMC_CONFIG), then HMC_* variables."""
        env = os.environ if env is None else env
        file = path or env.get("HMC_CONFIG")
        from_file = _read_file(file) if file else {}
        from_env = _read_environment(env)
        policy = {**from_file.pop("policy", {}), **from_env.pop("policy", {})}  # per key: HMC_PATHS_DENY keeps the file's allow
        return cls(**{**from_file, **from_env, **({"policy": PathPolicy(**policy)} if policy else {})})

    def replace(self, **changes: Any) -> Config:
        """A copy with some fields changed, validated like a new Config."""
        return type(self)(**{**dict(self), **changes})


# -- the sources: the TOML file and the environment, each validated on its own so a refusal names its key ---


def _optional(fields: Mapping[str, str], *metadata: Any, alias: str = "") -> dict[str, Any]:
    """{key: Config field name} as model fields of that field's type and constraints, None when not given.

    `alias` formats the name the key is found under from the upper-cased key (e.g. "HMC_{key}").
    """
    out: dict[str, Any] = {}
    for key, name in fields.items():
        field = Config.model_fields[name]
        annotation = (Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation) | None
        out[key] = (Annotated[(annotation, *metadata)] if metadata else annotation, Field(None, validation_alias=alias.format(key=key.upper()) or None))
    return out


_TABLES = {
    "transfer": {"timeout_s": "timeout_s", "streams": "staged_streams", "chunk_bytes": "staged_chunk_bytes", "socket_buffer_bytes": "socket_buffer_bytes", "ipc_threads": "ipc_threads"},
    "ucx": {"transports": "ucx_transports", "library": "ucx_library", "workers": "ucx_workers", "map_peers": "ucx_map_peers"},
    "directory": {"kind": "directory", "endpoints": "etcd_endpoints", "prefix": "etcd_prefix", "lease_ttl_s": "etcd_lease_ttl_s", "ca": "etcd_ca", "cert": "etcd_cert", "key": "etcd_key"},
}
"""[table] key -> Config field; every other scalar field is a top-level key of its own name."""
_IN_TABLES = {name for keys in _TABLES.values() for name in keys.values()}
_SCALARS = [name for name in Config.model_fields if name not in {"policy", "vendor_override"}]
_POLICY_KEYS = tuple(PathPolicy.model_fields)

_TABLE = ConfigDict(extra="forbid", strict=True)
_File = create_model(
    "_File",
    __config__=_TABLE,
    **_optional({name: name for name in _SCALARS if name not in _IN_TABLES}),
    **{table: (create_model(f"_{table.title()}", __config__=_TABLE, **_optional(keys)) | None, None) for table, keys in _TABLES.items()},
    paths=(create_model("_Paths", __config__=_TABLE, **{key: (PathNames | None, None) for key in _POLICY_KEYS}) | None, None),
    devices=(create_model("_Devices", __config__=_TABLE, vendor_override=(dict[NonEmpty, VendorName] | None, None)) | None, None),
)
"""The TOML layout: strict types (a TOML string is never a number), no unknown key in any table."""


def _read_file(file: str | os.PathLike[str]) -> dict[str, Any]:
    """Config keyword arguments from a TOML file (policy as a dict of the keys given)."""
    try:
        with open(file, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ArgumentError(f"cannot read config file {file}: {exc}") from exc
    with _refusals(f"config file {file}"):
        given = _File.model_validate(data).model_dump(exclude_none=True)
    tables = {table: given.pop(table, {}) for table in _TABLES}
    paths, devices = given.pop("paths", {}), given.pop("devices", {})
    fields = {_TABLES[table][key]: value for table, values in tables.items() for key, value in values.items()}
    return {**given, **fields, **devices, **({"policy": paths} if paths else {})}


def _split(value: Any) -> Any:
    """A comma-separated variable as a tuple of its non-empty items."""
    return tuple(item.strip() for item in value.split(",") if item.strip()) if isinstance(value, str) else value


def _pairs(value: Any) -> Any:
    """`cuda:1=amd,cuda:2=nvidia` as a dict."""
    if not isinstance(value, str):
        return value
    pairs = [item.split("=", 1) for item in _split(value)]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError("must look like 'cuda:1=amd,cuda:2=nvidia'")
    return {device.strip(): vendor.strip() for device, vendor in pairs}


class _EnvironmentBase(BaseSettings):
    """HMC_* variables, each named exactly (case-sensitive); strings are parsed into the field's type."""

    model_config = SettingsConfigDict(case_sensitive=True, extra="ignore", frozen=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)  # values come from `_Variables` over the mapping Config.load was given, never os.environ behind its back

    _lists = field_validator("static_peers", "etcd_endpoints", *(f"paths_{key}" for key in _POLICY_KEYS), mode="before", check_fields=False)(_split)
    _vendor_pairs = field_validator("device_vendor_override", mode="before", check_fields=False)(_pairs)


_Environment = create_model(
    "_Environment",
    __base__=_EnvironmentBase,
    **_optional({name: name for name in _SCALARS}, NoDecode, alias="HMC_{key}"),
    **{f"paths_{key}": (Annotated[PathNames | None, NoDecode], Field(None, validation_alias=f"HMC_PATHS_{key.upper()}")) for key in _POLICY_KEYS},
    device_vendor_override=(Annotated[dict[NonEmpty, VendorName] | None, NoDecode], Field(None, validation_alias="HMC_DEVICE_VENDOR_OVERRIDE")),
)
"""The variables: HMC_<FIELD> for every scalar field, HMC_PATHS_ALLOW/DENY/PREFER and HMC_DEVICE_VENDOR_OVERRIDE.

Lists are comma-separated (NoDecode: never JSON)."""


class _Variables(EnvSettingsSource):
    """pydantic-settings' environment source over the mapping given to `Config.load(env=...)`."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # the one override: EnvSettingsSource reads os.environ here (DotEnvSettingsSource overrides it the same way)
        return dict(self._environ)


def _read_environment(env: Mapping[str, str]) -> dict[str, Any]:
    """Config keyword arguments from HMC_* variables (policy as a dict of the variables set)."""
    with _refusals("environment"):
        given = _Environment.model_validate(_Variables(_Environment, env)()).model_dump(exclude_none=True)
    policy = {key: given.pop(f"paths_{key}") for key in _POLICY_KEYS if f"paths_{key}" in given}
    if "device_vendor_override" in given:
        given["vendor_override"] = given.pop("device_vendor_override")
    return {**given, **({"policy": policy} if policy else {})}
