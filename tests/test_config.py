"""Config: defaults < TOML file < HMC_* environment; every refusal an ArgumentError naming its key."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from hmc.config import PATH_NAMES, Config, PathPolicy
from hmc.errors import ArgumentError

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_do_not_need_environment() -> None:
    config = Config.load(env={})
    assert config.timeout_s > 0
    assert config.policy == PathPolicy()
    assert config.socket.endswith("hmcd.sock")


def test_file_then_environment(tmp_path: Path) -> None:
    file = tmp_path / "hmc.toml"
    file.write_text(
        'node = "a"\ntoken = "t1"\nstatic_peers = ["127.0.0.1:1"]\nkeepalive_s = 7\n'
        "[transfer]\ntimeout_s = 3.5\nstreams = 2\nchunk_bytes = 8192\n"
        '[paths]\ndeny = ["ipc"]\n'
        '[devices]\nvendor_override = { "cuda:1" = "amd" }\n'
    )
    config = Config.load(file, env={"HMC_TOKEN": "t2", "HMC_TIMEOUT_S": "2", "HMC_PATHS_PREFER": "staged"})
    assert config.node == "a"  # file over default
    assert config.token == "t2"  # environment over file
    assert config.timeout_s == 2.0
    assert config.static_peers == ("127.0.0.1:1",)
    assert config.keepalive_s == 7.0 and isinstance(config.keepalive_s, float)
    assert (config.staged_streams, config.staged_chunk_bytes) == (2, 8192)
    assert config.policy == PathPolicy(deny=("ipc",), prefer=("staged",))  # per key: HMC_PATHS_PREFER keeps the file's deny
    assert config.vendor_override == {"cuda:1": "amd"}
    assert config.ipc_threads == Config().ipc_threads  # untouched: the default


def test_config_file_from_environment(tmp_path: Path) -> None:
    file = tmp_path / "c.toml"
    file.write_text('node = "from-file"\n')
    other = tmp_path / "other.toml"
    other.write_text('node = "from-path"\n')
    assert Config.load(env={"HMC_CONFIG": str(file)}).node == "from-file"
    assert Config.load(other, env={"HMC_CONFIG": str(file)}).node == "from-path"


def test_environment_strings_are_parsed() -> None:
    config = Config.load(
        env={
            "HMC_TIMEOUT_S": "1e6",
            "HMC_STAGED_STREAMS": "64",
            "HMC_METRICS": "false",
            "HMC_STATIC_PEERS": "10.0.0.2:7710, [::1]:7711,",
            "HMC_PATHS_ALLOW": "ipc,staged",
            "HMC_DEVICE_VENDOR_OVERRIDE": "cuda:1=AMD, cuda:2=nvidia",
            "HMC_HOST_ID": "read elsewhere, ignored here",
            "hmc_timeout_s": "-1",  # not an HMC_* variable: names are case-sensitive
        }
    )
    assert (config.timeout_s, config.staged_streams, config.metrics) == (1e6, 64, False)
    assert config.static_peers == ("10.0.0.2:7710", "[::1]:7711")
    assert config.policy.allow == ("ipc", "staged")
    assert config.vendor_override == {"cuda:1": "amd", "cuda:2": "nvidia"}


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"HMC_TIMEOUT_S": "soon"}, "HMC_TIMEOUT_S"),
        ({"HMC_TIMEOUT_S": "nan"}, "HMC_TIMEOUT_S"),
        ({"HMC_TIMEOUT_S": "inf"}, "HMC_TIMEOUT_S"),
        ({"HMC_TIMEOUT_S": "-1"}, "HMC_TIMEOUT_S"),
        ({"HMC_TIMEOUT_S": "0"}, "HMC_TIMEOUT_S"),
        ({"HMC_TIMEOUT_S": "1000001"}, "HMC_TIMEOUT_S"),
        ({"HMC_PEER_CHECK_INTERVAL_S": "nan"}, "HMC_PEER_CHECK_INTERVAL_S"),
        ({"HMC_KEEPALIVE_S": "0"}, "HMC_KEEPALIVE_S"),
        ({"HMC_STAGED_STREAMS": "0"}, "HMC_STAGED_STREAMS"),
        ({"HMC_STAGED_STREAMS": "65"}, "HMC_STAGED_STREAMS"),
        ({"HMC_STAGED_STREAMS": "4.5"}, "HMC_STAGED_STREAMS"),
        ({"HMC_STAGED_CHUNK_BYTES": "4095"}, "HMC_STAGED_CHUNK_BYTES"),
        ({"HMC_SOCKET_BUFFER_BYTES": "-1"}, "HMC_SOCKET_BUFFER_BYTES"),
        ({"HMC_IPC_THREADS": "65"}, "HMC_IPC_THREADS"),
        ({"HMC_PEER_MAX_CONNECTIONS": "0"}, "HMC_PEER_MAX_CONNECTIONS"),
        ({"HMC_PEER_MAX_CONNECTIONS": "65537"}, "HMC_PEER_MAX_CONNECTIONS"),
        ({"HMC_NOTIFY_INBOX_BYTES": "1048575"}, "HMC_NOTIFY_INBOX_BYTES"),  # below one notification's 1 MiB
        ({"HMC_METRICS": "maybe"}, "HMC_METRICS"),
        ({"HMC_NODE": ""}, "HMC_NODE"),
        ({"HMC_PATHS_DENY": "teleport"}, "HMC_PATHS_DENY"),
        ({"HMC_PATHS_ALLOW": "ipc,teleport"}, "HMC_PATHS_ALLOW"),
        ({"HMC_DEVICE_VENDOR_OVERRIDE": "cuda:1"}, "HMC_DEVICE_VENDOR_OVERRIDE"),
        ({"HMC_DEVICE_VENDOR_OVERRIDE": "cuda:1=intel"}, "HMC_DEVICE_VENDOR_OVERRIDE"),
        ({"HMC_STATIC_PEERS": "10.0.0.2"}, "HMC_STATIC_PEERS"),
        ({"HMC_STATIC_PEERS": "10.0.0.2:7710,:7711"}, "HMC_STATIC_PEERS"),
        ({"HMC_STATIC_PEERS": "10.0.0.2:0"}, "HMC_STATIC_PEERS"),
        ({"HMC_STATIC_PEERS": "10.0.0.2:65536"}, "HMC_STATIC_PEERS"),
    ],
)
def test_bad_environment_is_refused_by_name(env: dict[str, str], key: str) -> None:
    with pytest.raises(ArgumentError, match=re.escape(key)) as refused:
        Config.load(env=env)
    assert type(refused.value) is ArgumentError  # no pydantic error leaks, not even as a subclass


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ('[transfer]\ntimeout_s = "30"\n', "transfer.timeout_s"),  # strict types: a string is not a number
        ("[transfer]\ntimeout_s = nan\n", "transfer.timeout_s"),
        ("[transfer]\ntimeout_s = inf\n", "transfer.timeout_s"),
        ("[transfer]\ntimeout_s = -1.0\n", "transfer.timeout_s"),
        ("[transfer]\nstreams = -3\n", "transfer.streams"),
        ("[transfer]\nstreams = 2.0\n", "transfer.streams"),
        ("[transfer]\nchunk_bytes = 100\n", "transfer.chunk_bytes"),
        ("[transfer]\nipc_threads = 0\n", "transfer.ipc_threads"),
        ("[transfer]\nsocket_buffer_bytes = -1\n", "transfer.socket_buffer_bytes"),
        ("[transfer]\nbogus = 1\n", "transfer.bogus"),
        ("[transfer]\nstaged_streams = 2\n", "transfer.staged_streams"),  # the [transfer] name is `streams`
        ("timeout_s = 3.0\n", "timeout_s"),  # its home is [transfer]
        ("colour = 1\n", "colour"),
        ("peer_check_interval_s = 2e6\n", "peer_check_interval_s"),
        ("keepalive_s = 0\n", "keepalive_s"),
        ("peer_max_connections = 0\n", "peer_max_connections"),
        ('metrics = "yes"\n', "metrics"),
        ("node = 5\n", "node"),
        ('static_peers = "10.0.0.2:7710"\n', "static_peers"),
        ('static_peers = ["10.0.0.2:7710", "nowhere"]\n', "static_peers[1]"),
        ('[paths]\ndeny = ["teleport"]\n', "paths.deny"),
        ('[paths]\nforbid = ["ipc"]\n', "paths.forbid"),
        ("paths = 3\n", "paths"),
        ('[devices]\nvendor_override = { "cuda:1" = "intel" }\n', "devices.vendor_override"),
        ("[devices]\nvendor_override = { \"cuda:1\" = 1 }\n", "devices.vendor_override"),
        ("[devices]\ncolour = 1\n", "devices.colour"),
    ],
)
def test_bad_file_is_refused_by_name(tmp_path: Path, toml: str, key: str) -> None:
    file = tmp_path / "bad.toml"
    file.write_text(toml)
    with pytest.raises(ArgumentError, match=re.escape(key)) as refused:
        Config.load(file, env={})
    assert type(refused.value) is ArgumentError
    assert str(file) in str(refused.value)


def test_a_secret_is_never_echoed(tmp_path: Path) -> None:
    file = tmp_path / "secret.toml"
    file.write_text("token = 123456789\n")
    with pytest.raises(ArgumentError, match="token") as refused:
        Config.load(file, env={})
    assert "123456789" not in str(refused.value)


def test_unreadable_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(ArgumentError, match="cannot read"):
        Config.load(tmp_path / "missing.toml", env={})
    broken = tmp_path / "broken.toml"
    broken.write_text("node = \n")
    with pytest.raises(ArgumentError, match="cannot read"):
        Config.load(broken, env={})


def test_direct_construction_and_replace_are_validated() -> None:
    assert Config(socket="/tmp/x.sock", timeout_s=10).timeout_s == 10.0  # an int is a fine number of seconds
    with pytest.raises(ArgumentError, match="timeout_s"):
        Config(timeout_s="30")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="timeout_s"):
        Config(timeout_s=float("nan"))
    with pytest.raises(ArgumentError, match="unknown key colour"):
        Config(colour=1)  # type: ignore[call-arg]
    config = Config(node="n", static_peers=["10.0.0.2:7710"])  # type: ignore[arg-type]
    assert config.static_peers == ("10.0.0.2:7710",)  # any sequence, kept as a tuple
    with pytest.raises(ArgumentError, match="staged_streams"):
        config.replace(staged_streams=0)
    with pytest.raises(ArgumentError, match="unknown key bogus"):
        config.replace(bogus=1)
    staged = config.replace(policy=PathPolicy(allow=("staged",)))
    assert staged.policy.allow == ("staged",) and staged.node == "n" and config.policy == PathPolicy()
    with pytest.raises(ArgumentError, match="vendor_override"):
        config.replace(vendor_override={"cuda:1": "intel"})
    assert config.replace(vendor_override={"host": "AMD"}).vendor_override == {"host": "amd"}


def test_path_policy_names_paths() -> None:
    assert PathPolicy().allow == PATH_NAMES
    assert PathPolicy(deny=["ipc"]) == PathPolicy(deny=("ipc",))  # type: ignore[arg-type]
    assert hash(PathPolicy(deny=["ipc"])) == hash(PathPolicy(deny=("ipc",)))  # type: ignore[arg-type]
    assert PathPolicy(deny=("ipc",)) != PathPolicy()
    with pytest.raises(ArgumentError, match=r"allow\[0\]"):
        PathPolicy(allow=("teleport",))
    with pytest.raises(ArgumentError, match="prefer"):
        PathPolicy(prefer="staged")  # type: ignore[arg-type]  # a string is not a list of names


def test_config_is_frozen_hashable_and_pickles() -> None:
    config = Config(
        node="n",
        socket="/tmp/p.sock",
        static_peers=("10.0.0.2:7710",),
        policy=PathPolicy(deny=("ipc",)),
        vendor_override={"cuda:1": "amd"},
        timeout_s=12.5,
    )
    with pytest.raises(AttributeError):
        config.node = "x"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del config.token
    copy = pickle.loads(pickle.dumps(config))  # how PeerProcess hands a Config to a spawned process
    assert copy == config and copy is not config
    assert hash(copy) == hash(config) and {config: 1}[copy] == 1
    assert copy.replace(timeout_s=1.0) != config


def test_every_field_has_a_variable() -> None:
    """HMC_<FIELD> reaches each scalar field (a field added to Config cannot be forgotten by the environment)."""
    config = Config(node="n", socket="/tmp/n.sock", listen="127.0.0.1:0", token="t", agent_host="10.0.0.9", tls_ca="/ca.pem", directory="etcd", etcd_prefix="/c1", etcd_cert="/c.pem", etcd_key="/k.pem")
    text = {name: str(value) for name, value in config if isinstance(value, str | int | float)}
    assert Config.load(env={f"HMC_{name.upper()}": value for name, value in text.items()}) == config
    assert set(text) == set(Config.model_fields) - {"static_peers", "etcd_endpoints", "policy", "vendor_override"}


def test_the_directory_table_and_its_variables() -> None:
    env = {"HMC_DIRECTORY": "etcd", "HMC_ETCD_ENDPOINTS": "10.0.0.1:2379, https://etcd-1:2379", "HMC_ETCD_LEASE_TTL_S": "3"}
    config = Config.load(env=env)
    assert (config.directory, config.etcd_endpoints, config.etcd_lease_ttl_s) == ("etcd", ("10.0.0.1:2379", "https://etcd-1:2379"), 3)
    with pytest.raises(ArgumentError, match="HMC_DIRECTORY"):
        Config.load(env={"HMC_DIRECTORY": "consul"})
    for prefix in ("hmc", "/hmc/", "/a//b", ""):
        with pytest.raises(ArgumentError, match="etcd_prefix"):
            Config(etcd_prefix=prefix)
    for ttl in (1, 0, -5, 10**6):
        with pytest.raises(ArgumentError, match="etcd_lease_ttl_s"):
            Config(etcd_lease_ttl_s=ttl)


def test_shipped_example_configs_load() -> None:
    for file in [ROOT / "deploy" / "hmcd.toml", *sorted((ROOT / "examples").rglob("*.toml"))]:
        config = Config.load(file, env={})
        assert config.node, file


def test_the_readme_configuration_loads(tmp_path: Path) -> None:
    """The TOML block under the README's "Configuration" heading is a valid file with every documented key."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Configuration\n.*?```toml\n(.*?)```", readme, re.S)
    assert block is not None
    file = tmp_path / "readme.toml"
    file.write_text(block.group(1))
    config = Config.load(file, env={})
    assert (config.node, config.staged_streams, config.vendor_override) == ("prefill-0", 4, {"cuda:1": "amd"})
