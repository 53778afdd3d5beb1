"""Where the staged path's shared rings live, and which peers can share one.

A ring is a file the initiator creates (`ring_path`) and the owner maps (only files named like
`RING_NAME` in one of `ring_dirs`: `_staged_owner`): /dev/shm, else the temporary directory where
/dev/shm is too small (containers). Two agents share a ring when they run on one host (`same_host`,
by the host id `hmc.memory._machine.host_id` gives) and a ring can be made here.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
import uuid

from hmc.errors import UnsupportedError
from hmc.memory._machine import host_id
from hmc.v1 import common_pb2

__all__ = ["RING_NAME", "ring_dirs", "ring_path", "same_host"]

_SHM_DIR = "/dev/shm"
_PREFIX = "hmc-staged-"
RING_NAME = re.compile(r"hmc-staged-[0-9a-f]{32}")
"""The names ring files have (the owner maps no other file)."""


def ring_dirs() -> tuple[str, ...]:
    """Where rings may live: /dev/shm, else (a container's small /dev/shm) the temporary directory."""
    return (_SHM_DIR, tempfile.gettempdir())


def _ring_dir(size: int) -> str:
    """The first ring directory with room for `size` bytes (twice over: two agents may hold rings)."""
    for directory in ring_dirs():
        try:
            stat = os.statvfs(directory)
        except OSError:
            continue
        if os.access(directory, os.W_OK) and stat.f_bavail * stat.f_frsize >= 2 * size:
            return directory
    raise UnsupportedError(f"no room for a {size >> 20} MiB staging ring in {' or '.join(ring_dirs())}")


def _shm_available() -> bool:
    """Whether a ring directory exists here that this process may write."""
    return any(os.path.isdir(d) and os.access(d, os.W_OK) for d in ring_dirs())


@functools.cache
def _ring_host() -> str:
    """This host's id where a shared ring can be made here, else "" (asked once: every transfer checks it)."""
    return host_id() if _shm_available() else ""


def same_host(agent: common_pb2.AgentInfo) -> bool:
    """True when `agent` runs on this host and a shared ring can be made here."""
    return bool(agent.host_id) and agent.host_id == _ring_host()


def ring_path(size: int) -> str:
    """A new ring file's path, in the first ring directory with room for `size` bytes."""
    return os.path.join(_ring_dir(size), f"{_PREFIX}{uuid.uuid4().hex}")
