"""The HIP-on-CUDA runtime (`hmc.memory._hip_on_cuda`) against the installed hip-python, so the two cannot drift:
every function it offers exists in hip-python with the same argument names, every enum member with the same
value, every constant equal, every struct attribute present; and every `hip.*` name the HIP backend uses is
offered by both. Also: with hip-python but no ROCm, the HIP backend is absent and `hmc devices` says why.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

real_hip = pytest.importorskip("hip", reason="hip-python is not installed (the `hip` extra)").hip

from hmc.testing.hip_on_cuda import hip as ours  # noqa: E402 - after the skip

BACKEND = [Path(__file__).parents[1] / "hmc" / "memory" / name for name in ("_hip.py", "_hip_ipc.py", "_hip_runtime.py")]


def _offered() -> dict[str, Any]:
    """Our runtime's public names (defined there, not imported)."""
    names = {}
    for name, value in vars(ours).items():
        if name.startswith("_") or not name.startswith("hip"):
            continue
        names[name] = value
    return names


def test_every_function_has_hip_pythons_name_and_arguments() -> None:
    functions = {name: value for name, value in _offered().items() if inspect.isfunction(value)}
    assert len(functions) >= 30
    for name, function in functions.items():
        theirs = getattr(real_hip, name, None)
        assert theirs is not None, f"hip-python has no {name}"
        assert list(inspect.signature(function).parameters) == list(inspect.signature(theirs).parameters), name


def test_every_enum_member_and_constant_has_hip_pythons_value() -> None:
    for name, value in _offered().items():
        if isinstance(value, type) and issubclass(value, enum.Enum):
            theirs = getattr(real_hip, name)
            for member in value:
                assert int(getattr(theirs, member.name)) == int(member), f"{name}.{member.name}"
        elif isinstance(value, int):
            assert int(getattr(real_hip, name)) == value, name


def test_every_struct_attribute_exists_in_hip_python() -> None:
    structs = {name: value for name, value in _offered().items() if isinstance(value, type) and not issubclass(value, enum.Enum)}
    assert {"hipUUID", "hipIpcMemHandle_t", "hipPointerAttribute_t"} <= set(structs)
    for name, struct in structs.items():
        theirs = getattr(real_hip, name)
        ours_attributes = {a for a in dir(struct()) if not a.startswith("_")}
        assert ours_attributes <= set(dir(theirs)), f"{name}: {ours_attributes - set(dir(theirs))}"


def test_the_backend_calls_only_what_both_offer() -> None:
    used = set()
    for path in BACKEND:
        used |= set(re.findall(r"\bhip\.(hip\w+)", path.read_text()))
    assert {"hipMalloc", "hipIpcGetMemHandle", "hipMemcpyAsync"} <= used
    assert used <= set(_offered()), used - set(_offered())
    assert all(hasattr(real_hip, name) for name in used)


def test_without_rocm_the_hip_backend_is_absent_and_hmc_devices_says_why(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hmc.cli._main", "devices", "--json", "--local"],
        capture_output=True, text=True, timeout=60, check=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    report = json.loads(result.stdout)
    assert all(device["kind"] != "DEVICE_KIND_HIP" for device in report["devices"])
    reasons = {entry["kind"]: entry["reason"] for entry in report["absent"]}
    assert "ROCm" in reasons["hip"] or "AMD" in reasons["hip"], reasons
