"""How fast does a cluster on etcd notice a dead node, and find a restarted one? (JSON out)

Three nodes as network namespaces on this machine (`hmc.testing.NetnsCluster`: a real etcd, one hmcd per
node, real agents). Node B holds a named buffer; its hmcd is SIGKILLed `--rounds` times. Per round:

- `gone_s`: kill -> the buffer has left the views of A and C (the later of the two BUFFER_WITHDRAWN events
  their Watch streams deliver), against the lease TTL it must stay under (+1 s);
- `found_s`: hmcd started again (the moment it serves) -> both A and C find the buffer under the new epoch;
- `stale_refused`: the old descriptor, used by an agent on C, is refused (StaleDescriptorError).

Needs root (namespaces). Run: `python bench/cluster_failover.py --out bench/results/cluster-failover-....json`
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from hmc.errors import HMCError, StaleDescriptorError, UnavailableError, UnknownBufferError
from hmc.testing import NetnsCluster, netns_available
from hmc.v1 import daemon_pb2


def _epoch_found(client: object, name: str) -> int:
    try:
        return client.lookup(name).registry_epoch  # type: ignore[attr-defined]
    except (UnknownBufferError, UnavailableError):
        return 0


def _round(cluster: NetnsCluster, held_id: str, stale_check: object) -> dict[str, object]:
    a, b, c = cluster.nodes
    clients = [a.hmcd.client(), c.hmcd.client()]  # type: ignore[union-attr]
    try:
        old = clients[1].lookup("bench-kv-on-b")
        streams = [client.events(timeout=30, include_peers=True) for client in clients]
        b.kill_hmcd()
        killed = time.monotonic()
        gone = []
        for stream in streams:
            next(e for e in stream if e.kind == daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN and e.buffer.id == held_id)
            gone.append(time.monotonic() - killed)
            stream.close()
        b.start_hmcd()
        started = time.monotonic()
        with b.hmcd.client() as own:  # type: ignore[union-attr]
            epoch = own.node_info().registry_epoch
        deadline = started + 30
        while not all(_epoch_found(client, "bench-kv-on-b") == epoch for client in clients):
            if time.monotonic() > deadline:
                raise HMCError("the restarted node was not found within 30 s")
            time.sleep(0.005)
        found = time.monotonic() - started
        return {"gone_s": max(gone), "gone_per_viewer_s": gone, "found_s": found, "old_epoch": old.registry_epoch, "new_epoch": epoch, "stale_refused": stale_check(old)}  # type: ignore[operator]
    finally:
        for client in clients:
            client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ttl", type=int, default=2, help="lease TTL of every hmcd, seconds")
    parser.add_argument("--out", type=Path, help="write the JSON here (stdout otherwise)")
    args = parser.parse_args()
    available, why = netns_available()
    if not available:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    rounds = []
    with NetnsCluster(3, ttl_s=args.ttl) as cluster:
        _, b, c = cluster.nodes
        owner = b.agent()
        held = owner.register(1 << 20, name="bench-kv-on-b", fill=0x3C)
        writer = c.agent()
        source = writer.register(4096, fill=0x11)

        def stale_check(old: object) -> bool:
            try:
                writer.transfer("write", source.id, old, 0, 0, 4096)  # type: ignore[arg-type]
            except StaleDescriptorError:
                return True
            return False

        with c.hmcd.client() as client:  # type: ignore[union-attr]
            deadline = time.monotonic() + 30
            while not _epoch_found(client, "bench-kv-on-b"):
                if time.monotonic() > deadline:
                    raise HMCError("the buffer never reached node c")
                time.sleep(0.01)
        for _ in range(args.rounds):
            rounds.append(_round(cluster, held.id, stale_check))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    result = {
        "question": "a killed node's buffers gone from the others' view within TTL + 1 s; a restarted node found again within 2 s of its start",
        "machine": {"cpus": len(__import__("os").sched_getaffinity(0)), "processor": platform.processor() or platform.machine(), "kernel": platform.release()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "ttl_s": args.ttl,
        "rounds": rounds,
        "gone_s_max": max(r["gone_s"] for r in rounds),  # type: ignore[type-var]
        "found_s_max": max(r["found_s"] for r in rounds),  # type: ignore[type-var]
        "within_bounds": all(r["gone_s"] <= args.ttl + 1.0 and r["found_s"] <= 2.0 and r["stale_refused"] for r in rounds),  # type: ignore[operator]
    }
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0 if result["within_bounds"] else 1


if __name__ == "__main__":
    sys.exit(main())
