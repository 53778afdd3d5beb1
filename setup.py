"""Build hook: generate the control-plane code in hmc/v1/ from proto/hmc/v1/*.proto.

The generated modules are never edited or committed; every install (regular or
editable) regenerates them with the pinned grpcio-tools from pyproject.toml.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "proto"
OUT_PACKAGE = ROOT / "hmc" / "v1"


def generate_protos() -> None:
    """Run grpc_tools.protoc over proto/hmc/v1 into hmc/v1 (an importable package)."""
    from grpc_tools import protoc  # build-time dependency only

    import importlib.resources

    include = str(importlib.resources.files("grpc_tools") / "_proto")
    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "hmc" / "v1").glob("*.proto"))
    OUT_PACKAGE.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on proto/hmc/v1")
    (OUT_PACKAGE / "__init__.py").write_text('"""Generated from proto/hmc/v1 at build time; do not edit."""\n')


# Generate before setuptools discovers packages, so hmc.v1 is found by both
# regular and editable installs.
generate_protos()
setup()
