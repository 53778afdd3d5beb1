"""Remote buffers an agent was told are withdrawn, so that their descriptors are refused here, typed, before a path runs.

A buffer is withdrawn by its owner (for good: BufferWithdrawnError), or at an epoch of its node's registry (its hmcd
started again, or its node left the directory): a descriptor of that epoch or an earlier one is refused, and once
the buffer is registered again at a later epoch, a descriptor of an epoch before that is stale
(StaleDescriptorError). hmcd relays every withdrawal of the cluster, so the record is bounded: the entries of the
`remember` buffers withdrawn longest ago are forgotten. A descriptor of a forgotten one is then refused by its
owner instead (its buffer table, and the epoch in its key proof), or its owner is gone: the same typed errors,
after a round trip rather than before it.

Concurrency: any thread; one lock.
"""

from __future__ import annotations

import collections
import threading

from hmc.errors import BufferWithdrawnError, StaleDescriptorError
from hmc.v1 import common_pb2

__all__ = ["RemoteWithdrawals"]

_FOREVER = 1 << 63
"""The epoch of a withdrawal by the buffer's owner: every descriptor of it is refused."""
_REMEMBER = 1 << 16
"""Withdrawn remote buffers remembered (about 10 MiB at most)."""


class RemoteWithdrawals:
    """Per remote buffer id: the newest registry epoch it was withdrawn at (`_FOREVER`: by its owner), and the epoch it
    was registered again at since (0: not); the `remember` most recent only."""

    def __init__(self, remember: int = _REMEMBER) -> None:
        self._lock = threading.Lock()  # guards _entries
        self._entries: collections.OrderedDict[str, tuple[int, int]] = collections.OrderedDict()
        self._remember = remember

    def check(self, descriptor: common_pb2.BufferDescriptor) -> None:
        """Refuse `descriptor` (typed) if it names a buffer withdrawn at its epoch or for good, or is stale."""
        with self._lock:
            withdrawn, back_at = self._entries.get(descriptor.id, (-1, 0))
        epoch = descriptor.registry_epoch
        if withdrawn == _FOREVER:
            raise BufferWithdrawnError(f"buffer {descriptor.id} was withdrawn by its owner")
        if 0 < epoch < back_at:
            raise StaleDescriptorError(
                f"stale descriptor: buffer {descriptor.id} was served by registry epoch {epoch} of node {descriptor.owner.node!r}, "
                f"and is registered again at epoch {back_at}: look it up again"
            )
        if (epoch and epoch <= withdrawn) or (not epoch and withdrawn >= 0 and not back_at):  # epoch 0: no hmcd served it
            raise BufferWithdrawnError(f"buffer {descriptor.id} left the directory with its node (it may come back: look it up again)")

    def withdrawn(self, buffer_id: str, epoch: int = 0) -> None:
        """The buffer was withdrawn: by its owner (epoch 0: for good), or at `epoch` of its node's registry."""
        with self._lock:
            withdrawn, back_at = self._entries.pop(buffer_id, (-1, 0))
            self._entries[buffer_id] = (max(epoch or _FOREVER, withdrawn), back_at)
            while len(self._entries) > self._remember:
                self._entries.popitem(last=False)

    def added(self, buffer_id: str, epoch: int) -> None:
        """The buffer is registered again at `epoch`: that epoch is good again, older ones stay refused; one its
        owner withdrew for good stays withdrawn."""
        with self._lock:
            entry = self._entries.get(buffer_id)
            if entry is not None and entry[0] != _FOREVER and epoch > 0:
                self._entries[buffer_id] = (min(entry[0], epoch - 1), max(entry[1], epoch))
