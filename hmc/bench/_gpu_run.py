"""One GPU benchmark run (`bench/gpu.py`): every system on the same workloads, GPU0 -> GPU1, one JSON report.

The parent never touches CUDA: a probe child reports the devices and versions,
then each group of systems runs in child processes of its own, one group at a
time (one process for the one-process systems, a GPU0/GPU1 pair for cuda-ipc,
each NCCL variant and NIXL, and the HMC plug-in's own child). Every wait on a
child is bounded (first message STARTUP_TIMEOUT_S, then MESSAGE_TIMEOUT_S, and
the run's deadline); a child that stalls or dies is killed, its group is recorded
as failed with the error, and the rows it had sent are kept. A system that
cannot run here (fewer than two GPUs, NIXL or HMC's CUDA paths missing) is
recorded as skipped with the reason. `on_report` is called with the report so
far after every group, so a run cut short still leaves its file.

The ratio checks are issue 3's "Must show", from the rows of this one run.

Concurrency: the caller's thread; groups run one after another.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from hmc.bench._child import receive, reap
from hmc.bench._gpu_common import EXTRA_COLUMNS, GPU_ENV, apply_env, sizes_of
from hmc.bench._report import Check, evaluate, machine_info, provenance
from hmc.bench._timing import COLUMNS, Row, Timing
from hmc.bench._workloads import KIND_BULK, KIND_KV, Workload
from hmc.errors import BrokenResourceError, TimeoutError, UnavailableError

__all__ = ["GROUPS", "SYSTEMS", "GpuSpec", "floor_checks", "format_table", "gpu_checks", "run_gpu"]

SCHEMA = "hmc-bench-gpu/1"
LOCAL_SYSTEMS = ("peer-copy", "pinned-d2h", "pinned-h2d", "torch-gather", "copy-kernel")
SYSTEMS = (*LOCAL_SYSTEMS, "cuda-ipc", "nccl", "nccl-nop2p", "nixl", "hmc", "hmc-prepared")
GROUPS = {"local": LOCAL_SYSTEMS, "cuda-ipc": ("cuda-ipc",), "nccl": ("nccl",), "nccl-nop2p": ("nccl-nop2p",), "nixl": ("nixl",), "hmc": ("hmc", "hmc-prepared")}
"""Child-process groups, in run order, and the systems each measures."""
STARTUP_TIMEOUT_S = 240.0
MESSAGE_TIMEOUT_S = 150.0

OnRow = Callable[[Row], None]


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What one run measures."""

    workloads: tuple[Workload, ...]
    systems: tuple[str, ...] = SYSTEMS
    timing: Timing = Timing(seconds=0.3)
    deadline_s: float = 1500.0
    """The whole run; a group still running then is killed and recorded as failed."""


def gpu_checks(workloads: Sequence[Workload]) -> list[Check]:
    """Issue 3's ratio targets for the workloads of a run (largest bulk, smallest bulk, each KV)."""
    bulk = sorted((w for w in workloads if w.kind == KIND_BULK), key=lambda w: w.nbytes)
    if not bulk:
        return []
    big, small = bulk[-1].name, bulk[0].name
    w_ = "WRITE"
    checks = [
        Check(f"hmc ipc {big} vs raw peer copy", ("hmc", "ipc", w_, big), ("peer-copy", "", w_, big), 0.97),
        Check(f"hmc ipc {big} vs NIXL", ("hmc", "ipc", w_, big), ("nixl", "", w_, big), 1.3),
    ]
    for kv in (w.name for w in workloads if w.kind == KIND_KV):
        checks.append(Check(f"hmc ipc {kv} vs NIXL", ("hmc", "ipc", w_, kv), ("nixl", "", w_, kv), 30.0))
    checks += [
        Check(f"hmc ipc {small} p50 latency vs NIXL", ("hmc", "ipc", w_, small), ("nixl", "", w_, small), 1.0, "p50_lat_us"),
        Check(f"hmc ipc {small} p50 latency, prepared as NIXL's is, vs NIXL", ("hmc-prepared", "ipc", w_, small), ("nixl", "", w_, small), 1.0, "p50_lat_us"),
        Check(f"hmc staged {big} vs pinned D2H", ("hmc", "staged", w_, big), ("pinned-d2h", "", w_, big), 0.9),
        Check(f"hmc staged {big} vs pinned H2D", ("hmc", "staged", w_, big), ("pinned-h2d", "", w_, big), 0.9),
        Check(f"hmc staged {big} vs NCCL with P2P disabled", ("hmc", "staged", w_, big), ("nccl-nop2p", "", w_, big), 1.3),
    ]
    return checks


def floor_checks(workloads: Sequence[Workload], rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Issue 3's absolute target: hmc ipc on each KV pattern >= 300 GB/s (None: not measured)."""
    out = []
    for kv in (w.name for w in workloads if w.kind == KIND_KV):
        row = next((r for r in rows if r["system"] == "hmc" and r["path"] == "ipc" and r["workload"] == kv), None)
        out.append({
            "check": f"hmc ipc {kv} >= 300 GB/s",
            "value": row["gbps"] if row else None,
            "target": ">= 300.0",
            "ok": (row["gbps"] >= 300.0) if row else None,
            **({} if row else {"reason": f"no row for hmc ipc WRITE {kv}"}),
        })
    return out


def reference_ratios(workloads: Sequence[Workload], rows: Sequence[Row]) -> list[dict[str, Any]]:
    """What the baselines say about the targets: the ceilings (copy kernel, peer copy) against NIXL."""
    def find(system: str, path: str, name: str) -> Row | None:
        return next((r for r in rows if r["system"] == system and (not path or r["path"] == path) and r["workload"] == name), None)

    out = []
    for w in workloads:
        nixl = find("nixl", "", w.name)
        for system, path in (("copy-kernel", "push"), ("cuda-ipc", "kernel"), ("cuda-ipc", "memcpy"), ("peer-copy", ""), ("torch-gather", ""), ("nccl", "")):
            row = find(system, path, w.name)
            if row and nixl and nixl["gbps"]:
                out.append({"workload": w.name, "system": f"{system} {path}".strip(), "gbps": row["gbps"], "nixl_gbps": nixl["gbps"],
                            "ratio": round(row["gbps"] / nixl["gbps"], 2)})
    return out


# -- child groups ------------------------------------------------------------------


class _Group:
    """Child processes of one group and the pipe their rows come back on."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.context = multiprocessing.get_context("spawn")
        self.recv, self.send = self.context.Pipe(duplex=False)
        self.procs: list[Any] = []
        self.closing: list[Any] = [self.send]

    def pipe(self) -> tuple[Any, Any]:
        a, b = self.context.Pipe()
        self.closing.append(b)
        self.closing.append(a)
        return a, b

    def start(self, target: Callable[..., None], args: tuple[Any, ...], role: str, daemon: bool = True) -> None:
        proc = self.context.Process(target=target, args=args, name=f"hmc-gpu-bench-{self.name}-{role}", daemon=daemon)
        proc.start()
        self.procs.append(proc)

    def collect(self, deadline: float, on_row: OnRow, on_info: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Rows until ("done",); bounded waits; the children are reaped (killed if need be) in every case."""
        for end in self.closing:
            end.close()
        timeout = STARTUP_TIMEOUT_S
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{self.name}: the run's deadline passed")
                message = receive(self.recv, "", min(timeout, remaining), procs=self.procs)
                timeout = MESSAGE_TIMEOUT_S
                if message[0] == "row":
                    on_row(message[1])
                elif message[0] == "info" and on_info is not None:
                    on_info(message[1])
                elif message[0] == "unavailable":
                    raise UnavailableError(message[1])
                elif message[0] == "done":
                    return
        finally:
            self.recv.close()
            reap(*self.procs, timeout=15.0)


def _hmc_child(out: Any, workloads: Sequence[Workload], timing: Timing) -> None:
    """Child: the HMC plug-in; its rows, or ("unavailable", reason)."""
    from hmc.bench._child import send_error

    try:
        apply_env()
        from hmc.bench._gpu_hmc import hmc_rows

        try:
            hmc_rows(workloads, timing, lambda row: out.send(("row", row)))
        except UnavailableError as exc:
            out.send(("unavailable", str(exc)))
            return
        out.send(("done",))
    except BaseException:
        send_error(out)


def _probe(deadline: float) -> dict[str, Any]:
    from hmc.bench._gpu_baselines import probe_child

    group = _Group("probe")
    group.start(probe_child, (group.send,), "probe")
    info: dict[str, Any] = {}
    group.collect(min(deadline, time.monotonic() + STARTUP_TIMEOUT_S), lambda row: None, info.update)
    return info


def _run_group(name: str, systems: Sequence[str], spec: GpuSpec, deadline: float, on_row: OnRow) -> None:
    from hmc.bench import _gpu_baselines as base
    from hmc.bench import _gpu_nixl as nixl

    wls, timing = list(spec.workloads), spec.timing
    group = _Group(name)
    store_dir = None
    try:
        if name == "local":
            group.start(base.local_child, (group.send, wls, timing, tuple(systems)), "local")
        elif name == "cuda-ipc":
            a, b = group.pipe()
            group.start(base.ipc_target, (b, sizes_of(wls)), "target")
            group.start(base.ipc_initiator, (a, group.send, wls, timing), "initiator")
        elif name in ("nccl", "nccl-nop2p"):
            store_dir = tempfile.mkdtemp(prefix="hmc-gpu-bench-")
            store = os.path.join(store_dir, "store")
            a, b = group.pipe()
            group.start(base.nccl_rank, (1, b, None, store, name, wls, timing), "rank1")
            group.start(base.nccl_rank, (0, a, group.send, store, name, wls, timing), "rank0")
        elif name == "nixl":
            ok, why = nixl.nixl_available()
            if not ok:
                raise UnavailableError(why)
            a, b = group.pipe()
            group.start(nixl.nixl_target, (b, sizes_of(wls)), "target")
            group.start(nixl.nixl_initiator, (a, group.send, wls, timing), "initiator")
        elif name == "hmc":
            from hmc.bench._gpu_hmc import unavailable_reason

            reason = unavailable_reason()
            if reason is not None:
                raise UnavailableError(reason)
            group.start(_hmc_child, (group.send, wls, timing), "hmc", daemon=False)
        group.collect(deadline, on_row)
    finally:
        if store_dir is not None:
            for leaf in os.listdir(store_dir):
                os.unlink(os.path.join(store_dir, leaf))
            os.rmdir(store_dir)


def run_gpu(spec: GpuSpec, command: Sequence[str] = (), progress: Callable[[str], None] | None = None,
            on_report: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Measure every system of `spec`; the JSON-ready report."""
    apply_env()
    note = progress or (lambda text: None)
    started = time.monotonic()
    deadline = started + spec.deadline_s
    rows: list[Row] = []
    skipped: list[dict[str, str]] = []
    failed: list[dict[str, str]] = []
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "command": " ".join(command) or None,
        **provenance(),
        "machine": machine_info(),
        "gpu": None,
        "env": {key: os.environ.get(key) for key in GPU_ENV},
        "settings": {
            "systems": list(spec.systems),
            "direction": "GPU0 -> GPU1 (cuda:0 source, cuda:1 destination); pinned: cuda:0 <-> host",
            "workloads": [w.to_dict() for w in spec.workloads],
            "timing": dataclasses.asdict(spec.timing),
            "python_executable": sys.executable,
        },
        "columns": [*COLUMNS, *EXTRA_COLUMNS],
        "rows": rows,
        "ratios": [],
        "floors": [],
        "reference_ratios": [],
        "skipped": skipped,
        "failed": failed,
        "duration_s": None,
    }

    def finish() -> dict[str, Any]:
        report["ratios"] = evaluate(gpu_checks(spec.workloads), rows)
        report["floors"] = floor_checks(spec.workloads, rows)
        report["reference_ratios"] = reference_ratios(spec.workloads, rows)
        report["duration_s"] = round(time.monotonic() - started, 1)
        report["machine"]["loadavg_end"] = machine_info()["loadavg"]
        if on_report is not None:
            on_report(report)
        return report

    try:
        info = _probe(deadline)
    except Exception as exc:  # noqa: BLE001 - without a probe nothing else can run
        failed.append({"system": "probe", "error": f"{type(exc).__name__}: {exc}"})
        skipped.extend({"system": s, "reason": "the GPU probe failed"} for s in spec.systems)
        return finish()
    report["gpu"] = info
    report["versions"].update({k: v for k, v in info.get("versions", {}).items() if v})
    note(f"GPUs: {[d['name'] for d in info.get('devices', [])]}, peer access {info.get('peer_access')}")
    if info.get("device_count", 0) < 2:
        skipped.extend({"system": s, "reason": f"needs 2 GPUs, found {info.get('device_count', 0)}"} for s in spec.systems)
        return finish()

    def on_row(row: Row) -> None:
        rows.append(row)
        note(f"{row['system']} {row['path']} {row['workload']}: {row['gbps']:.2f} GB/s, p50 {row['p50_lat_us']} us, verified {row['verified']}")

    for name, members in GROUPS.items():
        systems = [s for s in members if s in spec.systems]
        if not systems:
            continue
        before = len(rows)
        try:
            _run_group(name, systems, spec, deadline, on_row)
        except UnavailableError as exc:
            skipped.extend({"system": s, "reason": str(exc)} for s in systems)
            note(f"{name}: skipped ({exc})")
        except (BrokenResourceError, TimeoutError, Exception) as exc:  # noqa: BLE001 - one group's failure is reported, the others still run
            failed.append({"system": ",".join(systems), "error": f"{type(exc).__name__}: {exc}", "rows_kept": len(rows) - before})
            note(f"{name}: FAILED ({type(exc).__name__}: {str(exc)[-2000:]})")
        finish()
    return finish()


def format_table(report: dict[str, Any]) -> str:
    """The rows, then the checks, as plain text."""
    head = ("system", "path", "workload", "GB/s", "pipelined", "avg us", "p50 us", "p99 us", "iters", "ok")
    lines = [head]
    for r in report["rows"]:
        lines.append((r["system"], r["path"], r["workload"], f"{r['gbps']:.2f}", f"{r['pipelined_gbps']:.2f}" if "pipelined_gbps" in r else "-",
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
