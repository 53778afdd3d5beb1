"""Find "kv-decode" by name through this node's hmcd (it may live under a peer hmcd) and write 256 MiB into it.

    python writer.py node-a.toml
"""

from __future__ import annotations

import sys
import time

import numpy as np

import hmc
from hmc.testing import ranges_digest


def main(config_file: str) -> None:
    with hmc.Agent(hmc.Config.load(config_file), daemon=True) as agent:
        source = np.frombuffer(np.random.default_rng().bytes(256 << 20), dtype=np.uint8).copy()
        buffer = agent.register(source, name="kv-prefill")
        remote = agent.lookup("kv-decode")
        choice = agent.path_to(buffer, remote)
        print(f"found kv-decode on {remote.owner.node}; path {choice.path.value}: {choice.reason}")
        started = time.perf_counter()
        handle = agent.write(buffer, remote, 0, 0, source.size, notify=b"kv ready")
        handle.wait()
        seconds = time.perf_counter() - started
        print(f"wrote {source.size} bytes over {handle.path} in {seconds:.3f} s; source digest {ranges_digest(source).hex()}")


if __name__ == "__main__":
    main(sys.argv[1])
