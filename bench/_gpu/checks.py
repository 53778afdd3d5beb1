"""The GPU benchmark's ratio checks, floors and table, from the rows of ONE run (never across runs).

Issue 11 (the cross-vendor path; on one GPU and on two), with `big` the run's
largest bulk workload (1 GiB in a full run) and `small` its smallest (4 KiB):

    hmc staged (peer AMD) big WRITE, READ     >= 0.9 x min(pinned D2H, pinned H2D)   (GB/s)
                                              >= 0.9 x pinned D2H and H2D at once    (GB/s; the
                                                 ceiling where both ends share one GPU's link)
                                              >= 0.9 x the pinned ring, hand-off on the GPU (GB/s;
                                                 the ceiling of any ring of staged's geometry)
    the pinned ring itself (big)              >= 0.9 x min(pinned D2H, pinned H2D)   (GB/s; whether
                                                 any ring of that geometry reaches the first bar)
    hmc staged (peer AMD) each KV WRITE, READ >= 0.8 x the same op's big rate          (GB/s)
                                              >= 80 x NIXL UCX_TLS=tcp,cuda_copy, same ranges and op
    hmc and hmc-prepared staged small WRITE p50 <= NIXL UCX_TLS=tcp,cuda_copy's        (us)

Issue 12 (the CUDA <-> HIP pair, the peer on the HIP-on-CUDA runtime):

    hmc staged-hip big and each KV, WRITE, READ >= 0.8 x hmc staged (peer AMD)'s     (GB/s)

Issue 14 (the ucx path with CUDA memory, both processes on the GPU(s) of the run):

    hmc ucx big WRITE >= 1.0 x NIXL's; its READ >= 0.9 x its WRITE; each KV WRITE >= 2 x NIXL's (GB/s)

Issue 3 (two GPUs only: cuda:0 -> cuda:1 over NVLink): ipc against peer copy and
NIXL, staged against pinned copies and NCCL without P2P, and the ipc KV floor of
300 GB/s.

Issue 16 (two GPUs only, cuda:1 the peer's): for staged (peer AMD) and staged-hip alike,

    big WRITE, READ   >= 0.9 x min(pinned D2H, pinned H2D); WRITE >= 1.3 x NCCL with P2P disabled (GB/s)
    each KV WRITE, READ >= 0.8 x the same path's big rate, same op                        (GB/s)
    small WRITE p50   <= NIXL UCX_TLS=tcp,cuda_copy's                                      (us) A check whose rows are missing (a system skipped or failed) says so
and has `ok: null`.

Concurrency: pure functions; any thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from _gpu.harness import OPS
from hmc.bench._report import Check, evaluate
from hmc.bench._timing import Row
from hmc.bench._workloads import KIND_BULK, KIND_KV, Workload

__all__ = [
    "MinCheck", "cross_vendor_checks", "evaluate_checks", "floor_checks", "format_table", "gpu_checks", "hip_pair_checks", "reference_ratios",
    "two_gpu_checks", "two_gpu_staged_checks",
]

NIXL_NO_IPC = "nixl-tcp-cuda-copy"
"""NIXL without vendor IPC (UCX_TLS=tcp,cuda_copy): the cross-vendor anchor."""
STAGED_AMD = "hmc staged (peer AMD)"
RING = "the pinned ring with its hand-off on the GPU"


@dataclasses.dataclass(frozen=True)
class MinCheck:
    """`numerator` against the smallest of `denominators` (GB/s): x / min(d) = max(x / d)."""

    name: str
    numerator: tuple[str, str, str, str]
    denominators: tuple[tuple[str, str, str, str], ...]
    target: float


def _sizes(workloads: Sequence[Workload]) -> tuple[str, str, list[str]] | None:
    """(largest bulk, smallest bulk, KV names), or None without a bulk workload."""
    bulk = sorted((w for w in workloads if w.kind == KIND_BULK), key=lambda w: w.nbytes)
    if not bulk:
        return None
    return bulk[-1].name, bulk[0].name, [w.name for w in workloads if w.kind == KIND_KV]


def cross_vendor_checks(workloads: Sequence[Workload]) -> list[Check | MinCheck]:
    """Issue 11's targets for HMC's staged path with the peer declared AMD."""
    sizes = _sizes(workloads)
    if sizes is None:
        return []
    big, small, kvs = sizes
    checks: list[Check | MinCheck] = []
    pinned = (("pinned-d2h", "", "WRITE", big), ("pinned-h2d", "", "WRITE", big))
    for op in OPS:
        checks.append(MinCheck(f"{STAGED_AMD} {big} {op} vs min(pinned D2H, pinned H2D)", ("hmc", "staged", op, big), pinned, 0.9))
        checks.append(Check(f"{STAGED_AMD} {big} {op} vs pinned D2H and H2D at once (one GPU's link)", ("hmc", "staged", op, big), ("pinned-both", "", "WRITE", big), 0.9))
        checks.append(Check(f"{STAGED_AMD} {big} {op} vs {RING}", ("hmc", "staged", op, big), ("pinned-ring", "", "WRITE", big), 0.9))
    checks.append(MinCheck(f"{RING} {big} vs min(pinned D2H, pinned H2D): can a ring reach issue 11's bar here?", ("pinned-ring", "", "WRITE", big), pinned, 0.9))
    for kv in kvs:
        for op in OPS:
            staged = ("hmc", "staged", op, kv)
            checks.append(Check(f"{STAGED_AMD} {kv} {op} vs its {big} {op}", staged, ("hmc", "staged", op, big), 0.8))
            checks.append(Check(f"{STAGED_AMD} {kv} {op} vs NIXL UCX_TLS=tcp,cuda_copy", staged, (NIXL_NO_IPC, "", op, kv), 80.0))
    for system in ("hmc", "hmc-prepared"):
        checks.append(Check(f"{system} staged (peer AMD) {small} WRITE p50 latency vs NIXL UCX_TLS=tcp,cuda_copy",
                            (system, "staged", "WRITE", small), (NIXL_NO_IPC, "", "WRITE", small), 1.0, "p50_lat_us"))
    return checks


def hip_pair_checks(workloads: Sequence[Workload]) -> list[Check]:
    """Issue 12's target: the CUDA <-> HIP-on-CUDA pair against the CUDA pair with the peer declared AMD."""
    sizes = _sizes(workloads)
    if sizes is None:
        return []
    big, _, kvs = sizes
    return [
        Check(f"hmc staged-hip (CUDA <-> HIP-on-CUDA) {name} {op} vs {STAGED_AMD}", ("hmc", "staged-hip", op, name), ("hmc", "staged", op, name), 0.8)
        for name in (big, *kvs)
        for op in OPS
    ]


def two_gpu_checks(workloads: Sequence[Workload]) -> list[Check]:
    """Issue 3's targets between two GPUs (largest bulk, smallest bulk, each KV)."""
    sizes = _sizes(workloads)
    if sizes is None:
        return []
    big, small, kvs = sizes
    w_ = "WRITE"
    checks = [
        Check(f"hmc ipc {big} vs raw peer copy", ("hmc", "ipc", w_, big), ("peer-copy", "", w_, big), 0.97),
        Check(f"hmc ipc {big} vs NIXL", ("hmc", "ipc", w_, big), ("nixl", "", w_, big), 1.3),
    ]
    for kv in kvs:
        checks.append(Check(f"hmc ipc {kv} vs NIXL", ("hmc", "ipc", w_, kv), ("nixl", "", w_, kv), 30.0))
    checks += [
        Check(f"hmc ipc {small} p50 latency vs NIXL", ("hmc", "ipc", w_, small), ("nixl", "", w_, small), 1.0, "p50_lat_us"),
        Check(f"hmc ipc {small} p50 latency, prepared as NIXL's is, vs NIXL", ("hmc-prepared", "ipc", w_, small), ("nixl", "", w_, small), 1.0, "p50_lat_us"),
        Check(f"hmc staged {big} vs pinned D2H", ("hmc", "staged", w_, big), ("pinned-d2h", "", w_, big), 0.9),
        Check(f"hmc staged {big} vs pinned H2D", ("hmc", "staged", w_, big), ("pinned-h2d", "", w_, big), 0.9),
        Check(f"hmc staged {big} vs NCCL with P2P disabled", ("hmc", "staged", w_, big), ("nccl-nop2p", "", w_, big), 1.3),
    ]
    return checks


def two_gpu_staged_checks(workloads: Sequence[Workload]) -> list[Check | MinCheck]:
    """Issue 16's targets for both cross-vendor pairs (peer declared AMD, and the HIP-on-CUDA peer) across two GPUs."""
    sizes = _sizes(workloads)
    if sizes is None:
        return []
    big, small, kvs = sizes
    pinned = (("pinned-d2h", "", "WRITE", big), ("pinned-h2d", "", "WRITE", big))
    checks: list[Check | MinCheck] = []
    for path in ("staged", "staged-hip"):
        name = f"hmc {path} (two GPUs)"
        for op in OPS:
            checks.append(MinCheck(f"{name} {big} {op} vs min(pinned D2H, pinned H2D)", ("hmc", path, op, big), pinned, 0.9))
            checks.append(Check(f"{name} {big} {op} vs D2H on one GPU and H2D on the other at once", ("hmc", path, op, big),
                                ("pinned-across", "", "WRITE", big), 0.9))
            checks.append(Check(f"{name} {big} {op} vs {RING}", ("hmc", path, op, big), ("pinned-ring", "", "WRITE", big), 0.9))
            checks += [Check(f"{name} {kv} {op} vs its {big} {op}", ("hmc", path, op, kv), ("hmc", path, op, big), 0.8) for kv in kvs]
        checks.append(Check(f"{name} {big} WRITE vs NCCL with P2P disabled", ("hmc", path, "WRITE", big), ("nccl-nop2p", "", "WRITE", big), 1.3))
        checks.append(Check(f"{name} {small} WRITE p50 latency vs NIXL UCX_TLS=tcp,cuda_copy", ("hmc", path, "WRITE", small),
                            (NIXL_NO_IPC, "", "WRITE", small), 1.0, "p50_lat_us"))
    return checks


def ucx_checks(workloads: Sequence[Workload]) -> list[Check]:
    """Issue 14's targets for the ucx path with CUDA memory: against NIXL (default UCX), and READ against WRITE."""
    sizes = _sizes(workloads)
    if sizes is None:
        return []
    big, _, kvs = sizes
    checks = [
        Check(f"hmc ucx {big} WRITE vs NIXL", ("hmc", "ucx", "WRITE", big), ("nixl", "", "WRITE", big), 1.0),
        Check(f"hmc ucx {big} READ vs its WRITE", ("hmc", "ucx", "READ", big), ("hmc", "ucx", "WRITE", big), 0.9),
    ]
    for kv in kvs:
        checks.append(Check(f"hmc ucx {kv} WRITE vs NIXL", ("hmc", "ucx", "WRITE", kv), ("nixl", "", "WRITE", kv), 2.0))
    return checks


def gpu_checks(workloads: Sequence[Workload], gpus: int) -> list[Check | MinCheck]:
    """The checks of a run on `gpus` GPUs: issues 11's, 12's and 14's everywhere, issues 3's and 16's on two."""
    two = [*two_gpu_checks(workloads), *two_gpu_staged_checks(workloads)] if gpus >= 2 else []
    return [*cross_vendor_checks(workloads), *hip_pair_checks(workloads), *ucx_checks(workloads), *two]


def _evaluate_min(check: MinCheck, rows: Sequence[Row]) -> dict[str, Any]:
    parts = evaluate([Check(check.name, check.numerator, d, check.target) for d in check.denominators], rows)
    missing = [p for p in parts if p["ok"] is None]
    result = dict(missing[0] if missing else max(parts, key=lambda p: p["ratio"]))
    result["denominator"] = "min(" + ", ".join(p["denominator"] for p in parts) + ")"
    return result


def evaluate_checks(checks: Sequence[Check | MinCheck], rows: Sequence[Row]) -> list[dict[str, Any]]:
    """`hmc.bench._report.evaluate` of each check, in order; a MinCheck against its smallest denominator."""
    return [_evaluate_min(c, rows) if isinstance(c, MinCheck) else evaluate([c], rows)[0] for c in checks]


def floor_checks(workloads: Sequence[Workload], rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Issue 3's absolute target on two GPUs: hmc ipc on each KV pattern >= 300 GB/s (None: not measured)."""
    out = []
    for kv in (w.name for w in workloads if w.kind == KIND_KV):
        row = next((r for r in rows if r["system"] == "hmc" and r["path"] == "ipc" and r["op"] == "WRITE" and r["workload"] == kv), None)
        out.append({
            "check": f"hmc ipc {kv} >= 300 GB/s",
            "value": row["gbps"] if row else None,
            "target": ">= 300.0",
            "ok": (row["gbps"] >= 300.0) if row else None,
            **({} if row else {"reason": f"no row for hmc ipc WRITE {kv}"}),
        })
    return out


REFERENCES = (
    ("copy-kernel", "push"), ("cuda-ipc", "kernel"), ("cuda-ipc", "memcpy"), ("device-copy", ""), ("peer-copy", ""), ("torch-gather", ""), ("nccl", ""),
    ("hmc", "ucx-puts"),
)
"""The ceilings and baselines set against NIXL (UCX defaults) in `reference_ratios`; hmc ucx-puts: the ucx path's UCX puts
(what crosses hosts) on the same UCX as NIXL."""


def reference_ratios(workloads: Sequence[Workload], rows: Sequence[Row]) -> list[dict[str, Any]]:
    """What the baselines say about the targets: the ceilings against NIXL, WRITE."""
    def find(system: str, path: str, name: str) -> Row | None:
        return next((r for r in rows if r["system"] == system and r["op"] == "WRITE" and (not path or r["path"] == path) and r["workload"] == name), None)

    out = []
    for w in workloads:
        nixl = find("nixl", "", w.name)
        for system, path in REFERENCES:
            row = find(system, path, w.name)
            if row and nixl and nixl["gbps"]:
                out.append({"workload": w.name, "system": f"{system} {path}".strip(), "gbps": row["gbps"], "nixl_gbps": nixl["gbps"],
                            "ratio": round(row["gbps"] / nixl["gbps"], 2)})
    return out


def format_table(report: dict[str, Any]) -> str:
    """The rows, then the checks, skips and failures, as plain text."""
    head = ("system", "path", "op", "workload", "GB/s", "pipelined", "avg us", "p50 us", "p99 us", "iters", "ok")
    lines = [head]
    for r in report["rows"]:
        lines.append((r["system"], r["path"], r["op"], r["workload"], f"{r['gbps']:.2f}", f"{r['pipelined_gbps']:.2f}" if "pipelined_gbps" in r else "-",
                      f"{r['avg_lat_us']:.1f}", f"{r['p50_lat_us']:.1f}", f"{r['p99_lat_us']:.1f}", str(r["iterations"]), "yes" if r["verified"] else "NO"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in lines]
    for check in report["ratios"]:
        verdict = {True: "ok", False: "MISS", None: "n/a"}[check["ok"]]
        text.append(f"[{verdict}] {check['check']}: {check.get('ratio')} (target {check['target']})" + (f" - {check['reason']}" if check.get("reason") else ""))
    for check in report["floors"]:
        verdict = {True: "ok", False: "MISS", None: "n/a"}[check["ok"]]
        text.append(f"[{verdict}] {check['check']}: {check['value']}" + (f" - {check['reason']}" if check.get("reason") else ""))
    for item in report["skipped"]:
        text.append(f"skipped {item['system']}: {item['reason']}")
    for item in report["failed"]:
        text.append(f"FAILED {item['system']}: {item['error'][-3000:]}")
    return "\n".join(text)
