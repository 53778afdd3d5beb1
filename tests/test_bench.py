"""`hmc bench --quick`: real agents in two processes, real baselines, the JSON report's shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hmc.bench import COLUMNS, quick_workloads
from hmc.bench._paths import PATHS
from hmc.cli._main import main


def test_bench_quick_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    code = main([
        "bench", "--quick", "--json", "--quiet", "--baselines", "memcpy,socket", "--workloads", "bulk",
        "--iterations-time", "0.01", "--out", str(out),
    ])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == report

    bulk = [w.name for w in quick_workloads() if w.kind == "bulk"]
    assert report["columns"] == list(COLUMNS)
    for row in report["rows"]:
        assert list(row) == list(COLUMNS)
        assert row["verified"] is True
        assert row["gbps"] > 0 and row["iterations"] >= 5
        assert row["p50_lat_us"] <= row["p99_lat_us"]
    hmc = {(r["path"], r["op"], r["workload"]) for r in report["rows"] if r["system"] == "hmc"}
    assert hmc == {(p, op, w) for p in PATHS for op in ("WRITE", "READ") for w in bulk}
    for system in ("memcpy", "socket"):
        assert {r["workload"] for r in report["rows"] if r["system"] == system} == set(bulk)

    ratios = {r["check"]: r for r in report["ratios"]}
    assert ratios[f"staged {bulk[-1]} WRITE vs socket"]["ratio"] > 0
    assert ratios[f"ipc {bulk[-1]} WRITE vs memcpy"]["ratio"] > 0
    assert ratios[f"ipc {bulk[-1]} WRITE vs NIXL"]["ok"] is None  # NIXL not asked for: reported, not guessed
    assert all(r["target"].startswith((">=", "<=")) for r in ratios.values())

    assert report["failed"] == [] and report["skipped"] == []
    machine = report["machine"]
    assert machine["cores"] >= 1 and machine["cpu_model"] and machine["kernel"] and len(machine["loadavg"]) == 3
    assert set(machine["interference"]) == {"hmc", "memcpy", "socket"}
    assert all(0 <= v["other_cpu_fraction"] <= 1 for v in machine["interference"].values())
    assert report["date"] and report["versions"]["numpy"] and report["versions"]["python"]


def test_bench_rejects_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--paths", "ipc,rdma-ish"]) == 1
    assert "unknown path rdma-ish" in capsys.readouterr().err


def test_bench_rounds_report_each_rows_best_round(capsys: pytest.CaptureFixture[str]) -> None:
    """Three rounds of every system, one after the other: one row per (system, path, op, workload), the round with the
    highest GB/s, every round's figures beside it."""
    code = main([
        "bench", "--quick", "--json", "--quiet", "--paths", "local", "--ops", "write", "--baselines", "memcpy", "--workloads", "bulk",
        "--iterations-time", "0.01", "--rounds", "3",
    ])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    bulk = [w.name for w in quick_workloads() if w.kind == "bulk"]
    keys = [(r["system"], r["path"], r["op"], r["workload"]) for r in report["rows"]]
    assert len(keys) == len(set(keys)) == 2 * len(bulk)
    for row in report["rows"]:
        assert len(row["rounds_gbps"]) == len(row["rounds_p50_us"]) == 3
        assert row["gbps"] == max(row["rounds_gbps"]) and row["p50_lat_us"] in row["rounds_p50_us"]
        assert row["verified"] is True
    assert report["settings"]["rounds"] == 3 and report["command"].endswith("--rounds 3")
    assert set(report["machine"]["interference"]) == {f"{s} round {i}" for s in ("hmc", "memcpy") for i in range(3)}


@pytest.mark.parametrize("rounds", ["0", "21", "-1"])
def test_bench_refuses_rounds_out_of_range(capsys: pytest.CaptureFixture[str], rounds: str) -> None:
    assert main(["bench", "--quick", "--rounds", rounds]) == 1
    assert "--rounds must be 1..20" in capsys.readouterr().err


class _Clock:
    """A clock each step of the measured loop moves on by `step_ns` (an injected clock: no sleeps)."""

    def __init__(self, step_ns: int) -> None:
        self.now, self.step_ns, self.steps = 0, step_ns, 0

    def __call__(self) -> int:
        return self.now

    def step(self) -> None:
        self.steps += 1
        self.now += self.step_ns


@pytest.mark.parametrize(
    ("warmup", "warmup_s", "step_ns", "warm_steps"),
    [(2, 0.0, 1_000, 2), (2, 0.25, 1_000_000, 250), (2, 0.25, 400_000_000, 2), (0, 0.25, 10_000_000, 25), (0, 0.25, 400_000_000, 1), (2, 0.25, 0, 1000)],
)
def test_rows_warm_up_for_warmup_s_untimed_then_time_what_was_asked(warmup: int, warmup_s: float, step_ns: int, warm_steps: int) -> None:
    """`warmup` iterations, then more until `warmup_s` of warming up went by (none more when the first already took
    that long; at most `max_iters`, for a step the clock cannot see); those are never among the timed ones, and each
    batch is announced to a passive peer."""
    from hmc.bench._timing import Timing, measure

    clock = _Clock(step_ns)
    announced: list[int] = []
    timing = Timing(seconds=10 * step_ns / 1e9, warmup=warmup, warmup_s=warmup_s, min_iters=5, max_iters=1000)
    times = measure(clock.step, timing, announced.append, clock=clock)
    assert clock.steps - len(times) == warm_steps
    assert sum(announced) == clock.steps
    assert (times == step_ns).all() and len(times) >= 5


def test_range_checks_bench_accepts_each_batch_and_refuses_a_block_taken_twice_both_ways(tmp_path: Path) -> None:
    """`bench/range_checks.py` (CPU cost of checking a KV batch, the C pass against numpy alone) runs end to end: every
    case both ways, each batch accepted, the same batch with one block taken twice refused, and its JSON written."""
    import subprocess
    import sys

    out = tmp_path / "range-checks.json"
    script = Path(__file__).resolve().parent.parent / "bench" / "range_checks.py"
    done = subprocess.run([sys.executable, str(script), "--seconds", "0.01", "--rounds", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    cases = {row["case"] for row in report["rows"]}
    assert len(cases) == 5 and sum("sparse" in case for case in cases) == 3
    assert sorted((row["case"], row["way"]) for row in report["rows"]) == sorted((case, way) for case in cases for way in ("c", "numpy"))
    assert all(row["accepted"] and row["refused_a_block_taken_twice"] and row["p50_us"] > 0 for row in report["rows"])
    assert {ratio["case"] for ratio in report["ratios"]} == cases

