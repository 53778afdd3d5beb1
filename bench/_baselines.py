"""Baseline half of the HMC host-memory benchmark (imported by ``hmc bench``).

Three incumbents move the same workloads between host (DRAM) buffers:

* ``memcpy_baseline``  -- one process, ``np.copyto`` between two preallocated uint8 arrays.
* ``socket_baseline``  -- two processes, plain Python TCP over 127.0.0.1: the sender does
  ``sock.sendall(memoryview)`` per range, the receiver ``recv_into`` the preallocated
  destination, then acks one byte (so an iteration ends when all bytes have landed).
  WRITE only (READ is the same thing reversed).
* ``nixl_baseline``    -- NIXL Python API, two agents in two spawned processes (initiator
  and target, metadata exchanged over a multiprocessing pipe, no etcd), default UCX
  backend, WRITE and READ.  One transfer request per workload and op, reposted for every
  iteration as nixlbench does.  ``env={"UCX_TLS": "tcp"}`` forces UCX onto TCP: the env is
  applied in both children before nixl is imported.

Every workload: sources hold random bytes, destinations are poisoned with 0xA5, 2 warm-up
iterations, then enough timed iterations for ~0.5 s (5..2000); the time of one iteration is
post + wait until complete.  After the timed loop every transferred byte is checked (in
one process by direct comparison, across processes by SHA-1 of the ranges on both sides).
Rows are plain dicts with nixlbench-like columns (``gbps`` is 1e9 bytes/s over the mean
iteration time; latencies are microseconds).  Every wait has a timeout and children that
get stuck are killed.

NIXL install (CPU machine): ``pip install nixl-cu12==1.5.1`` then
``pip install --no-deps nixl==1.5.1``.  nixl-cu12 depends on torch, and when the torch pip
picks is built for CUDA 13 the ``nixl`` meta package refuses to import ("detected CUDA 13
but nixl-cu13 is not installed"); we then import the ``nixl_cu12`` wheel directly.

Run all baselines: ``python bench/_baselines.py --json out.json``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any, Callable, Sequence

import numpy as np

KiB = 1024
MiB = 1024 * KiB
POISON = 0xA5
SEED = 20240601
TARGET_S = 0.5  # timed seconds per workload (after warm-up)
WARMUP, MIN_ITERS, MAX_ITERS = 2, 5, 2000
ITER_TIMEOUT_S = 30.0  # one iteration / one control message
RUN_TIMEOUT_S = 900.0  # a whole baseline run in child processes
SOCK_BUF = 64 * MiB  # requested; the kernel clamps to net.core.{w,r}mem_max * 2

Row = dict[str, Any]


@dataclass(frozen=True)
class Workload:
    """``batch_size`` ranges of ``block_size`` bytes inside ``total_size``-byte buffers.

    ``random``: src and dst slots are independent random permutations of the block-aligned
    slots; otherwise ranges are packed from offset 0.
    """

    name: str
    block_size: int
    batch_size: int
    total_size: int
    random: bool

    @property
    def nbytes(self) -> int:
        """Bytes moved per iteration."""
        return self.block_size * self.batch_size


def _fmt_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def default_workloads(max_bulk: int = 256 * MiB) -> list[Workload]:
    """Bulk 4 KiB..256 MiB (batch 1, up to ``max_bulk``) plus the two KV patterns."""
    bulk = [4 * KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB]
    wls = [Workload(f"bulk_{_fmt_size(s)}", s, 1, s, False) for s in bulk if s <= max_bulk]
    wls.append(Workload("kv_4096x64KiB", 64 * KiB, 4096, 256 * MiB, True))
    wls.append(Workload("kv_16384x16KiB", 16 * KiB, 16384, 256 * MiB, True))
    return wls


def make_ranges(workload: Workload, seed: int = SEED) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (src_offsets, dst_offsets, lengths) as int64 arrays, deterministic in ``seed``."""
    w = workload
    nslots = w.total_size // w.block_size
    if w.batch_size > nslots:
        raise ValueError(f"{w.name}: {w.batch_size} blocks do not fit in {w.total_size} bytes")
    if w.random:
        rng = np.random.default_rng(seed)
        src = rng.permutation(nslots)[: w.batch_size]
        dst = rng.permutation(nslots)[: w.batch_size]
    else:
        src = dst = np.arange(w.batch_size)
    bs = np.int64(w.block_size)
    return (src.astype(np.int64) * bs, dst.astype(np.int64) * bs,
            np.full(w.batch_size, w.block_size, dtype=np.int64))


# ----------------------------------------------------------------------------- helpers


def _buf_size(workloads: Sequence[Workload]) -> int:
    return max(w.total_size for w in workloads)


def _random_buffer(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _digest(buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> str:
    """SHA-1 of the given ranges of ``buf``, concatenated in range order."""
    h = hashlib.sha1()
    for off, ln in zip(offsets.tolist(), lengths.tolist()):
        h.update(buf[off:off + ln])
    return h.hexdigest()


def _measure(step: Callable[[], None], announce: Callable[[int], None] | None = None) -> list[float]:
    """Run WARMUP untimed-for-stats iterations, then a calibrated timed batch (seconds each)."""

    def batch(n: int) -> list[float]:
        if announce is not None:
            announce(n)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            out.append(time.perf_counter() - t0)
        return out

    warm = batch(WARMUP)
    iters = int(min(MAX_ITERS, max(MIN_ITERS, TARGET_S / max(min(warm), 1e-7))))
    return batch(iters)


def _row(system: str, path: str, op: str, w: Workload, times: Sequence[float]) -> Row:
    t = np.asarray(times, dtype=np.float64)
    return {
        "system": system, "path": path, "op": op, "block_size": w.block_size,
        "batch_size": w.batch_size, "total_bytes": w.nbytes,
        "gbps": round(w.nbytes / float(t.mean()) / 1e9, 4),
        "avg_lat_us": round(float(t.mean()) * 1e6, 2),
        "p99_lat_us": round(float(np.percentile(t, 99)) * 1e6, 2),
        "p50_lat_us": round(float(np.percentile(t, 50)) * 1e6, 2),
        "iterations": len(t),
    }


def _recv(conn: Connection, timeout: float = ITER_TIMEOUT_S) -> tuple[Any, ...]:
    """Receive one control message or raise (timeout, peer error, peer gone)."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no control message within {timeout:.0f} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"peer process failed:\n{msg[1]}")
    return msg


def _expect(conn: Connection, kind: str, timeout: float = ITER_TIMEOUT_S) -> tuple[Any, ...]:
    msg = _recv(conn, timeout)
    if msg[0] != kind:
        raise RuntimeError(f"expected {kind!r}, got {msg[0]!r}")
    return msg


def _reap(*procs: mp.process.BaseProcess, timeout: float = 10.0) -> None:
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(5.0)


def _check(what: str, got: str, want: str) -> None:
    if got != want:
        raise RuntimeError(f"{what}: data mismatch (digest {got} != {want})")


# ----------------------------------------------------------------------------- memcpy


def memcpy_baseline(workloads: Sequence[Workload]) -> list[Row]:
    """Single-process ``np.copyto`` of every range (one call per range), WRITE rows."""
    size = _buf_size(workloads)
    src = _random_buffer(size, SEED)
    dst = np.empty(size, dtype=np.uint8)
    rows = []
    for w in workloads:
        so, do, ln = make_ranges(w, SEED)
        dst[: w.total_size].fill(POISON)
        pairs = [(dst[d:d + n], src[s:s + n]) for s, d, n in zip(so.tolist(), do.tolist(), ln.tolist())]

        def step() -> None:
            for d_view, s_view in pairs:
                np.copyto(d_view, s_view)

        times = _measure(step)
        if not all(np.array_equal(d_view, s_view) for d_view, s_view in pairs):
            raise RuntimeError(f"memcpy {w.name}: data mismatch")
        rows.append(_row("memcpy", "numpy.copyto", "WRITE", w, times))
    return rows


# ----------------------------------------------------------------------------- TCP socket


def _tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("sender closed the socket")
        got += n


def _socket_receiver(conn: Connection, port: int, size: int) -> None:
    """Child: receive each announced batch of iterations into a poisoned buffer, ack each."""
    try:
        dst = np.empty(size, dtype=np.uint8)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _tune_socket(sock)
        sock.settimeout(ITER_TIMEOUT_S)
        sock.connect(("127.0.0.1", port))
        views: list[memoryview] = []
        do = ln = np.zeros(0, dtype=np.int64)
        while True:
            msg = _recv(conn, RUN_TIMEOUT_S)
            if msg[0] == "workload":
                _, do, ln = make_ranges(msg[1], SEED)
                dst[: msg[1].total_size].fill(POISON)
                views = [memoryview(dst[d:d + n]) for d, n in zip(do.tolist(), ln.tolist())]
                conn.send(("ready",))
            elif msg[0] == "iters":
                for _ in range(msg[1]):
                    for v in views:
                        _recv_exact(sock, v)
                    sock.sendall(b"\x01")
            elif msg[0] == "digest":
                conn.send(("digest", _digest(dst, do, ln)))
            else:
                break
        sock.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def socket_baseline(workloads: Sequence[Workload]) -> list[Row]:
    """Python TCP over 127.0.0.1 between this process (sender) and a spawned receiver."""
    ctx = mp.get_context("spawn")
    size = _buf_size(workloads)
    conn, child_conn = ctx.Pipe()
    listener = socket.create_server(("127.0.0.1", 0))
    _tune_socket(listener)
    proc = ctx.Process(target=_socket_receiver, args=(child_conn, listener.getsockname()[1], size),
                       daemon=True)
    proc.start()
    sock: socket.socket | None = None
    rows = []
    try:
        listener.settimeout(60.0)
        sock, _ = listener.accept()
        _tune_socket(sock)
        sock.settimeout(ITER_TIMEOUT_S)
        src = _random_buffer(size, SEED)
        ack = bytearray(1)
        for w in workloads:
            so, _, ln = make_ranges(w, SEED)
            views = [memoryview(src[s:s + n]) for s, n in zip(so.tolist(), ln.tolist())]
            conn.send(("workload", w))
            _expect(conn, "ready")

            def step() -> None:
                for v in views:
                    sock.sendall(v)
                if sock.recv_into(ack, 1) != 1:
                    raise ConnectionError("receiver closed the socket")

            times = _measure(step, announce=lambda n: conn.send(("iters", n)))
            conn.send(("digest",))
            _check(f"socket {w.name}", _expect(conn, "digest")[1], _digest(src, so, ln))
            rows.append(_row("socket", "tcp-127.0.0.1", "WRITE", w, times))
        conn.send(("quit",))
    finally:
        if sock is not None:
            sock.close()
        listener.close()
        _reap(proc)
    return rows


# ----------------------------------------------------------------------------- NIXL


def _import_nixl() -> ModuleType:
    """Return the nixl ``_api`` module (meta package first, then the wheels directly)."""
    errors = []
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise ImportError("; ".join(errors))


def _nixl_version() -> str:
    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def nixl_available() -> tuple[bool, str]:
    """(True, version) if the NIXL Python API imports, else (False, reason)."""
    try:
        _import_nixl()
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return False, f"{type(e).__name__}: {e}"
    return True, f"nixl {_nixl_version()}"


def _nixl_agent(name: str, backend: str, env: dict[str, str]) -> Any:
    """Apply ``env`` (before nixl/UCX is loaded in this process) and create an agent."""
    os.environ.update(env)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    api = _import_nixl()
    return api.nixl_agent(name, api.nixl_agent_config(backends=[backend]))


def _descs(base: int, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Nx3 (address, length, device id) descriptor array."""
    out = np.zeros((len(offsets), 3), dtype=np.uint64)
    out[:, 0] = offsets.astype(np.uint64) + np.uint64(base)
    out[:, 1] = lengths.astype(np.uint64)
    return out


def _register(agent: Any, bufs: Sequence[np.ndarray]) -> Any:
    regs = np.array([(b.ctypes.data, b.nbytes, 0) for b in bufs], dtype=np.uint64)
    return agent.register_memory(regs, "DRAM")


def _nixl_target(conn: Connection, backend: str, env: dict[str, str], size: int) -> None:
    """Child: passive side; owns a random source (READ) and a poisoned destination (WRITE)."""
    try:
        agent = _nixl_agent("hmc-bench-target", backend, env)
        src = _random_buffer(size, SEED + 1)
        dst = np.full(size, POISON, dtype=np.uint8)
        regs = _register(agent, [src, dst])
        conn.send(("md", agent.get_agent_metadata(), src.ctypes.data, dst.ctypes.data))
        while True:
            msg = _recv(conn, RUN_TIMEOUT_S)
            if msg[0] == "prep":
                dst[: msg[1].total_size].fill(POISON)
                conn.send(("ready",))
            elif msg[0] == "digest":
                w, op = msg[1], msg[2]
                so, do, ln = make_ranges(w, SEED)
                conn.send(("digest", _digest(dst, do, ln) if op == "WRITE" else _digest(src, so, ln)))
            else:
                break
        agent.deregister_memory(regs)
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _nixl_initiator(conn: Connection, out: Connection, backend: str, env: dict[str, str],
                    workloads: Sequence[Workload], ops: Sequence[str], path: str) -> None:
    """Child: active side; one transfer request per workload and op, reposted each iteration."""
    try:
        agent = _nixl_agent("hmc-bench-initiator", backend, env)
        size = _buf_size(workloads)
        src = _random_buffer(size, SEED)
        dst = np.empty(size, dtype=np.uint8)
        regs = _register(agent, [src, dst])
        _, md, r_src, r_dst = _expect(conn, "md", 120.0)
        peer = agent.add_remote_agent(md)
        rows = []
        for w in workloads:
            so, do, ln = make_ranges(w, SEED)
            for op in ops:
                conn.send(("prep", w))
                dst[: w.total_size].fill(POISON)
                _expect(conn, "ready")
                if op == "WRITE":
                    local, remote = _descs(src.ctypes.data, so, ln), _descs(r_dst, do, ln)
                else:
                    local, remote = _descs(dst.ctypes.data, do, ln), _descs(r_src, so, ln)
                handle = agent.initialize_xfer(op, agent.get_xfer_descs(local, "DRAM"),
                                               agent.get_xfer_descs(remote, "DRAM"), peer)

                def step() -> None:
                    state = agent.transfer(handle)
                    deadline = time.perf_counter() + ITER_TIMEOUT_S
                    while state == "PROC":
                        if time.perf_counter() > deadline:
                            raise TimeoutError(f"nixl {op} {w.name}: transfer not done in time")
                        state = agent.check_xfer_state(handle)
                    if state != "DONE":
                        raise RuntimeError(f"nixl {op} {w.name}: transfer state {state}")

                times = _measure(step)
                agent.release_xfer_handle(handle)
                conn.send(("digest", w, op))
                mine = _digest(src, so, ln) if op == "WRITE" else _digest(dst, do, ln)
                _check(f"nixl {op} {w.name}", _expect(conn, "digest")[1], mine)
                rows.append(_row("nixl", path, op, w, times))
        conn.send(("quit",))
        agent.remove_remote_agent(peer)
        agent.deregister_memory(regs)
        out.send(("rows", rows))
    except BaseException:
        msg = ("error", traceback.format_exc())
        for c in (out, conn):
            try:
                c.send(msg)
            except OSError:
                pass


def nixl_baseline(workloads: Sequence[Workload], backend: str = "UCX",
                  env: dict[str, str] | None = None,
                  ops: Sequence[str] = ("WRITE", "READ")) -> list[Row]:
    """NIXL host-memory transfers between two agent processes; [] if nixl is unavailable.

    ``env`` (e.g. ``{"UCX_TLS": "tcp"}``) is set in both agent processes before nixl loads.
    Raises RuntimeError/TimeoutError on failure or data mismatch.
    """
    if not nixl_available()[0]:
        return []
    env = dict(env or {})
    path = " ".join([backend] + [f"{k}={v}" for k, v in sorted(env.items())])
    ctx = mp.get_context("spawn")
    ini_conn, tgt_conn = ctx.Pipe()
    res_recv, res_send = ctx.Pipe(duplex=False)
    target = ctx.Process(target=_nixl_target, args=(tgt_conn, backend, env, _buf_size(workloads)),
                         daemon=True)
    initiator = ctx.Process(target=_nixl_initiator, daemon=True,
                            args=(ini_conn, res_send, backend, env, list(workloads), list(ops), path))
    target.start()
    initiator.start()
    try:
        return list(_expect(res_recv, "rows", RUN_TIMEOUT_S)[1])
    finally:
        _reap(initiator, target)


# ----------------------------------------------------------------------------- CLI


def machine_info() -> dict[str, Any]:
    """Short description of the host the numbers were taken on."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"hostname": platform.node(), "platform": platform.platform(), "cpu": cpu,
            "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "nixl": nixl_available()[1]}


def format_table(rows: Sequence[Row]) -> str:
    """Fixed-width text table of result rows."""
    head = f"{'system':8} {'path':16} {'op':5} {'block':>8} {'batch':>6} {'total':>8} " \
           f"{'GB/s':>8} {'avg_us':>10} {'p50_us':>10} {'p99_us':>10} {'iters':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['system']:8} {r['path']:16} {r['op']:5} {_fmt_size(r['block_size']):>8} "
                     f"{r['batch_size']:>6} {_fmt_size(r['total_bytes']):>8} {r['gbps']:>8.3f} "
                     f"{r['avg_lat_us']:>10.1f} {r['p50_lat_us']:>10.1f} {r['p99_lat_us']:>10.1f} "
                     f"{r['iterations']:>6}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run memcpy, socket, NIXL (default UCX) and NIXL with UCX_TLS=tcp; print and save."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write results to this file")
    ap.add_argument("--max-bulk-mib", type=int, default=256, help="largest bulk size (MiB)")
    args = ap.parse_args(argv)
    wls = default_workloads(args.max_bulk_mib * MiB)
    runs: list[tuple[str, Callable[[], list[Row]]]] = [
        ("memcpy", lambda: memcpy_baseline(wls)),
        ("socket", lambda: socket_baseline(wls)),
        ("nixl", lambda: nixl_baseline(wls)),
        ("nixl tcp", lambda: nixl_baseline(wls, env={"UCX_TLS": "tcp"})),
    ]
    ok, why = nixl_available()
    if not ok:
        print(f"nixl not available, skipped: {why}", file=sys.stderr)
    rows: list[Row] = []
    failed = False
    for name, fn in runs:
        t0 = time.monotonic()
        try:
            got = fn()
        except Exception as e:  # noqa: BLE001 - report and continue with the next baseline
            print(f"{name}: FAILED: {e}", file=sys.stderr)
            failed = True
            continue
        print(f"{name}: {len(got)} rows in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        rows += got
    print(format_table(rows))
    if args.json:
        doc = {"machine": machine_info(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "rows": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
