"""HMCConnector's decode side: loads a request's blocks from the prefill instance named in its offer.

Push: send the prefill worker a `want` naming this worker's blocks, and wait for its `kv` parts. Pull: send
a `claim` naming the same, and read the blocks only once the prefill worker answers `grant` for exactly this
request, these blocks and this prompt (the prefill side checks them: the offer's own digest proves
nothing), then send `release` naming the decode request. Hmcd: ask hmcd for a third-party transfer with the
same `kv` parts, then send `release`. Only the agents owning the load's peer buffers count: a `kv`, `err`
or `grant` from any other agent is dropped. A load fails at its deadline, at once on `err`, or when its
transfers fail; a push load that fails while a push may still be under way is cancelled (`release`
naming the decode request) and reported only once no push of it can write (`quiet`).
Concurrency: everything here runs on the connector thread, except the result sets (see hmc_vllm.side); its
messages go through the outbox (hmc_vllm.outbox), so a want or claim counts as sent once posted there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import hmc
from hmc.errors import HMCError
from hmc_vllm.layout import block_ranges
from hmc_vllm.metadata import RecvTask, WorkerHandshake, encode
from hmc_vllm.outbox import Outgoing
from hmc_vllm.side import WorkerSide

_log = logging.getLogger(__name__)


@dataclass
class Load:
    """A load in flight."""

    task: RecvTask
    started: float
    parts: int | None = None  # push: kv parts announced by the prefill side
    landed: set[int] = field(default_factory=set)
    handles: list[hmc.TransferHandle | Outgoing] = field(default_factory=list)  # the want or claim message, then (pull) the reads
    peer: WorkerHandshake | None = None
    senders: frozenset[str] = frozenset()  # agents owning the peer's buffers: the only ones whose kv, err and grant count
    budget: float | None = None  # push and pull: the seconds the want or claim gave the prefill side
    quiet: float | None = None  # push: time.monotonic() after which no push for it writes (set once the want is acknowledged)
    granted: bool = False  # pull: the prefill side granted the claim and the reads started


class DecodeSide(WorkerSide):
    """Loads in flight, and the failed push loads whose blocks a push may still reach."""

    tp_rank: int  # set by the worker: the prefill worker of the same rank is the peer

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self._loads: dict[str, Load] = {}  # by local request id
        self._ending: dict[str, Load] = {}  # failed push loads, not yet reported, whose blocks a push may still reach
        self._client: hmc.Client | None = None  # hmcd mode only

    def _peer(self, task: RecvTask) -> WorkerHandshake:
        wire = task.remote_workers.get(str(self.tp_rank))
        if wire is None:
            raise HMCError(f"the prefill instance has no worker of tensor-parallel rank {self.tp_rank}")
        return WorkerHandshake.from_wire(wire)

    def _remaining(self, task: RecvTask) -> float:
        return max(task.deadline - time.time(), 0.001)

    def _start_load(self, task: RecvTask) -> None:
        load = Load(task, time.monotonic())
        if task.local_blocks:
            self._loads[task.request_id] = load
        try:
            if task.refused or not task.local_blocks:
                self._tell_release(task)
                if task.refused:
                    raise HMCError(task.refused)
                return
            load.peer = self._peer(task)
            remote = [hmc.BufferDescriptor.FromString(b) for b in load.peer.buffers]
            load.senders = frozenset(r.owner.id for r in remote)
            if self.settings.mode == "hmcd":
                self._migrate(load, remote)
            else:
                load.budget = self._remaining(task)
                kind = "claim" if self.settings.mode == "pull" else "want"
                load.handles.append(
                    self._message(
                        remote[0],
                        encode(
                            kind, req=task.remote_request_id, dreq=task.request_id, blocks=list(task.local_blocks), rblocks=list(task.remote_blocks),
                            prompt=task.prompt, peer=self._handshake.to_wire() if self._handshake else None, budget=load.budget,
                        ),
                        f"{kind} for request {task.remote_request_id}",
                    )
                )
        except Exception as exc:  # HMCError, or a peer handshake the offer's parse let through: this load only
            self._fail_load(task, f"{type(exc).__name__}: {exc}" if not isinstance(exc, HMCError) else str(exc))

    def _start_reads(self, load: Load, grant: dict[str, Any]) -> None:
        """Pull: the prefill side granted the claim: read exactly what it granted, within the load's time."""
        assert self.agent is not None and self.layout is not None and load.peer is not None
        task = load.task
        try:
            granted = (grant.get("req"), grant.get("rblocks"), grant.get("prompt"))
            if granted != (task.remote_request_id, list(task.remote_blocks), task.prompt):
                raise HMCError(f"the prefill instance granted request {granted[0]}, blocks {granted[1]} (prompt {str(granted[2])[:12]}), not what this load reads")
            remote = [hmc.BufferDescriptor.FromString(b) for b in load.peer.buffers]
            load.granted, load.handles = True, []
            for (src, dst), (r_off, l_off, lengths) in block_ranges(load.peer.layout, self.layout, task.remote_blocks, task.local_blocks).items():
                load.handles.append(self.agent.read(self.buffers[dst], remote[src], r_off, l_off, lengths, timeout=self._remaining(task)))
        except Exception as exc:  # HMCError from the check or a read: this load only
            self._fail_load(task, str(exc))

    def _tell_release(self, task: RecvTask) -> None:
        """Tell the prefill instance that one load of its request (or, with release_all, all) will not come."""
        if not task.remote_workers:
            return
        try:
            remote = hmc.BufferDescriptor.FromString(self._peer(task).buffers[0])
            self._message(remote, encode("release", req=task.remote_request_id, all=task.release_all), f"release of request {task.remote_request_id}")
        except Exception as exc:  # HMCError, or an undecodable descriptor: the lease frees the blocks
            _log.warning("HMCConnector: release of request %s not delivered (its lease frees it): %s", task.remote_request_id, exc)

    def _tell_over(self, task: RecvTask) -> None:
        """Tell the prefill instance that decode request `task.request_id` is over: its push stops, its grant ends."""
        try:
            remote = hmc.BufferDescriptor.FromString(self._peer(task).buffers[0])
            self._message(remote, encode("release", req=task.remote_request_id, dreq=task.request_id), f"release of {task.request_id}'s load")
        except Exception as exc:  # HMCError, or an undecodable descriptor: the push or grant ends at its budget anyway
            _log.warning("HMCConnector: release of %s's load of request %s not delivered: %s", task.request_id, task.remote_request_id, exc)

    def _migrate(self, load: Load, remote: list[hmc.BufferDescriptor]) -> None:
        """Ask hmcd to have the prefill instance's agent write the blocks here (a third-party transfer)."""
        assert self.agent is not None and self.layout is not None and load.peer is not None
        if self._client is None:
            self._client = hmc.Client(config=self.agent.config)
        task = load.task
        groups = block_ranges(load.peer.layout, self.layout, task.remote_blocks, task.local_blocks)
        for i, ((src, dst), (s_off, d_off, lengths)) in enumerate(groups.items()):
            notify = encode("kv", dreq=task.request_id, part=i, parts=len(groups), prompt=task.prompt)
            self._client.submit(remote[src], self.buffers[dst].descriptor, s_off, d_off, lengths, notify=notify, timeout=self._remaining(task))

    def _on_answer(self, kind: str, message: dict[str, Any], sender: str) -> None:
        """A `kv`, `err` or `grant` for one of this worker's loads."""
        dreq = str(message.get("dreq"))
        load = self._loads.get(dreq) or self._ending.get(dreq)
        if load is None:
            return
        if sender not in load.senders:  # any agent holding a key of ours could send one: only the peer's count
            _log.warning("HMCConnector: ignored a %s for request %s from agent %s, not the prefill worker it loads from", kind, load.task.request_id, sender)
            return
        if dreq in self._ending:  # the prefill side answers nothing while a push of it is under way: none is now
            if kind == "err":
                self._report_failed(load.task)
            return
        pull = self.settings.mode == "pull"
        if kind == "err":
            self._fail_load(load.task, f"the prefill instance refused: {message.get('reason')}", settled=not load.granted)
        elif kind == "grant":
            if pull and not load.granted:
                self._start_reads(load, message)
        elif not pull:  # kv: pull loads land through their own reads
            if message.get("prompt") != load.task.prompt:
                self._fail_load(load.task, f"the blocks that landed hold another prompt's KV (digest {str(message.get('prompt'))[:12]}, this prompt {load.task.prompt[:12]})")
                return
            load.parts = int(message["parts"])
            load.landed.add(int(message["part"]))

    def _poll_loads(self) -> None:
        for request_id, load in list(self._loads.items()):
            self._acknowledged(load)
            if not all(h.done() for h in load.handles):
                continue
            failed = [h.error for h in load.handles if h.error is not None]
            if failed:  # the want or claim never reached the prefill side, which pushes or grants nothing; or a read failed
                self._fail_load(load.task, f"transfer failed: {failed[0]}", settled=not load.granted)
            elif load.granted or (load.parts is not None and len(load.landed) == load.parts):
                self._loads.pop(request_id)
                assert self.layout is not None
                self.stats.record("load", len(load.task.local_blocks) * len(self.layout.segments) * self.layout.block_bytes, time.monotonic() - load.started)
                with self._lock:
                    self._finished_recving.add(request_id)
                _log.info("HMCConnector: loaded request %s (%d blocks) in %.3f ms", request_id, len(load.task.local_blocks), 1e3 * (time.monotonic() - load.started))
                if load.granted:
                    self._tell_over(load.task)
                elif self.settings.mode == "hmcd" and load.peer is not None:
                    try:
                        remote = hmc.BufferDescriptor.FromString(load.peer.buffers[0])
                        self._message(remote, encode("release", req=load.task.remote_request_id), f"release of request {load.task.remote_request_id}")
                    except Exception as exc:  # an undecodable descriptor
                        _log.warning("HMCConnector: release of request %s not delivered (its lease frees it): %s", load.task.remote_request_id, exc)

    def _expire_loads(self) -> None:
        now, mono = time.time(), time.monotonic()
        for load in list(self._loads.values()):
            if load.task.deadline <= now:
                self._fail_load(load.task, f"no KV after {self.settings.load_timeout_s:g}s")
        for load in list(self._ending.values()):
            self._acknowledged(load)
            if load.quiet is not None and load.quiet <= mono:
                self._report_failed(load.task)

    def _acknowledged(self, load: Load) -> None:
        """Push: once the want is acknowledged, the prefill side got it no later than now, and its push ends `budget` after."""
        if self.settings.mode == "push" and load.quiet is None and load.budget is not None and load.handles and load.handles[0].done():
            load.quiet = time.monotonic() + load.budget if load.handles[0].error is None else time.monotonic()

    def _fail_load(self, task: RecvTask, reason: str, settled: bool = False) -> None:
        """Fail a load; the prefill side is told unless it `settled` it (refused it, or never got the request).

        A push that may still write is cancelled and reported once it cannot.
        """
        load = self._loads.pop(task.request_id, None)
        _log.error("HMCConnector: loading request %s from engine %s failed: %s", task.request_id, task.remote_engine_id, reason)
        if load is None:  # a release (nothing parked), or reported already
            return
        if self.settings.mode != "push":
            for handle in load.handles:  # pull: the reads, or the claim
                handle.cancel()
        if self.settings.mode == "hmcd":  # a third party writes: the prefill side does not know
            self._tell_release(task)
        elif load.handles and not settled:  # the want or claim reached, or may reach, the prefill side
            self._tell_over(task)  # its push stops, its grant ends, or it is refused when its hold comes
            if self.settings.mode == "push":  # vLLM may reuse the blocks once reported: not while a push may reach them
                self._ending[task.request_id] = load
                return
        self._report_failed(task)

    def _report_failed(self, task: RecvTask) -> None:
        """Hand the failed load and its blocks to vLLM, which may reuse them from now on."""
        self._ending.pop(task.request_id, None)
        self.stats.failure("load")
        with self._lock:
            self._finished_recving.add(task.request_id)
            self._failed_recving.add(task.request_id)
            self._bad_blocks.update(task.local_blocks)
