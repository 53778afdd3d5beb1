"""The C tests' node: a real hmcd (unix socket, and TCP with a token over TLS) and two real agents attached to it,
whose ConnBuffers are files the C tests map too (so a test writes a source, poisons a destination and checks
every byte itself, while the agents move them); and a second node, "far", an hmcd the first knows as a static
peer, declaring another host, with one agent of its own.

    python cluster.py start DIR    # returns once everything serves; DIR/state.env says where and what
    python cluster.py stop DIR
    python cluster.py agent NAME DIR NODE SPEC...   # (internal) one agent of NODE: SPEC is name:bytes[:ro] (a name "@FILE": FILE's text)
    python cluster.py fake DIR    # a scripted hmcd on TCP (DIR/fake.port says where) for what a real one does not do on cue

state.env (key=value lines): socket, tcp, token, ca, hmcd_pid, python, dir, and per buffer its file and size.
Buffers: agent "a" holds capi-src (64 MiB) and capi-ro (1 MiB, read-only); agent "b" holds capi-dst (64 MiB)
and capi-small (64 KiB); the far node's agent holds capi-far (1 MiB). Everything stops on `stop` (SIGTERM to the
supervisor), or when the supervisor dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MIB = 1 << 20
AGENTS = {"a": ("node", ("capi-src:67108864", "capi-ro:1048576:ro")), "b": ("node", ("capi-dst:67108864", "capi-small:65536")), "far": ("far", ("capi-far:1048576",))}
FAR_HOST = "capi-far-host"
"""The far node's host id: its agent is another host's to negotiation (staged or ucx over TCP, not ipc)."""
TOKEN = "capi-test-token"
_START_S = 60.0


def agent(name: str, directory: str, node: str, specs: list[str]) -> None:
    """One agent attached to `node`'s hmcd, registering a file-backed buffer per spec; runs until killed."""
    import hmc

    config = hmc.Config(node=node, socket=os.path.join(directory, f"{node}.sock"), timeout_s=10.0)
    with hmc.Agent(config, daemon=True) as held:
        for spec in specs:
            buffer, size, *mode = spec.split(":")
            path = Path(directory, buffer)
            if buffer.startswith("@"):  # a name too long for a command line: FILE's text, the memory in FILE.mem
                path, buffer = Path(buffer[1:] + ".mem"), Path(buffer[1:]).read_text()
            path.write_bytes(bytes([0xA5]) * int(size))
            data = np.memmap(path, dtype=np.uint8, mode="r" if mode == ["ro"] else "r+", shape=(int(size),))
            held.register(memoryview(data) if mode == ["ro"] else data, name=buffer)
        Path(directory, f"agent-{name}.ready").write_text(str(os.getpid()))
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        signal.sigwait({signal.SIGTERM, signal.SIGINT})


def fake(directory: Path) -> None:
    """A scripted hmcd on TCP, serving with hmcd's own server options (its keepalive policy), until SIGTERM. Its one
    transfer is PENDING once submitted; the first Wait answers RUNNING at once (early, as a forwarded wait may), every
    later Wait fails UNAVAILABLE (hmcd gone between two answers). A transfer from a buffer named "capi-held" is taken
    and then nothing more is answered about it: Wait and Cancel hold until the caller gives up (an hmcd that stopped
    after the submit). Watch subscribes and then sends nothing."""
    import itertools
    import threading
    from concurrent import futures

    import grpc

    from hmc.control._hmcd import SERVER_OPTIONS
    from hmc.control._services import SUBSCRIBED_KEY
    from hmc.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

    class Node(daemon_pb2_grpc.NodeServiceServicer):
        def GetNodeInfo(self, request, context):
            return daemon_pb2.NodeInfo(node="fake")

    class Transfers(daemon_pb2_grpc.TransferServiceServicer):
        waits = itertools.count(1)

        def Submit(self, request, context):
            if request.src.name == "capi-held":
                return daemon_pb2.TransferStatus(transfer_id="held-1", state=common_pb2.TRANSFER_STATE_PENDING, path="held")
            return daemon_pb2.TransferStatus(transfer_id="fake-1", state=common_pb2.TRANSFER_STATE_PENDING, path="submitted-" + "s" * 64)

        @staticmethod
        def _hold(context):
            ended = threading.Event()
            context.add_callback(ended.set)  # the caller's deadline ends the call
            ended.wait()
            return daemon_pb2.TransferStatus()

        def Cancel(self, request, context):
            return self._hold(context)

        def Wait(self, request, context):
            if request.transfer_id == "held-1":
                return self._hold(context)
            if next(self.waits) == 1:
                return daemon_pb2.TransferStatus(transfer_id=request.transfer_id, state=common_pb2.TRANSFER_STATE_RUNNING, path="running-" + "r" * 64)
            context.abort(grpc.StatusCode.UNAVAILABLE, "the fake hmcd went away")

    class Events(daemon_pb2_grpc.EventServiceServicer):
        def Watch(self, request, context):
            context.send_initial_metadata(((SUBSCRIBED_KEY, "1"),))
            ended = threading.Event()
            context.add_callback(ended.set)
            ended.wait()
            yield from ()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    daemon_pb2_grpc.add_NodeServiceServicer_to_server(Node(), server)
    daemon_pb2_grpc.add_TransferServiceServicer_to_server(Transfers(), server)
    daemon_pb2_grpc.add_EventServiceServicer_to_server(Events(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    server.start()
    Path(directory, "fake.port.tmp").write_text(str(port))
    os.replace(Path(directory, "fake.port.tmp"), Path(directory, "fake.port"))
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.stop(0)


def _supervise(directory: Path) -> None:
    """Start hmcd and the agents, write state.env, and stop them all on SIGTERM."""
    from hmc.testing import HmcdProcess, make_certificates
    from hmc.testing._hmcd import clean_env

    ca, cert, key = (str(path) for path in make_certificates(directory))
    far = HmcdProcess.start(directory, "far", token=TOKEN, env=clean_env(HMC_HOST_ID=FAR_HOST))
    hmcd = HmcdProcess.start(directory, "node", token=TOKEN, args=("--tls-cert", cert, "--tls-key", key, "--static-peer", far.tcp_address))
    agents = []
    try:
        for name, (node, specs) in AGENTS.items():
            env = {**os.environ, "HMC_HOST_ID": FAR_HOST} if node == "far" else None
            agents.append(subprocess.Popen([sys.executable, __file__, "agent", name, str(directory), node, *specs], stdin=subprocess.DEVNULL, env=env))
        deadline = time.monotonic() + _START_S
        while not all(Path(directory, f"agent-{name}.ready").exists() for name in AGENTS):
            if time.monotonic() > deadline or any(p.poll() is not None for p in agents):
                raise SystemExit("an agent did not start")
            time.sleep(0.05)
        lines = {
            "socket": f"unix:{hmcd.socket}", "tcp": f"127.0.0.1:{hmcd.port}", "token": TOKEN, "ca": ca, "hmcd_pid": hmcd.process.pid,
            "python": sys.executable, "cluster": __file__, "dir": str(directory),
        }
        for _, specs in AGENTS.values():
            for spec in specs:
                buffer, size, *_ = spec.split(":")
                lines[f"{buffer}.file"] = str(Path(directory, buffer))
                lines[f"{buffer}.size"] = size
        Path(directory, "state.env.tmp").write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # after the children: they keep the default
        os.replace(Path(directory, "state.env.tmp"), Path(directory, "state.env"))
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
    finally:
        for process in agents:
            process.terminate()
        for process in agents:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        hmcd.stop()
        far.stop()
        Path(directory, "stopped").write_text("")


def start(directory: Path) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    for stale in ("state.env", "stopped", *(f"agent-{name}.ready" for name in AGENTS)):
        Path(directory, stale).unlink(missing_ok=True)
    log = open(directory / "cluster.log", "ab")
    supervisor = subprocess.Popen([sys.executable, __file__, "supervise", str(directory)], stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    Path(directory, "supervisor.pid").write_text(str(supervisor.pid))
    deadline = time.monotonic() + _START_S + 30
    while not Path(directory, "state.env").exists():
        if supervisor.poll() is not None or time.monotonic() > deadline:
            supervisor.kill()
            raise SystemExit(f"the test node did not start:\n{Path(directory, 'cluster.log').read_text(errors='replace')[-4000:]}")
        time.sleep(0.05)


def stop(directory: Path) -> None:
    pid_file = Path(directory, "supervisor.pid")
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while not Path(directory, "stopped").exists():
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            return
        time.sleep(0.05)


if __name__ == "__main__":
    verb, where = sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else Path()
    if verb == "agent":
        agent(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    elif verb == "fake":
        fake(where)
    elif verb == "supervise":
        _supervise(where)
    elif verb == "start":
        start(where)
    elif verb == "stop":
        stop(where)
    else:
        raise SystemExit(__doc__)
