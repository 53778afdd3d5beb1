"""What does checking a KV batch cost the CPU before a byte moves, with the one C pass and with numpy alone?

Every transfer's range list is built (the caller's arrays copied), bounds-checked on both sides, checked for
destination ranges that share a byte, and coalesced (`hmc.transport._ranges.RangeList`) on the caller's thread,
before any path queues a copy. This times those four steps for batches of KV blocks in random order, the blocks of
the destination either packed in a cache the size of the batch's span ("dense": what `bench/gpu.py` moves) or
scattered over a cache 256 and 65536 times larger than the batch ("sparse": a serving engine's KV cache, where a map
of the grid is too large and the C pass keeps a set of the blocks taken), with the compiled pass and with numpy alone
(as in a build without a C compiler), alternated in one process. Every list is also checked to be accepted, and the
same list with one block taken twice to be refused, both ways.

    python bench/range_checks.py [--seconds 0.3] [--out FILE]

Writes bench/results/range-checks-<machine>-<date>.json (a later run the same day gets -2, -3, ...).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from host_paths import result_path

from hmc.bench._report import machine_info, provenance
from hmc.bench._timing import Timing, measure
from hmc.errors import ArgumentError
from hmc.transport._ranges import RangeList, _Facts

CASES = (  # (name, ranges, block bytes, grid slots per range)
    ("dense 4096 x 64 KiB", 4096, 65536, 1),
    ("dense 16384 x 16 KiB", 16384, 16384, 1),
    ("sparse 4096 x 64 KiB, 1:256", 4096, 65536, 256),
    ("sparse 16384 x 16 KiB, 1:256", 16384, 16384, 256),
    ("sparse 16384 x 16 KiB, 1:65536", 16384, 16384, 65536),
)
WAYS = ("c", "numpy")


def _checked(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, size: int, way: str) -> RangeList:
    """What an agent does with a new batch before it is posted: build, bounds, overlap, coalesce."""
    ranges = RangeList.build(src, dst, lengths)
    if way == "numpy":
        ranges.__dict__["_facts"] = None  # as where the module was not built
    ranges.check(size, size)
    ranges.check_disjoint_dst()
    return ranges.coalesced()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=0.3, help="timed seconds per row and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each timing every row once (the median is kept)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if _Facts._library() is None:
        print("hmc.transport._ranges_c was not built: nothing to compare", file=sys.stderr)
        return 1
    rng = np.random.default_rng(11)
    timing = Timing(seconds=args.seconds, warmup=3, min_iters=20)
    samples: dict[tuple[str, str], list[float]] = {}
    inputs = {}
    for name, count, block, spread in CASES:
        slots = count * spread
        src = rng.permutation(count).astype(np.int64) * block
        dst = rng.choice(slots, count, replace=False).astype(np.int64) * block
        inputs[name] = (src, dst, np.full(count, block, np.int64), slots * block)
    for _ in range(args.rounds):
        for name, *_ in CASES:
            src, dst, lengths, size = inputs[name]
            for way in WAYS:
                times = measure(lambda: _checked(src, dst, lengths, size, way), timing)  # noqa: B023
                samples.setdefault((name, way), []).append(float(np.median(times)) / 1e3)
    rows: list[dict[str, Any]] = []
    for name, count, block, spread in CASES:
        src, dst, lengths, size = inputs[name]
        twice = dst.copy()
        twice[-1] = twice[0]
        for way in WAYS:
            accepted = len(_checked(src, dst, lengths, size, way)) == count
            try:
                _checked(src, twice, lengths, size, way)
                refused = False
            except ArgumentError:
                refused = True
            p50 = float(np.median(samples[(name, way)]))
            rows.append({"case": name, "ranges": count, "block_bytes": block, "grid_slots_per_range": spread, "way": way,
                         "p50_us": round(p50, 1), "rounds_p50_us": [round(x, 1) for x in samples[(name, way)]],
                         "accepted": accepted, "refused_a_block_taken_twice": refused})
            print(f"{name:34s} {way:6s} {p50:9.1f} us  accepted={accepted} refused-twice={refused}")
    ratios = []
    for name, *_ in CASES:
        c, plain = (next(r["p50_us"] for r in rows if r["case"] == name and r["way"] == way) for way in WAYS)
        ratios.append({"case": name, "c_over_numpy": round(c / plain, 3)})
        print(f"{name:34s} C / numpy alone: {c / plain:.3f}")
    report = {
        "question": "CPU cost of building, checking and coalescing a KV batch before it moves: one C pass vs numpy alone",
        "command": "python bench/range_checks.py " + " ".join(argv),
        "date": datetime.date.today().isoformat(),
        "provenance": provenance(),
        "machine": machine_info(),
        "settings": {"seconds": args.seconds, "rounds": args.rounds},
        "rows": rows,
        "ratios": ratios,
    }
    out = args.out or result_path("range-checks")
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if all(r["accepted"] and r["refused_a_block_taken_twice"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
