"""HMCConnector's prefill side: holds finished requests' blocks, checks what decode workers ask of them, pushes or grants.

A decode worker asks for a held request's blocks with a `want` (push mode: write them into mine) or a
`claim` (pull mode: may I read them). Both pass the same check (`admit`): the request is held here with
loads left and not released, the asker's prompt digest is the held request's, the blocks it names are
exactly the tail of the held block ids in order, its budget (the decode side's time left) names a time
not yet spent, and the buffers it names are the sender's own (a want or claim naming another agent's
buffers is dropped unanswered). A refusal answers `err` and spends one load.
Push: the blocks are written within the want's budget, counted from before the want arrived (and within the
lease), and never after it. Pull: a `grant` names the request, blocks and prompt it allows; the granted
read counts as in flight on the held request, which is then not freed (by its lease or a release of all)
until the claimer's `release` for that decode request or the claim's budget, counted from when the grant
is sent (no earlier than the decode side's reads can end), whichever comes first.
Once a decode agent has sent a want or claim for a held request, only the agents that did may release it.
Concurrency: everything here runs on the connector thread, which never writes to a peer itself: messages and
pushes go through the outbox (hmc_vllm.outbox); a push's writes are issued by its peer's sender, each with the
time left when it is issued, and a push whose time is spent by then fails and is answered `err`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import hmc
from hmc.errors import HMCError, ProtocolError
from hmc_vllm.layout import KVLayout, block_ranges
from hmc_vllm.metadata import SendTask, WorkerHandshake, encode
from hmc_vllm.outbox import Outgoing, peer_key
from hmc_vllm.parked import ParkedWants, Want
from hmc_vllm.side import WorkerSide

_log = logging.getLogger(__name__)

#: How long a `want` or `claim` for a request this prefill worker does not hold waits for the scheduler's hold
#: (which follows within an engine step) before the decode side is told the blocks will not come.
UNKNOWN_WANT_S = 5.0


@dataclass
class Push:
    """A push in flight for one decode request (`dreq`)."""

    request_id: str
    dreq: str
    sent: Outgoing  # its writes, issued by the decode agent's sender
    started: float
    nbytes: int
    want: dict[str, Any]  # the decode side's request, to answer if the push fails


@dataclass(frozen=True)
class Pull:
    """A granted read, for one decode request: the held blocks stay until its release or `until`."""

    claimer: str  # the agent that claimed it: the only one whose release ends it
    until: float  # time.monotonic() after which no read of it can still run


@dataclass
class Held:
    """A request's blocks, held until `loads` decode loads are done, released or expired."""

    task: SendTask
    served: int = 0
    released: bool = False  # freed by a release of all: no more pushes or grants start
    pushes: dict[str, Push] = field(default_factory=dict)  # by decode request id
    pulls: dict[str, Pull] = field(default_factory=dict)  # granted reads, by decode request id
    wanters: set[str] = field(default_factory=set)  # agents that sent a want or claim: once any has, only they may release it

    @property
    def done(self) -> bool:
        return (self.released or self.served >= self.task.loads) and not self.pushes and not self.pulls


@dataclass(frozen=True)
class Admitted:
    """A want or claim that passed `admit`: the decode worker's buffers, the held blocks it names, and their ranges."""

    remote: list[hmc.BufferDescriptor]
    rblocks: list[int]
    groups: dict[tuple[int, int], Any]


def admit(held: Held, wanted: Want, layout: KVLayout) -> Admitted:
    """Check a want or claim against the held request; HMCError or ProtocolError saying why it is refused."""
    send, message = held.task, wanted.message
    if held.released or held.served >= send.loads:
        raise HMCError(f"request {send.request_id} served its {send.loads} load(s) or was released")
    if wanted.deadline is None:
        raise ProtocolError(f"the {wanted.kind} for request {send.request_id} names no budget (a decode side older than this one)")
    if message.get("prompt") != send.prompt:
        raise HMCError(f"request {send.request_id} holds another prompt's KV (digest {send.prompt[:12]}, wanted {str(message.get('prompt'))[:12]})")
    peer = WorkerHandshake.from_wire(message.get("peer") or {})
    rblocks = [int(b) for b in message.get("rblocks", ())]
    if not rblocks or rblocks != list(send.block_ids[-len(rblocks):]):  # in order: block i of the request is position i
        raise HMCError(f"blocks {rblocks} are not the last blocks held for request {send.request_id}, in order ({list(send.block_ids)})")
    groups = block_ranges(layout, peer.layout, rblocks, [int(b) for b in message.get("blocks", ())])
    return Admitted([hmc.BufferDescriptor.FromString(b) for b in peer.buffers], rblocks, groups)


def time_left(held: Held, wanted: Want) -> float:
    """Seconds before the decode side's budget (counted from before the message arrived) or the lease ends; HMCError if none."""
    assert wanted.deadline is not None
    left = min(wanted.deadline - time.monotonic(), held.task.expiry - time.time())
    if left <= 0:
        raise HMCError(f"the {wanted.kind} for request {held.task.request_id} came after the decode side's deadline or the lease")
    return left


def sender_owns_peer(message: Mapping[str, Any], sender: str) -> bool:
    """Whether the buffers a want or claim names (where the answer goes) belong to the agent that sent it."""
    try:
        peer = WorkerHandshake.from_wire(message.get("peer") or {})
        return hmc.BufferDescriptor.FromString(peer.buffers[0]).owner.id == sender
    except Exception:  # a malformed peer: admit refuses it, and the answer goes nowhere
        return True


class PrefillSide(WorkerSide):
    """Blocks held for decode workers, and the pushes and grants that serve them."""

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self._held: dict[str, Held] = {}
        self._wanted = ParkedWants()  # wants and claims that came before their SendTask

    def _hold(self, send: SendTask) -> None:
        held = self._held[send.request_id] = Held(send)
        for want in self._wanted.take(send.request_id):
            self._answer(held, want)

    def _on_request(self, message: dict[str, Any], sender: str, since: float) -> None:
        """A `want` or `claim`; `since` (time.monotonic()) precedes its arrival: its budget counts from there."""
        req = str(message.get("req"))
        if not sender_owns_peer(message, sender):
            _log.warning("HMCConnector: ignored a %s for request %s from agent %s naming another agent's buffers", message["t"], req, sender)
            return
        budget = message.get("budget")
        deadline = since + budget if isinstance(budget, (int, float)) and math.isfinite(budget) and budget >= 0 else None
        held, want = self._held.get(req), Want(message, sender, time.monotonic(), deadline)
        if held is None:
            refused = self._wanted.park(req, want)
            if refused is not None and refused != "repeat":
                _log.warning("HMCConnector: refused a %s for request %s: %s", want.kind, req, refused)
                self._reply_error(message, refused)
        else:
            self._answer(held, want)

    def _answer(self, held: Held, wanted: Want) -> None:
        """Push or grant what a want or claim asks (once per decode request), or refuse it with `err`."""
        assert self.layout is not None
        dreq = str(wanted.message.get("dreq"))
        held.wanters.add(wanted.sender)
        if dreq in held.pushes or dreq in held.pulls:
            return
        try:
            admitted = admit(held, wanted, self.layout)
            if wanted.kind == "claim":
                self._grant(held, wanted, admitted)
            else:
                self._push(held, wanted, admitted)
        except Exception as exc:  # HMCError, or a malformed want or claim: refused, this load only
            _log.error("HMCConnector: %s of request %s refused or failed: %s", wanted.kind, held.task.request_id, exc)
            self.stats.failure("push")
            if not wanted.answered:
                self._reply_error(wanted.message, str(exc))
            self._serve(held)

    def _push(self, held: Held, wanted: Want, admitted: Admitted) -> None:
        """Write the held blocks into the decode worker's blocks, ending within its budget."""
        agent, buffers = self.agent, self.buffers
        assert agent is not None
        send, dreq = held.task, str(wanted.message.get("dreq"))
        self.before_push(send, admitted.rblocks)
        time_left(held, wanted)  # after the hook: a stalled thread must not start a late push
        groups, remote = admitted.groups, admitted.remote

        def write(out: Outgoing, issued: list[hmc.TransferHandle]) -> None:  # on the decode agent's sender
            for i, ((src, dst), (s_off, d_off, lengths)) in enumerate(groups.items()):
                if out.cancelled:
                    raise HMCError(f"the push of request {send.request_id} to {dreq} was cancelled")
                notify = encode("kv", dreq=dreq, part=i, parts=len(groups), prompt=send.prompt)
                issued.append(agent.write(buffers[src], remote[dst], s_off, d_off, lengths, notify=notify, timeout=time_left(held, wanted)))

        sent = self.outbox.post(peer_key(remote[0]), write, f"push of request {send.request_id} to {dreq}")
        nbytes = sum(int(lengths.sum()) for _, _, lengths in groups.values())
        held.pushes[dreq] = Push(send.request_id, dreq, sent, time.monotonic(), nbytes, wanted.message)

    def _grant(self, held: Held, wanted: Want, admitted: Admitted) -> None:
        """Let the claimer read the blocks it claimed, holding them for as long as its reads may run."""
        time_left(held, wanted)
        send, dreq = held.task, str(wanted.message.get("dreq"))
        until = time.monotonic() + float(wanted.message["budget"])  # its reads started after the claim was sent, and end within the budget
        grant = encode("grant", dreq=dreq, req=send.request_id, rblocks=admitted.rblocks, prompt=send.prompt)
        self._message(admitted.remote[0], grant, f"grant of request {send.request_id} to {dreq}")
        held.pulls[dreq] = Pull(wanted.sender, until)
        held.served += 1

    def before_push(self, send: SendTask, block_ids: list[int]) -> None:
        """Hook run just before blocks are pushed (the tests' negative control corrupts them here)."""

    def _reply_error(self, want: Mapping[str, Any], reason: str) -> None:
        try:
            peer = WorkerHandshake.from_wire(want.get("peer") or {})
            remote = hmc.BufferDescriptor.FromString(peer.buffers[0])
            self._message(remote, encode("err", dreq=want.get("dreq"), reason=reason), f"err for {want.get('dreq')} ({reason})")
        except Exception as exc:  # HMCError, or a want whose peer is not one
            _log.warning("HMCConnector: could not tell the decode instance: %s", exc)

    def _serve(self, held: Held) -> None:
        """One of the held request's loads is over (pushed, failed, refused or released): free it when all are."""
        held.served += 1
        if held.done:
            self._finish_send(held.task.request_id)

    def _on_release(self, message: Mapping[str, Any], sender: str) -> None:
        held = self._held.get(str(message.get("req")))
        if held is not None and held.wanters and sender not in held.wanters:
            _log.warning("HMCConnector: ignored a release of request %s from agent %s, which sent no want or claim for it", held.task.request_id, sender)
        elif "dreq" in message:
            self._cancel(str(message.get("req")), str(message["dreq"]), sender)
        else:
            self._release(str(message.get("req")), everything=message.get("all") is True)

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
        """Decode request `dreq` is over: stop its push, end its granted read, or refuse its parked want or claim.

        Its load was counted once already (by the push, the grant or the refusal), or will be, when the hold comes.
        """
        held = self._held.get(request_id)
        if held is not None and dreq in held.pushes:
            held.pushes[dreq].sent.cancel()  # _poll_pushes answers err once its writes end
            return
        if held is not None and dreq in held.pulls:
            if held.pulls[dreq].claimer != sender:
                _log.warning("HMCConnector: ignored a release of %s's read of request %s from agent %s, which did not claim it", dreq, request_id, sender)
                return
            del held.pulls[dreq]
            if held.done:
                self._finish_send(request_id)
            return
        want = self._wanted.cancel(request_id, sender, dreq)  # refused, and its load served, when the hold comes
        if want is not None:
            self._reply_error(want.message, f"the load of request {request_id} was cancelled")

    def _finish_send(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        with self._lock:
            self._finished_sending.add(request_id)

    def _poll_pushes(self) -> None:
        for held in list(self._held.values()):
            for push in list(held.pushes.values()):
                if not push.sent.done():
                    continue
                failed = push.sent.error
                if failed is not None:
                    _log.error("HMCConnector: push of request %s to %s failed: %s", push.request_id, push.dreq, failed)
                    self.stats.failure("push")
                    self._reply_error(push.want, f"the push failed: {failed}")  # the decode side fails now, not at its deadline
                else:
                    self.stats.record("push", push.nbytes, time.monotonic() - push.started)
                    _log.debug("HMCConnector: pushed request %s to %s in %.3f ms", push.request_id, push.dreq, 1e3 * (time.monotonic() - push.started))
                del held.pushes[push.dreq]
                self._serve(held)

    def _expire_held(self) -> None:
        """Free held requests whose lease ran out (once nothing is in flight), end spent grants, refuse stale parked wants."""
        now, mono = time.time(), time.monotonic()
        for request_id, held in list(self._held.items()):
            spent = [dreq for dreq, pull in held.pulls.items() if pull.until <= mono]
            for dreq in spent:
                del held.pulls[dreq]
            if spent and held.done:
                self._finish_send(request_id)
            elif held.task.expiry <= now and not held.pushes and not held.pulls:
                _log.warning("HMCConnector: lease of request %s expired before a decode instance took its blocks; freeing them", request_id)
                self.stats.failure("push")
                self._finish_send(request_id)
        for req, wants in self._wanted.stale(mono, min(self.settings.lease_s, UNKNOWN_WANT_S)):
            for want in wants:
                if not want.answered:
                    self._reply_error(want.message, f"request {req} is not held here (expired or unknown)")
