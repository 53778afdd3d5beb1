"""`hmc bench`: HMC's host paths against memcpy, a Python socket and NIXL, in one run.

Concurrency: the CLI's main thread drives the run; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hmc.bench import BASELINES, OPS, BenchSpec, Timing, default_workloads, fmt_size, quick_workloads, run
from hmc.bench._paths import PATHS
from hmc.cli._output import Progress, print_json, print_table
from hmc.config import Config
from hmc.errors import ArgumentError

__all__ = ["register"]

DESCRIPTION = """\
Measure HMC's host-memory paths (local, ipc, ucx, ucx over tcp only, staged) WRITE and READ, and in the
same run the baselines on the same workloads: single-process memcpy, a plain
Python TCP socket between two processes, and NIXL 1.5.1 (UCX backend, default
settings, and forced onto TCP). Then print the issue's ratio checks, computed
from this run only. A full run takes a few minutes; --quick takes seconds.

An initiator agent runs here and a target agent in a child process; no hmcd is
needed. Sources hold random bytes, destinations are poisoned before each
workload, and after the timed loop every moved byte is verified."""

EPILOG = """\
workloads:
  bulk   one range of 4KiB, 64KiB, 1MiB, 16MiB, 256MiB (--quick: up to 1MiB)
  kv     4096 random 64KiB ranges and 16384 random 16KiB ranges in 256MiB buffers
         (random: independent permutations of the block slots on each side;
         --quick: 256 x 64KiB and 1024 x 16KiB in 16MiB)

columns:
  system      hmc, or a baseline: memcpy, socket, nixl (UCX defaults), nixl-tcp (UCX_TLS=tcp)
  path        hmc: local | ipc | staged (local and ipc as the agent picks them, fast path
              included; staged forced with path="staged"); baselines: how they move bytes
  op          WRITE (push into the target) or READ (pull from it); memcpy/socket: WRITE only
  block       bytes per range            batch   ranges per transfer
  total       bytes per transfer (block x batch)
  gb/s        1e9 bytes/s over the mean iteration (one iteration = post + wait)
  avg/p50/p99 iteration latency in microseconds
  iters       timed iterations (after 2 warm-ups; about --iterations-time seconds)
  ok          every moved byte verified (digest of destination vs source ranges)

ratio checks (targets from the issue; largest bulk size of the run, smallest for latency):
  staged bulk WRITE >= 0.9x socket and >= 1.3x nixl-tcp; ipc bulk WRITE >= 0.6x memcpy
  and >= 1.0x nixl; each kv pattern over ipc >= 0.8x ipc bulk and >= 2x nixl; ipc 4KiB
  WRITE p50 <= 2x nixl's.

NIXL is optional: without it the nixl rows are skipped with the reason. Install it with
  pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1

examples:
  hmc bench --quick
  hmc bench --paths ipc --workloads kv --baselines nixl
  hmc bench --json --out bench/results/mine.json

exit status: 1 when a system failed or a byte was not verified; missed ratio targets are
reported, not an error.
"""


def _choices(text: str, allowed: tuple[str, ...], what: str, *, none_ok: bool = False) -> tuple[str, ...]:
    items = tuple(part.strip() for part in text.split(",") if part.strip())
    if none_ok and items == ("none",):
        return ()
    lowered = {a.lower(): a for a in allowed}
    unknown = [item for item in items if item.lower() not in lowered]
    if unknown or not items:
        raise ArgumentError(f"unknown {what} {', '.join(unknown) or repr(text)}; choose from {', '.join(allowed)}" + (" or none" if none_ok else ""))
    return tuple(dict.fromkeys(lowered[item.lower()] for item in items))


def _spec(args: argparse.Namespace) -> BenchSpec:
    kinds = _choices(args.workloads, ("bulk", "kv"), "workload kind")
    workloads = tuple(w for w in (quick_workloads() if args.quick else default_workloads()) if w.kind in kinds)
    seconds = args.iterations_time if args.iterations_time is not None else (0.05 if args.quick else 0.5)
    if seconds <= 0:
        raise ArgumentError("--iterations-time must be positive")
    if not 1 <= args.rounds <= 20:
        raise ArgumentError(f"--rounds must be 1..20, got {args.rounds}")
    return BenchSpec(
        workloads=workloads,
        paths=_choices(args.paths, PATHS, "path", none_ok=True),
        ops=_choices(args.ops, OPS, "op"),
        baselines=_choices(args.baselines, BASELINES, "baseline", none_ok=True),
        timing=Timing(seconds=seconds),
        rounds=args.rounds,
    )


def _command(args: argparse.Namespace, spec: BenchSpec) -> list[str]:
    """An `hmc bench` command line that repeats this run (recorded in the report)."""
    return [
        "hmc", "bench", *(["--quick"] if args.quick else []),
        "--paths", ",".join(spec.paths) or "none", "--ops", ",".join(spec.ops).lower(),
        "--workloads", args.workloads, "--baselines", ",".join(spec.baselines) or "none",
        "--iterations-time", str(spec.timing.seconds), *(["--rounds", str(spec.rounds)] if spec.rounds > 1 else []),
    ]


def _display(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "system": row["system"],
        "path": row["path"],
        "op": row["op"],
        "block": fmt_size(row["block_size"]),
        "batch": row["batch_size"],
        "total": fmt_size(row["total_bytes"]),
        "gb/s": row["gbps"],
        "avg_us": row["avg_lat_us"],
        "p50_us": row["p50_lat_us"],
        "p99_us": row["p99_lat_us"],
        "iters": row["iterations"],
        "ok": "yes" if row["verified"] else "NO",
    }


def _print_checks(ratios: list[dict[str, Any]]) -> None:
    print_table([
        {
            "check": r["check"],
            "value": "-" if r["ratio"] is None else f"{r['numerator_value']} / {r['denominator_value']}",
            "ratio": "-" if r["ratio"] is None else f"{r['ratio']:.2f}x",
            "target": r["target"],
            "result": {True: "pass", False: "FAIL", None: f"n/a ({r.get('reason', '')})"}[r["ok"]],
        }
        for r in ratios
    ])


def _print_report(report: dict[str, Any]) -> None:
    machine = report["machine"]
    print(f"hmc bench on {machine['cores']} x {machine['cpu_model']}, kernel {machine['kernel']}, "
          f"load {' '.join(map(str, machine['loadavg']))} -> {' '.join(map(str, machine['loadavg_end']))}")
    busy = ", ".join(f"{name} {v['other_cpu_fraction']:.0%}" for name, v in machine.get("interference", {}).items())
    if busy:
        print(f"CPU taken by other processes while each system ran: {busy}")
    print_table([_display(r) for r in report["rows"]])
    for item in report["skipped"]:
        print(f"skipped {item['system']}: {item['reason']}")
    for item in report["failed"]:
        print(f"FAILED {item['system']}: {item['error']}")
    if report["ratios"]:
        print()
        _print_checks(report["ratios"])


def _run(args: argparse.Namespace, config: Config) -> int:
    spec = _spec(args)
    progress = Progress(spec.rounds * sum(spec.units().values()), "hmc bench", enabled=not args.quiet)
    report = run(spec, config, lambda units, note: progress.advance(units, note), command=_command(args, spec))
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print_json(report)
    else:
        _print_report(report)
    unverified = any(not r["verified"] for r in report["rows"])
    return 1 if report["failed"] or unverified else 0


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "bench", help="HMC's paths against socket, memcpy and NIXL baselines",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--paths", default=",".join(PATHS), metavar="LIST", help=f"HMC paths to measure: {','.join(PATHS)} or none (default: all)")
    parser.add_argument("--ops", default="write,read", metavar="LIST", help="write,read (default: both)")
    parser.add_argument("--workloads", default="bulk,kv", metavar="LIST", help="bulk,kv (default: both)")
    parser.add_argument("--baselines", default=",".join(BASELINES), metavar="LIST", help=f"{','.join(BASELINES)} or none (default: all)")
    parser.add_argument("--quick", action="store_true", help="small sizes and 0.05 s per workload: a smoke test in seconds")
    parser.add_argument("--iterations-time", type=float, metavar="S", help="timed seconds per workload (default 0.5; --quick 0.05)")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="run every system N times, one round after the other, and report each row's best round (default 1)")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON report to FILE")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.set_defaults(run=_run)
