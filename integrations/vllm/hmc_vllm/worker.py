"""HMCConnector's worker half: registers the KV caches once and moves blocks as batched HMC transfers.

The worker is both sides at once (a `kv_both` instance prefills and decodes): hmc_vllm.prefill holds
finished requests' blocks and answers decode workers' `want` (push: it writes the blocks) and `claim`
(pull: it checks and grants a read); hmc_vllm.decode starts loads and takes the `kv`, `err` and `grant`
answers. Push (default): the prefill worker writes its blocks straight into the decode worker's, one
agent.write per buffer pair with a `kv` notification that arrives after the data. Pull: the decode
worker claims the blocks, reads them once granted, and sends `release`. Hmcd (KV-cache migration): the
decode worker asks hmcd, through hmc.Client, for a third-party transfer; hmcd instructs the agent that
owns the blocks to write them here, with the same `kv` notifications, and the decode worker sends `release`.
Identity: every want and claim names the digest of the decode request's prompt, checked by the prefill
worker against the request it holds (with the blocks, which must be the held ones in order); every `kv`
and `grant` names the digest of the prompt the blocks hold, checked by the decode worker: blocks are
never cached under the hashes of a prompt they do not hold.
Failures become data: a failed, refused or late load is reported in failed_recving and its blocks in
`block_ids_with_load_errors`, and the prefill instance is told at once (`release`); a prefill request
is held until it has served its `loads` decode loads, its lease expires, or it is released, and is
then reported finished so vLLM frees its blocks (never while a push or a granted read of it may run).
Concurrency: nothing here blocks the forward pass: all HMC work runs on the connector's own thread
("hmc-connector"), which takes each step's metadata as soon as vLLM binds it, reacts to peer messages
as they arrive (a push starts when the `want` lands, not at the next engine step) and leaves its
results for `get_transfer_results`. It never writes to a peer itself (a write to a new peer blocks until the
peer answers): every message and push goes through a sender per peer agent (hmc_vllm.outbox). That thread, and every thread the agent starts from it, may run on
any CPU: vLLM's CPU backend pins the worker's main thread to one core, where it spins between steps,
and HMC's threads pinned beside it starved for seconds.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import hmc
from hmc.errors import HMCError
from hmc_vllm.decode import DecodeSide
from hmc_vllm.layout import describe, storages
from hmc_vllm.metadata import HMCConnectorMetadata, WorkerHandshake, decode
from hmc_vllm.prefill import PrefillSide

_log = logging.getLogger(__name__)


class HMCConnectorWorker(PrefillSide, DecodeSide):
    """One vLLM worker's agent, registered KV buffers, and the transfers in flight."""

    def __init__(self, engine_id: str, tp_rank: int, num_blocks: int, settings: Any) -> None:
        super().__init__(settings)
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.num_blocks = num_blocks
        self.kv_bytes: list[Any] = []  # the registered allocations as flat uint8 tensors, in buffer order
        self._steps: queue.SimpleQueue[HMCConnectorMetadata] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

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

        `since` (time.monotonic()) precedes the arrival of every note: a want's or claim's budget counts from there.
        """
        self.outbox.settle()
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
        self._expire_held()
        self._expire_loads()

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
            self._hold(send)
        for request_id in meta.releases:
            self._release(request_id, everything=True)
        for task in meta.recvs:
            self._start_load(task)

    def _on_message(self, payload: bytes, sender: str, since: float) -> None:
        try:
            message = decode(payload)
        except HMCError as exc:
            _log.warning("HMCConnector: ignored a notification: %s", exc)
            return
        kind = message["t"]
        if kind in ("want", "claim"):
            self._on_request(message, sender, since)
        elif kind == "release":
            self._on_release(message, sender)
        else:
            self._on_answer(kind, message, sender)

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

    def close(self) -> None:
        """Stop the connector thread and close the agent (its buffers are withdrawn)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.settings.message_timeout_s)
        self.outbox.close(timeout=self.settings.message_timeout_s)  # a sender ends once its write returns
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
