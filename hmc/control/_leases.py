"""What hmcd remembers across its own restarts: the registry epoch and who holds which buffer name.

    <socket dir>/<socket stem>.registry.json     (0600, in the socket's 0700 directory)
    {"version": 1, "epoch": 17, "leases": [{"name": "kv-0", "agent_id": "...", "pid": 4242, "start_time": 123456}]}

A lease names its holder by agent id and by process identity: pid plus the
process's start time (field 22 of /proc/<pid>/stat, clock ticks after boot), so
a pid the kernel handed to another process is not mistaken for the holder.
Access keys and descriptors never reach the file: only names and holders.

The file is written atomically (a private temporary file renamed over it) and
not fsynced: it protects against hmcd dying, not the host (a host crash ends
every holder too). A file that is not a regular file owned by hmcd's user with
mode 0600 (no group or other bits), or that does not parse, is ignored with a
warning: hmcd then starts with no reservations and a time-based epoch. Reading
and writing never raise.

`ProcessWatch` tells hmcd's loop the moment a holder's process exits (a pidfd
that becomes readable), so a dead holder's names are freed at once.

Concurrency: `LeaseFile` has no state of its own beyond its path; `ProcessWatch`
belongs to the event loop that created it and calls back on that loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["Lease", "LeaseFile", "ProcessIdentity", "ProcessWatch", "next_epoch", "process_identity", "state_path_for"]

log = logging.getLogger("hmc.hmcd")

_FORMAT_VERSION = 1
_MAX_FILE_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class ProcessIdentity:
    """A process that cannot be confused with a later one that reuses its pid."""

    pid: int
    start_time: int


@dataclasses.dataclass(frozen=True)
class Lease:
    """Buffer `name` belongs to agent `agent_id`, running as `process`."""

    name: str
    agent_id: str
    process: ProcessIdentity


def process_identity(pid: int) -> ProcessIdentity | None:
    """The running process `pid` (None when there is none, it is a zombie, or /proc cannot say)."""
    if pid <= 0:
        return None
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    try:
        fields = raw[raw.rindex(b")") + 2 :].split()  # the command name may hold spaces and parentheses
        state, start_time = fields[0], int(fields[19])
    except (ValueError, IndexError):
        return None
    if state in (b"Z", b"X", b"x"):
        return None
    return ProcessIdentity(pid, start_time)


def next_epoch(stored: int, clock: Callable[[], float] = time.time) -> int:
    """An epoch above `stored` and no lower than the clock in milliseconds (so it grows without a file too)."""
    return max(stored + 1, int(clock() * 1000))


def state_path_for(socket: str) -> str:
    """Where the hmcd serving on `socket` keeps its state: beside the socket, in the same private directory."""
    path = Path(socket)
    return str(path.with_name(f"{path.stem}.registry.json"))


class LeaseFile:
    """The state file of one hmcd."""

    def __init__(self, path: str) -> None:
        self.path = path

    def load(self) -> tuple[int, list[Lease]]:
        """(epoch, leases) as last saved; (0, []) when the file is missing, unsafe or corrupt."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0, []
        except OSError as exc:
            log.warning("ignoring hmcd state file %s: cannot open it (%s)", self.path, exc)
            return 0, []
        try:
            problem = _unsafe(os.fstat(fd))
            if problem:
                log.warning("ignoring hmcd state file %s: %s", self.path, problem)
                return 0, []
            with os.fdopen(fd, "rb", closefd=False) as fh:
                raw = fh.read(_MAX_FILE_BYTES + 1)
        except OSError as exc:
            log.warning("ignoring hmcd state file %s: cannot read it (%s)", self.path, exc)
            return 0, []
        finally:
            os.close(fd)
        try:
            if len(raw) > _MAX_FILE_BYTES:
                raise ValueError(f"larger than {_MAX_FILE_BYTES} bytes")
            return _parse(json.loads(raw))
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("ignoring hmcd state file %s: not a valid state file (%s)", self.path, exc)
            return 0, []

    def save(self, epoch: int, leases: list[Lease]) -> None:
        """Replace the file atomically; a failure is logged, never raised (the registry works without it)."""
        text = json.dumps(
            {
                "version": _FORMAT_VERSION,
                "epoch": epoch,
                "leases": [{"name": x.name, "agent_id": x.agent_id, "pid": x.process.pid, "start_time": x.process.start_time} for x in leases],
            }
        ).encode()
        temporary = f"{self.path}.{os.getpid()}.tmp"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, 0o600)  # O_TRUNC keeps the mode of a leftover temporary file
                os.write(fd, text)
            finally:
                os.close(fd)
            os.replace(temporary, self.path)
        except OSError as exc:
            log.warning("could not save hmcd state file %s: %s (names will not be reserved across a restart)", self.path, exc)
            try:
                os.unlink(temporary)
            except OSError:
                pass


def _unsafe(info: os.stat_result) -> str:
    """Why a state file may not be trusted ('' when it may)."""
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_uid != os.geteuid():
        return f"owned by uid {info.st_uid}, not hmcd's uid {os.geteuid()}"
    if info.st_mode & 0o077:
        return f"mode {stat.S_IMODE(info.st_mode):04o} lets other users read or write it (must be 0600)"
    return ""


def _parse(data: object) -> tuple[int, list[Lease]]:
    if not isinstance(data, dict) or data.get("version") != _FORMAT_VERSION:
        raise ValueError(f"expected a version {_FORMAT_VERSION} object")
    epoch = data["epoch"]
    if type(epoch) is not int or epoch < 0:
        raise ValueError(f"epoch {epoch!r} is not a non-negative integer")
    leases = []
    for entry in data["leases"]:
        name, agent_id, pid, start_time = entry["name"], entry["agent_id"], entry["pid"], entry["start_time"]
        if not (isinstance(name, str) and name and isinstance(agent_id, str) and agent_id):
            raise ValueError(f"lease {entry!r} lacks a name or an agent id")
        if type(pid) is not int or pid <= 0 or type(start_time) is not int or start_time < 0:
            raise ValueError(f"lease {entry!r} has no valid pid and start time")
        leases.append(Lease(name, agent_id, ProcessIdentity(pid, start_time)))
    return epoch, leases


class ProcessWatch:
    """Calls `on_exit` on the running loop once `process` has exited (at once if it already has).

    Uses a pidfd (Linux 5.3+). Where pidfds are unavailable nothing is watched
    and the caller relies on its own checks and deadline.
    """

    def __init__(self, process: ProcessIdentity, on_exit: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_exit: Callable[[], None] | None = on_exit
        self._fd: int | None = None
        try:
            fd = os.pidfd_open(process.pid)
        except ProcessLookupError:
            self._loop.call_soon(self._fire)
            return
        except (OSError, AttributeError) as exc:
            log.debug("cannot watch process %d (%s); relying on the lease deadline", process.pid, exc)
            return
        if process_identity(process.pid) != process:  # exited (or the pid was reused) before the pidfd was made
            os.close(fd)
            self._loop.call_soon(self._fire)
            return
        self._fd = fd
        self._loop.add_reader(fd, self._fire)

    def _fire(self) -> None:
        on_exit = self._on_exit
        if on_exit is None:  # closed, or already fired
            return
        self.close()
        on_exit()

    def close(self) -> None:
        """Stop watching; idempotent."""
        self._on_exit = None
        if self._fd is not None:
            fd, self._fd = self._fd, None
            self._loop.remove_reader(fd)
            os.close(fd)
