"""The public API is exactly what hmc/__init__.py lists, and every listed name exists."""

from __future__ import annotations

import types

import hmc


def test_all_names_exist_and_nothing_public_is_unlisted() -> None:
    listed = set(hmc.__all__)
    for name in listed:
        assert hasattr(hmc, name), name
    public = {name for name, value in vars(hmc).items() if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    modules = {name for name, value in vars(hmc).items() if not name.startswith("_") and isinstance(value, types.ModuleType)}
    assert public <= listed
    assert {"errors", "memory"} <= modules


def test_exported_classes_claim_their_public_home() -> None:
    for name in ("Agent", "AgentEvent", "AgentEventKind", "ConnBuffer", "Client", "Config", "RangeList"):
        assert getattr(hmc, name).__module__.startswith("hmc."), name


def test_version_matches_the_package_metadata() -> None:
    from importlib.metadata import version

    assert hmc.__version__ == version("hmc")
