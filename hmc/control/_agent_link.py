"""The agent's end of `RegistryService.Attach`: one long-lived stream to the local hmcd, kept attached.

The stream opens with a hello (protocol version 1, the agent's AgentInfo).
Over it the agent registers and unregisters buffers (each acknowledged),
receives transfer instructions, cancellations and events, and reports transfer
outcomes. `close()` ends it cleanly: hmcd withdraws the agent's buffers at once.

The link outlives hmcd. When the stream breaks for any other reason (hmcd
killed, restarted, stopped) the link re-attaches: it retries with exponential
backoff (50 ms doubling to 0.5 s, each wait drawn between half and all of it: a failed
connect to a unix socket costs microseconds, and a restarted hmcd has its agents back within that),
sends the hello again with the same agent id, and registers again every buffer
it holds, under the same id and name, before any newer request. While hmcd is
down:

- `register()` succeeds locally; the buffer is published when the link is
  attached again (a name hmcd then refuses is logged, and the buffer stays
  usable by descriptor);
- `unregister()` succeeds locally (hmcd forgets the buffer with the old stream);
- `lookup()` raises UnavailableError at once, saying hmcd is down and the link
  is reconnecting;
- `report()` drops the report with a log line (hmcd failed that transfer when
  the stream broke);
- `measured()` keeps the measurement (the latest per pair and kinds of memory,
  at most `MEASURED_KEPT`), sent with every attach to an hmcd that takes them
  (its hello says so: an hmcd of an older release would end the stream).

Only the first attach, in the constructor, fails outright (UnavailableError,
BusyResourceError, VersionMismatchError): an agent that never attached runs
embedded. Transfers between agents never use the link.

Concurrency: one sync gRPC channel per attach attempt. Requests go through a
queue that gRPC's own thread drains (the request iterator). The named daemon
thread "hmc-daemon-link" consumes hmcd's messages, resolves acks, hands
instructions and cancellations to their callbacks (which must not block), and
sleeps out the backoff (woken by `close()`). Events and the link's own losses
and re-attaches go to their callbacks on a second named thread,
"hmc-daemon-events", so a slow handler never delays an acknowledgement.
`_lock` guards the pending-ack table, the request counter, the published
buffers, the measurements, the current stream (queue, call, channel, stub) and the link's state;
every public method is safe from any thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import logging
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from hmc.config import Config
from hmc.control._auth import CHANNEL_OPTIONS, check_socket_dir
from hmc.control._errors import error_from_proto, error_to_proto, rpc_errors, translate_rpc_error
from hmc.errors import ArgumentError, BrokenResourceError, ClosedResourceError, HMCError, TimeoutError, UnavailableError, UnknownBufferError
from hmc.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

__all__ = ["DaemonLink", "hmcd_clock_ahead"]

log = logging.getLogger("hmc.agent.link")

PROTOCOL_VERSION = common_pb2.PROTOCOL_VERSION_1
RETRY_MIN_S = 0.05
RETRY_MAX_S = 0.5
MEASURED_KEPT = 256
"""Measurements a link keeps to send again (the oldest goes first); hmcd keeps as many per agent."""

Message = daemon_pb2.AgentMessage


class _Stream:
    """One attach attempt: its channel, request queue and call."""

    def __init__(self, address: str, hello: Message) -> None:
        check_socket_dir(address.removeprefix("unix:"))  # never hand keys to an hmcd in someone else's directory
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.registry = daemon_pb2_grpc.RegistryServiceStub(self.channel)
        # Messages to hmcd; drained by gRPC's request thread through _outgoing(); None ends the stream.
        self.requests: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self.started = time.monotonic()
        """This process's clock before the hello left: one end of the round trip that bounds hmcd's clock."""
        self.requests.put(hello)
        self.call = self.registry.Attach(self._outgoing())

    def _outgoing(self) -> Iterator[Message]:
        while (message := self.requests.get()) is not None:
            yield message

    def end(self) -> None:
        """Half-close (hmcd sees EOF: a clean close)."""
        self.requests.put(None)

    def abort(self) -> None:
        self.requests.put(None)
        self.call.cancel()
        self.channel.close()


class DaemonLink:
    """An agent's registration stream to hmcd at `unix:<config.socket>`, re-attached whenever it breaks."""

    def __init__(
        self,
        config: Config,
        agent_info: common_pb2.AgentInfo,
        on_instruction: Callable[[daemon_pb2.TransferInstruction], None],
        on_event: Callable[[daemon_pb2.Event], None] | None = None,
        *,
        on_cancel: Callable[[str], None] | None = None,
        on_lost: Callable[[HMCError], None] | None = None,
        on_attached: Callable[[daemon_pb2.DaemonHello], None] | None = None,
        on_down: Callable[[HMCError], None] | None = None,
    ) -> None:
        """Connect and attach; UnavailableError when no hmcd answers within `config.timeout_s`.

        Callbacks: `on_instruction`/`on_cancel`, and `on_down` (the stream broke: before any instruction of the
        stream attached next), on the link's thread (must not block);
        `on_event` (hmcd's events), `on_lost` (the stream broke; re-attaching) and
        `on_attached` (attached again, buffers being registered again) on "hmc-daemon-events".
        """
        self.address = f"unix:{config.socket}"
        self._timeout = config.timeout_s
        self._agent_id = agent_info.id
        self._agent_info = agent_info
        self._on_instruction = on_instruction
        self._on_event = on_event
        self._on_cancel = on_cancel
        self._on_lost = on_lost
        self._on_attached = on_attached
        self._on_down = on_down
        self._lock = threading.Lock()  # guards everything listed in the module's concurrency note
        self._pending: dict[int, concurrent.futures.Future[daemon_pb2.Ack]] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._down: HMCError | None = None
        self._down_since = 0.0
        self._published: dict[str, common_pb2.BufferDescriptor] = {}
        """Every buffer registered through this link and not unregistered: what a re-attach registers again."""
        self._refused: set[str] = set()
        """Ids hmcd refused to take back on the latest re-attach (held locally, unknown to hmcd)."""
        self._measured: dict[tuple[str, str, int, int], common_pb2.PathMeasurement] = {}
        """What this agent's paths measured (`measured()`): sent again with every attach."""
        self._takes_measurements = False
        """Whether the hmcd attached to last takes PathMeasurement messages."""
        self._ahead_s = 0.0
        """How far the clock of the hmcd attached to last may be ahead of ours (`hmcd_clock_ahead`); read by the
        link's thread alone."""
        self._wake = threading.Event()  # set by close(): ends the backoff wait
        self._hello: concurrent.futures.Future[daemon_pb2.DaemonHello] = concurrent.futures.Future()
        # Callbacks for "hmc-daemon-events"; None ends that thread.
        self._callbacks: queue.SimpleQueue[tuple[Callable[[Any], None], Any] | None] = queue.SimpleQueue()
        self._stream = _Stream(self.address, self._greeting())
        self._thread = threading.Thread(target=self._run, name="hmc-daemon-link", daemon=True)
        self._events_thread = threading.Thread(target=self._run_callbacks, name="hmc-daemon-events", daemon=True)
        self._thread.start()
        self._events_thread.start()
        try:
            hello = self._hello.result(timeout=self._timeout)
        except concurrent.futures.TimeoutError:
            self.close()
            raise UnavailableError(f"hmcd at {self.address} did not answer the agent hello within {self._timeout:g}s") from None
        except BaseException:
            self.close()
            raise
        self.node: str = hello.node
        self.host_id: str = hello.host_id
        self.registry_epoch: int = hello.registry_epoch
        with self._lock:
            self._takes_measurements = hello.takes_measurements
        self.past_epochs: frozenset[int] = frozenset()
        """Earlier epochs of hmcd's registry this link was attached under (the last 16)."""

    def _greeting(self) -> Message:
        """A new stream's hello, naming the buffers this link holds: it registers them again once hmcd answers, and
        hmcd frees whatever else it kept reserved for this agent."""
        with self._lock:
            names = sorted({descriptor.name for descriptor in self._published.values() if descriptor.name})
        held = daemon_pb2.HeldNames(names=names)
        return Message(hello=daemon_pb2.AgentHello(protocol_version=PROTOCOL_VERSION, agent=self._agent_info, reads_daemon_clock=True, held=held))

    # -- requests ---------------------------------------------------------------------

    def register(self, descriptor: common_pb2.BufferDescriptor) -> None:
        """Publish a ConnBuffer; raises hmcd's typed refusal (ArgumentError, BusyResourceError, ...).

        While hmcd is down the buffer is kept and published on re-attach.
        """
        with self._lock:
            self._check_open()
            if descriptor.id in self._published:
                raise ArgumentError(f"buffer id {descriptor.id!r} is already registered through this link")
            self._published[descriptor.id] = descriptor
            if self._down is not None:
                log.info("hmcd is down: buffer %s is registered here and will be published when the link attaches again", descriptor.id)
                return
            future, request_id = self._expect()
            self._stream.requests.put(Message(register=daemon_pb2.RegisterBuffer(request_id=request_id, descriptor=descriptor)))
        try:
            self._acknowledged(future, request_id)
        except HMCError as exc:
            with self._lock:
                if self._published.get(descriptor.id) is descriptor:
                    del self._published[descriptor.id]
                if isinstance(exc, TimeoutError) and not self._closed and self._down is None:
                    # The register is still queued (or being served) on the stream: withdraw it behind it, or a stalled
                    # hmcd would serve a buffer this agent was told it failed to register. Its ack is not waited for.
                    self._stream.requests.put(Message(unregister=daemon_pb2.UnregisterBuffer(request_id=self._expect()[1], buffer_id=descriptor.id)))
            raise

    def unregister(self, buffer_id: str) -> None:
        """Withdraw a ConnBuffer this agent registered (locally while hmcd is down)."""
        with self._lock:
            self._check_open()
            known = self._published.pop(buffer_id, None) is not None
            refused = buffer_id in self._refused
            self._refused.discard(buffer_id)
            if self._down is not None or refused:
                if not known:
                    raise UnknownBufferError(f"no buffer {buffer_id!r} was registered through this link")
                return
            future, request_id = self._expect()
            self._stream.requests.put(Message(unregister=daemon_pb2.UnregisterBuffer(request_id=request_id, buffer_id=buffer_id)))
        self._acknowledged(future, request_id)

    def report(self, report: daemon_pb2.TransferReport) -> None:
        """Tell hmcd how an instructed transfer went (no acknowledgement; dropped while hmcd is down)."""
        with self._lock:
            self._check_open()
            if self._down is None:
                self._stream.requests.put(Message(report=report))
                return
        log.info("hmcd is down: dropped the report of transfer %s (hmcd failed it when the stream broke)", report.transfer_id)

    def measured(self, measured: common_pb2.PathMeasurement) -> None:
        """Tell hmcd what a path measured between this agent and another (kept, and sent again with every attach;
        not sent to an hmcd that does not take them, nor while hmcd is down; nothing once the link is closed)."""
        key = (measured.path, measured.owner_agent, measured.local_kind, measured.remote_kind)
        with self._lock:
            if self._closed:
                return
            self._measured.pop(key, None)
            while len(self._measured) >= MEASURED_KEPT:
                del self._measured[next(iter(self._measured))]
            self._measured[key] = measured
            if self._down is None and self._takes_measurements:
                self._stream.requests.put(Message(measured=measured))

    def lookup(self, ref: str) -> common_pb2.BufferDescriptor:
        """A ConnBuffer's descriptor by id, else by name, here or at hmcd's peers (UnavailableError while hmcd is down)."""
        try:
            return self._lookup(daemon_pb2.BufferRef(id=ref))
        except UnknownBufferError as by_id:
            if by_id.code != UnknownBufferError.code:  # withdrawn: the id was known
                raise
        except UnavailableError:  # a silent peer might hold that id; the name may still be found
            pass
        return self._lookup(daemon_pb2.BufferRef(name=ref))

    def _lookup(self, ref: daemon_pb2.BufferRef) -> common_pb2.BufferDescriptor:
        with self._lock:
            self._check_open()
            if self._down is not None:
                raise UnavailableError(
                    f"hmcd at {self.address} is down ({self._down}); the link has been reconnecting for {time.monotonic() - self._down_since:.1f}s"
                )
            registry = self._stream.registry
        with rpc_errors(self.address):
            return registry.LookupBuffer(daemon_pb2.LookupBufferRequest(ref=ref), timeout=self._timeout)

    def _expect(self) -> tuple[concurrent.futures.Future[daemon_pb2.Ack], int]:
        """A pending acknowledgement (call with `_lock` held)."""
        future: concurrent.futures.Future[daemon_pb2.Ack] = concurrent.futures.Future()
        request_id = next(self._ids)
        self._pending[request_id] = future
        return future, request_id

    def _acknowledged(self, future: concurrent.futures.Future[daemon_pb2.Ack], request_id: int) -> None:
        try:
            ack = future.result(timeout=self._timeout)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._pending.pop(request_id, None)
            raise TimeoutError(f"hmcd at {self.address} did not acknowledge within {self._timeout:g}s") from None
        error = error_from_proto(ack.error)
        if error is not None:
            raise error

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError("the link to hmcd is closed")

    # -- the link's thread ("hmc-daemon-link") ---------------------------------------------

    def _run(self) -> None:
        stream = self._stream
        delay = RETRY_MIN_S
        while True:
            attached, error = self._consume(stream)
            stream.abort()
            if not self._hello.done():  # the first attach failed: the constructor raises it
                self._hello.set_exception(error)
                self._fail_pending(error)
                return
            if not self._went_down(error):
                return
            if attached:
                delay = RETRY_MIN_S
            while True:
                if self._wake.wait(random.uniform(delay / 2, delay)):
                    return
                delay = min(delay * 2, RETRY_MAX_S)
                try:
                    stream = _Stream(self.address, self._greeting())
                except Exception as exc:  # noqa: BLE001 - e.g. a socket path gRPC refuses; keep trying
                    log.warning("cannot reach hmcd at %s: %s", self.address, exc)
                    continue
                with self._lock:
                    if self._closed:
                        stream.abort()
                        return
                    self._stream = stream
                break

    def _consume(self, stream: _Stream) -> tuple[bool, HMCError]:
        """Dispatch hmcd's messages until the stream ends: (whether hmcd said hello, why it ended)."""
        attached = False
        try:
            for message in stream.call:
                if message.WhichOneof("kind") == "hello":
                    attached = True
                    self._ahead_s = hmcd_clock_ahead(stream.started, time.monotonic(), message.hello.monotonic_s)
                self._dispatch(message)
            return attached, BrokenResourceError(f"hmcd at {self.address} ended the agent stream")
        except grpc.RpcError as exc:
            return attached, translate_rpc_error(exc, self.address)
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave waiters hanging
            log.exception("agent link thread failed")
            return attached, BrokenResourceError(f"agent link failed: {exc}")

    def _dispatch(self, message: daemon_pb2.DaemonMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "hello":
            if not self._hello.done():
                self._hello.set_result(message.hello)
            else:
                self._attached_again(message.hello)
        elif kind == "ack":
            with self._lock:
                future = self._pending.pop(message.ack.request_id, None)
            if future is not None:
                future.set_result(message.ack)
        elif kind == "instruction":
            self._instruct(message.instruction)
        elif kind == "event":
            self._schedule(self._on_event, message.event)
        elif kind == "cancel":
            if self._on_cancel is not None:
                self._guard(self._on_cancel, message.cancel.transfer_id)

    def _attached_again(self, hello: daemon_pb2.DaemonHello) -> None:
        """hmcd answered a re-attach: register every held buffer again, ahead of any newer request."""
        with self._lock:
            if self._closed:
                return
            self._refused.clear()
            for descriptor in self._published.values():
                future, request_id = self._expect()
                future.add_done_callback(functools.partial(self._registered_again, descriptor))
                self._stream.requests.put(Message(register=daemon_pb2.RegisterBuffer(request_id=request_id, descriptor=descriptor, again=True)))
            count = len(self._published)
            self._takes_measurements = hello.takes_measurements
            if hello.takes_measurements:
                for measured in self._measured.values():
                    self._stream.requests.put(Message(measured=measured))
            down_for = time.monotonic() - self._down_since
            self._down = None
            if hello.registry_epoch != self.registry_epoch:
                self.past_epochs = frozenset(sorted(self.past_epochs | {self.registry_epoch})[-16:])
            self.node, self.host_id, self.registry_epoch = hello.node, hello.host_id, hello.registry_epoch
        log.warning("attached to hmcd at %s again after %.1fs (registry epoch %d); registering %d buffer(s) again", self.address, down_for, hello.registry_epoch, count)
        self._schedule(self._on_attached, hello)

    def _registered_again(self, descriptor: common_pb2.BufferDescriptor, future: concurrent.futures.Future[daemon_pb2.Ack]) -> None:
        if future.exception() is not None:
            return
        error = error_from_proto(future.result().error)
        if error is None:
            return
        with self._lock:
            if descriptor.id in self._published:
                self._refused.add(descriptor.id)
        log.warning("hmcd refused buffer %s%s on re-attach: %s; it stays usable by descriptor", descriptor.id, f" ({descriptor.name!r})" if descriptor.name else "", error)

    def _instruct(self, instruction: daemon_pb2.TransferInstruction) -> None:
        if instruction.deadline_monotonic_s:  # hmcd's clock -> ours, never later than hmcd's deadline
            instruction.deadline_monotonic_s = max(instruction.deadline_monotonic_s - self._ahead_s, 1e-9)
        try:
            self._on_instruction(instruction)
        except Exception as exc:  # noqa: BLE001 - reported as the transfer's failure
            log.warning("agent refused transfer %s: %s", instruction.transfer_id, exc)
            failed = daemon_pb2.TransferReport(transfer_id=instruction.transfer_id, state=common_pb2.TRANSFER_STATE_FAILED, error=error_to_proto(exc))
            with contextlib.suppress(ClosedResourceError):
                self.report(failed)

    def _went_down(self, error: HMCError) -> bool:
        """The stream ended: settle the pending acks; False when the link is closing (no re-attach)."""
        with self._lock:
            closing = self._closed
            pending, self._pending = self._pending, {}
            was_up, previous = self._down is None, self._down
            if not closing:
                self._down = error
                if was_up:
                    self._down_since = time.monotonic()
        if closing:
            self._fail_pending(ClosedResourceError("the link to hmcd was closed"), pending)
            return False
        for future in pending.values():
            future.set_result(daemon_pb2.Ack())  # done here; hmcd learns it on re-attach
        if was_up:
            log.warning("link to hmcd at %s lost: %s; re-attaching", self.address, error)
            if self._on_down is not None:
                self._guard(self._on_down, error)
            self._schedule(self._on_lost, error)
        elif str(error) != str(previous):  # a new reason (e.g. hmcd is back but refuses): worth a warning once
            log.warning("re-attaching to hmcd at %s failed: %s; still trying", self.address, error)
        else:
            log.debug("re-attaching to hmcd at %s failed again: %s", self.address, error)
        return True

    def _fail_pending(self, error: HMCError, pending: dict[int, concurrent.futures.Future[daemon_pb2.Ack]] | None = None) -> None:
        if pending is None:
            with self._lock:
                pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(error)

    # -- callbacks ("hmc-daemon-events") ------------------------------------------------------

    def _schedule(self, callback: Callable[[Any], None] | None, argument: object) -> None:
        if callback is not None:
            self._callbacks.put((callback, argument))

    def _run_callbacks(self) -> None:
        while (item := self._callbacks.get()) is not None:
            self._guard(*item)

    @staticmethod
    def _guard(callback: Callable[[Any], None], argument: object) -> None:
        try:
            callback(argument)
        except Exception:  # noqa: BLE001 - one bad callback must not end the link
            log.exception("agent link callback %s failed", getattr(callback, "__name__", callback))

    # -- life cycle ---------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> HMCError | None:
        """Why the link is down while it re-attaches (None while attached, and after close())."""
        return None if self._closed else self._down

    def close(self) -> None:
        """End the stream (hmcd withdraws this agent's buffers at once), stop re-attaching, release the channel; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stream = self._stream
        self._wake.set()
        stream.end()
        current = threading.current_thread()
        if current is not self._thread:
            self._thread.join(timeout=min(self._timeout, 5.0))
            if self._thread.is_alive():
                stream.abort()
                self._thread.join(timeout=5.0)
        stream.abort()
        self._callbacks.put(None)
        if current is not self._events_thread:
            self._events_thread.join(timeout=5.0)

    def __enter__(self) -> DaemonLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "down" if self._down else "attached"
        return f"<DaemonLink agent={self._agent_id!r} {self.address} {state}>"


def hmcd_clock_ahead(sent: float, received: float, theirs: float) -> float:
    """How far hmcd's CLOCK_MONOTONIC may be ahead of this process's, from one hello: ours before the hello left
    (`sent`) and as hmcd's reached us (`received`), hmcd's as it sent it (`theirs`; 0: an hmcd that does not say).

    0 where the round trip allows one clock (hmcd's reading between ours: one kernel, one time namespace; clocks
    that differ by less than the round trip read so too, later by at most that), and where hmcd does not say (an
    hmcd of an older release gives deadlines to agents on its own clock only); else the most it can be,
    `theirs - sent` (another time namespace, with its offset): a deadline of hmcd's read on our clock through it
    is then never later than hmcd's, and earlier by at most the round trip (the attach's connect included). A
    reading that is not a finite number says nothing either (0)."""
    if not theirs or not math.isfinite(theirs) or sent <= theirs <= received:
        return 0.0
    return theirs - sent
