"""`bench/gpu.py` (its engine in bench/_gpu): the pieces everywhere, the whole quick run where GPUs exist.

Without a GPU: range chunking, the workloads, the checks (issue 11's cross-vendor
ones, issue 3's two-GPU ones) and the table, the CLI's help, and a whole run that
finds no GPU, skips every system with the reason and exits 0. Where torch is
importable: the data pattern and the byte check, the NCCL rows' two-process
orchestration over gloo on CPU tensors, and HMC's rows (every peer: ipc, staged,
staged-tcp; WRITE and READ; plain and prepared) between two processes on host
memory; where NIXL is importable too, the NIXL rows' orchestration (both systems,
WRITE and READ) on host memory. With a CUDA GPU: `bench/gpu.py --quick --gpus 1`
(both processes of every pair on cuda:0), every row verified; with two, `--gpus 2`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hmc.bench._timing import Timing, make_row
from hmc.bench._workloads import Workload, make_ranges

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:  # bench/ is not a package: its scripts import bench/_gpu as `_gpu` (spawned children inherit the path)
    sys.path.insert(0, str(BENCH))

from _gpu.checks import MinCheck, evaluate_checks, floor_checks, format_table, gpu_checks  # noqa: E402
from _gpu.harness import GPU_ENV, NIXL_GPU_SYSTEMS, Devices, chunk_ranges, gpu_quick_workloads, gpu_workloads  # noqa: E402
from _gpu.hmc_rows import HMC_PATHS  # noqa: E402
from _gpu.run import SYSTEMS, _Group  # noqa: E402

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
SCRIPT = BENCH / "gpu.py"


def _nixl_importable() -> bool:
    from _gpu.nixl import nixl_available

    return HAS_TORCH and nixl_available()[0]


def _cuda_count() -> int:
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return 0
    return done.stdout.count("GPU ") if done.returncode == 0 else 0


def _script(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("OUT", None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False)


@pytest.mark.parametrize("chunk", [16, 4096, 65536])
def test_chunk_ranges_cover_every_byte_in_order(chunk: int) -> None:
    rng = np.random.default_rng(chunk)
    ln = rng.integers(1, 5 * chunk, 50).astype(np.int64)
    so = np.cumsum(ln) - ln + 7
    do = rng.permutation(50).astype(np.int64) * (5 * chunk) + 3
    cs, cd, cl = chunk_ranges(so, do, ln, chunk)
    assert cl.max() <= chunk and cl.min() > 0 and cl.sum() == ln.sum()
    src_bytes = np.concatenate([np.arange(s, s + n) for s, n in zip(so, ln)])
    dst_bytes = np.concatenate([np.arange(d, d + n) for d, n in zip(do, ln)])
    assert np.array_equal(np.concatenate([np.arange(s, s + n) for s, n in zip(cs, cl)]), src_bytes)
    assert np.array_equal(np.concatenate([np.arange(d, d + n) for d, n in zip(cd, cl)]), dst_bytes)


def test_workloads_are_issue_3s() -> None:
    names = [w.name for w in gpu_workloads()]
    assert names == ["bulk_4KiB", "bulk_64KiB", "bulk_1MiB", "bulk_16MiB", "bulk_256MiB", "bulk_1GiB", "kv_4096x64KiB", "kv_16384x16KiB"]
    for w in gpu_workloads(256 << 20) + gpu_quick_workloads():
        so, do, ln = make_ranges(w)
        assert (so + ln).max() <= w.total_size and (do + ln).max() <= w.total_size
        assert len(np.unique(do)) == w.batch_size


def test_devices_one_gpu_puts_both_ends_on_cuda0() -> None:
    one, two = Devices.for_gpus(1), Devices.for_gpus(2)
    assert (one.src, one.dst, one.same) == ("cuda:0", "cuda:0", True)
    assert (two.src, two.dst, two.same) == ("cuda:0", "cuda:1", False)
    assert "one device" in one.describe() and two.describe() == "cuda:0 -> cuda:1"


def _row(system: str, path: str, workload: Workload, seconds: float, op: str = "WRITE") -> dict:
    return make_row(system, path, op, workload, np.full(10, int(seconds * 1e9)), True)


def test_two_gpu_checks_floors_and_table() -> None:
    wls = gpu_quick_workloads()
    big, small, kv = wls[2], wls[0], wls[3]
    rows = [
        _row("hmc", "ipc", big, 1e-5), _row("peer-copy", "torch", big, 1e-5), _row("nixl", "UCX", big, 2e-5),
        _row("hmc", "ipc", kv, 1e-4), _row("nixl", "UCX", kv, 1e-2),
        _row("hmc", "ipc", small, 5e-6), _row("hmc-prepared", "ipc", small, 4e-6), _row("nixl", "UCX", small, 1e-5),
    ]
    ratios = {r["check"]: r for r in evaluate_checks(gpu_checks(wls, 2), rows)}
    assert ratios["hmc ipc bulk_1MiB vs raw peer copy"]["ok"] is True
    assert ratios["hmc ipc bulk_1MiB vs NIXL"]["ratio"] == pytest.approx(2.0, rel=1e-3)
    assert ratios["hmc ipc kv_256x64KiB vs NIXL"]["ratio"] == pytest.approx(100.0, rel=1e-3)
    assert ratios["hmc ipc bulk_4KiB p50 latency vs NIXL"]["ok"] is True
    assert ratios["hmc ipc bulk_4KiB p50 latency, prepared as NIXL's is, vs NIXL"]["ratio"] == pytest.approx(0.4, rel=1e-3)
    assert ratios["hmc staged bulk_1MiB vs pinned D2H"]["ok"] is None
    assert not any(name.startswith("hmc ipc") for name in (c.name for c in gpu_checks(wls, 1)))  # issue 3's are two-GPU checks
    floors = {f["check"]: f for f in floor_checks(wls, rows)}
    assert floors["hmc ipc kv_256x64KiB >= 300 GB/s"]["ok"] is False  # 16 MiB in 100 us = 168 GB/s
    assert floors["hmc ipc kv_1024x16KiB >= 300 GB/s"]["ok"] is None
    report = {"rows": rows, "ratios": list(ratios.values()), "floors": list(floors.values()), "skipped": [{"system": "nccl", "reason": "why"}], "failed": []}
    text = format_table(report)
    assert "hmc  " in text and "[ok] hmc ipc bulk_1MiB vs NIXL: 2.0" in text and "skipped nccl: why" in text


def test_cross_vendor_checks_of_issue_11() -> None:
    wls = gpu_quick_workloads()
    big, small, kv64, kv16 = wls[2], wls[0], wls[3], wls[4]
    nixl = "nixl-tcp-cuda-copy"
    rows = [
        _row("pinned-d2h", "torch", big, 1e-4), _row("pinned-h2d", "torch", big, 2e-4),  # 10.5 and 5.2 GB/s: min is H2D
        _row("hmc", "staged", big, 1.9e-4), _row("hmc", "staged", big, 2.5e-4, "READ"),
        _row("hmc", "staged", kv64, 2e-3), _row(nixl, "UCX UCX_TLS=tcp,cuda_copy", kv64, 0.3),
        _row("hmc", "staged", kv64, 2e-3, "READ"), _row(nixl, "UCX UCX_TLS=tcp,cuda_copy", kv64, 0.1, "READ"),
        _row("hmc", "staged", kv16, 2e-3),
        _row("hmc", "staged", small, 30e-6), _row("hmc-prepared", "staged", small, 50e-6), _row(nixl, "UCX UCX_TLS=tcp,cuda_copy", small, 40e-6),
    ]
    checks = gpu_checks(wls, 1)
    assert sum(isinstance(c, MinCheck) for c in checks) == 3
    ring = _row("pinned-ring", "cuda", big, 2.1e-4)
    ratios = {r["check"]: r for r in evaluate_checks(checks, rows + [_row("pinned-both", "torch", big, 2.2e-4), ring])}
    ceiling = ratios["the pinned ring with its hand-off on the GPU bulk_1MiB vs min(pinned D2H, pinned H2D): can a ring reach issue 11's bar here?"]
    assert ceiling["ratio"] == pytest.approx(2e-4 / 2.1e-4, rel=1e-3) and ceiling["ok"] is True
    assert ratios["hmc staged (peer AMD) bulk_1MiB READ vs the pinned ring with its hand-off on the GPU"]["ratio"] == pytest.approx(2.1e-4 / 2.5e-4, rel=1e-3)
    both = ratios["hmc staged (peer AMD) bulk_1MiB WRITE vs pinned D2H and H2D at once (one GPU's link)"]
    assert both["ratio"] == pytest.approx(2.2e-4 / 1.9e-4, rel=1e-3) and both["ok"] is True
    write = ratios["hmc staged (peer AMD) bulk_1MiB WRITE vs min(pinned D2H, pinned H2D)"]
    assert write["ratio"] == pytest.approx(2e-4 / 1.9e-4, rel=1e-3) and write["ok"] is True  # against H2D, the slower
    assert write["denominator"] == "min(pinned-d2h WRITE bulk_1MiB, pinned-h2d WRITE bulk_1MiB)"
    read = ratios["hmc staged (peer AMD) bulk_1MiB READ vs min(pinned D2H, pinned H2D)"]
    assert read["ratio"] == pytest.approx(0.8, rel=1e-3) and read["ok"] is False
    assert ratios[f"hmc staged (peer AMD) {kv64.name} WRITE vs its bulk_1MiB WRITE"]["ok"] is True  # 8.4 vs 5.5 GB/s
    assert ratios[f"hmc staged (peer AMD) {kv64.name} WRITE vs NIXL UCX_TLS=tcp,cuda_copy"]["ratio"] == pytest.approx(150.0, rel=1e-3)
    assert ratios[f"hmc staged (peer AMD) {kv64.name} READ vs NIXL UCX_TLS=tcp,cuda_copy"]["ok"] is False  # 50x
    missing = ratios[f"hmc staged (peer AMD) {kv16.name} WRITE vs NIXL UCX_TLS=tcp,cuda_copy"]
    assert missing["ok"] is None and missing["reason"] == f"no row for {nixl} WRITE {kv16.name}"
    assert ratios["hmc staged (peer AMD) bulk_4KiB WRITE p50 latency vs NIXL UCX_TLS=tcp,cuda_copy"]["ok"] is True
    assert ratios["hmc-prepared staged (peer AMD) bulk_4KiB WRITE p50 latency vs NIXL UCX_TLS=tcp,cuda_copy"]["ok"] is False
    no_pinned = evaluate_checks(checks, rows[2:])[0]
    assert no_pinned["ok"] is None and no_pinned["reason"] == "no row for pinned-d2h WRITE bulk_1MiB"


def test_help_names_every_system() -> None:
    done = _script("--help", timeout=120)
    assert done.returncode == 0, done.stderr
    for name in (*SYSTEMS, *HMC_PATHS, "--gpus", "--deadline", "--git-commit"):
        assert name in done.stdout


def test_rounds_run_every_group_again_and_keep_each_rows_best_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rounds: every group runs twice, round after round; a row is its round of the highest GB/s with both rounds'
    figures beside it, verified only if both were; a skip is said once; the checks use the best rows."""
    from _gpu import run

    ran: list[str] = []
    rates = {("nixl", 0): 10.0, ("nixl", 1): 12.0, ("hmc", 0): 11.0, ("hmc", 1): 9.0}

    def group(name: str, systems: Any, spec: Any, devices: Any, deadline: float, on_row: Any, on_skip: Any) -> None:
        round_ = ran.count(name)
        ran.append(name)
        on_skip("nccl", "needs two GPUs")
        times = np.full(5, (1 << 30) / rates[(name, round_)], dtype=np.float64)  # ns: GB/s = bytes / ns
        row = make_row(name, "p", "WRITE", Workload("bulk_1GiB", 1 << 30, 1, 1 << 30, False), times, verified=name != "hmc" or round_ == 0)
        on_row(row)

    monkeypatch.setattr(run, "_probe", lambda deadline: {"device_count": 1, "devices": [{"name": "fake"}]})
    monkeypatch.setattr(run, "_run_group", group)
    spec = run.GpuSpec((Workload("bulk_1GiB", 1 << 30, 1, 1 << 30, False),), ("nixl", "hmc"), Timing(seconds=0.01), 60.0, 1, rounds=2)
    report = run.run_gpu(spec)
    assert ran == ["nixl", "hmc", "nixl", "hmc"] and report["settings"]["rounds"] == 2
    rows = {r["system"]: r for r in report["rows"]}
    assert set(rows) == {"nixl", "hmc"} and len(report["rows"]) == 2
    assert rows["nixl"]["gbps"] == pytest.approx(12.0) and rows["nixl"]["rounds_gbps"] == pytest.approx([10.0, 12.0])
    assert rows["hmc"]["gbps"] == pytest.approx(11.0) and rows["hmc"]["verified"] is False
    assert report["skipped"] == [{"system": "nccl", "reason": "needs two GPUs"}]


def test_rounds_out_of_range_are_refused() -> None:
    for rounds in ("0", "21"):
        done = _script("--rounds", rounds, timeout=120)
        assert done.returncode == 2 and "--rounds must be 1..20" in done.stderr


@pytest.mark.skipif(_cuda_count() > 0, reason="a GPU is here: the quick runs below cover the run")
@pytest.mark.timeout(240)
def test_a_run_without_a_gpu_skips_every_system_with_the_reason_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    done = _script("--quick", "--out", str(out), "--git-commit", "abc123", timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["rows"] == [] and report["failed"] == [] and report["gpus_used"] == 0
    assert [s["system"] for s in report["skipped"]] == list(SYSTEMS)
    assert all("no CUDA GPU" in s["reason"] for s in report["skipped"])
    assert report["env"] == GPU_ENV and report["git"]["commit"] == "abc123" and report["date"]
    assert all(r["ok"] is None for r in report["ratios"]) and report["ratios"]
    assert f"skipped hmc: {report['skipped'][-1]['reason']}" in done.stdout


@needs_torch
def test_pattern_is_deterministic_and_verify_sees_one_wrong_byte() -> None:
    import torch

    from _gpu.harness import pattern, poison, verify

    a, b = pattern(1 << 20, 1, "cpu"), pattern(1 << 20, 1, "cpu")
    assert a.equal(b) and not a.equal(pattern(1 << 20, 2, "cpu"))
    assert pattern(1000, 1, "cpu").equal(a[:1000])
    assert int(torch.bincount(a, minlength=256).min()) > 0  # every byte value appears
    w = Workload("kv", 4096, 64, 1 << 20, True)
    so, do, _ = make_ranges(w)
    dst = torch.empty(1 << 20, dtype=torch.uint8)
    poison(dst, w.total_size)
    assert not verify(dst, a, w, so, do)
    for s, d in zip(so.tolist(), do.tolist()):
        dst[d : d + 4096] = a[s : s + 4096]
    assert verify(dst, a, w, so, do)
    dst[int(do[-1]) + 4095] ^= 1  # the last byte of the last range
    assert not verify(dst, a, w, so, do)
    bulk = Workload("bulk", 4096, 1, 4096, False)
    assert verify(a, a, bulk, np.zeros(1, np.int64), np.zeros(1, np.int64))


def _collect(group: _Group) -> list[dict]:
    rows: list[dict] = []
    group.collect(time.monotonic() + 100.0, rows.append)
    return rows


@needs_torch
@pytest.mark.timeout(180)
def test_nccl_rows_orchestration_over_gloo_on_cpu(tmp_path: Path) -> None:
    from _gpu.baselines import nccl_rank

    wls = gpu_quick_workloads()
    group = _Group("nccl-test")
    a, b = group.pipe()
    store = str(tmp_path / "store")
    for rank, conn, out in ((1, b, None), (0, a, group.send)):
        group.start(nccl_rank, (rank, conn, out, store, "nccl-nop2p", wls, Timing(seconds=0.01), ("cpu", "cpu"), "gloo"), f"rank{rank}")
    rows = _collect(group)
    assert [r["workload"] for r in rows] == [w.name for w in wls if not w.random]
    assert all(r["verified"] and r["system"] == "nccl-nop2p" and r["pipelined_gbps"] > 0 for r in rows)
    assert "NCCL_P2P_DISABLE=1" in rows[0]["detail"]


@pytest.mark.skipif(not _nixl_importable(), reason="NIXL or torch is not importable")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("system", list(NIXL_GPU_SYSTEMS))
def test_nixl_rows_orchestration_on_host_memory(system: str) -> None:
    from _gpu.nixl import nixl_initiator, nixl_target

    wls = gpu_quick_workloads()
    env = NIXL_GPU_SYSTEMS[system]
    group = _Group("nixl-test")
    a, b = group.pipe()
    group.start(nixl_target, (b, 16 << 20, "cpu", env), "target")
    group.start(nixl_initiator, (a, group.send, system, wls, Timing(seconds=0.01), "cpu", env), "initiator")
    rows = _collect(group)
    assert [(r["op"], r["workload"]) for r in rows] == [(op, w.name) for op in ("WRITE", "READ") for w in wls]
    assert all(r["verified"] and r["system"] == system for r in rows)
    assert "from local DRAM" in rows[0]["detail"]
    assert rows[0]["path"] == ("UCX UCX_TLS=tcp,cuda_copy" if env else "UCX")


@needs_torch
@pytest.mark.timeout(300)
def test_hmc_rows_every_peer_both_ops_on_host_memory() -> None:
    """The HMC rows' orchestration on host memory (the peers' paths as host memory takes them: the vendor override
    names no host device, so that peer's staged is forced, and says so; so is ucx on one host, where ipc wins)."""
    from _gpu.hmc_rows import PREPARED_MAX_BYTES, hmc_rows

    wls = gpu_quick_workloads()
    rows: list[dict] = []
    skipped: list[tuple[str, str]] = []
    returned = hmc_rows(wls, Timing(seconds=0.01), rows.append, Devices("cpu", "cpu"), on_skip=lambda *a: skipped.append(a))
    assert returned == rows and not skipped
    small = [w.name for w in wls if w.batch_size == 1 and w.nbytes <= PREPARED_MAX_BYTES]
    expected = {("hmc", p, op, w.name) for p in HMC_PATHS for op in ("WRITE", "READ") for w in wls}
    expected |= {("hmc-prepared", p, op, name) for p in HMC_PATHS for op in ("WRITE", "READ") for name in small}
    assert {(r["system"], r["path"], r["op"], r["workload"]) for r in rows} == expected and len(rows) == len(expected)
    assert all(r["verified"] for r in rows)
    details = {r["path"]: r["detail"] for r in rows if r["system"] == "hmc" and r["op"] == "READ"}
    assert details["ipc"].endswith("path ipc (negotiated)")
    assert details["staged"].endswith("path staged (forced: negotiation picked ipc)")
    # host memory of two hosts: ucx where its binding is built (it ranks above staged), staged where it is not
    assert details["staged-tcp"].endswith(("path staged (negotiated)", "path staged (forced: negotiation picked ucx)"))
    assert details["ucx"].endswith("path ucx (forced: negotiation picked ipc)")
    assert details["ucx-puts"].endswith("path ucx (forced: negotiation picked ipc)") and "maps no peer memory" in details["ucx-puts"]


def _quick_run(tmp_path: Path, gpus: int) -> dict:
    out = tmp_path / "gpu.json"
    done = _script("--quick", "--gpus", str(gpus), "--deadline", "360", "--out", str(out), timeout=400)
    report = json.loads(out.read_text())
    assert not report["failed"], done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, done.stdout[-4000:]
    assert report["env"]["NCCL_NVLS_ENABLE"] == "0" and report["gpu"]["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert report["gpus_used"] == gpus
    assert all(r["verified"] for r in report["rows"])
    systems = {r["system"] for r in report["rows"]}
    skipped = {s["system"] for s in report["skipped"]}
    assert set(SYSTEMS) == systems | skipped
    wls = gpu_quick_workloads()
    bulk = [w.name for w in wls if not w.random]
    for system in ("device-copy", "pinned-d2h", "pinned-h2d", "pinned-both", "pinned-ring"):
        assert [r["workload"] for r in report["rows"] if r["system"] == system] == bulk
    hmc = {(r["path"], r["op"], r["workload"]) for r in report["rows"] if r["system"] == "hmc"}
    assert hmc == {(p, op, w.name) for p in HMC_PATHS for op in ("WRITE", "READ") for w in wls}
    assert {r["check"] for r in report["ratios"]} >= {c.name for c in gpu_checks(wls, gpus)}
    return report


@pytest.mark.cuda
@pytest.mark.timeout(420)
def test_gpu_bench_quick_on_one_gpu(tmp_path: Path) -> None:
    if _cuda_count() < 1:
        pytest.skip("needs a CUDA GPU")
    report = _quick_run(tmp_path, 1)
    skipped = {s["system"] for s in report["skipped"]}
    assert {"peer-copy", "pinned-across", "nccl", "nccl-nop2p"} <= skipped <= {"peer-copy", "pinned-across", "nccl", "nccl-nop2p", *NIXL_GPU_SYSTEMS}
    assert {(r["path"], r["workload"]) for r in report["rows"] if r["system"] == "copy-kernel"} == {("push", w.name) for w in gpu_quick_workloads()}
    staged = [r for r in report["rows"] if r["system"] == "hmc" and r["path"] == "staged"]
    assert all("declares its GPU AMD" in r["detail"] and r["detail"].endswith("(negotiated)") for r in staged)


@pytest.mark.cuda
@pytest.mark.multi_gpu(2)
@pytest.mark.timeout(420)
def test_gpu_bench_quick_on_two_gpus(tmp_path: Path) -> None:
    if _cuda_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    report = _quick_run(tmp_path, 2)
    assert {s["system"] for s in report["skipped"]} <= set(NIXL_GPU_SYSTEMS)
    bulk = [w.name for w in gpu_quick_workloads() if not w.random]
    for system in ("peer-copy", "pinned-across", "nccl", "nccl-nop2p"):
        assert [r["workload"] for r in report["rows"] if r["system"] == system] == bulk
    assert {(r["path"], r["workload"]) for r in report["rows"] if r["system"] == "copy-kernel"} == {
        (p, w.name) for p in ("push", "pull") for w in gpu_quick_workloads()}


def test_two_gpu_staged_checks_of_issue_16() -> None:
    wls = gpu_quick_workloads()
    big, small, kv = wls[2], wls[0], wls[3]
    rows = [
        _row("pinned-d2h", "torch", big, 1e-4), _row("pinned-h2d", "torch", big, 2e-4),  # min is H2D (5.2 GB/s)
        _row("hmc", "staged-hip", big, 2.1e-4), _row("hmc", "staged-hip", kv, 4e-3), _row("nccl-nop2p", "torch", big, 4e-4),
        _row("hmc", "staged-hip", small, 50e-6), _row("nixl-tcp-cuda-copy", "UCX", small, 40e-6),
        _row("pinned-across", "torch", big, 2.05e-4),
    ]
    ratios = {r["check"]: r for r in evaluate_checks(gpu_checks(wls, 2), rows)}
    name = "hmc staged-hip (two GPUs)"
    assert ratios[f"{name} bulk_1MiB WRITE vs min(pinned D2H, pinned H2D)"]["ratio"] == pytest.approx(2e-4 / 2.1e-4, rel=1e-3)
    across = ratios[f"{name} bulk_1MiB WRITE vs D2H on one GPU and H2D on the other at once"]
    assert across["ratio"] == pytest.approx(2.05e-4 / 2.1e-4, rel=1e-3) and across["ok"] is True
    assert ratios[f"{name} bulk_1MiB READ vs D2H on one GPU and H2D on the other at once"]["ok"] is None  # no READ row
    assert ratios[f"{name} bulk_1MiB WRITE vs NCCL with P2P disabled"]["ok"] is True  # 1.9x
    assert ratios[f"{name} kv_256x64KiB WRITE vs its bulk_1MiB WRITE"]["ok"] is True  # 16 MiB in 4 ms against 1 MiB in 0.21 ms
    assert ratios[f"{name} bulk_4KiB WRITE p50 latency vs NIXL UCX_TLS=tcp,cuda_copy"]["ok"] is False
    assert ratios["hmc staged (two GPUs) bulk_1MiB READ vs min(pinned D2H, pinned H2D)"]["ok"] is None  # no staged rows
    assert not any("(two GPUs)" in c.name for c in gpu_checks(wls, 1))
