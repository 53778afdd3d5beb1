"""HMCConnector's worker half: registers the KV caches once and moves blocks as batched HMC transfers.

Push (default): the decode worker sends the prefill worker a `want` message naming its blocks;
the prefill worker writes its blocks straight into them, one agent.write per buffer pair with a
`kv` notification that arrives after the data. Pull: the decode worker reads the blocks itself and
sends `release`. Hmcd (KV-cache migration): the decode worker asks hmcd, through hmc.Client, for a
third-party transfer; hmcd instructs the agent that owns the blocks to write them here, with the
same `kv` notifications, and the decode worker sends `release`. Nothing here blocks the forward pass: all HMC work runs on the connector's own
thread ("hmc-connector"), which takes each step's metadata as soon as vLLM binds it, reacts to peer
messages as they arrive (a push starts when the `want` lands, not at the next engine step) and
leaves its results for `get_transfer_results`. That thread, and every thread the agent starts from
it, may run on any CPU: vLLM's CPU backend pins the worker's main thread to one core, where it
spins between steps, and HMC's threads pinned beside it starved for seconds.
Identity: every `want` names the digest of the decode request's prompt and every `kv` the digest of
the prompt the written blocks hold; the prefill worker refuses a want for another prompt and the
decode worker fails a load whose parts hold another prompt, so blocks are never cached under the
hashes of a prompt they do not hold.
Failures become data: a failed, refused or late load is reported in failed_recving and its blocks in
`block_ids_with_load_errors`, and the prefill instance is told at once (`release`); a prefill request
is held until it has served its `loads` decode loads, its lease expires, or it is released, and is
then reported finished so vLLM frees its blocks.
Deadlines (push): the want carries the decode side's budget, the seconds left to its deadline; the prefill
worker pushes only within that budget, counted from before the want arrived (and within the lease), and
never starts a want whose budget is spent. A push load that fails while a push may still be under way is
cancelled (`release` naming the decode request) and reported only after the budget, counted from the want's
acknowledgement, has run out or the prefill side answers `err`: vLLM never reuses blocks a push may reach.
Peers: `kv` and `err` count only from the agent that owns the load's peer buffers, and once a decode agent
has sent a `want` for a held request, only the agents that did may release it.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import hmc
from hmc.errors import HMCError, ProtocolError
from hmc_vllm.layout import KVLayout, block_ranges, describe, storages
from hmc_vllm.metadata import HMCConnectorMetadata, RecvTask, SendTask, WorkerHandshake, decode, encode
from hmc_vllm.stats import TransferRecorder

_log = logging.getLogger(__name__)

#: How long a `want` for a request this prefill worker does not hold waits for the scheduler's hold
#: (which follows within an engine step) before the decode side is told the blocks will not come.
UNKNOWN_WANT_S = 5.0


@dataclass
class _Load:
    """A load in flight on the decode side."""

    task: RecvTask
    started: float
    parts: int | None = None  # push: kv parts announced by the prefill side
    landed: set[int] = field(default_factory=set)
    handles: list[hmc.TransferHandle] = field(default_factory=list)  # pull reads, or the want message
    peer: WorkerHandshake | None = None
    senders: frozenset[str] = frozenset()  # agents owning the peer's buffers: the only ones whose kv and err count
    budget: float | None = None  # push: the seconds the want gave the prefill side to finish writing
    quiet: float | None = None  # push: time.monotonic() after which no push for it writes (set once the want is acknowledged)


@dataclass
class _Push:
    """A push in flight on the prefill side, for one decode request (`dreq`)."""

    request_id: str
    dreq: str
    handles: list[hmc.TransferHandle]
    started: float
    nbytes: int
    want: dict[str, Any]  # the decode side's request, to answer if the push fails


@dataclass(frozen=True)
class _Want:
    """Prefill side: a decode worker's `want` and the agent that sent it."""

    message: dict[str, Any]
    sender: str
    received: float  # time.monotonic()
    deadline: float | None  # time.monotonic() by which a push for it must have ended; None: the want named no budget


@dataclass
class _Held:
    """Prefill side: a request's blocks, held until `loads` decode loads are done, released or expired."""

    task: SendTask
    served: int = 0
    released: bool = False  # freed by a release of all: no more pushes start
    pushes: dict[str, _Push] = field(default_factory=dict)  # by decode request id
    wanters: set[str] = field(default_factory=set)  # agents that sent a want for it: once any has, only they may release it

    @property
    def done(self) -> bool:
        return (self.released or self.served >= self.task.loads) and not self.pushes


class HMCConnectorWorker:
    """One vLLM worker's agent, registered KV buffers, and the transfers in flight."""

    def __init__(self, engine_id: str, tp_rank: int, num_blocks: int, settings: Any) -> None:
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.num_blocks = num_blocks
        self.settings = settings
        self.agent: hmc.Agent | None = None
        self.buffers: list[hmc.ConnBuffer] = []
        self.kv_bytes: list[Any] = []  # the registered allocations as flat uint8 tensors, in buffer order
        self.layout: KVLayout | None = None
        self._handshake: WorkerHandshake | None = None
        self._held: dict[str, _Held] = {}  # prefill: blocks held for decode instances
        self._wanted: dict[str, list[_Want]] = {}  # prefill: wants that came before their SendTask
        self._loads: dict[str, _Load] = {}  # decode: by local request id
        self._ending: dict[str, _Load] = {}  # decode: failed push loads, not yet reported, whose blocks a push may still reach
        self._steps: queue.SimpleQueue[HMCConnectorMetadata] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the four result sets below, shared with the engine's thread
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._bad_blocks: set[int] = set()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._client: hmc.Client | None = None  # hmcd mode only
        self.stats = TransferRecorder()  # taken by vLLM every step (HMCConnector.get_kv_connector_stats)

    # -- once ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Start the connector thread, which registers the KV caches (once, never per request)."""
        ready: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(kv_caches, ready), name="hmc-connector", daemon=True)
        self._thread.start()
        try:
            error = ready.get(timeout=self.settings.message_timeout_s * 6)
        except queue.Empty:
            raise HMCError("HMCConnector: registering the KV caches did not finish in time") from None
        if error is not None:
            raise error

    def _run(self, kv_caches: Mapping[str, Any], ready: queue.SimpleQueue[BaseException | None]) -> None:
        _unpin()
        started = time.monotonic()
        try:
            self._register(kv_caches)
        except BaseException as exc:  # handed to the engine's thread, which raises it
            ready.put(exc)
            return
        ready.put(None)
        assert self.agent is not None
        since = started
        while not self._stop.is_set():
            asked = time.monotonic()
            try:
                self._turn(self.agent.notifications(timeout=self.settings.poll_s), since)
            except Exception:  # a bug here must not stop the thread that enforces every deadline
                _log.exception("HMCConnector: connector thread error (continuing)")
            since = asked  # the next batch was queued after this call drained the inbox

    def _turn(self, notes: list[hmc.Notification], since: float) -> None:
        """One round of the connector thread: new steps, peer messages, then handles and deadlines.

        `since` (time.monotonic()) precedes the arrival of every note: a want's budget counts from there.
        """
        while True:
            try:
                self._take(self._steps.get_nowait())
            except queue.Empty:
                break
        for note in notes:
            try:
                self._on_message(note.payload, note.sender_agent, since)
            except Exception:  # one malformed message must not drop the rest of the batch
                _log.exception("HMCConnector: ignored a notification it could not handle")
        self._poll_pushes()
        self._poll_loads()
        self._expire()

    def _register(self, kv_caches: Mapping[str, Any]) -> None:
        self.agent = hmc.Agent(hmc.Config.load())
        self.kv_bytes = storages(kv_caches)
        self.layout = describe(kv_caches, self.kv_bytes, self.num_blocks)
        self.buffers = [self.agent.register(b, name=f"vllm/{self.engine_id}/tp{self.tp_rank}/kv{i}") for i, b in enumerate(self.kv_bytes)]
        self._handshake = WorkerHandshake(tuple(b.descriptor.SerializeToString() for b in self.buffers), self.layout)
        _log.info(
            "HMCConnector: %d KV buffer(s), %d segments of %d B per block, %d blocks, agent %s",
            len(self.buffers), len(self.layout.segments), self.layout.block_bytes, self.num_blocks, self.agent.id,
        )

    def handshake(self) -> WorkerHandshake | None:
        return self._handshake

    # -- every step: start ---------------------------------------------------------------

    def submit(self, meta: HMCConnectorMetadata) -> None:
        """Hand this step's holds and loads to the connector thread (never waits)."""
        if meta.sends or meta.recvs or meta.releases:
            self._steps.put(meta)

    def _take(self, meta: HMCConnectorMetadata) -> None:
        """Start the step's holds, releases and loads; each one's failure stays its own."""
        for send in meta.sends:
            held = self._held[send.request_id] = _Held(send)
            for want in self._wanted.pop(send.request_id, []):
                self._push(held, want)
        for request_id in meta.releases:
            self._release(request_id, everything=True)
        for task in meta.recvs:
            self._start_load(task)

    def _peer(self, task: RecvTask) -> WorkerHandshake:
        wire = task.remote_workers.get(str(self.tp_rank))
        if wire is None:
            raise HMCError(f"the prefill instance has no worker of tensor-parallel rank {self.tp_rank}")
        return WorkerHandshake.from_wire(wire)

    def _start_load(self, task: RecvTask) -> None:
        load = _Load(task, time.monotonic())
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
            elif self.settings.mode == "pull":
                assert self.agent is not None and self.layout is not None
                for (src, dst), (r_off, l_off, lengths) in block_ranges(load.peer.layout, self.layout, task.remote_blocks, task.local_blocks).items():
                    load.handles.append(self.agent.read(self.buffers[dst], remote[src], r_off, l_off, lengths, timeout=self._remaining(task)))
            else:
                load.budget = self._remaining(task)
                load.handles.append(
                    self._message(
                        remote[0],
                        encode(
                            "want", req=task.remote_request_id, dreq=task.request_id, blocks=list(task.local_blocks), rblocks=list(task.remote_blocks),
                            prompt=task.prompt, peer=self._handshake.to_wire() if self._handshake else None, budget=load.budget,
                        ),
                    )
                )
        except Exception as exc:  # HMCError, or a peer handshake the offer's parse let through: this load only
            self._fail_load(task, f"{type(exc).__name__}: {exc}" if not isinstance(exc, HMCError) else str(exc))

    def _tell_release(self, task: RecvTask) -> None:
        """Tell the prefill instance that one load of its request (or, with release_all, all) will not come."""
        if not task.remote_workers:
            return
        try:
            remote = hmc.BufferDescriptor.FromString(self._peer(task).buffers[0])
            self._message(remote, encode("release", req=task.remote_request_id, all=task.release_all))
        except Exception as exc:  # HMCError, or an undecodable descriptor: the lease frees the blocks
            _log.warning("HMCConnector: release of request %s not delivered (its lease frees it): %s", task.remote_request_id, exc)

    def _migrate(self, load: _Load, remote: list[hmc.BufferDescriptor]) -> None:
        """Ask hmcd to have the prefill instance's agent write the blocks here (a third-party transfer)."""
        assert self.agent is not None and self.layout is not None and load.peer is not None
        if self._client is None:
            self._client = hmc.Client(config=self.agent.config)
        task = load.task
        groups = block_ranges(load.peer.layout, self.layout, task.remote_blocks, task.local_blocks)
        for i, ((src, dst), (s_off, d_off, lengths)) in enumerate(groups.items()):
            notify = encode("kv", dreq=task.request_id, part=i, parts=len(groups), prompt=task.prompt)
            self._client.submit(remote[src], self.buffers[dst].descriptor, s_off, d_off, lengths, notify=notify, timeout=self._remaining(task))

    def _remaining(self, task: RecvTask) -> float:
        return max(task.deadline - time.time(), 0.001)

    def _message(self, remote: hmc.BufferDescriptor, payload: bytes) -> hmc.TransferHandle:
        """A notification to the peer that owns `remote`, riding on an empty transfer."""
        assert self.agent is not None
        return self.agent.write(self.buffers[0], remote, [], [], [], notify=payload, timeout=self.settings.message_timeout_s)

    # -- prefill side -------------------------------------------------------------------------

    def _push(self, held: _Held, wanted: _Want) -> None:
        """Write the held blocks a `want` asked for into the decode worker's blocks (once per decode request)."""
        assert self.agent is not None and self.layout is not None
        send, want, dreq = held.task, wanted.message, str(wanted.message.get("dreq"))
        held.wanters.add(wanted.sender)
        if dreq in held.pushes:
            return
        try:
            if held.released or held.served >= send.loads:
                raise HMCError(f"request {send.request_id} served its {send.loads} load(s) or was released")
            if wanted.deadline is None:
                raise ProtocolError(f"the want for request {send.request_id} names no budget (a decode side older than this one)")
            if want.get("prompt") != send.prompt:
                raise HMCError(f"request {send.request_id} holds another prompt's KV (digest {send.prompt[:12]}, wanted {str(want.get('prompt'))[:12]})")
            peer = WorkerHandshake.from_wire(want.get("peer") or {})
            remote = [hmc.BufferDescriptor.FromString(b) for b in peer.buffers]
            rblocks = [int(b) for b in want.get("rblocks", ())]
            if not rblocks or rblocks != list(send.block_ids[-len(rblocks):]):  # in order: block i of the want is position i
                raise HMCError(f"blocks {rblocks} are not the last blocks held for request {send.request_id}, in order ({list(send.block_ids)})")
            self.before_push(send, rblocks)
            groups = block_ranges(self.layout, peer.layout, rblocks, [int(b) for b in want.get("blocks", ())])
            timeout = min(wanted.deadline - time.monotonic(), send.expiry - time.time())  # ends before the decode side gives up
            if timeout <= 0:
                raise HMCError(f"the want for request {send.request_id} came after the decode side's deadline or the lease")
            handles = [
                self.agent.write(
                    self.buffers[src], remote[dst], s_off, d_off, lengths,
                    notify=encode("kv", dreq=dreq, part=i, parts=len(groups), prompt=send.prompt), timeout=timeout,
                )
                for i, ((src, dst), (s_off, d_off, lengths)) in enumerate(groups.items())
            ]
        except Exception as exc:  # HMCError, or a malformed want: refused, this push only
            _log.error("HMCConnector: push of request %s failed: %s", send.request_id, exc)
            self.stats.failure("push")
            self._reply_error(want, str(exc))
            self._serve(held)
            return
        nbytes = sum(int(lengths.sum()) for _, _, lengths in groups.values())
        held.pushes[dreq] = _Push(send.request_id, dreq, handles, time.monotonic(), nbytes, want)

    def before_push(self, send: SendTask, block_ids: list[int]) -> None:
        """Hook run just before blocks are pushed (the tests' negative control corrupts them here)."""

    def _reply_error(self, want: Mapping[str, Any], reason: str) -> None:
        try:
            peer = WorkerHandshake.from_wire(want.get("peer") or {})
            self._message(hmc.BufferDescriptor.FromString(peer.buffers[0]), encode("err", dreq=want.get("dreq"), reason=reason))
        except Exception as exc:  # HMCError, or a want whose peer is not one
            _log.warning("HMCConnector: could not tell the decode instance: %s", exc)

    def _serve(self, held: _Held) -> None:
        """One of the held request's loads is over (pushed, failed, refused or released): free it when all are."""
        held.served += 1
        if held.done:
            self._finish_send(held.task.request_id)

    def _release(self, request_id: str, everything: bool) -> None:
        """A decode load of `request_id` will not come (or, `everything`, none will): free what is no longer needed."""
        held = self._held.get(request_id)
        if held is None:
            return
        if everything:
            held.released = True
            if held.done:
                self._finish_send(request_id)
        else:
            self._serve(held)

    def _cancel(self, request_id: str, dreq: str, sender: str) -> None:
        """The decode side gave up on `dreq`: stop its push, or refuse its parked want (the load was served or will be, once)."""
        held = self._held.get(request_id)
        push = held.pushes.get(dreq) if held is not None else None
        if push is not None:
            for handle in push.handles:  # _poll_pushes answers err once they end
                handle.cancel()
            return
        wants = self._wanted.get(request_id, [])
        for i, want in enumerate(wants):
            if want.sender == sender and str(want.message.get("dreq")) == dreq:
                wants[i] = replace(want, deadline=-math.inf)  # refused, and its load served, when the hold comes
                self._reply_error(want.message, f"the load of request {request_id} was cancelled")

    def _finish_send(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        with self._lock:
            self._finished_sending.add(request_id)

    # -- every step: collect ---------------------------------------------------------------

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last step; failed ⊆ finished_recving."""
        with self._lock:
            done = (self._finished_sending, self._finished_recving, self._failed_recving)
            self._finished_sending, self._finished_recving, self._failed_recving = set(), set(), set()
        return done

    def block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def _on_message(self, payload: bytes, sender: str, since: float) -> None:
        try:
            message = decode(payload)
        except HMCError as exc:
            _log.warning("HMCConnector: ignored a notification: %s", exc)
            return
        kind = message["t"]
        if kind == "want":
            req = str(message.get("req"))
            budget = message.get("budget")
            deadline = since + budget if isinstance(budget, (int, float)) and math.isfinite(budget) and budget >= 0 else None
            held, want = self._held.get(req), _Want(message, sender, time.monotonic(), deadline)
            if held is None:
                self._wanted.setdefault(req, []).append(want)
            else:
                self._push(held, want)
            return
        if kind == "release":
            held = self._held.get(str(message.get("req")))
            if held is not None and held.wanters and sender not in held.wanters:
                _log.warning("HMCConnector: ignored a release of request %s from agent %s, which sent no want for it", held.task.request_id, sender)
            elif "dreq" in message:
                self._cancel(str(message.get("req")), str(message["dreq"]), sender)
            else:
                self._release(str(message.get("req")), everything=message.get("all") is True)
            return
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
        if kind == "kv":
            if message.get("prompt") != load.task.prompt:
                self._fail_load(load.task, f"the blocks that landed hold another prompt's KV (digest {str(message.get('prompt'))[:12]}, this prompt {load.task.prompt[:12]})")
                return
            load.parts = int(message["parts"])
            load.landed.add(int(message["part"]))
        else:
            self._fail_load(load.task, f"the prefill instance refused: {message.get('reason')}", settled=True)

    def _poll_pushes(self) -> None:
        for held in list(self._held.values()):
            for push in list(held.pushes.values()):
                if not all(h.done() for h in push.handles):
                    continue
                failed = [h.error for h in push.handles if h.error is not None]
                if failed:
                    _log.error("HMCConnector: push of request %s to %s failed: %s", push.request_id, push.dreq, failed[0])
                    self.stats.failure("push")
                    self._reply_error(push.want, f"the push failed: {failed[0]}")  # the decode side fails now, not at its deadline
                else:
                    self.stats.record("push", push.nbytes, time.monotonic() - push.started)
                    _log.debug("HMCConnector: pushed request %s to %s in %.3f ms", push.request_id, push.dreq, 1e3 * (time.monotonic() - push.started))
                del held.pushes[push.dreq]
                self._serve(held)

    def _poll_loads(self) -> None:
        for request_id, load in list(self._loads.items()):
            self._acknowledged(load)
            if not all(h.done() for h in load.handles):
                continue
            failed = [h.error for h in load.handles if h.error is not None]
            if failed:  # push: the want never reached the prefill side, which pushes nothing
                self._fail_load(load.task, f"transfer failed: {failed[0]}", settled=True)
            elif self.settings.mode == "pull" or (load.parts is not None and len(load.landed) == load.parts):
                self._loads.pop(request_id)
                assert self.layout is not None
                self.stats.record("load", len(load.task.local_blocks) * len(self.layout.segments) * self.layout.block_bytes, time.monotonic() - load.started)
                with self._lock:
                    self._finished_recving.add(request_id)
                _log.info("HMCConnector: loaded request %s (%d blocks) in %.3f ms", request_id, len(load.task.local_blocks), 1e3 * (time.monotonic() - load.started))
                if self.settings.mode != "push" and load.peer is not None:
                    try:
                        self._message(hmc.BufferDescriptor.FromString(load.peer.buffers[0]), encode("release", req=load.task.remote_request_id))
                    except HMCError as exc:
                        _log.warning("HMCConnector: release of request %s not delivered (its lease frees it): %s", load.task.remote_request_id, exc)

    def _expire(self) -> None:
        now, mono = time.time(), time.monotonic()
        for request_id, held in list(self._held.items()):
            if held.task.expiry <= now and not held.pushes:
                _log.warning("HMCConnector: lease of request %s expired before a decode instance took its blocks; freeing them", request_id)
                self.stats.failure("push")
                self._finish_send(request_id)
        for req, wants in list(self._wanted.items()):
            if mono - wants[0].received > min(self.settings.lease_s, UNKNOWN_WANT_S):
                self._wanted.pop(req)
                for want in wants:
                    self._reply_error(want.message, f"request {req} is not held here (expired or unknown)")
        for load in list(self._loads.values()):
            if load.task.deadline <= now:
                self._fail_load(load.task, f"no KV after {self.settings.load_timeout_s:g}s")
        for load in list(self._ending.values()):
            self._acknowledged(load)
            if load.quiet is not None and load.quiet <= mono:
                self._report_failed(load.task)

    def _acknowledged(self, load: _Load) -> None:
        """Push: once the want is acknowledged, the prefill side got it no later than now, and its push ends `budget` after."""
        if load.quiet is None and load.budget is not None and load.handles and load.handles[0].done():
            load.quiet = time.monotonic() + load.budget if load.handles[0].error is None else time.monotonic()

    def _fail_load(self, task: RecvTask, reason: str, settled: bool = False) -> None:
        """Fail a load; a push that may still write (not `settled` by the prefill side) is cancelled and reported once it cannot."""
        load = self._loads.pop(task.request_id, None)
        _log.error("HMCConnector: loading request %s from engine %s failed: %s", task.request_id, task.remote_engine_id, reason)
        if load is None:  # a release (nothing parked), or reported already
            return
        if self.settings.mode != "push":  # a push's prefill side is told below, or knows already; a reader's does not
            for handle in load.handles:
                handle.cancel()
            self._tell_release(task)
        elif load.handles and load.budget is not None and not settled:  # vLLM may reuse the blocks once reported: not while a push may reach them
            self._ending[task.request_id] = load
            try:
                remote = hmc.BufferDescriptor.FromString(self._peer(task).buffers[0])
                self._message(remote, encode("release", req=task.remote_request_id, dreq=task.request_id))
            except Exception as exc:  # HMCError, or an undecodable descriptor: the push ends at its deadline anyway
                _log.warning("HMCConnector: cancel of request %s not delivered: %s", task.remote_request_id, exc)
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

    def close(self) -> None:
        """Stop the connector thread and close the agent (its buffers are withdrawn)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.settings.message_timeout_s)
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None


def _unpin() -> None:
    """Let the calling thread (and the threads it starts) run on every CPU this process may use."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError as exc:
        _log.debug("HMCConnector: connector thread keeps its CPU affinity: %s", exc)

