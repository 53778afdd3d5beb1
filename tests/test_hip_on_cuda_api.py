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

real = pytest.importorskip("hip", reason="hip-python is not installed (the `hip` extra)")

from hmc.memory._hip_on_cuda import hiprtc as our_hiprtc  # noqa: E402 - after the skip
from hmc.testing.hip_on_cuda import hip as our_hip  # noqa: E402

MODULES = [(our_hip, real.hip), (our_hiprtc, real.hiprtc)]

BACKEND = [Path(__file__).parents[1] / "hmc" / "memory" / name for name in ("_hip.py", "_hip_ipc.py", "_hip_runtime.py")]


def _offered(ours: Any) -> dict[str, Any]:
    """A runtime module's public names (hip-python's spelling: hip*, HIPRTC*)."""
    return {name: value for name, value in vars(ours).items() if name.startswith(("hip", "HIPRTC"))}


@pytest.mark.parametrize(("ours", "theirs"), MODULES, ids=["hip", "hiprtc"])
def test_every_function_has_hip_pythons_name_and_arguments(ours: Any, theirs: Any) -> None:
    functions = {name: value for name, value in _offered(ours).items() if inspect.isfunction(value)}
    assert len(functions) >= 7
    for name, function in functions.items():
        real_function = getattr(theirs, name, None)
        assert real_function is not None, f"hip-python has no {name}"
        assert list(inspect.signature(function).parameters) == list(inspect.signature(real_function).parameters), name


@pytest.mark.parametrize(("ours", "theirs"), MODULES, ids=["hip", "hiprtc"])
def test_every_enum_member_and_constant_has_hip_pythons_value(ours: Any, theirs: Any) -> None:
    for name, value in _offered(ours).items():
        if isinstance(value, type) and issubclass(value, enum.Enum):
            real_enum = getattr(theirs, name)
            for member in value:
                assert int(getattr(real_enum, member.name)) == int(member), f"{name}.{member.name}"
        elif isinstance(value, int):
            assert int(getattr(theirs, name)) == value, name


@pytest.mark.parametrize(("ours", "theirs"), MODULES, ids=["hip", "hiprtc"])
def test_every_struct_attribute_exists_in_hip_python(ours: Any, theirs: Any) -> None:
    structs = {name: value for name, value in _offered(ours).items() if isinstance(value, type) and not issubclass(value, enum.Enum)}
    assert structs
    for name, struct in structs.items():
        real_struct = getattr(theirs, name)
        try:
            instance: Any = struct()
        except TypeError:  # made by the runtime only (a program): its class's methods
            instance = struct
        ours_attributes = {a for a in dir(instance) if not a.startswith("_")}
        assert ours_attributes <= set(dir(real_struct)), f"{name}: {ours_attributes - set(dir(real_struct))}"


def test_the_backend_calls_only_what_both_offer() -> None:
    for module, (ours, theirs) in zip(("hip", "hiprtc"), MODULES):
        used = set()
        for path in BACKEND:
            used |= set(re.findall(rf"\b{module}\.((?:hip|HIPRTC)\w+)", path.read_text()))
        assert used, module
        assert used <= set(_offered(ours)), used - set(_offered(ours))
        assert all(hasattr(theirs, name) for name in used)


def test_without_rocm_the_hip_backend_is_absent_and_hmc_devices_says_why(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hmc.cli._main", "devices", "--json", "--local"],
        capture_output=True, text=True, timeout=60, check=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    report = json.loads(result.stdout)
    assert all(device["kind"] != "DEVICE_KIND_HIP" for device in report["devices"])
    reasons = {entry["kind"]: entry["reason"] for entry in report["absent"]}
    assert "ROCm" in reasons["hip"] or "AMD" in reasons["hip"], reasons
