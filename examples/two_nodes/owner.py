"""Register a 256 MiB ConnBuffer named "kv-decode" under this node's hmcd and wait for a writer's notification.

    python owner.py node-b.toml
"""

from __future__ import annotations

import sys

import numpy as np

import hmc
from hmc.testing import ranges_digest


def main(config_file: str) -> None:
    with hmc.Agent(hmc.Config.load(config_file), daemon=True) as agent:
        kv = np.full(256 << 20, 0xA5, dtype=np.uint8)
        agent.register(kv, name="kv-decode")
        print("registered kv-decode; waiting up to 60 s for a writer", flush=True)
        notes = agent.notifications(timeout=60.0)
        if not notes:
            sys.exit("no writer came")
        print(f"notified {notes[0].payload!r}; destination digest {ranges_digest(kv).hex()}")


if __name__ == "__main__":
    main(sys.argv[1])
