"""How do HMC's CUDA paths compare with device copies, CUDA IPC, NCCL and NIXL, on one GPU or two?

One run, every system on the same workloads (bulk 4 KiB to 1 GiB, 4096 random
64 KiB ranges and 16384 random 16 KiB ranges inside 1 GiB buffers, 4 KiB latency
p50/p99 from the bulk_4KiB rows), WRITE and READ where the system has READ. On two
GPUs the source is on cuda:0 and the destination on cuda:1; on one GPU (or with
--gpus 1) both processes of every pair are on cuda:0.

    device-copy    torch copy_ cuda:0 -> cuda:0 in one process: the ceiling of ipc on one GPU
    peer-copy      torch copy_ cuda:0 -> cuda:1 in one process (cudaMemcpyPeerAsync); two GPUs
    pinned-d2h/h2d torch copy_ between cuda:0 and pinned host memory: the ceiling of staged
    pinned-both    D2H and H2D on cuda:0 at once: staged's ceiling when both ends share one GPU
    pinned-across  D2H on cuda:0 and H2D on cuda:1 at once: staged's ceiling across two GPUs
    pinned-ring    through a pinned ring of staged's geometry, hand-offs on the GPU, no CPU between
                   slots: the ceiling of any such ring (its fill, drain and cost per slot included)
    torch-gather   index_select -> (peer copy) -> index_copy_ of the KV ranges (one process)
    copy-kernel    a CuPy copy kernel, one thread block per range, in one process
    cuda-ipc       two processes: the source's process opens the destination's IPC handle and
                   writes into it (cudaMemcpyAsync; the copy kernel)
    nccl           torch.distributed send/recv between two processes; nccl-nop2p with
                   NCCL_P2P_DISABLE=1 (host-staged); two GPUs (NCCL refuses two ranks on one)
    nixl           NIXL 1.5.x, UCX backend, default settings, VRAM <-> VRAM, two processes
    nixl-tcp-cuda-copy  the same with UCX_TLS=tcp,cuda_copy: NIXL between vendors without RDMA
    hmc            HMC through its public API, two processes, write()/read() + wait() per
                   iteration, on paths ipc (same vendor), staged (the peer declares its GPU
                   AMD: vendor override), staged-tcp (the peer declares another host) and
                   staged-hip (the peer runs HMC's HIP backend on the HIP-on-CUDA runtime)
    hmc-prepared   the same peers: single ranges up to 64 KiB as one prepare_write()/
                   prepare_read() posted per iteration, as the nixl rows repost one request

NCCL_NVLS_ENABLE=0 (and the other multicast switches) are set here and in every
child. Every wait on a child is bounded; children are killed when they stall; the
whole run stops at --deadline (default 480 s a round: a full run on one H100 takes about
3 minutes). Writes JSON: --out PATH, else $OUT/gpu-<gpus>x-<device>-<date>.json where
$OUT is set (the device machine), else bench/results/gpu-<gpus>x-<device>-<date>.json
(-2, -3, ... for later runs the same day). Prints the table and the ratio checks
(issue 11's cross-vendor checks; issue 3's on two GPUs). Exits 1 when a group failed
or a row was not verified, else 0 (also when everything was skipped: no GPU).

    python bench/gpu.py [--quick] [--gpus 1|2] [--seconds S] [--systems a,b,...] [--hmc-paths a,b]
                        [--kv-total BYTES] [--rounds N] [--deadline S] [--out PATH] [--git-commit SHA [--git-modified a,b]]

--rounds N runs every group N times, one round after the other, and reports each row's
best round (every round's GB/s and p50 beside it): each round's processes allocate their
buffers anew, and a 1 GiB copy within one GPU runs 2-3% faster or slower by where they lie.

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

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(MULTICAST_OFF)  # before anything can load NCCL; children inherit it (and set it again)


def _import_hmc() -> str | None:
    """Put bench/ (the `_gpu` package) and the repository (hmc) on sys.path and import hmc; where the package itself
    does not import (a broken dependency), load only the benchmark's modules, so the baselines still run (HMC's rows
    are then skipped). This runs in every spawned child too (spawn re-imports this script, and hands the children
    this sys.path). None, or why the lean import was used."""
    for folder in (ROOT, BENCH):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
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

from _gpu.checks import format_table  # noqa: E402
from _gpu.harness import GiB, gpu_quick_workloads, gpu_workloads  # noqa: E402
from _gpu.hmc_rows import HMC_PATHS  # noqa: E402
from _gpu.run import DEADLINE_S, SYSTEMS, WARMUP_S, GpuSpec, run_gpu  # noqa: E402
from hmc.bench._timing import Timing  # noqa: E402


def result_name(report: dict, today: datetime.date | None = None) -> str:
    """'gpu-1x-nvidia-h100-80gb-hbm3-2026-11-24': the GPUs used and the probe's first device."""
    devices = (report.get("gpu") or {}).get("devices") or []
    model = re.sub(r"[^a-z0-9]+", "-", devices[0]["name"].lower()).strip("-") if devices else "unknown"
    return f"gpu-{report.get('gpus_used', 0)}x-{model}-{(today or datetime.date.today()).isoformat()}"


def result_path(report: dict, folder: Path) -> Path:
    stem = result_name(report)
    path, n = folder / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}.json"
    return path


def _names(parser: argparse.ArgumentParser, text: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    names = tuple(s for s in text.split(",") if s)
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown {what} {unknown}; choose from {', '.join(known)}")
    return names


def main(argv: list[str]) -> int:
    head, _, rest = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke-sized workloads (bulk 4 KiB..1 MiB, KV in 16 MiB) and short timing")
    parser.add_argument("--gpus", type=int, choices=(1, 2), default=None, help="GPUs to use (default: 2 where two exist, else 1)")
    parser.add_argument("--seconds", type=float, default=None, help="timed seconds per row (default 0.3; --quick 0.05)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--hmc-paths", default=",".join(HMC_PATHS), help=f"comma-separated subset of {','.join(HMC_PATHS)} (the hmc rows' peers)")
    parser.add_argument("--kv-total", type=int, default=GiB, help="bytes of the buffers the KV ranges lie in (default 1 GiB)")
    parser.add_argument("--rounds", type=int, default=1, help="run every group this many times and report each row's best round (default 1)")
    parser.add_argument("--deadline", type=float, default=None, help=f"seconds for the whole run (default {DEADLINE_S:.0f} a round); a group still running then is killed")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--git-commit", default=None, help="the commit to record instead of what this copy's .git says (the device machine's copy has none, or a stale one)")
    parser.add_argument("--git-modified", default="", help="with --git-commit: comma-separated tracked files modified in the tree that was copied")
    args = parser.parse_args(argv)
    systems = _names(parser, args.systems, SYSTEMS, "systems")
    hmc_paths = _names(parser, args.hmc_paths, HMC_PATHS, "HMC paths")
    workloads = tuple(gpu_quick_workloads() if args.quick else gpu_workloads(args.kv_total))
    seconds = args.seconds if args.seconds is not None else (0.05 if args.quick else 0.3)
    if not 1 <= args.rounds <= 20:
        parser.error("--rounds must be 1..20")
    deadline = args.deadline if args.deadline is not None else DEADLINE_S * args.rounds
    spec = GpuSpec(workloads, systems, Timing(seconds=seconds, warmup_s=0.0 if args.quick else WARMUP_S), deadline, args.gpus, hmc_paths, args.rounds)
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
    return 0 if not report["failed"] and all(r["verified"] for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
