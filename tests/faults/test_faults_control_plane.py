"""The control plane admits only whom it should (issue 9, scenarios 3 and 6).

- hmcd's socket directory: created 0700; an existing one that is loose, foreign or a symlink is refused.
- Clients refuse a socket or directory another user could have put there (the impostor of scenario 3).
- Peer credentials: a uid other than hmcd's own or root is refused on the unix socket even where file
  permissions let it connect.
- A lookup during a partition is UnavailableError naming the silent peer, never UnknownBufferError.

Tests that change uids run as root (they fork a child that drops to nobody, 65534: the interpreter
lives under /root, so nobody cannot exec one); they skip otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator

import pytest
from control_fixtures import REPO, DaemonSet, FakeAgent, clean_env, daemon_set, short_tempdir, start_peered, wait_until

from hmc.agent._peer_process import wait_stopped
from hmc.config import Config
from hmc.control import Client
from hmc.control._auth import check_socket_dir
from hmc.errors import AuthenticationError, UnavailableError, UnknownBufferError, UntrustedSocketError

NOBODY = 65534
TOKEN = "partition-secret"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: changes file owners and forks a child that drops to uid 65534")


@pytest.fixture
def scratch() -> Iterator[str]:
    directory = short_tempdir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def daemons() -> Iterator[DaemonSet]:
    yield from daemon_set()


def refused_start(socket_path: str) -> str:
    """Start hmcd on `socket_path`, expect exit status 1, and return its stderr."""
    args = [sys.executable, "-m", "hmc.control._hmcd_main", "--socket", socket_path, "--node", "refused"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=30, cwd=REPO, env=clean_env())
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    return run.stderr


# -- hmcd's socket directory ------------------------------------------------------------------


def test_hmcd_makes_its_socket_directory_private(daemons: DaemonSet) -> None:
    nested = os.path.join(daemons.directory, "run", "hmc")
    node = daemons.start("fresh", extra_args=("--socket", os.path.join(nested, "hmcd.sock")))
    assert stat.S_IMODE(os.stat(nested).st_mode) == 0o700
    for path in (os.path.join(nested, "hmcd.sock"), os.path.join(nested, "hmcd.sock.grpc")):
        assert stat.S_ISSOCK(os.lstat(path).st_mode) and stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    with Client(config=node.config(socket=os.path.join(nested, "hmcd.sock"))) as client:
        assert client.health().node == "fresh"
    node.stop()
    assert not {"hmcd.sock", "hmcd.sock.grpc"} & set(os.listdir(nested))  # both sockets removed on SIGTERM


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o701, 0o777])
def test_hmcd_refuses_a_directory_open_to_others(scratch: str, mode: int) -> None:
    loose = os.path.join(scratch, "loose")
    os.mkdir(loose)
    os.chmod(loose, mode)
    stderr = refused_start(os.path.join(loose, "hmcd.sock"))
    assert f"hmcd's socket directory {loose} has mode {mode:04o}: it is open to" in stderr
    assert os.listdir(loose) == []


def test_hmcd_refuses_a_symlinked_directory_and_a_file_in_the_socket_place(scratch: str) -> None:
    real = os.path.join(scratch, "real")
    os.mkdir(real, 0o700)
    os.symlink(real, os.path.join(scratch, "link"))
    assert "is a symlink" in refused_start(os.path.join(scratch, "link", "hmcd.sock"))
    squatter = os.path.join(real, "hmcd.sock")
    with open(squatter, "w") as fh:
        fh.write("not a socket")
    assert f"existing socket file {squatter} is not a socket" in refused_start(squatter)


@needs_root
def test_hmcd_refuses_a_directory_or_socket_of_another_user(scratch: str) -> None:
    foreign = os.path.join(scratch, "foreign")
    os.mkdir(foreign, 0o700)
    os.chown(foreign, NOBODY, NOBODY)
    assert f"{foreign} is owned by uid {NOBODY}, not by root" in refused_start(os.path.join(foreign, "hmcd.sock"))
    mine = os.path.join(scratch, "mine")
    os.mkdir(mine, 0o700)
    planted = os.path.join(mine, "hmcd.sock")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(planted)
    os.chown(planted, NOBODY, NOBODY)
    assert f"existing socket file {planted} is owned by uid {NOBODY}" in refused_start(planted)


# -- clients refuse sockets another user could have put there ---------------------------------


def test_clients_refuse_a_loose_directory_a_symlink_and_a_world_writable_socket(scratch: str) -> None:
    shared = os.path.join(scratch, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    with Client(config=Config(socket=os.path.join(shared, "hmcd.sock"), timeout_s=2.0)) as client, pytest.raises(UntrustedSocketError, match="mode 0777"):
        client.health()
    private = os.path.join(scratch, "private")
    os.mkdir(private, 0o700)
    os.symlink(private, os.path.join(scratch, "link"))
    with pytest.raises(UntrustedSocketError, match="is a symlink"):
        check_socket_dir(os.path.join(scratch, "link", "hmcd.sock"))
    open_socket = os.path.join(private, "hmcd.sock")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(open_socket)
        os.chmod(open_socket, 0o666)
        with pytest.raises(UntrustedSocketError, match="mode 0666"):
            check_socket_dir(open_socket)
    missing = os.path.join(scratch, "absent", "hmcd.sock")
    with Client(config=Config(socket=missing, timeout_s=2.0)) as client, pytest.raises(UnavailableError, match="absent"):
        client.health()  # nothing there: not refused, just not running


def _fork_as_nobody(action: Callable[[], None]) -> int:
    """Fork a child that drops to nobody and runs `action` (plain syscalls only: the parent has threads), then exits."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python >= 3.12 warns about fork() beside threads
        pid = os.fork()
    if pid == 0:
        status = 0
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
        except BaseException:  # noqa: BLE001 - the child reports through its exit status only
            status = 1
        os._exit(status)
    return pid


def _reap(pid: int) -> int:
    """The exit status of child `pid`, waiting at most 10 s."""
    statuses: list[int] = []

    def exited() -> bool:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            statuses.append(os.waitstatus_to_exitcode(status))
        return bool(done)

    wait_until(exited, timeout=10.0, what=f"child {pid} to exit")
    return statuses[0]


def _read_line(fd: int, timeout: float = 10.0) -> bytes:
    """One line from pipe `fd`, within `timeout`."""
    data = b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while not data.endswith(b"\n"):
            if not selector.select(timeout=max(deadline - time.monotonic(), 0.0)):
                raise AssertionError(f"no line from the child within {timeout}s (got {data!r})")
            chunk = os.read(fd, 64)
            if not chunk:
                break
            data += chunk
    return data


@needs_root
def test_the_impostor_hmcd_of_scenario_3_learns_nothing(scratch: str) -> None:
    """/tmp/hmc-0 made 0777 and owned by nobody, nobody listening in it: root's client and hmcd refuse it."""
    os.chmod(scratch, 0o711)
    den = os.path.join(scratch, "hmc-0")
    os.mkdir(den)
    os.chown(den, NOBODY, NOBODY)
    os.chmod(den, 0o777)
    impostor = os.path.join(den, "hmcd.sock")
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()

    def listen_then_count() -> None:
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(impostor)
            listener.listen(16)
            os.write(ready_w, b"ready\n")
            os.read(done_r, 1)  # until the test is done
            listener.setblocking(False)
            connections = 0
            with contextlib.suppress(BlockingIOError):
                while True:
                    listener.accept()[0].close()
                    connections += 1
            os.write(ready_w, f"{connections}\n".encode())

    child = _fork_as_nobody(listen_then_count)
    try:
        assert _read_line(ready_r) == b"ready\n"
        assert os.stat(impostor).st_uid == NOBODY
        with Client(config=Config(socket=impostor, timeout_s=2.0)) as client, pytest.raises(UntrustedSocketError, match=f"owned by uid {NOBODY}"):
            client.health()
        with pytest.raises(UntrustedSocketError, match=f"owned by uid {NOBODY}"):
            check_socket_dir(impostor)  # what the agent's link calls before attaching
        cli = subprocess.run(
            [sys.executable, "-m", "hmc.cli._main", "status", "--address", f"unix:{impostor}"], capture_output=True, text=True, timeout=30, cwd=REPO, env=clean_env()
        )
        assert cli.returncode == 1 and f"owned by uid {NOBODY}" in cli.stderr, cli.stderr
        for place in (impostor, os.path.join(den, "root.sock")):
            assert f"{den} is owned by uid {NOBODY}" in refused_start(place)
        os.write(done_w, b"x")
        assert _read_line(ready_r) == b"0\n"  # not one connection reached the impostor
    finally:
        with contextlib.suppress(OSError):
            os.write(done_w, b"x")
        for fd in (ready_r, ready_w, done_r, done_w):
            os.close(fd)
    assert _reap(child) == 0


# -- peer credentials on hmcd's socket ------------------------------------------------------


def _connect_as_nobody(path: str) -> socket.socket:
    """A connection to `path` made by a process running as nobody (SO_PEERCRED records it), handed back to us."""
    ours, theirs = socket.socketpair(socket.AF_UNIX)
    with ours:

        def connect_and_hand_over() -> None:
            sock = socket.socket(socket.AF_UNIX)
            try:
                sock.connect(path)
            except OSError as exc:
                socket.send_fds(theirs, [f"errno {exc.errno}".encode()], [])
                return
            socket.send_fds(theirs, [b"connected"], [sock.fileno()])

        child = _fork_as_nobody(connect_and_hand_over)
        theirs.close()
        ours.settimeout(10.0)
        message, fds, _, _ = socket.recv_fds(ours, 64, 1)
    assert _reap(child) == 0
    if not fds:
        raise PermissionError(int(message.split()[1]), message.decode())
    return socket.socket(fileno=fds[0])


def _relay(connection: socket.socket, directory: str) -> str:
    """A unix address whose first client is spliced to `connection` (so gRPC can speak over a connection a child made)."""
    path = os.path.join(directory, f"relay-{connection.fileno()}.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(10.0)

    def pump() -> None:
        with listener:
            client, _ = listener.accept()
        ends = {client: connection, connection: client}
        deadline = time.monotonic() + 30.0
        with client, connection, selectors.DefaultSelector() as selector, contextlib.suppress(OSError):  # either end may close first
            for end in ends:
                selector.register(end, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                for key, _ in selector.select(timeout=max(deadline - time.monotonic(), 0.0)):
                    data = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
                    if not data:
                        return
                    ends[key.fileobj].sendall(data)  # type: ignore[index]

    threading.Thread(target=pump, name="test-relay", daemon=True).start()
    return f"unix:{path}"


@needs_root
def test_peer_credentials_admit_hmcds_own_uid_and_root_only(daemons: DaemonSet, scratch: str) -> None:
    node = daemons.start("creds")
    with pytest.raises(PermissionError) as blocked:
        _connect_as_nobody(node.socket)
    assert blocked.value.errno == errno.EACCES  # first gate: the private directory and the 0600 socket
    os.chmod(daemons.directory, 0o711)  # loosened by hand: only peer credentials stand in the way now
    os.chmod(node.socket, 0o666)
    before = len(node.log_text())
    with Client(_relay(_connect_as_nobody(node.socket), scratch), config=node.config()) as client:
        with pytest.raises(AuthenticationError, match="admits only root"):
            client.node_info()
        with pytest.raises(AuthenticationError, match="admits only root"):
            client.buffers()
    refusals = [line for line in node.log_text()[before:].splitlines() if "refused a connection" in line]
    assert len(refusals) == 1 and f"uid {NOBODY}" in refusals[0]
    root_connection = socket.socket(socket.AF_UNIX)
    root_connection.connect(node.socket)
    with Client(_relay(root_connection, scratch), config=node.config()) as client:  # the same way in, as root
        assert client.node_info().node == "creds"


# -- scenario 6: a lookup during a partition --------------------------------------------------


def test_a_lookup_while_a_peer_is_silent_is_unavailable_naming_it(daemons: DaemonSet) -> None:
    node_a, node_b = start_peered(daemons, "part-a", "part-b", TOKEN)
    here = FakeAgent(node_a.config())
    try:
        here.register("kv-here", size=4096)
        os.kill(node_b.process.pid, signal.SIGSTOP)
        try:
            wait_stopped(node_b.process.pid, time.monotonic() + 10.0)
            with Client(config=node_a.config(), timeout=15.0) as client:
                with pytest.raises(UnavailableError, match=node_b.tcp_address):  # before or after the health check notices
                    client.lookup("kv-somewhere")
                wait_until(lambda: [p.up for p in client.node_info().peers] == [False], what="part-a to see part-b down")
                with pytest.raises(UnavailableError, match=f"{node_b.tcp_address}"):
                    client.lookup("kv-somewhere")
                with pytest.raises(UnavailableError, match="may hold it"):
                    client.lookup("id:0123456789abcdef")
                assert client.lookup("kv-here").owner.node == "part-a"  # what is local still resolves
                assert here.link.lookup("kv-here").name == "kv-here"  # the agent's lookup (by id, then by name) too
        finally:
            os.kill(node_b.process.pid, signal.SIGCONT)
        with node_a.client() as client:
            wait_until(lambda: [p.up for p in client.node_info().peers] == [True], what="part-a to see part-b up again")
            with pytest.raises(UnknownBufferError, match="kv-somewhere"):
                client.lookup("kv-somewhere")  # every peer answered: now it is unknown
    finally:
        here.close()
