"""How do HMC's CUDA paths compare with peer copies, CUDA IPC, NCCL and NIXL on two GPUs of one host?

One run, GPU0 -> GPU1, every system on the same workloads (bulk 4 KiB to 1 GiB,
4096 random 64 KiB ranges and 16384 random 16 KiB ranges inside 1 GiB buffers,
4 KiB latency p50/p99 from the bulk_4KiB rows):

    peer-copy      torch copy_ cuda:0 -> cuda:1 in one process (cudaMemcpyPeerAsync)
    pinned-d2h/h2d torch copy_ between cuda:0 and pinned host memory
    torch-gather   index_select -> peer copy -> index_copy_ of the KV ranges (one process)
    copy-kernel    a CuPy copy kernel, one thread block per range, GPU0 writes (push) or
                   GPU1 reads (pull) the peer's memory over NVLink: the ceiling
    cuda-ipc       two processes: cuda:0's process opens cuda:1's IPC handle and writes
                   into it (cudaMemcpyAsync; the copy kernel)
    nccl           torch.distributed send/recv between two processes; nccl-nop2p with
                   NCCL_P2P_DISABLE=1 (host-staged)
    nixl           NIXL 1.5.x, UCX backend, default settings, VRAM -> VRAM, two processes
    hmc            HMC's CUDA paths, through the plug-in hmc.bench._gpu_hmc (skipped with
                   the reason while hmc.transport has none): write() + wait() per iteration
    hmc-prepared   the same child: single ranges up to 64 KiB as one prepare_write() posted
                   per iteration, as the nixl rows repost one prepared request

NCCL_NVLS_ENABLE=0 (and the other multicast switches) are set here and in every
child. Every wait on a child is bounded; children are killed when they stall.
Writes JSON: --out PATH, else $OUT/gpu-<gpus>-<date>.json where $OUT is set (the
device machine), else bench/results/gpu-<gpus>-<date>.json (-2, -3, ... for later
runs the same day). Prints the table and issue 3's ratio checks.

    python bench/gpu.py [--quick] [--seconds S] [--systems a,b,...] [--kv-total BYTES] [--deadline S] [--out PATH]
                        [--git-commit SHA [--git-modified a,b]]

NIXL: `pip install --no-deps nixl-cu13==1.5.1 nixl==1.5.1` (without it the nixl rows are skipped).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(MULTICAST_OFF)  # before anything can load NCCL; children inherit it (and set it again)


def _import_hmc() -> str | None:
    """Import hmc; where the package itself does not import (a broken dependency), load only the
    benchmark's modules, so the baselines still run (HMC's rows are then skipped). This runs in
    every spawned child too (spawn re-imports this script). None, or why the lean import was used."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        import hmc  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - reported in the result
        for name, folder in (("hmc", ROOT / "hmc"), ("hmc.bench", ROOT / "hmc" / "bench")):
            module = types.ModuleType(name)
            module.__path__ = [str(folder)]
            sys.modules[name] = module
        return f"{type(exc).__name__}: {exc}"
    return None


HMC_IMPORT_ERROR = _import_hmc()

from hmc.bench._gpu_common import GiB, gpu_quick_workloads, gpu_workloads  # noqa: E402
from hmc.bench._gpu_run import SYSTEMS, GpuSpec, format_table, run_gpu  # noqa: E402
from hmc.bench._timing import Timing  # noqa: E402


def result_name(report: dict, today: datetime.date | None = None) -> str:
    """'gpu-2x-nvidia-h200-2026-11-22' from the probe's devices."""
    devices = (report.get("gpu") or {}).get("devices") or []
    model = re.sub(r"[^a-z0-9]+", "-", devices[0]["name"].lower()).strip("-") if devices else "unknown"
    return f"gpu-{len(devices)}x-{model}-{(today or datetime.date.today()).isoformat()}"


def result_path(report: dict, folder: Path) -> Path:
    stem = result_name(report)
    path, n = folder / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}.json"
    return path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke-sized workloads (bulk 4 KiB..1 MiB, KV in 16 MiB) and short timing")
    parser.add_argument("--seconds", type=float, default=None, help="timed seconds per row (default 0.3; --quick 0.05)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--kv-total", type=int, default=GiB, help="bytes of the buffers the KV ranges lie in (default 1 GiB)")
    parser.add_argument("--deadline", type=float, default=1500.0, help="seconds for the whole run; a group still running then is killed")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--git-commit", default=None, help="the commit to record instead of what this copy's .git says (the device machine's copy has none, or a stale one)")
    parser.add_argument("--git-modified", default="", help="with --git-commit: comma-separated tracked files modified in the tree that was copied")
    args = parser.parse_args(argv)
    systems = tuple(s for s in args.systems.split(",") if s)
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    workloads = tuple(gpu_quick_workloads() if args.quick else gpu_workloads(args.kv_total))
    seconds = args.seconds if args.seconds is not None else (0.05 if args.quick else 0.3)
    spec = GpuSpec(workloads, systems, Timing(seconds=seconds), args.deadline)
    out_path: list[Path] = []

    def save(report: dict) -> None:
        if HMC_IMPORT_ERROR:
            report["hmc_import_error"] = HMC_IMPORT_ERROR
        if args.git_commit and "git_device_view" not in report:  # the device machine's copy has no .git, or a stale one
            report["git_device_view"] = report.get("git")
            report["git"] = {"commit": args.git_commit, "modified_files": [f for f in args.git_modified.split(",") if f],
                             "source": "--git-commit (the copy of the tree that ran has no .git, or one that lags behind)"}
        if not out_path:
            if args.out is not None:
                out_path.append(args.out)
            else:
                folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS
                out_path.append(result_path(report, folder))
            out_path[0].parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path[0].with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(out_path[0])

    if HMC_IMPORT_ERROR:
        print(f"hmc does not import ({HMC_IMPORT_ERROR}); measuring the baselines only", file=sys.stderr, flush=True)
    report = run_gpu(spec, ["python", "bench/gpu.py", *argv], lambda text: print(text, file=sys.stderr, flush=True), save)
    print(format_table(report), flush=True)
    print(f"wrote {out_path[0] if out_path else '(nothing)'}", flush=True)
    return 0 if report["rows"] and all(r["verified"] for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
