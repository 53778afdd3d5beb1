"""`hmc demo`: the main job on the embedded single-node default.

Starts an hmcd if none is running, an agent here and one in a child process,
then moves `--size` bytes (1 GiB by default) over every path and reports, per
path, whether it is available (and why not), the path negotiation would pick for
the pair, GB/s, and whether every byte arrived (BLAKE2b of the destination,
computed where the destination lives, against the source's).

Where CUDA devices exist it then does the same for device memory: cuda:0 here to
cuda:1 in the child (cuda:0 there on a one-GPU machine: two processes on one GPU),
over every path but `local`, each forced as for host memory (so `staged` runs
through its pinned ring although the pair would get `ipc`), each timed after one
4 KiB transfer that opens the peer's IPC handle or maps the ring. Then once more
towards a second child that declares that GPU AMD (`Config.vendor_override`, as
HMC_DEVICE_VENDOR_OVERRIDE=cuda:0=amd would): a cross-vendor pair, for which
negotiation refuses vendor IPC and picks `staged`, what an NVIDIA-AMD pair gets.
With `--hip-on-cuda`, once more towards a third child that runs HMC's HIP backend
on the HIP-on-CUDA runtime (HMC_HIP_ON_CUDA=1: its GPU is hip:0, vendor AMD): a
CUDA -> HIP pair, the HIP end's code running for real (on NVIDIA hardware).
Every row says the path the transfer reports it took (`used`). The size is cut to
a quarter of the smaller GPU's memory where `--size` does not fit, and the report
says so; one device target at a time exists, beside the source.

Concurrency: the CLI's main thread drives everything; each child agent answers
over its pipe (hmc.agent._peer_process.PeerProcess), driven one at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hmc import memory
from hmc.agent._buffers import ConnBuffer
from hmc.cli._output import Progress, print_json, print_table
from hmc.config import Config, PathPolicy
from hmc.errors import ArgumentError, HMCError, NoPathError, TimeoutError, UnavailableError
from hmc.memory import Device, DeviceKind
from hmc.transport._base import PathName
from hmc.transport._negotiate import Endpoint, negotiate

__all__ = ["parse_size", "register"]

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_FILL_CHUNK = 64 << 20
_WARM_UP = 4096
_PROGRESS_S = 0.02
"""How often a running transfer's progress is redrawn."""
_DECLARED_VENDOR = "amd"
"""What the second peer of the device sections declares its GPU to be: a cross-vendor pair on an NVIDIA-only machine."""


def parse_size(text: str) -> int:
    """'1GiB', '256M', '64kb', '4096' -> bytes (binary units)."""
    match = _SIZE.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise ArgumentError(f"cannot read size {text!r}; use e.g. 4096, 64KiB, 256MiB, 1GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@contextlib.contextmanager
def _hmcd(config: Config, progress_out: Any) -> Iterator[str]:
    """Yield 'running' when an hmcd answers on the config's socket, else start one for the demo."""
    from hmc.control import Client

    with Client(config=config, timeout=2.0) as client:
        try:
            client.health()
        except UnavailableError:
            pass
        else:
            yield "running"
            return
    print(f"starting hmcd on {config.socket} ...", file=progress_out)
    command = [sys.executable, "-m", "hmc.control._hmcd_main", "--socket", config.socket, "--node", config.node, "--log-level", "warning"]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_healthy(config, process)
        yield "started"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _wait_healthy(config: Config, process: subprocess.Popen[bytes]) -> None:
    from hmc.control import Client

    deadline = time.monotonic() + max(config.timeout_s, 20.0)
    with Client(config=config, timeout=1.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                stderr = process.stderr.read().decode(errors="replace") if process.stderr else ""
                raise UnavailableError(f"hmcd exited with status {process.returncode}: {stderr.strip()[-500:]}")
            try:
                client.health()
                return
            except UnavailableError:
                time.sleep(0.1)
    raise UnavailableError(f"hmcd did not answer on {config.socket} within {deadline:.0f}s")


def _fill_random(array: np.ndarray, progress: Progress) -> None:
    rng = np.random.default_rng()
    for start in range(0, array.size, _FILL_CHUNK):
        chunk = array[start : start + _FILL_CHUNK]
        chunk[:] = np.frombuffer(rng.bytes(chunk.size), dtype=np.uint8)
        progress.advance(chunk.size)


def _forced(source: Any, target: Any, path: PathName) -> tuple[bool, str]:
    """Whether `path` can serve this pair, and why (or why not)."""
    try:
        choice = negotiate(Endpoint.of(source.descriptor), Endpoint.of(target), PathPolicy(prefer=(path.value,)))
    except NoPathError as exc:
        return False, str(exc)
    if choice.path is path:
        return True, choice.reason
    return False, dict(choice.rejected)[path]


def _run_path(
    agent: Any, peer: Any, source: Any, target: Any, path: PathName, size: int, expected: bytes, timeout: float, quiet: bool, memory_pair: str = "host"
) -> dict[str, Any]:
    """One path's row (`used`: the path the transfer reports); device memory (`memory_pair` names it) gets one 4 KiB
    transfer first (it opens IPC handles, maps the ring), not timed."""
    from hmc.agent._peer_process import ranges_digest

    chosen = agent.path_to(source, target)
    row: dict[str, Any] = {
        "path": path.value,
        "pair": "same agent" if path is PathName.LOCAL else "two processes, same node",
        "negotiated": chosen.path.value,
        "reason": chosen.reason,
        "rejected": [{"path": p.value, "reason": r} for p, r in chosen.rejected],
    }
    available, why = _forced(source, getattr(target, "descriptor", target), path)
    row.update(available=available, why=why)
    if not available:
        return row
    local_target = isinstance(target, ConnBuffer)
    if memory_pair != "host":
        agent.write(source, target, 0, 0, min(size, _WARM_UP), path=path.value, timeout=timeout).wait()
        row["warm_up_bytes"] = min(size, _WARM_UP)
    if local_target:
        memory.fill(target.region, 0xA5)
    else:
        peer.poison(target.id, 0xA5)
    label = path.value if memory_pair == "host" else f"{memory_pair} {path.value}"
    progress = Progress(size, f"{label:>6}: writing", enabled=not quiet)
    started = time.perf_counter()
    handle = agent.write(source, target, 0, 0, size, path=path.value, timeout=timeout)
    _wait(handle, progress)
    seconds = time.perf_counter() - started
    progress.update(size, f"{size / seconds / 1e9:.2f} GB/s")
    digest = ranges_digest(target.numpy()) if local_target else peer.digest(target.id)
    row.update(used=handle.path, bytes=size, seconds=round(seconds, 4), gbps=round(size / seconds / 1e9, 3), verified=digest == expected)
    return row


def _wait(handle: Any, progress: Progress) -> None:
    """Wait for the transfer to end (its error raised), redrawing its progress meanwhile. The wait returns the moment
    the transfer ends: a sleep between looks counted up to a whole interval into the time (a 1 GiB ipc write that
    takes 0.5 ms read as 20.8 ms, 51 GB/s)."""
    while True:
        try:
            handle.wait(_PROGRESS_S)
            return
        except TimeoutError:
            if handle.done():  # it ended (by its deadline, or just now): its own outcome
                handle.wait()
                return
        progress.update(handle.bytes_done)


def _cuda_pair() -> tuple[Device, Device] | None:
    """(cuda:0, cuda:1), or (cuda:0, cuda:0) on a one-GPU machine; None without CUDA devices."""
    gpus = [device for device in memory.devices() if device.kind is DeviceKind.CUDA]
    if not gpus:
        return None
    return gpus[0], gpus[1] if len(gpus) > 1 else gpus[0]


def _cuda_size(size: int, pair: tuple[Device, Device]) -> int:
    """`size`, or a quarter of the smaller GPU's memory where that is less (both ends may share one GPU)."""
    cap = min(device.total_memory for device in pair) // 4
    return min(size, cap) if cap > 0 else size


def _cuda_sections(
    agent: Any, peer: Any, config: Config, source: Any, size: int, name: str, quiet: bool, *, hip_on_cuda: bool = False
) -> list[dict[str, Any]] | None:
    """The device-memory sections of the report: cuda:0 here -> cuda:1 (or cuda:0) in the child, every path but
    local; then the same towards a second child that declares that GPU AMD (`vendor_override`), a cross-vendor pair;
    with `hip_on_cuda`, towards a third child on the HIP-on-CUDA runtime (a CUDA -> HIP pair)."""
    from hmc.agent._peer_process import PeerProcess, ranges_digest
    from hmc.memory._hip_on_cuda import SWITCH

    pair = _cuda_pair()
    if pair is None:
        return None
    here, there = pair
    gpu_size = _cuda_size(size, pair)
    override = {there.name: _DECLARED_VENDOR}
    head: dict[str, Any] = {"source": here.name, "target": there.name, "size_bytes": gpu_size, "paths": []}
    if gpu_size < size:
        head["note"] = f"{gpu_size} bytes instead of {size}: a quarter of the smaller GPU's memory"
    sections = [head, {**head, "paths": [], "vendor_override": override}]
    owners: list[Callable[[], contextlib.AbstractContextManager[Any]]] = [
        lambda: contextlib.nullcontext(peer),
        lambda: PeerProcess(config.replace(vendor_override={**config.vendor_override, **override}), daemon=True),
    ]
    if hip_on_cuda:
        sections.append({**head, "paths": [], "target": there.name.replace("cuda:", "hip:"), "runtime": "hip_on_cuda"})
        owners.append(lambda: PeerProcess(config, daemon=True, env={SWITCH: "1"}))
    try:
        with memory.allocate(gpu_size, here) as region:
            host_bytes = source.numpy()[:gpu_size]
            memory.copy(region, host_bytes)
            expected = ranges_digest(host_bytes)
            gpu_source = agent.register(region, name=f"{name}-source-{here.name}")
            try:
                for section, owner in zip(sections, owners):
                    _cuda_section(section, agent, owner, gpu_source, expected, name, config.timeout_s, quiet)
            finally:
                agent.unregister(gpu_source)
    except HMCError as exc:  # no room on the GPU for the source, a driver failure: the host rows still stand
        for section in sections:
            section.setdefault("error", f"{type(exc).__name__}: {exc}")
    return sections


def _declared(section: dict[str, Any]) -> str:
    """The vendor the section's peer declares its GPU to be, '' where it declares none."""
    return str(section.get("vendor_override", {}).get(section["target"], ""))


def _cuda_section(
    section: dict[str, Any],
    agent: Any,
    owner: Callable[[], contextlib.AbstractContextManager[Any]],
    gpu_source: Any,
    expected: bytes,
    name: str,
    timeout: float,
    quiet: bool,
) -> None:
    """Fill one device section: a buffer on the target GPU in the owner's process, every path but local forced into it.

    On one GPU the target is cuda:0 in another process, so its name differs from the source's (and, with a declared
    vendor, from the first peer's)."""
    target, vendor = section["target"], _declared(section)
    memory_pair = f"{section['source']}->{target}"
    pair = f"two processes, same node, {memory_pair}" + (f", the peer declaring {target} {vendor}" if vendor else "")
    if section.get("runtime") == "hip_on_cuda":
        pair += ", the peer's HIP backend on the HIP-on-CUDA runtime"
        vendor = "hip-on-cuda"
    label = f"{memory_pair} {vendor}".rstrip()
    try:
        with owner() as peer:
            remote = peer.register(section["size_bytes"], name=f"{name}-target-{target}" + (f"-{vendor}" if vendor else ""), device=target)
            try:
                for path in PathName:
                    if path is not PathName.LOCAL:
                        row = _run_path(agent, peer, gpu_source, remote, path, section["size_bytes"], expected, timeout, quiet, label)
                        section["paths"].append(row | {"pair": pair})
            finally:
                peer.unregister(remote.id)
    except HMCError as exc:  # no room on the GPU, a driver failure, a peer that did not start: the other rows still stand
        section["error"] = f"{type(exc).__name__}: {exc}"


def _demo(args: argparse.Namespace, config: Config) -> int:
    from hmc.agent import Agent
    from hmc.agent._peer_process import PeerProcess, ranges_digest

    size = parse_size(args.size)
    quiet = args.json and not sys.stderr.isatty()
    name = f"hmc-demo-{os.getpid()}"
    rows: list[dict[str, Any]] = []
    with _hmcd(config, sys.stderr) as hmcd_state:
        with Agent(config, daemon=True) as agent, PeerProcess(config, daemon=True) as peer:
            peer.register(size, name=name)
            remote = agent.lookup(name)
            with memory.allocate(size) as src_memory, memory.allocate(size) as dst_memory:
                source = agent.register(src_memory, name=f"{name}-source")
                local_target = agent.register(dst_memory)
                _fill_random(source.numpy(), Progress(size, "filling source with random bytes", enabled=not quiet))
                expected = ranges_digest(source.numpy())
                for path in PathName:
                    target = local_target if path is PathName.LOCAL else remote
                    rows.append(_run_path(agent, peer, source, target, path, size, expected, config.timeout_s, quiet))
                sections = _cuda_sections(agent, peer, config, source, size, name, quiet, hip_on_cuda=args.hip_on_cuda) or []
                agent.unregister(source)
                agent.unregister(local_target)
    every = rows + [row for section in sections for row in section["paths"]]
    ok = all(row["verified"] for row in every if row["available"]) and not any("error" in section for section in sections)
    report: dict[str, Any] = {"node": config.node, "hmcd": hmcd_state, "size_bytes": size, "paths": rows, "ok": ok}
    report.update(zip(("cuda", "cuda_cross_vendor", "cuda_to_hip"), sections))
    if args.json:
        print_json(report)
        return 0 if ok else 1
    print(f"\nhmc demo: {size / 2**30:.2f} GiB per path, node {config.node}, hmcd {hmcd_state}")
    print_table(_table(rows))
    for section in sections:
        note = f" ({section['note']})" if "note" in section else ""
        declared = f", the peer declaring its {section['target']} {_declared(section)} (vendor_override)" if _declared(section) else ""
        if section.get("runtime") == "hip_on_cuda":
            declared = ", the peer's HIP backend on the HIP-on-CUDA runtime (NVIDIA hardware)"
        print(f"\nCUDA device memory, {section['source']} -> {section['target']}{declared}: {section['size_bytes'] / 2**30:.2f} GiB per path{note}, after a 4 KiB warm-up")
        if "error" in section:
            print(f"failed: {section['error']}")
        print_table(_table(section["paths"]))
    return 0 if ok else 1


def _table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "path": r["path"],
            "result": (("verified" if r["verified"] else "CORRUPT") if r["available"] else "unavailable"),
            "GB/s": r.get("gbps", "-"),
            "negotiated for pair": r["negotiated"],
            "why": r["why"],
        }
        for r in rows
    ]


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    demo = commands.add_parser(
        "demo",
        help="move and verify bytes over every path available on this machine",
        description="Start hmcd if needed and two agents in two processes, move --size bytes over every path "
        "(local, ipc, rdma, ucx, staged), verify every byte, and report per path the choice, the reasons and GB/s; "
        "where CUDA devices exist, the same for GPU memory (cuda:0 -> cuda:1, or cuda:0 in the other process on one GPU), "
        "and once more with the other process declaring that GPU AMD (a cross-vendor pair: staged).",
    )
    demo.add_argument("--size", default="1GiB", help="bytes to move per path (default: 1GiB; e.g. 256MiB)")
    demo.add_argument(
        "--hip-on-cuda", action="store_true",
        help="also move device memory to a child agent running HMC's HIP backend on the HIP-on-CUDA runtime (a CUDA -> HIP pair on NVIDIA GPUs)",
    )
    demo.set_defaults(run=_demo)
