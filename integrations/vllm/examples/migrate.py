"""KV-cache migration between two vLLM instances through hmcd.

Instance A runs with `{"kv_connector": "HMCConnector", "kv_role": "kv_producer"}` and instance B with
`{"kv_connector": "HMCConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"mode": "hmcd"}}`,
both with HMC_SOCKET pointing at the same hmcd (or at two peered ones). This script:

1. lists the KV caches hmcd knows (each instance registers `vllm/<engine_id>/tp<rank>/kv<i>` once);
2. prefills the prompt on A, which keeps the request's blocks and returns where they are;
3. sends the request on to B: B's connector asks hmcd, through hmc.Client, for a third-party
   transfer, and hmcd has A's agent write the blocks into B's; B decodes from them;
4. prints B's output and what hmcd moved (its transfer counters before and after).

    python integrations/vllm/examples/migrate.py --a http://127.0.0.1:8100 --b http://127.0.0.1:8200 \
        --prompt "the quick brown fox" [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from typing import Any

import hmc


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return dict(json.loads(reply.read()))


def counters(client: hmc.Client) -> dict[str, float]:
    """hmcd's third-party transfer counters (Prometheus text)."""
    text = client.metrics()
    done = re.search(r'^hmc_transfers_total\{state="done"\} (\S+)$', text, re.M)
    moved = re.search(r"^hmc_transfer_bytes_total (\S+)$", text, re.M)
    return {"transfers_done": float(done.group(1)) if done else 0.0, "bytes": float(moved.group(1)) if moved else 0.0}


def settled(client: hmc.Client, before: dict[str, float], timeout_s: float = 10.0) -> dict[str, float]:
    """hmcd's counters once they show the transfer (A's agent tells B before it reports to hmcd), or at the timeout."""
    deadline = time.monotonic() + timeout_s
    after = counters(client)
    while after["transfers_done"] <= before["transfers_done"] and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a counter another process updates; bounded by the deadline
        after = counters(client)
    return after


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Migrate a request's KV cache from vLLM instance A to B through hmcd.")
    parser.add_argument("--a", required=True, help="URL of instance A (HMCConnector, kv_producer)")
    parser.add_argument("--b", required=True, help="URL of instance B (HMCConnector, kv_consumer, mode hmcd)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)

    with hmc.Client() as client:
        caches = sorted(d.name for d in client.buffers() if d.name.startswith("vllm/"))
        before = counters(client)
        models = json.loads(urllib.request.urlopen(args.a + "/v1/models", timeout=30).read())["data"]
        body = {"model": models[0]["id"], "prompt": args.prompt, "temperature": 0}
        prefilled = post(args.a, {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        params = prefilled["kv_transfer_params"]
        decoded = post(args.b, {**body, "max_tokens": args.max_tokens, "kv_transfer_params": params})
        after = settled(client, before)

    report = {
        "kv_caches": caches,
        "source": {"engine": params["remote_engine_id"], "request": params["remote_request_id"], "blocks": params["remote_block_ids"]},
        "text": decoded["choices"][0]["text"],
        "hmcd_transfers_done": after["transfers_done"] - before["transfers_done"],
        "hmcd_bytes": after["bytes"] - before["bytes"],
    }
    if args.json:
        print(json.dumps(report))
    else:
        print("KV caches registered with hmcd:", *report["kv_caches"], sep="\n  ")
        print(f"request {report['source']['request']} on engine {report['source']['engine']}: blocks {report['source']['blocks']}")
        print(f"hmcd moved {report['hmcd_bytes']:.0f} bytes in {report['hmcd_transfers_done']:.0f} transfer(s)")
        print("B continued:", repr(report["text"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
