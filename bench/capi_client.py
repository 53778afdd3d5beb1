"""What does a C scheduler pay for a third-party transfer through libhmc, against the Python client?

One hmcd, two agents in their own processes (a 64 MiB source and destination); the same migration (one range of
4 KiB, then of 64 MiB) asked of hmcd by `hmc.Client.migrate` and by libhmc's `hmc_migrate` (bench/capi/migrate_loop.c,
built here against a Release build of libhmc), alternating rounds so both see the same machine. Every migration
is submitted, executed by the source's agent and waited for. Prints the table and the issue's check (C client
<= 1.2x the Python client's per-migration time, p50) and writes bench/results/capi-client-<machine>-<date>.json.

    python bench/capi_client.py [--rounds 5] [--count 200]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_paths import result_path  # noqa: E402  (bench/ is not a package)

from hmc.bench._report import machine_info  # noqa: E402
from hmc.control import Client  # noqa: E402
from hmc.testing import HmcdProcess, PeerProcess  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SIZES = {"4KiB": 4096, "64MiB": 64 << 20}
TARGET = 1.2


def build_c_client(where: Path) -> Path:
    """libhmc (Release) and migrate_loop linked against it."""
    build = where / "libhmc"
    for command in (
        ["cmake", "-S", str(REPO / "libhmc"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DHMC_BUILD_TESTS=OFF", "-DHMC_BUILD_EXAMPLES=OFF"],
        ["cmake", "--build", str(build), "-j", "2"],
        ["cc", "-O2", "-I", str(REPO / "libhmc" / "include"), str(REPO / "bench" / "capi" / "migrate_loop.c"), f"-L{build}", "-lhmc", f"-Wl,-rpath,{build}",
         "-o", str(where / "migrate_loop")],
    ):
        subprocess.run(command, check=True, capture_output=True, timeout=900)
    return where / "migrate_loop"


def python_times(client: Client, nbytes: int, warmup: int, count: int) -> list[float]:
    times = []
    for i in range(warmup + count):
        started = time.perf_counter()
        client.migrate("bench-src", "bench-dst", (0, 0, nbytes), timeout=30.0)
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return times


def c_times(program: Path, address: str, nbytes: int, warmup: int, count: int) -> list[float]:
    done = subprocess.run([str(program), address, "bench-src", "bench-dst", str(nbytes), str(warmup), str(count)], capture_output=True, text=True, timeout=600, check=True)
    return [float(line) for line in done.stdout.split()]


def summary(times: list[float]) -> dict[str, float]:
    values = np.array(times) * 1e6
    return {"p50_us": round(float(np.percentile(values, 50)), 1), "p10_us": round(float(np.percentile(values, 10)), 1), "p90_us": round(float(np.percentile(values, 90)), 1),
            "mean_us": round(float(values.mean()), 1), "n": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of each client per size")
    parser.add_argument("--count", type=int, default=200, help="timed 4 KiB migrations per round (64 MiB: a tenth)")
    parser.add_argument("--git-commit", default="", help="the commit measured (recorded as given)")
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hmc-capi-", dir="/tmp") as scratch:
        work = Path(scratch)
        work.chmod(0o700)
        program = build_c_client(work)
        hmcd = HmcdProcess.start(work, "bench")
        try:
            with PeerProcess(hmcd.config(), daemon=True) as a, PeerProcess(hmcd.config(), daemon=True) as b, Client(hmcd.unix_address, config=hmcd.config()) as client:
                data = np.random.default_rng(1).integers(1, 256, 64 << 20, dtype=np.uint8).tobytes()
                source = a.register(64 << 20, name="bench-src")
                a.fill(source.id, data)
                target = b.register(64 << 20, name="bench-dst", fill=0xA5)
                path = client.path("bench-src", "bench-dst").path.value
                rows, checks = [], []
                for label, nbytes in SIZES.items():
                    count = args.count if nbytes <= 4096 else max(args.count // 10, 5)
                    py: list[float] = []
                    c: list[float] = []
                    for _ in range(args.rounds):
                        py += python_times(client, nbytes, 10, count)
                        c += c_times(program, hmcd.unix_address, nbytes, 10, count)
                    for system, times in (("python-client", py), ("c-client", c)):
                        rows.append({"system": system, "workload": label, "bytes": nbytes, "path": path, **summary(times)})
                    ratio = float(np.percentile(c, 50) / np.percentile(py, 50))
                    checks.append({"check": f"C client {label} migration p50 vs the Python client's", "target": f"<= {TARGET}", "ratio": round(ratio, 3), "ok": ratio <= TARGET})
                verified = b.contents(target.id) == data  # the last 64 MiB migration's bytes, every one
        finally:
            hmcd.stop()
    report = {
        "schema": "hmc-capi-client/1", "command": " ".join(sys.argv), "date": datetime.date.today().isoformat(), "git_commit": args.git_commit,
        "machine": machine_info(), "verified": verified, "rows": rows, "checks": checks, "duration_s": round(time.monotonic() - started, 1),
    }
    for row in rows:
        print(f"{row['system']:14} {row['workload']:6} over {row['path']}: p50 {row['p50_us']:>10} us  p10 {row['p10_us']:>10}  p90 {row['p90_us']:>10}  n={row['n']}")
    for check in checks:
        print(f"[{'ok' if check['ok'] else 'MISS'}] {check['check']}: {check['ratio']} (target {check['target']})")
    if not verified:
        raise SystemExit("the destination does not hold the source's bytes")
    out = result_path("capi-client")
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
