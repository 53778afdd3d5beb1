"""Build hook: generate the control-plane code in hmc/v1/ from proto/hmc/v1/*.proto, and compile the four cffi
modules: the UCP binding of the `ucx` path (hmc/transport/_ucx_c, see hmc/transport/_ucx_build.py), the copy
lanes' CUDA and HIP calls (hmc/transport/_gpu_batch_c, see hmc/transport/_gpu_batch_build.py), the one-pass range
list facts (hmc/transport/_ranges_c, see hmc/transport/_ranges_build.py), and the HIP-on-CUDA runtime's C entry
points (hmc/memory/_hip_on_cuda/_runtime_c, see its _runtime_build.py).

None is edited or committed; every install (regular or editable) regenerates them, with the pinned
grpcio-tools, cffi and libucx-cu13 from pyproject.toml. Every module is optional: where one cannot be built
(no libucx wheel for the platform, no C compiler) the install goes on, the `ucx` path says why it is
unavailable, the staged ring queues its CUDA (and HIP-on-CUDA) batches from Python, and numpy alone checks range lists.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import Distribution, setup

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


_COMPILE = """
import runpy, sys
from pathlib import Path
script, package_dir = Path(sys.argv[1]), Path(sys.argv[2])
root = Path(sys.argv[3]) if len(sys.argv) > 3 else package_dir.parent.parent
runpy.run_path(str(script))["binding"]().compile(tmpdir=str(root), verbose=False)
stem = script.name.removesuffix("_build.py") + "_c"
for leftover in (package_dir / (stem + ".c"), package_dir / (stem + ".o")):
    leftover.unlink(missing_ok=True)
"""
"""Compiles the cffi module a build script declares (its `binding()`), leaving only the extension behind."""


def build_binding(script: str, what: str, package: str = "hmc/transport") -> bool:
    """Compile one cffi module of `package` (a directory under the root), as its build script declares it; a warning
    naming `what` is lost, not a failure, where it cannot be (False then).

    In a process of its own: cffi's compiler run would otherwise reset the distutils state setup() uses."""
    import subprocess
    import sys

    package_dir = ROOT / package
    result = subprocess.run([sys.executable, "-c", _COMPILE, str(package_dir / script), str(package_dir), str(ROOT)], capture_output=True, text=True)
    if result.returncode != 0:
        why = (result.stderr.strip().splitlines() or ["unknown"])[-1]
        print(f"warning: {script} did not build, {what}: {why}")
    return result.returncode == 0


class _Distribution(Distribution):
    """A wheel that carries the compiled binding is a platform wheel, not a pure one."""

    def has_ext_modules(self) -> bool:
        return any((ROOT / "hmc" / "transport").glob("_*_c*.so"))


# Generate before setuptools discovers packages, so hmc.v1 is found by both
# regular and editable installs.
generate_protos()
build_binding("_ucx_build.py", "the ucx path will be unavailable")
build_binding("_gpu_batch_build.py", "the staged ring's CUDA batches will be queued from Python")
build_binding("_ranges_build.py", "long range lists will be checked by numpy alone")
build_binding("_runtime_build.py", "HIP-on-CUDA batches will be queued from Python", "hmc/memory/_hip_on_cuda")
setup(
    package_data={"hmc.transport": ["_ucx_c*.so", "_gpu_batch_c*.so", "_ranges_c*.so"], "hmc.memory._hip_on_cuda": ["_runtime_c*.so"]},
    distclass=_Distribution,
)
