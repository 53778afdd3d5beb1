"""This agent's outgoing connections: one control channel per peer agent, data streams on demand.

The control channel (initiator -> owner) carries OpenBuffer, Push and Notify requests;
the owner sends Withdrawn frames back over it when a buffer we opened goes away.
A Withdrawn is accepted only for a buffer opened over that very channel, i.e.
from its owner: another peer cannot make this agent refuse a third agent's buffer.
Every connection proves, at its handshake, the access key of the buffer it was
opened for (`hmc.transport._handshake.handshake`), and is tuned so that a silent peer
is detected (keepalive; unacknowledged data for `unacked_s` resets it).
Channels are opened lazily, cached per peer agent id, and dropped when they
break, which also tells the agent that the peer is lost. Reconnecting to a lost
peer that no longer answers is BrokenResourceError (it died), not
UnavailableError (it was never reachable).

Concurrency: any thread may ask for a channel; `_lock` guards the cache and a
per-peer lock keeps two threads from connecting to one peer at once. Callbacks
(`on_withdrawn`, `on_lost`) run on channel reader threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hmc.errors import AccessDeniedError, BrokenResourceError, ClosedResourceError, ProtocolError, UnavailableError
from hmc.transport._channel import Channel, ReplyCallback
from hmc.transport._handshake import connect, handshake, tune_socket
from hmc.transport._wire import FrameStream
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["Peers"]

_CONTROL = peer_pb2.PeerHello.CHANNEL_CONTROL
_DATA = peer_pb2.PeerHello.CHANNEL_DATA


class Peers:
    """Connections from this agent to other agents."""

    def __init__(
        self,
        local_info: Callable[[], common_pb2.AgentInfo],
        *,
        on_withdrawn: Callable[[str, str], None],
        on_lost: Callable[[common_pb2.AgentInfo], None],
        buffer_bytes: int,
        keepalive_s: float,
        unacked_s: float,
    ) -> None:
        self._local_info = local_info
        self._on_withdrawn = on_withdrawn
        self._on_lost = on_lost
        self._buffer_bytes = buffer_bytes
        self._keepalive_s = keepalive_s
        self._unacked_s = unacked_s
        self._lock = threading.Lock()  # guards _channels, _opened, _connecting, _lost, _closed
        self._channels: dict[str, Channel] = {}
        self._opened: dict[Channel, set[str]] = {}
        """Buffers opened (or notified) over each control channel: the only ones its peer may withdraw."""
        self._lost: set[str] = set()
        self._connecting: dict[str, threading.Lock] = {}
        self._closed = False

    def _stream(self, descriptor: common_pb2.BufferDescriptor, channel: int, deadline: float, buffer_bytes: int = 0) -> FrameStream:
        agent = descriptor.owner
        sock = connect(agent.endpoint, deadline, buffer_bytes=buffer_bytes)
        tune_socket(sock, self._keepalive_s, self._unacked_s)
        stream = FrameStream(sock, peer=f"agent {agent.id} at {agent.endpoint.host}:{agent.endpoint.port}")
        try:
            handshake(stream, self._local_info(), channel, deadline, descriptor)
        except BaseException:
            stream.close()
            raise
        return stream

    def connect_data(self, descriptor: common_pb2.BufferDescriptor, deadline: float) -> FrameStream:
        """A new data connection to `descriptor`'s owner (for the staged path), handshake and proof done."""
        return self._stream(descriptor, _DATA, deadline, self._buffer_bytes)

    def control(self, descriptor: common_pb2.BufferDescriptor, deadline: float) -> Channel:
        """The control channel to `descriptor`'s owner, connecting (and proving its key) on first use; the buffer
        is recorded as opened over it, so its owner may withdraw it."""
        channel = self._control(descriptor, deadline)
        with self._lock:
            self._opened.setdefault(channel, set()).add(descriptor.id)
        return channel

    def _control(self, descriptor: common_pb2.BufferDescriptor, deadline: float) -> Channel:
        agent = descriptor.owner
        with self._lock:
            if self._closed:
                raise ClosedResourceError("agent is closed")
            channel = self._channels.get(agent.id)
            if channel is not None and not channel.closed:
                return channel
            gate = self._connecting.setdefault(agent.id, threading.Lock())
        with gate:
            with self._lock:
                channel = self._channels.get(agent.id)
            if channel is not None and not channel.closed:
                return channel
            try:
                stream = self._stream(descriptor, _CONTROL, deadline)
            except UnavailableError as exc:
                with self._lock:
                    gone = agent.id in self._lost
                if gone:
                    raise BrokenResourceError(f"lost the connection to agent {agent.id}, and it does not answer any more") from exc
                raise
            lost = agent

            def handler(frame: peer_pb2.PeerFrame) -> peer_pb2.PeerReply:
                if frame.WhichOneof("kind") != "withdrawn":
                    raise ProtocolError(f"agent {lost.id} sent {frame.WhichOneof('kind')} on our control channel")
                buffer_id = frame.withdrawn.buffer_id
                with self._lock:
                    owned = buffer_id in self._opened.get(channel, ())
                if not owned:
                    raise AccessDeniedError(f"agent {lost.id} withdrew buffer {buffer_id!r}, which this agent did not open from it")
                self._on_withdrawn(lost.id, buffer_id)
                return peer_pb2.PeerReply()

            channel = Channel(stream, handler, name=f"hmc-peer-ctl-{agent.id[:8]}", on_close=lambda ch: self._closed_channel(lost, ch))
            with self._lock:
                self._channels[agent.id] = channel
            return channel.start()

    def _closed_channel(self, agent: common_pb2.AgentInfo, channel: Channel) -> None:
        with self._lock:
            if self._channels.get(agent.id) is channel:
                del self._channels[agent.id]
            self._opened.pop(channel, None)
            self._lost.add(agent.id)
            closing = self._closed
        if not closing:
            self._on_lost(agent)

    def open_grant(self, descriptor: common_pb2.BufferDescriptor, deadline: float, path: str = "ipc") -> peer_pb2.BufferGrant:
        """Ask the owner for one-sided access to a buffer over `path` (ipc, ucx, rdma)."""
        channel = self.control(descriptor, deadline)
        proof = channel.stream.proof(descriptor.access_key, descriptor.registry_epoch)
        frame = peer_pb2.PeerFrame(open=peer_pb2.OpenBuffer(buffer_id=descriptor.id, key_proof=proof, path=path))
        return channel.request(frame, deadline).grant

    def push(self, descriptor: common_pb2.BufferDescriptor, message: peer_pb2.Push, deadline: float, callback: ReplyCallback) -> None:
        """Ask the owner to push a read (`message` without its key proof); `callback` runs when it ended (or failed)."""
        channel = self.control(descriptor, deadline)
        message.key_proof = channel.stream.proof(descriptor.access_key, descriptor.registry_epoch)
        channel.request_async(peer_pb2.PeerFrame(push=message), deadline, callback)

    def notify(self, descriptor: common_pb2.BufferDescriptor, transfer_id: str, payload: bytes, deadline: float, callback: ReplyCallback) -> None:
        """Send a Notify to the owner; `callback` runs when it acknowledged (or failed)."""
        channel = self.control(descriptor, deadline)
        proof = channel.stream.proof(descriptor.access_key, descriptor.registry_epoch)
        frame = peer_pb2.PeerFrame(notify=peer_pb2.Notify(buffer_id=descriptor.id, key_proof=proof, transfer_id=transfer_id, payload=payload))
        channel.request_async(frame, deadline, callback)

    def close(self) -> None:
        """Close every control channel (joining their readers); idempotent."""
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
