"""One GPU benchmark run (`bench/gpu.py`): every system on the same workloads, on one GPU or two, one JSON report.

The parent never touches CUDA: a probe child reports the devices and versions;
the run then uses two GPUs (cuda:0 -> cuda:1) where two exist and one (both
processes of every pair on cuda:0) where one does (`GpuSpec.gpus` picks), and
each group of systems runs in child processes of its own, one group at a time
(one process for the one-process systems, a pair for cuda-ipc, each NCCL and
NIXL variant, and the HMC rows' own child, which starts its targets). Every wait
on a child is bounded (first message STARTUP_TIMEOUT_S, then MESSAGE_TIMEOUT_S,
and the run's deadline); a child that stalls or dies is killed, its group is
recorded as failed with the error, and the rows it had sent are kept. A system
that cannot run here (no GPU, one GPU for a two-GPU system, NIXL or HMC not
importable) is recorded as skipped with the reason. `on_report` is called with
the report so far after every group, so a run cut short still leaves its file.

With `rounds` above one, every group runs that many times, one round after the
other, and each row reports its round with the highest GB/s, every round's
figures beside it (`hmc.bench._timing.best_rounds`, as `hmc bench --rounds`):
a 1 GiB copy within one GPU runs at a rate set by where the two buffers lie,
and each round's processes allocate theirs anew (docs/decisions.md, "ucx 1 GiB
on one GPU: parity").

The ratio checks (`_gpu.checks`) come from the rows of this one run.

Concurrency: the caller's thread; groups run one after another.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from _gpu.baselines import LOCAL_SYSTEMS, TWO_GPU_SYSTEMS
from _gpu.checks import evaluate_checks, floor_checks, gpu_checks, reference_ratios
from _gpu.harness import EXTRA_COLUMNS, GPU_ENV, NIXL_GPU_SYSTEMS, Devices, apply_env, sizes_of
from _gpu.hmc_rows import HMC_PATHS, HMC_SYSTEMS
from hmc.bench._child import receive, reap, send_error
from hmc.bench._report import machine_info, provenance
from hmc.bench._timing import COLUMNS, Row, Timing, best_rounds
from hmc.bench._workloads import Workload
from hmc.errors import BrokenResourceError, TimeoutError, UnavailableError

__all__ = ["GROUPS", "SYSTEMS", "GpuSpec", "run_gpu"]

SCHEMA = "hmc-bench-gpu/2"
SYSTEMS = (*LOCAL_SYSTEMS, "cuda-ipc", "nccl", "nccl-nop2p", *NIXL_GPU_SYSTEMS, *HMC_SYSTEMS)
GROUPS: dict[str, tuple[str, ...]] = {
    "local": LOCAL_SYSTEMS,
    "cuda-ipc": ("cuda-ipc",),
    "nccl": ("nccl",),
    "nccl-nop2p": ("nccl-nop2p",),
    **{name: (name,) for name in NIXL_GPU_SYSTEMS},
    "hmc": HMC_SYSTEMS,
}
"""Child-process groups, in run order, and the systems each measures."""
STARTUP_TIMEOUT_S = 240.0
MESSAGE_TIMEOUT_S = 150.0
DEADLINE_S = 480.0
"""The default budget of a whole run: inside the device machine's 10 minutes a command."""
WARMUP_S = 0.25
"""Each row warms up for this long before it is timed (the GPU's first second or so of a new kind of work is slower)."""

OnRow = Callable[[Row], None]


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What one run measures."""

    workloads: tuple[Workload, ...]
    systems: tuple[str, ...] = SYSTEMS
    timing: Timing = Timing(seconds=0.3, warmup_s=WARMUP_S)
    deadline_s: float = DEADLINE_S
    """The whole run; a group still running then is killed and recorded as failed."""
    gpus: int | None = None
    """GPUs to use (1 or 2); None: two where two exist, else one."""
    hmc_paths: tuple[str, ...] = HMC_PATHS
    rounds: int = 1
    """Times every group runs, one round after the other; each row reports its best round."""


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

    def collect(self, deadline: float, on_row: OnRow, on_info: Callable[[dict[str, Any]], None] | None = None,
                on_skip: Callable[[str, str], None] | None = None) -> None:
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
                elif message[0] == "skipped" and on_skip is not None:
                    on_skip(message[1], message[2])
                elif message[0] == "unavailable":
                    raise UnavailableError(message[1])
                elif message[0] == "done":
                    return
        finally:
            self.recv.close()
            reap(*self.procs, timeout=15.0)


def _hmc_child(out: Any, workloads: Sequence[Workload], timing: Timing, devices: Devices, systems: Sequence[str], paths: Sequence[str]) -> None:
    """Child: HMC's rows; ("skipped", system, reason) for a path that refuses the buffers, or ("unavailable", reason)."""
    try:
        apply_env()
        from _gpu.hmc_rows import hmc_rows

        try:
            hmc_rows(workloads, timing, lambda row: out.send(("row", row)), devices, systems, paths,
                     on_skip=lambda system, reason: out.send(("skipped", system, reason)))
        except UnavailableError as exc:
            out.send(("unavailable", str(exc)))
            return
        out.send(("done",))
    except BaseException:
        send_error(out)


def _probe(deadline: float) -> dict[str, Any]:
    from _gpu.baselines import probe_child

    group = _Group("probe")
    group.start(probe_child, (group.send,), "probe")
    info: dict[str, Any] = {}
    group.collect(min(deadline, time.monotonic() + STARTUP_TIMEOUT_S), lambda row: None, info.update)
    return info


def _run_group(name: str, systems: Sequence[str], spec: GpuSpec, devices: Devices, deadline: float, on_row: OnRow,
               on_skip: Callable[[str, str], None]) -> None:
    from _gpu import baselines as base

    wls, timing = list(spec.workloads), spec.timing
    group = _Group(name)
    store_dir = None
    try:
        if name == "local":
            group.start(base.local_child, (group.send, wls, timing, tuple(systems), devices), "local")
        elif name == "cuda-ipc":
            a, b = group.pipe()
            group.start(base.ipc_target, (b, sizes_of(wls), devices.dst), "target")
            group.start(base.ipc_initiator, (a, group.send, wls, timing, devices), "initiator")
        elif name in base.NCCL_SYSTEMS:
            store_dir = tempfile.mkdtemp(prefix="hmc-gpu-bench-")
            store = os.path.join(store_dir, "store")
            a, b = group.pipe()
            pair = (devices.src, devices.dst)
            group.start(base.nccl_rank, (1, b, None, store, name, wls, timing, pair), "rank1")
            group.start(base.nccl_rank, (0, a, group.send, store, name, wls, timing, pair), "rank0")
        elif name in NIXL_GPU_SYSTEMS:
            from _gpu import nixl

            ok, why = nixl.nixl_available()
            if not ok:
                raise UnavailableError(why)
            env = NIXL_GPU_SYSTEMS[name]
            a, b = group.pipe()
            group.start(nixl.nixl_target, (b, sizes_of(wls), devices.dst, env), "target")
            group.start(nixl.nixl_initiator, (a, group.send, name, wls, timing, devices.src, env), "initiator")
        elif name == "hmc":
            group.start(_hmc_child, (group.send, wls, timing, devices, tuple(systems), spec.hmc_paths), "hmc", daemon=False)
        group.collect(deadline, on_row, on_skip=on_skip)
    finally:
        if store_dir is not None:
            for leaf in os.listdir(store_dir):
                os.unlink(os.path.join(store_dir, leaf))
            os.rmdir(store_dir)


def _gpus(spec: GpuSpec, found: int) -> tuple[int, str | None]:
    """GPUs the run uses, or 0 and why none."""
    if found < 1:
        return 0, "no CUDA GPU"
    if spec.gpus is None:
        return min(found, 2), None
    if spec.gpus > found:
        return 0, f"asked for {spec.gpus} GPUs, found {found}"
    return spec.gpus, None


def run_gpu(spec: GpuSpec, command: Sequence[str] = (), progress: Callable[[str], None] | None = None,
            on_report: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Measure every system of `spec`; the JSON-ready report."""
    apply_env()
    note = progress or (lambda text: None)
    started = time.monotonic()
    deadline = started + spec.deadline_s
    rows: list[Row] = []
    skipped: list[dict[str, str]] = []
    failed: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "command": " ".join(command) or None,
        **provenance(),
        "machine": machine_info(),
        "gpu": None,
        "gpus_used": 0,
        "env": {key: os.environ.get(key) for key in GPU_ENV},
        "settings": {
            "systems": list(spec.systems),
            "hmc_paths": list(spec.hmc_paths),
            "direction": None,
            "workloads": [w.to_dict() for w in spec.workloads],
            "timing": dataclasses.asdict(spec.timing),
            "rounds": spec.rounds,
            "python_executable": sys.executable,
        },
        "columns": [*COLUMNS, *EXTRA_COLUMNS],
        "rows": [],
        "ratios": [],
        "floors": [],
        "reference_ratios": [],
        "skipped": skipped,
        "failed": failed,
        "duration_s": None,
    }

    def finish() -> dict[str, Any]:
        gpus = report["gpus_used"]
        best = report["rows"] = best_rounds(rows) if spec.rounds > 1 else rows
        report["ratios"] = evaluate_checks(gpu_checks(spec.workloads, gpus), best)
        report["floors"] = floor_checks(spec.workloads, best) if gpus >= 2 else []
        report["reference_ratios"] = reference_ratios(spec.workloads, best)
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
    gpus, why = _gpus(spec, info.get("device_count", 0))
    note(f"GPUs: {[d['name'] for d in info.get('devices', [])]}, peer access {info.get('peer_access')}; using {gpus}")
    if not gpus:
        reason = f"{why}: {info['why']}" if info.get("why") else str(why)
        skipped.extend({"system": s, "reason": reason} for s in spec.systems)
        return finish()
    devices = Devices.for_gpus(gpus)
    report["gpus_used"] = gpus
    report["settings"]["direction"] = f"{devices.describe()}; pinned and device-copy: cuda:0 <-> host, cuda:0 -> cuda:0"

    def on_row(row: Row) -> None:
        rows.append(row)
        note(f"{row['system']} {row['path']} {row['op']} {row['workload']}: {row['gbps']:.2f} GB/s, p50 {row['p50_lat_us']} us, verified {row['verified']}")

    def on_skip(system: str, reason: str) -> None:
        if {"system": system, "reason": reason} not in skipped:  # said once, not once a round
            skipped.append({"system": system, "reason": reason})
            note(f"{system}: skipped ({reason})")

    for round_, (name, members) in itertools.product(range(spec.rounds), GROUPS.items()):
        wanted = [s for s in members if s in spec.systems]
        if gpus < 2:
            for s in (s for s in wanted if s in TWO_GPU_SYSTEMS):
                on_skip(s, f"needs two GPUs ({TWO_GPU_SYSTEMS[s]}); this run uses one")
            wanted = [s for s in wanted if s not in TWO_GPU_SYSTEMS]
        if not wanted:
            continue
        before = len(rows)
        try:
            _run_group(name, wanted, spec, devices, deadline, on_row, on_skip)
        except UnavailableError as exc:
            for s in wanted:
                on_skip(s, str(exc))
        except (BrokenResourceError, TimeoutError, Exception) as exc:  # noqa: BLE001 - one group's failure is reported, the others still run
            failed.append({"system": ",".join(wanted), "error": f"{type(exc).__name__}: {exc}", "rows_kept": len(rows) - before, "round": round_})
            note(f"{name}: FAILED ({type(exc).__name__}: {str(exc)[-2000:]})")
        finish()
    return finish()
