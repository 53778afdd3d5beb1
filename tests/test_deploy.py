"""The deployment artefacts are real: the Kubernetes manifests validate against the API's schemas (strict), the
configuration they carry loads, the container image builds and hmcd in it answers grpc.health.v1.

The image is built with buildah (no Docker engine here) on a Debian bookworm base made by debootstrap (no
image registry here); both are Debian packages that .ci/run installs. Skipped, with the reason, without them.
"""

from __future__ import annotations

import copy
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hmc.config import Config
from hmc.control._hmcd_main import build_config, parse_args

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
VERSIONS = ["1.29.0", "1.31.0", "1.37.0"]


def _resources() -> list[dict]:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    return [document for name in kustomization["resources"] for document in yaml.safe_load_all((KUBE / name).read_text())]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_kubernetes_manifests_validate_strictly(version: str) -> None:
    resources = _resources()
    assert {r["kind"] for r in resources} == {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet", "Service"}
    for resource in resources:
        kubernetes_validate.validate(resource, version, strict=True)


def test_the_validator_refuses_a_misspelt_field() -> None:
    """The validation above can fail: an unknown field in the DaemonSet is refused."""
    daemonset = copy.deepcopy(next(r for r in _resources() if r["kind"] == "DaemonSet"))
    daemonset["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 7710}}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(daemonset, VERSIONS[-1], strict=True)


def test_the_kustomization_lists_every_manifest_and_names_the_image() -> None:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")
    daemonset = next(r for r in _resources() if r["kind"] == "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert {c["image"] for c in pod["containers"] + pod["initContainers"]} == {image["name"] for image in kustomization["images"]}


def test_the_daemonset_runs_hmcd_as_its_configuration_says(tmp_path: Path) -> None:
    resources = _resources()
    daemonset = next(r for r in resources if r["kind"] == "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    (hmcd,) = pod["containers"]
    assert pod["hostNetwork"] is True and pod["securityContext"]["runAsNonRoot"] is True
    assert hmcd["readinessProbe"]["grpc"]["port"] == 7710  # grpc.health.v1, open on TCP without the token
    mounts = {m["name"]: m["mountPath"] for m in hmcd["volumeMounts"]}
    paths = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
    assert paths[next(n for n, p in mounts.items() if p == "/run/hmc")] == "/run/hmc"
    assert paths[next(n for n, p in mounts.items() if p == "/dev/shm")] == "/dev/shm"
    config_map = next(r for r in resources if r["kind"] == "ConfigMap")
    (tmp_path / "hmcd.toml").write_text(config_map["data"]["hmcd.toml"])
    env = {"HMC_CONFIG": str(tmp_path / "hmcd.toml"), "HMC_NODE": "gpu-node-7", "HMC_AGENT_HOST": "10.0.0.7", "HMC_TOKEN": "t"}
    args = [arg.replace("/etc/hmc/hmcd.toml", str(tmp_path / "hmcd.toml")) for arg in hmcd["args"]]
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        config = build_config(parse_args(args))
    assert config.directory == "etcd" and config.etcd_endpoints and config.socket == "/run/hmc/hmcd.sock" and config.node == "gpu-node-7"


def test_the_shipped_configs_and_the_systemd_unit_load() -> None:
    unit = (ROOT / "deploy" / "hmcd.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    args = exec_start.split()[1:]
    parsed = parse_args(args)
    assert parsed.socket and parsed.metrics_port is not None
    for name in ("hmcd.toml", "hmcd-etcd.toml"):
        assert Config.load(ROOT / "deploy" / name, env={}).node


# -- the container image -------------------------------------------------------------------------


def _image_tools() -> str:
    """Why the image cannot be built here ("" when it can)."""
    if os.geteuid() != 0:
        return "building the image with buildah and debootstrap needs root"
    missing = [tool for tool in ("buildah", "debootstrap") if shutil.which(tool) is None]
    return f"no {', '.join(missing)} (Debian packages; .ci/run installs them)" if missing else ""


def _run(*args: str, timeout: float = 900, attempts: int = 1) -> str:
    """Run a command to its end; `attempts` > 1 for steps that fetch from the network (Debian, PyPI)."""
    for attempt in range(attempts):
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env={**os.environ, **_BUILDAH_ENV})
        if result.returncode == 0:
            return result.stdout.strip()
    raise AssertionError(f"{' '.join(args[:3])} failed ({result.returncode}, {attempts} attempt(s)):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


_BUILDAH_ENV = {"STORAGE_DRIVER": "vfs", "BUILDAH_ISOLATION": "chroot"}


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    why = _image_tools()
    if why:
        pytest.skip(why)
    work = tmp_path_factory.mktemp("image")
    tag = uuid.uuid4().hex[:8]
    base, built = f"localhost/hmc-base:{tag}", f"localhost/hmcd:{tag}"
    rootfs = work / "rootfs"
    _run("sh", "-c", f"rm -rf '{rootfs}' && debootstrap --variant=minbase bookworm '{rootfs}' http://deb.debian.org/debian", attempts=2)  # afresh each time
    container = _run("buildah", "from", "scratch")
    try:
        _run("buildah", "copy", container, str(work / "rootfs") + "/", "/")
        _run("buildah", "commit", "-q", container, base)
    finally:
        _run("buildah", "rm", container)
    shutil.rmtree(work / "rootfs", ignore_errors=True)
    # pip in the build trusts the host's CA bundle (this machine's network inspects TLS)
    certs = ["--volume", "/etc/ssl/certs:/etc/ssl/host-certs:ro", "--build-arg", "PIP_CERT=/etc/ssl/host-certs/ca-certificates.crt"]
    try:
        dockerfile = str(ROOT / "deploy" / "container" / "Dockerfile")
        _run("buildah", "bud", "-q", "--layers=false", *certs, "--build-arg", f"BASE={base}", "-f", dockerfile, "-t", built, str(ROOT), attempts=2)
        yield built
    finally:
        subprocess.run(["buildah", "rmi", "-f", built, base], capture_output=True, timeout=300, env={**os.environ, **_BUILDAH_ENV})


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_image_runs_hmcd_as_a_non_root_user_and_it_answers_health(image: str) -> None:
    config = _run("buildah", "inspect", "--type", "image", "--format", "{{.OCIv1.Config.User}} {{.OCIv1.Config.Entrypoint}}", image)
    assert config == "10001:10001 [hmcd]"
    container = _run("buildah", "from", image)
    process = None
    try:
        assert _run("buildah", "run", container, "--", "id", "-u") == "10001"
        port = _free_port()
        process = subprocess.Popen(
            ["buildah", "run", container, "--", "hmcd", "--listen", f"127.0.0.1:{port}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **_BUILDAH_ENV},
        )  # fmt: skip
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                    break
                except grpc.RpcError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"hmcd in the image never answered:\n{process.stdout.read().decode(errors='replace') if process.stdout else ''}") from None
                    time.sleep(0.2)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=20)
            if process.stdout is not None:
                process.stdout.close()
        subprocess.run(["buildah", "rm", container], capture_output=True, timeout=120, env={**os.environ, **_BUILDAH_ENV})
