"""Config: defaults < TOML file < HMC_* environment, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from hmc.config import Config, PathPolicy
from hmc.errors import ArgumentError


def test_defaults_do_not_need_environment() -> None:
    config = Config.load(env={})
    assert config.timeout_s > 0
    assert config.policy == PathPolicy()
    assert config.socket.endswith("hmcd.sock")


def test_file_then_environment(tmp_path: Path) -> None:
    file = tmp_path / "hmc.toml"
    file.write_text(
        'node = "a"\ntoken = "t1"\nstatic_peers = ["127.0.0.1:1"]\n'
        '[transfer]\ntimeout_s = 3.5\nstreams = 2\n'
        '[paths]\ndeny = ["ipc"]\n'
        '[devices]\nvendor_override = { "cuda:1" = "amd" }\n'
    )
    config = Config.load(file, env={"HMC_TOKEN": "t2", "HMC_PATHS_PREFER": "staged"})
    assert config.node == "a"
    assert config.token == "t2"
    assert config.static_peers == ("127.0.0.1:1",)
    assert config.timeout_s == 3.5
    assert config.staged_streams == 2
    assert config.policy.prefer == ("staged",)
    assert config.vendor_override == {"cuda:1": "amd"}


def test_config_file_from_environment(tmp_path: Path) -> None:
    file = tmp_path / "c.toml"
    file.write_text('node = "from-file"\n')
    assert Config.load(env={"HMC_CONFIG": str(file)}).node == "from-file"


@pytest.mark.parametrize(
    "env",
    [
        {"HMC_TIMEOUT_S": "soon"},
        {"HMC_PATHS_DENY": "teleport"},
        {"HMC_DEVICE_VENDOR_OVERRIDE": "cuda:1"},
    ],
)
def test_bad_environment_is_a_typed_error(env: dict[str, str]) -> None:
    with pytest.raises(ArgumentError):
        Config.load(env=env)


def test_unknown_or_unreadable_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("colour = 1\n")
    with pytest.raises(ArgumentError, match="colour"):
        Config.load(bad, env={})
    with pytest.raises(ArgumentError, match="cannot read"):
        Config.load(tmp_path / "missing.toml", env={})
    broken = tmp_path / "broken.toml"
    broken.write_text("node = \n")
    with pytest.raises(ArgumentError):
        Config.load(broken, env={})


def test_config_is_frozen() -> None:
    config = Config.load(env={})
    with pytest.raises(AttributeError):
        config.node = "x"  # type: ignore[misc]
    assert config.replace(node="y").node == "y"


def test_shipped_example_configs_load() -> None:
    root = Path(__file__).resolve().parent.parent
    for file in [root / "deploy" / "hmcd.toml", *sorted((root / "examples").rglob("*.toml"))]:
        config = Config.load(file, env={})
        assert config.node, file
