"""`bench/gpu.py`: the GPU benchmark's pieces everywhere, the whole quick run where two GPUs exist.

Without a GPU: range chunking, the workloads, the checks and the table, the HMC
plug-in's reason, and a whole run that finds no GPU and says so. Where torch is
importable: the data pattern and the byte check, and the NCCL rows' two-process
orchestration over gloo on CPU tensors; where NIXL is importable too, the NIXL
rows' orchestration on host memory. With two CUDA GPUs: `bench/gpu.py --quick`,
every baseline row verified.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hmc.bench._gpu_common import GPU_ENV, chunk_ranges, gpu_quick_workloads, gpu_workloads
from hmc.bench._gpu_run import SYSTEMS, GpuSpec, _Group, floor_checks, format_table, gpu_checks, run_gpu
from hmc.bench._timing import Timing, make_row
from hmc.bench._workloads import Workload, make_ranges

ROOT = Path(__file__).resolve().parents[2]
HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")


def _nixl_importable() -> bool:
    from hmc.bench._gpu_nixl import nixl_available

    return HAS_TORCH and nixl_available()[0]


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


def _row(system: str, path: str, workload: Workload, seconds: float) -> dict:
    return make_row(system, path, "WRITE", workload, np.full(10, int(seconds * 1e9)), True)


def test_checks_floors_and_table() -> None:
    wls = gpu_quick_workloads()
    big, small, kv = wls[2], wls[0], wls[3]
    rows = [
        _row("hmc", "ipc", big, 1e-5), _row("peer-copy", "torch", big, 1e-5), _row("nixl", "UCX", big, 2e-5),
        _row("hmc", "ipc", kv, 1e-4), _row("nixl", "UCX", kv, 1e-2),
        _row("hmc", "ipc", small, 5e-6), _row("hmc-prepared", "ipc", small, 4e-6), _row("nixl", "UCX", small, 1e-5),
    ]
    report = {"rows": rows, "ratios": [], "floors": floor_checks(wls, rows), "skipped": [], "failed": []}
    from hmc.bench._report import evaluate

    report["ratios"] = evaluate(gpu_checks(wls), rows)
    ratios = {r["check"]: r for r in report["ratios"]}
    assert ratios["hmc ipc bulk_1MiB vs raw peer copy"]["ok"] is True
    assert ratios["hmc ipc bulk_1MiB vs NIXL"]["ratio"] == pytest.approx(2.0, rel=1e-3)
    assert ratios["hmc ipc kv_256x64KiB vs NIXL"]["ratio"] == pytest.approx(100.0, rel=1e-3)
    assert ratios["hmc ipc bulk_4KiB p50 latency vs NIXL"]["ok"] is True
    assert ratios["hmc ipc bulk_4KiB p50 latency, prepared as NIXL's is, vs NIXL"]["ratio"] == pytest.approx(0.4, rel=1e-3)
    assert ratios["hmc staged bulk_1MiB vs pinned D2H"]["ok"] is None
    floors = {f["check"]: f for f in report["floors"]}
    assert floors["hmc ipc kv_256x64KiB >= 300 GB/s"]["ok"] is False  # 16 MiB in 100 us = 168 GB/s
    assert floors["hmc ipc kv_1024x16KiB >= 300 GB/s"]["ok"] is None
    text = format_table(report)
    assert "hmc  " in text and "[ok] hmc ipc bulk_1MiB vs NIXL: 2.0" in text


def test_hmc_plugin_says_why_it_is_skipped() -> None:
    from hmc.bench._gpu_hmc import HMC_PATHS, unavailable_reason
    from hmc.memory import DeviceKind
    from hmc.transport._cuda_ipc import CudaIpcTransport

    assert "ipc" in HMC_PATHS
    reason = unavailable_reason()
    if DeviceKind.CUDA in CudaIpcTransport.capabilities.memory_kinds:
        assert reason is None
    else:
        assert reason is not None and reason.startswith("CUDA paths not implemented yet")


def _cuda_count() -> int:
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return 0
    return done.stdout.count("GPU ") if done.returncode == 0 else 0


@pytest.mark.skipif(_cuda_count() >= 2, reason="two GPUs here: the full quick run below covers this")
def test_run_without_two_gpus_skips_every_system_with_the_reason(tmp_path: Path) -> None:
    saved: list[dict] = []
    report = run_gpu(GpuSpec(tuple(gpu_quick_workloads()), timing=Timing(seconds=0.01), deadline_s=100.0), on_report=saved.append)
    assert report["rows"] == [] and saved and saved[-1] is report
    assert {s["system"] for s in report["skipped"]} == set(SYSTEMS)
    assert all(s["reason"] for s in report["skipped"])
    assert report["env"] == GPU_ENV
    json.dumps(report)


@needs_torch
def test_pattern_is_deterministic_and_verify_sees_one_wrong_byte() -> None:
    import torch

    from hmc.bench._gpu_common import pattern, poison, verify

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
    import time

    group.collect(time.monotonic() + 100.0, rows.append)
    return rows


@needs_torch
@pytest.mark.timeout(180)
def test_nccl_rows_orchestration_over_gloo_on_cpu(tmp_path: Path) -> None:
    from hmc.bench._gpu_baselines import nccl_rank

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
@pytest.mark.timeout(180)
def test_nixl_rows_orchestration_on_host_memory() -> None:
    from hmc.bench._gpu_nixl import nixl_initiator, nixl_target

    wls = gpu_quick_workloads()
    group = _Group("nixl-test")
    a, b = group.pipe()
    group.start(nixl_target, (b, 16 << 20, "cpu"), "target")
    group.start(nixl_initiator, (a, group.send, wls, Timing(seconds=0.01), "cpu"), "initiator")
    rows = _collect(group)
    assert [r["workload"] for r in rows] == [w.name for w in wls]
    assert all(r["verified"] and r["system"] == "nixl" for r in rows)
    assert "DRAM->DRAM" in rows[0]["detail"]


@pytest.mark.cuda
@pytest.mark.multi_gpu(2)
@pytest.mark.timeout(420)
def test_gpu_bench_quick_on_two_gpus(tmp_path: Path) -> None:
    if _cuda_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--quick", "--deadline", "360", "--out", str(out)],
                          capture_output=True, text=True, timeout=400, env=env, check=False)
    report = json.loads(out.read_text())
    assert not report["failed"], done.stdout[-4000:] + done.stderr[-4000:]
    assert report["env"]["NCCL_NVLS_ENABLE"] == "0" and report["gpu"]["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert done.returncode == 0, done.stdout[-4000:]
    systems = {r["system"] for r in report["rows"]}
    skipped = {s["system"] for s in report["skipped"]}
    assert set(SYSTEMS) == systems | skipped
    assert skipped <= {"nixl", "hmc", "hmc-prepared"}
    assert all(r["verified"] for r in report["rows"])
    bulk = [w.name for w in gpu_quick_workloads() if not w.random]
    for system in ("peer-copy", "pinned-d2h", "pinned-h2d", "nccl", "nccl-nop2p"):
        assert [r["workload"] for r in report["rows"] if r["system"] == system] == bulk
    assert {(r["path"], r["workload"]) for r in report["rows"] if r["system"] == "copy-kernel"} == {
        (p, w.name) for p in ("push", "pull") for w in gpu_quick_workloads()}
