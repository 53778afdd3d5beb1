"""One agent in its own process (and, run with `ip netns exec`, its own network namespace), driven line by line.

The fault tests start it as `python -m tests.faults._node --host ADDR ...`, send one JSON command per
line on stdin and read one JSON answer per line on stdout. It owns at most one registered buffer and
runs at most one transfer at a time; every answer comes back within the command's own deadline.

Commands (`op`): register {size, fill} -> {descriptor}; fill {value}; count {value} -> {count, other};
write {descriptor, size, timeout} -> {} (starts it); progress -> {bytes_done, state};
wait -> {error, at}; fill_source {value}; holders -> {count}; threads -> {names};
unregister -> {seconds, error};
quit.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

import numpy as np

from hmc import Agent, BufferDescriptor, Config, PathPolicy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--keepalive", type=float, default=1.0)
    parser.add_argument("--socket", required=True)
    args = parser.parse_args()
    config = Config(
        socket=args.socket, agent_host=args.host, timeout_s=args.timeout, keepalive_s=args.keepalive, policy=PathPolicy(allow=("staged",))
    )
    with Agent(config, daemon=False) as agent:
        _serve(agent)


def _serve(agent: Agent) -> None:
    memory: np.ndarray | None = None
    source: np.ndarray | None = None
    buffer: Any = None
    handle: Any = None
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        answer: dict[str, Any] = {}
        if op == "register":
            memory = np.full(command["size"], command["fill"], np.uint8)
            buffer = agent.register(memory)
            answer["descriptor"] = buffer.descriptor.SerializeToString().hex()
        elif op == "fill":
            assert memory is not None
            memory[:] = command["value"]
        elif op == "count":
            assert memory is not None
            answer["count"] = int(np.count_nonzero(memory == command["value"]))
            answer["other"] = int(memory.size - np.count_nonzero(memory == command.get("expect", command["value"])))
        elif op == "write":
            remote = BufferDescriptor.FromString(bytes.fromhex(command["descriptor"]))
            source = np.random.default_rng(command.get("seed", 1)).integers(1, 255, command["size"], dtype=np.uint8)
            local = agent.register(source)
            handle = agent.write(local, remote, 0, 0, command["size"], timeout=command["timeout"])
        elif op == "progress":
            answer["bytes_done"], answer["state"] = handle.bytes_done, handle.state.value
        elif op == "wait":
            try:
                handle.wait()
                answer["error"] = None
            except Exception as exc:  # noqa: BLE001 - the test reads the type
                answer["error"] = type(exc).__name__
            answer["at"] = time.monotonic()
        elif op == "fill_source":
            assert source is not None
            source[:] = command["value"]
        elif op == "holders":  # receives writing into the registered buffer right now
            answer["count"] = len(agent._buffers.holders(buffer.id))
        elif op == "threads":
            answer["names"] = [t.name for t in threading.enumerate()]
        elif op == "unregister":
            started = time.monotonic()
            try:
                agent.unregister(buffer)
                answer["error"] = None
            except Exception as exc:  # noqa: BLE001
                answer["error"] = f"{type(exc).__name__}: {exc}"
            answer["seconds"] = time.monotonic() - started
        elif op == "quit":
            return
        answer["at"] = answer.get("at", time.monotonic())
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
