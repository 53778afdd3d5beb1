"""The agent's peer listener: the owner side of every path that crosses processes.

Peers connect over TCP and say in their hello which channel they open:

- control: OpenBuffer (grants one-sided access, ipc or ucx, after the access-key
  check; the grant carries what the path's `Transport.grant` hands out, and says
  when the memory is read-only: initiators refuse to write it), Push (a read this
  agent pushes into the asker's memory, checked here, run by the path's
  `Transport.push`, answered when it ends),
  Notify (deduplicated, queued for `Agent.notifications()`), and the replies to
  the Withdrawn frames this agent sends when a granted buffer is unregistered;
- data: DataWrite and DataRead of the staged path, served on the connection's
  thread by the path's owner side, `hmc.transport._staged_serve` (bounds and key
  checks, payloads, device copies, replies in frame order, deadlines). A frame
  it finds malformed gets a ProtocolError reply here and that connection (only)
  is closed.

Admission. A connection must say hello and prove the access key of one of this
agent's buffers within `_HANDSHAKE_S`, and until it has, its frames are bounded
by HELLO_FRAME: nothing is reserved for a peer without a key. Every later request
proves its buffer's key on that connection (`key_proof`, never the key). At most
`max_connections` connections are served at once (bounded further by the file
descriptors this process may open); at the bound the oldest connection that has
not authenticated yet is dropped for the newcomer, or the newcomer is refused.
Running out of file descriptors (EMFILE) never stops the accept loop: it sheds
the connection it cannot serve and goes on.

Deadlines. A data connection honours its frames' deadlines (`_staged_serve`).
An idle connection is probed by keepalive. `cut(buffer_id)` aborts the
connections still writing into a buffer (`Agent.unregister` uses it).

Concurrency: one accept thread ("hmc-peer-accept") and one thread per
connection ("hmc-peer-<addr>"), all daemon threads joined (bounded) on close.
`_lock` guards the connection sets and the record of who opened which buffer;
`_freed` (on `_lock`) wakes the accept loop when a connection ends.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import resource
import select
import socket
import threading
import time
from collections.abc import Callable

from hmc.agent._buffers import BufferTable, ConnBuffer
from hmc.agent._transfer import Notification, NotificationInbox
from hmc.errors import AccessDeniedError, DeviceError, HMCError, ProtocolError, TimeoutError, UnknownBufferError
from hmc.transport._channel import DEFERRED, Channel, request_each
from hmc.transport._ranges import RangeList, past_notify_bounds
from hmc.transport._staged_serve import DataConnections
from hmc.transport._handshake import accept_handshake, tune_socket
from hmc.transport._wire import HELLO_FRAME, FrameStream, error_reply
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["PeerServer"]

_log = logging.getLogger(__name__)
_HANDSHAKE_S = 5.0
"""A new connection must have said hello and proved a key within this."""
_JOIN_S = 2.0
_SHED_WAIT_S = 0.5
"""Out of file descriptors: how long the accept loop waits for a connection to end before it sheds the next one."""
_FDS_PER_CONNECTION = 4
"""File descriptors one served connection may hold (its socket, the dup for the receiving thread, a lending pipe)."""
_FDS_KEPT = 64
"""File descriptors left to the rest of the process (its own outgoing connections, files) when bounding connections."""


class PeerServer:
    """Listens for peer agents and serves their control and data connections."""

    def __init__(
        self,
        host: str,
        *,
        info: Callable[[], common_pb2.AgentInfo],
        buffers: BufferTable,
        inbox: NotificationInbox,
        buffer_bytes: int,
        grant: Callable[[str, ConnBuffer], common_pb2.TransportHandles],
        push: Callable[[str, ConnBuffer, peer_pb2.Push, RangeList, float, Callable[[BaseException | None], None]], None],
        max_connections: int = 1024,
        keepalive_s: float = 5.0,
        timeout_s: float = 30.0,
    ) -> None:
        self._info = info
        self._grant = grant
        """The handles of a path's grant (the path's owner side: `Transport.grant`)."""
        self._push_to = push
        """Runs a read the owner pushes on its path (`Transport.push`)."""
        self._buffers = buffers
        self._inbox = inbox
        self._keepalive_s = keepalive_s
        self._timeout_s = timeout_s
        self._data = DataConnections(buffers, timeout_s)
        """The staged path's owner side, serving every data connection."""
        soft_fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_connections = max(8, min(max_connections, (soft_fds - _FDS_KEPT) // _FDS_PER_CONNECTION)) if soft_fds > 0 else max_connections
        """Connections served at once: the configured bound, or fewer where file descriptors would run out first."""
        self._lock = threading.Lock()  # guards _streams, _pending_auth, _threads, _opened, _closed
        self._freed = threading.Condition(self._lock)  # a connection ended
        self._streams: set[FrameStream] = set()
        self._pending_auth: collections.OrderedDict[FrameStream, None] = collections.OrderedDict()
        """Connections that have not proved a key yet, oldest first (the first to go at the bound)."""
        self._threads: list[threading.Thread] = []
        self._opened: dict[str, set[Channel]] = {}
        self._closed = False
        self._spare: int | None = _open_spare()
        """A descriptor held in reserve: out of descriptors, it is given up to accept and shed one connection."""
        self._listener = socket.create_server((host, 0), backlog=128)
        if buffer_bytes:  # accepted sockets inherit these (and the window scale they imply)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        self.port: int = self._listener.getsockname()[1]
        self._accepter = threading.Thread(target=self._accept_loop, name="hmc-peer-accept", daemon=True)
        self._accepter.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except OSError as exc:
                if self._closed or exc.errno not in _OUT_OF_RESOURCES:
                    return  # listener closed
                self._shed(exc)
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                tune_socket(sock, self._keepalive_s, self._timeout_s)
                stream = FrameStream(sock, peer=f"{address[0]}:{address[1]}", max_frame=HELLO_FRAME)
            except OSError as exc:  # EMFILE on the dup: this one is shed, like one accept could not take
                sock.close()
                if exc.errno in _OUT_OF_RESOURCES:
                    self._shed(exc)
                else:
                    _log.warning("peer port: cannot serve %s:%s: %s", address[0], address[1], exc)
                continue
            thread = threading.Thread(target=self._serve, args=(stream,), name=f"hmc-peer-{address[1]}", daemon=True)
            with self._lock:
                if not self._admit():
                    _log.warning("peer port: %d connections already served; refusing %s:%s", len(self._streams), address[0], address[1])
                    stream.close()
                    continue
                self._streams.add(stream)
                self._pending_auth[stream] = None
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _admit(self) -> bool:
        """Room for one more connection (under `_lock`): at the bound, the oldest one without a proof is dropped."""
        if len(self._streams) < self.max_connections:
            return True
        if not self._pending_auth:
            return False
        oldest, _ = self._pending_auth.popitem(last=False)
        oldest.shutdown()  # its thread ends and forgets it
        self._streams.discard(oldest)
        return True

    def _shed(self, exc: OSError) -> None:
        """Out of descriptors: give the spare one up to accept and close a waiting connection (so its peer is told at
        once rather than left hanging), then wait a little for a served connection to end."""
        _log.warning("peer port: %s; shedding a connection", exc)
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
            waiting = select.poll()  # poll, not select: out of descriptors, the listener's is likely past 1023
            waiting.register(self._listener, select.POLLIN)
            if waiting.poll(0):  # the connection it could not take (never block here)
                with contextlib.suppress(OSError):
                    self._listener.accept()[0].close()
            self._spare = _open_spare()
        with self._lock:
            if not self._closed:
                self._freed.wait(_SHED_WAIT_S)

    def _authenticate(self, stream: FrameStream, auth: peer_pb2.Auth) -> None:
        """The initiator's proof of one buffer's key (any error refuses the connection)."""
        self._buffers.get(auth.buffer_id, prove=stream.proof, proof=auth.key_proof)
        with self._lock:
            self._pending_auth.pop(stream, None)

    def _serve(self, stream: FrameStream) -> None:
        try:
            hello = accept_handshake(stream, self._info(), time.monotonic() + _HANDSHAKE_S, self._authenticate)
            if hello.channel == peer_pb2.PeerHello.CHANNEL_CONTROL:
                self._serve_control(stream, hello.agent)
            elif hello.channel == peer_pb2.PeerHello.CHANNEL_DATA:
                self._data.serve(stream)
            else:
                raise ProtocolError(f"unknown channel {hello.channel} in hello")
        except (ProtocolError, AccessDeniedError, UnknownBufferError) as exc:  # a refused hello or proof: say why before hanging up
            with contextlib.suppress(HMCError):
                stream.send(peer_pb2.PeerFrame(reply=error_reply(exc)), deadline=time.monotonic() + 1.0)
        except HMCError as exc:
            _log.debug("peer connection %s ended: %s", stream.peer, exc)
        finally:
            stream.close()
            with self._lock:
                self._streams.discard(stream)
                self._pending_auth.pop(stream, None)
                self._freed.notify_all()

    # -- control ----------------------------------------------------------------

    def _serve_control(self, stream: FrameStream, peer: common_pb2.AgentInfo) -> None:
        channel: Channel | None = None

        def handler(frame: peer_pb2.PeerFrame) -> peer_pb2.PeerReply:
            kind = frame.WhichOneof("kind")
            if kind == "open":
                assert channel is not None
                return self._open(frame.open, channel)
            if kind == "notify":
                return self._notify(frame.notify, peer.id, stream)
            if kind == "push":
                assert channel is not None
                return self._push(frame.request_id, frame.push, channel)
            raise ProtocolError(f"{kind or 'empty frame'} is not a control request")

        channel = Channel(stream, handler, name=threading.current_thread().name, on_close=self._forget_channel)
        channel.run()

    def _open(self, request: peer_pb2.OpenBuffer, channel: Channel) -> peer_pb2.PeerReply:
        buffer = self._buffers.get(request.buffer_id, prove=channel.stream.proof, proof=request.key_proof)
        handles = self._grant(request.path, buffer)
        with self._lock:
            self._opened.setdefault(buffer.id, set()).add(channel)
        grant = peer_pb2.BufferGrant(buffer_id=buffer.id, size=buffer.size, handles=handles, read_only=buffer.region.readonly)
        return peer_pb2.PeerReply(grant=grant)

    def _push(self, request_id: int, request: peer_pb2.Push, channel: Channel) -> peer_pb2.PeerReply:
        """Check a read the asker wants pushed (key proof, ranges inside both ends), hold the buffer, start it; the
        reply follows when it ends."""
        holder = ("push", channel, request_id)
        buffer = self._buffers.acquire(request.buffer_id, prove=channel.stream.proof, proof=request.key_proof, holder=holder)
        try:
            ranges = RangeList.from_proto(request.ranges)
            ranges.check(buffer.size, request.target_size)
            ranges.check_disjoint_dst()
            deadline = time.monotonic() + min(request.expires_ms / 1000 or self._timeout_s, self._timeout_s)  # the asker's, within ours

            def done(error: BaseException | None) -> None:
                self._buffers.release(buffer.id, holder)
                channel.reply(request_id, peer_pb2.PeerReply() if error is None else error_reply(error))

            self._push_to(request.path, buffer, request, ranges, deadline, done)
        except BaseException:
            self._buffers.release(buffer.id, holder)
            raise
        return DEFERRED

    def _notify(self, request: peer_pb2.Notify, sender: str, stream: FrameStream) -> peer_pb2.PeerReply:
        self._buffers.get(request.buffer_id, prove=stream.proof, proof=request.key_proof)
        if past := past_notify_bounds(request.payload, request.transfer_id):
            raise ProtocolError(past)
        self._inbox.deliver(Notification(request.buffer_id, request.transfer_id, request.payload, sender))
        return peer_pb2.PeerReply()

    def _forget_channel(self, channel: Channel) -> None:
        with self._lock:
            for holders in self._opened.values():
                holders.discard(channel)

    def withdraw(self, buffer_id: str, deadline: float) -> str:
        """Tell every peer that opened `buffer_id` it is gone; wait for their acknowledgements. Returns those (named)
        that did not confirm nothing of theirs can still land (no answer in time, or DeviceError: UCX may still run
        their puts); "" when all did. A peer that is gone, or one that refused otherwise, holds nothing any more."""
        with self._lock:
            holders = self._opened.pop(buffer_id, set())
        asks = [(channel, peer_pb2.PeerFrame(withdrawn=peer_pb2.Withdrawn(buffer_id=buffer_id))) for channel in holders]
        unconfirmed = []
        for (channel, _), outcome in zip(asks, request_each(asks, deadline)):  # all asked at once, each with the whole deadline
            if isinstance(outcome, DeviceError):  # it answered: its transfers may still land (its channel stays: it holds other grants)
                _log.warning("withdrawn %s: %s cannot confirm it (%s)", buffer_id, channel.name, outcome)
                unconfirmed.append(f"{channel.name} ({outcome})")
            elif isinstance(outcome, HMCError):  # cut it: a peer whose channel breaks drops every grant it holds from this agent
                _log.info("withdrawn %s not acknowledged by %s (%s): connection cut", buffer_id, channel.name, outcome)
                channel.stream.abort()
                if isinstance(outcome, TimeoutError):
                    unconfirmed.append(f"{channel.name} ({outcome})")
            elif isinstance(outcome, BaseException):
                raise outcome
        return ", ".join(unconfirmed)

    def cut(self, buffer_id: str) -> int:
        """Abort every connection whose receive still writes into `buffer_id`; how many were cut."""
        holders = [holder for holder in self._buffers.holders(buffer_id) if isinstance(holder, FrameStream)]
        for stream in holders:
            stream.abort()
        return len(holders)

    def close(self) -> None:
        """Stop accepting, break every connection, join the threads (bounded); idempotent."""
        with self._lock:
            self._closed = True
            self._freed.notify_all()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        with self._lock:
            streams, threads = list(self._streams), list(self._threads)
        for stream in streams:
            stream.shutdown()
        for thread in (self._accepter, *threads):
            thread.join(_JOIN_S)


def _open_spare() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return None


_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
