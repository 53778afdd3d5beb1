"""The agent's end of `RegistryService.Attach`: one long-lived stream to the local hmcd.

The stream opens with a hello (protocol version 1, the agent's AgentInfo) and
lives as long as the agent: hmcd withdraws the agent's ConnBuffers the moment it
ends, whether by `close()` or because the process died. Over it the agent
registers and unregisters buffers (each acknowledged), receives transfer
instructions, cancellations and events, and reports transfer outcomes.

Concurrency: a sync gRPC channel. Requests go through a queue that gRPC's own
thread drains (the request iterator); the named daemon thread "hmc-daemon-link"
consumes hmcd's messages, resolves acks and runs the callbacks. Callbacks run on
that thread and must not block: hand the work to another thread. `_lock`
guards the pending-ack table, the request counter and the link's state;
register/unregister/report/lookup are safe from any thread.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator

import grpc

from hmc.config import Config
from hmc.control._errors import error_from_proto, error_to_proto, rpc_errors, translate_rpc_error
from hmc.errors import BrokenResourceError, ClosedResourceError, HMCError, TimeoutError, UnavailableError, UnknownBufferError
from hmc.v1 import common_pb2, daemon_pb2, daemon_pb2_grpc

__all__ = ["DaemonLink"]

log = logging.getLogger("hmc.agent.link")

PROTOCOL_VERSION = common_pb2.PROTOCOL_VERSION_1


class DaemonLink:
    """An agent's registration stream to hmcd at `unix:<config.socket>`."""

    def __init__(
        self,
        config: Config,
        agent_info: common_pb2.AgentInfo,
        on_instruction: Callable[[daemon_pb2.TransferInstruction], None],
        on_event: Callable[[daemon_pb2.Event], None] | None = None,
        *,
        on_cancel: Callable[[str], None] | None = None,
        on_lost: Callable[[HMCError], None] | None = None,
    ) -> None:
        """Connect and attach; UnavailableError when no hmcd answers within `config.timeout_s`."""
        self.address = f"unix:{config.socket}"
        self._timeout = config.timeout_s
        self._agent_id = agent_info.id
        self._on_instruction = on_instruction
        self._on_event = on_event
        self._on_cancel = on_cancel
        self._on_lost = on_lost
        self._lock = threading.Lock()  # guards _pending, _ids, _closed, _broken
        self._pending: dict[int, concurrent.futures.Future[daemon_pb2.Ack]] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._broken: HMCError | None = None
        self._hello: concurrent.futures.Future[daemon_pb2.DaemonHello] = concurrent.futures.Future()
        # Messages to hmcd; drained by gRPC's request thread through _outgoing(); None ends the stream.
        self._requests: queue.SimpleQueue[daemon_pb2.AgentMessage | None] = queue.SimpleQueue()
        self._requests.put(daemon_pb2.AgentMessage(hello=daemon_pb2.AgentHello(protocol_version=PROTOCOL_VERSION, agent=agent_info)))
        self._channel = grpc.insecure_channel(self.address)
        self._registry = daemon_pb2_grpc.RegistryServiceStub(self._channel)
        self._call = self._registry.Attach(self._outgoing())
        self._thread = threading.Thread(target=self._consume, name="hmc-daemon-link", daemon=True)
        self._thread.start()
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

    # -- requests ---------------------------------------------------------------------

    def register(self, descriptor: common_pb2.BufferDescriptor) -> None:
        """Publish a ConnBuffer; raises hmcd's typed refusal (ArgumentError, ...)."""
        self._request(lambda rid: daemon_pb2.AgentMessage(register=daemon_pb2.RegisterBuffer(request_id=rid, descriptor=descriptor)))

    def unregister(self, buffer_id: str) -> None:
        """Withdraw a ConnBuffer this agent registered."""
        self._request(lambda rid: daemon_pb2.AgentMessage(unregister=daemon_pb2.UnregisterBuffer(request_id=rid, buffer_id=buffer_id)))

    def report(self, report: daemon_pb2.TransferReport) -> None:
        """Tell hmcd how an instructed transfer went (no acknowledgement)."""
        self._check_usable()
        self._requests.put(daemon_pb2.AgentMessage(report=report))

    def lookup(self, ref: str) -> common_pb2.BufferDescriptor:
        """A ConnBuffer's descriptor by id, else by name, here or at hmcd's peers."""
        self._check_usable()
        try:
            return self._lookup(daemon_pb2.BufferRef(id=ref))
        except UnknownBufferError as by_id:
            if by_id.code != UnknownBufferError.code:  # withdrawn: the id was known
                raise
        return self._lookup(daemon_pb2.BufferRef(name=ref))

    def _lookup(self, ref: daemon_pb2.BufferRef) -> common_pb2.BufferDescriptor:
        with rpc_errors(self.address):
            return self._registry.LookupBuffer(daemon_pb2.LookupBufferRequest(ref=ref), timeout=self._timeout)

    def _request(self, build: Callable[[int], daemon_pb2.AgentMessage]) -> None:
        future: concurrent.futures.Future[daemon_pb2.Ack] = concurrent.futures.Future()
        with self._lock:
            self._check_usable()
            request_id = next(self._ids)
            self._pending[request_id] = future
        self._requests.put(build(request_id))
        try:
            ack = future.result(timeout=self._timeout)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._pending.pop(request_id, None)
            raise TimeoutError(f"hmcd at {self.address} did not acknowledge within {self._timeout:g}s") from None
        error = error_from_proto(ack.error)
        if error is not None:
            raise error

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedResourceError("the link to hmcd is closed")
        if self._broken is not None:
            raise BrokenResourceError(f"the link to hmcd at {self.address} broke: {self._broken}")

    def _outgoing(self) -> Iterator[daemon_pb2.AgentMessage]:
        while True:
            message = self._requests.get()
            if message is None:
                return
            yield message

    # -- hmcd's messages (thread "hmc-daemon-link") ---------------------------------------

    def _consume(self) -> None:
        error: HMCError | None = None
        try:
            for message in self._call:
                self._dispatch(message)
            error = BrokenResourceError(f"hmcd at {self.address} ended the agent stream")
        except grpc.RpcError as exc:
            error = translate_rpc_error(exc, self.address)
        except Exception as exc:  # noqa: BLE001 - a bug in a callback must not leave waiters hanging
            log.exception("agent link thread failed")
            error = BrokenResourceError(f"agent link failed: {exc}")
        finally:
            self._lost(error or BrokenResourceError("agent stream ended"))

    def _dispatch(self, message: daemon_pb2.DaemonMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "hello":
            if not self._hello.done():
                self._hello.set_result(message.hello)
        elif kind == "ack":
            with self._lock:
                future = self._pending.pop(message.ack.request_id, None)
            if future is not None:
                future.set_result(message.ack)
        elif kind == "instruction":
            self._instruct(message.instruction)
        elif kind == "event":
            if self._on_event is not None:
                self._guard("on_event", self._on_event, message.event)
        elif kind == "cancel":
            if self._on_cancel is not None:
                self._guard("on_cancel", self._on_cancel, message.cancel.transfer_id)

    def _instruct(self, instruction: daemon_pb2.TransferInstruction) -> None:
        try:
            self._on_instruction(instruction)
        except Exception as exc:  # noqa: BLE001 - reported as the transfer's failure
            log.warning("agent refused transfer %s: %s", instruction.transfer_id, exc)
            failed = daemon_pb2.TransferReport(transfer_id=instruction.transfer_id, state=common_pb2.TRANSFER_STATE_FAILED, error=error_to_proto(exc))
            self._requests.put(daemon_pb2.AgentMessage(report=failed))

    @staticmethod
    def _guard(name: str, callback: Callable[..., None], argument: object) -> None:
        try:
            callback(argument)
        except Exception:  # noqa: BLE001 - one bad callback must not end the stream
            log.exception("agent link %s callback failed", name)

    def _lost(self, error: HMCError) -> None:
        with self._lock:
            closing = self._closed
            if not closing and self._hello.done():
                self._broken = error
            pending, self._pending = self._pending, {}
        if not self._hello.done():
            self._hello.set_exception(error)
        failure = ClosedResourceError("the link to hmcd was closed") if closing else BrokenResourceError(f"the link to hmcd at {self.address} broke: {error}")
        for future in pending.values():
            future.set_exception(failure)
        if not closing and self._hello.done() and self._hello.exception() is None:
            log.warning("link to hmcd lost: %s", error)
            if self._on_lost is not None:
                self._guard("on_lost", self._on_lost, error)

    # -- life cycle ---------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> HMCError | None:
        """Why the stream ended on hmcd's side (None while it is up or after close())."""
        return self._broken

    def close(self) -> None:
        """End the stream (hmcd withdraws this agent's buffers) and release the channel; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._requests.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=min(self._timeout, 5.0))
            if self._thread.is_alive():
                self._call.cancel()
                self._thread.join(timeout=5.0)
        else:
            self._call.cancel()
        self._channel.close()

    def __enter__(self) -> DaemonLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "attached"
        return f"<DaemonLink agent={self._agent_id!r} {self.address} {state}>"
