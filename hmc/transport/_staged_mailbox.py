"""The shared ring's mailbox: a single-range staged transfer's request and reply through shared memory, not the socket.

A page at the end of the ring file (`MAILBOX_BYTES`; every ShmSlot names where it starts). A
single-range transfer of up to one slot (the agent's inline fast path) posts its request here
instead of sending it, and the owner answers here. While the owner's connection thread waits for its next request it
polls the mailbox along with the socket, and says so (`awake`): then a request costs no system call
and no wake-up on either side (on one H100 host a socket round trip between two Python processes cost
8-10 us, a mailbox one 2). When the owner is not polling, the initiator rings its doorbell: a Posted
frame on the socket, which wakes it to look.

Records. A request is not a frame but a fixed record (`encode_request`): write or read, the owner's
buffer id and key proof, and one range of that buffer, always moved through slot 0 of the mailbox's
own ring. It is decoded with one struct call and checked like a frame's request (peer protocol 4;
a protobuf frame here cost the owner a parse, a dispatch and a slot lookup per request).

The page is bound to one connection at a time (`token`, from the connection's nonce, which both ends
hold): the initiator offers it to its current connection, and the owner's thread of that connection
attaches it (and says so) only when the offer names its own connection; requests carry the token too.
So the initiator posts only once the owner it is talking to has attached the page (an owner without
the mailbox, or of another release, never does: those keep to the socket), a connection being replaced
never serves its successor's requests, and a peer naming someone else's ring cannot attach its page.

Ordering. x86-64 keeps stores in order and loads in order (TSO), so a record written before its
sequence number is whole when the number is seen. Only a store followed by a load may pass each
other: the initiator may read `awake` as set (and ring no doorbell) while the owner, which just cleared
it, reads no request. So the owner looks once more after `RECHECK_S` before it sleeps on the socket:
such a request waits at most that long. Architectures with weaker orderings keep to the socket
(`SUPPORTED`).

Concurrency: the initiator posts under its link's lock (one request at a time, none on the socket
meanwhile); the owner takes and answers on its connection's thread, or (behind copies queued before
the request) its completion thread.
"""

from __future__ import annotations

import os
import platform
import struct
import time
from collections.abc import Callable
from typing import NamedTuple

from hmc.errors import ProtocolError, TimeoutError
from hmc.transport._wire import FrameStream, raise_for_reply
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["MAILBOX_BYTES", "RECHECK_S", "SUPPORTED", "Mailbox", "SmallRequest", "decode_request", "encode_request", "token_of"]

SUPPORTED = platform.machine() in ("x86_64", "AMD64")
"""Whether this machine's memory ordering lets two processes hand records over through plain loads and stores."""
MAILBOX_BYTES = 8192
"""The mailbox page: the header words, the request, the reply, each on lines of their own."""
RECHECK_S = 1e-3
"""How long the owner waits on its socket before it looks at the mailbox a last time and sleeps."""
_SPIN_S = 200e-6
"""How long the initiator polls for its reply before it yields (`answer`'s `yield_s`, a longer copy's time) and then
naps between looks (a small copy answers well within it)."""
_NAP_S = 50e-6
_AWAKE = 0  # word: the owner polls the mailbox (owner writes)
_OFFERED = 1  # word: the token of the connection the initiator uses the page with (initiator writes)
_ATTACHED = 2  # word: the token of the connection whose owner attached the page (owner writes)
_REQUEST = 64  # bytes: seq, token, length (u32 each), then the request record
_REPLY = 4096  # bytes: seq, length (u32 each), then a refusal's PeerReply (length 0: done)
_BODY = 64  # where a record's bytes start after its words
_MAX_RECORD = _REPLY - _REQUEST - _BODY


_RECORD = struct.Struct("<BBHQQ")
"""A request record's head: write (1) or read (0), key proof bytes, buffer id bytes, offset, length; then the
proof and the id (UTF-8)."""


class SmallRequest(NamedTuple):
    """A request taken from the mailbox: `length` bytes at `offset` of buffer `buffer_id`, through slot 0 of the ring."""

    write: bool
    buffer_id: str
    key_proof: bytes
    offset: int
    length: int


def encode_request(write: bool, buffer_id: str, key_proof: bytes, offset: int, length: int) -> bytes:
    """The record of a request (what `Mailbox.post` writes)."""
    name = buffer_id.encode()
    return _RECORD.pack(write, len(key_proof), len(name), offset, length) + key_proof + name


def decode_request(record: bytes) -> SmallRequest:
    """A request from its record; ProtocolError when it is malformed (the owner ends that connection)."""
    if len(record) < _RECORD.size:
        raise ProtocolError("a mailbox request shorter than its head")
    write, proof_bytes, name_bytes, offset, length = _RECORD.unpack_from(record)
    if write > 1 or length == 0 or len(record) != _RECORD.size + proof_bytes + name_bytes:
        raise ProtocolError("a malformed mailbox request")
    at = _RECORD.size + proof_bytes
    try:
        name = record[at:].decode()
    except UnicodeDecodeError as exc:
        raise ProtocolError("a mailbox request naming no buffer") from exc
    return SmallRequest(bool(write), name, record[_RECORD.size : at], offset, length)


def token_of(stream: FrameStream) -> int:
    """The 32-bit name of a connection in its mailbox records (from the listener's nonce, which both ends hold)."""
    return int.from_bytes(stream.nonce[:4], "little") or 1


class Mailbox:
    """One ring's mailbox page (`view`, `MAILBOX_BYTES` of the mapped ring), seen from either end; `close()` lets
    go of the page (the ring can be unmapped then, whoever still holds this object)."""

    def __init__(self, view: memoryview) -> None:
        if view.nbytes != MAILBOX_BYTES:
            raise ProtocolError(f"a mailbox is {MAILBOX_BYTES} bytes, not {view.nbytes}")
        self._view = view
        self._words = view.cast("I")
        self._request_seq = _REQUEST // 4
        self._reply_seq = _REPLY // 4
        self.seen = self._words[self._request_seq]
        """Owner: the last request sequence number taken (or there when attached)."""
        self._next = self._words[self._request_seq]

    def close(self) -> None:
        self._words.release()
        self._view.release()

    # -- initiator -------------------------------------------------------------

    def offer(self, token: int) -> None:
        """Use the page with connection `token` from now on (its owner attaches it on the next slot it is named in)."""
        self._words[_OFFERED] = token

    def ready(self, token: int) -> bool:
        """Whether the owner of connection `token` has attached the page (requests may be posted)."""
        return self._words[_ATTACHED] == token

    def owner_awake(self) -> bool:
        return bool(self._words[_AWAKE])

    def post(self, record: bytes, stream: FrameStream, deadline: float) -> int:
        """Write a request record (`encode_request`) for the connection `stream`, ringing the owner's doorbell there
        (a Posted frame) when it is not polling; returns the request's sequence number (its reply's)."""
        if len(record) > _MAX_RECORD:
            raise ProtocolError(f"a {len(record)}-byte request does not fit the mailbox")
        seq = self._next = (self._next + 1) & 0xFFFFFFFF or 1
        start = _REQUEST + _BODY
        self._view[start : start + len(record)] = record
        self._words[self._request_seq + 1] = token_of(stream)
        self._words[self._request_seq + 2] = len(record)
        self._words[self._request_seq] = seq  # last: the owner reads the record only once it sees this
        if not self._words[_AWAKE]:
            stream.send(peer_pb2.PeerFrame(posted=peer_pb2.Posted(seq=seq)), deadline=deadline)
        return seq

    def answer(self, seq: int, stream: FrameStream, deadline: float, *, yield_s: float = 0.0) -> None:
        """Wait for the reply to request `seq` (polled, then for `yield_s` more polled with yields of the CPU and the
        GIL, the time a longer copy takes, then napping while the connection stays quiet); a refusal raises its
        typed error, as does the connection ending first (BrokenResourceError, or the error the owner ended it
        with), TimeoutError at `deadline`."""
        words, at = self._words, self._reply_seq
        spin_until = time.monotonic() + _SPIN_S
        yield_until = spin_until + yield_s
        while words[at] != seq:
            now = time.monotonic()
            if now < spin_until:
                continue
            if now < yield_until and now < deadline:
                os.sched_yield()
                continue
            if now > deadline:
                raise TimeoutError("the owner did not answer a staged request in its mailbox before the deadline")
            if stream.readable():  # the owner answers here only: anything on the socket is its end (and why)
                frame = stream.recv(deadline)
                if frame.WhichOneof("kind") == "reply":
                    raise_for_reply(frame.reply)
                raise ProtocolError(f"{stream.peer} answered a mailbox request on the socket")
            time.sleep(_NAP_S)
        length = words[at + 1]
        if length:
            if length > _MAX_RECORD:
                raise ProtocolError("a mailbox reply longer than the mailbox")
            reply = peer_pb2.PeerReply()
            reply.ParseFromString(bytes(self._view[_REPLY + _BODY : _REPLY + _BODY + length]))
            raise_for_reply(reply)
            raise ProtocolError("a mailbox reply that is neither done nor a refusal")

    # -- owner -----------------------------------------------------------------

    def attach(self, token: int) -> bool:
        """Take the page for connection `token` if the initiator offered it to that connection (then say so)."""
        if self._words[_OFFERED] != token:
            return False
        self.seen = self._words[self._request_seq]
        self._words[_ATTACHED] = token
        return True

    def awake(self, polling: bool) -> None:
        self._words[_AWAKE] = 1 if polling else 0

    def take(self, token: int, looks: int = 1) -> tuple[int, bytes] | None:
        """The request posted for connection `token` since the last one taken (looking up to `looks` times):
        (sequence number, record), or None."""
        words, at, seen = self._words, self._request_seq, self.seen
        for _ in range(looks):
            if words[at] != seen:
                break
        else:
            return None
        seq = words[at]
        if words[at + 1] != token:
            return None
        length = words[at + 2]
        if length > _MAX_RECORD:
            raise ProtocolError("a mailbox request longer than the mailbox")
        self.seen = seq
        start = _REQUEST + _BODY
        return seq, bytes(self._view[start : start + length])

    def replier(self, seq: int) -> Callable[[peer_pb2.PeerReply], None]:
        """What answers request `seq`: its reply written here (a refusal's bytes first, then the sequence number)."""

        def reply(message: peer_pb2.PeerReply) -> None:
            body = b"" if message.ByteSize() == 0 else message.SerializeToString()
            if len(body) > _MAX_RECORD:  # a refusal's message cut short
                error = common_pb2.Error(code=message.error.code, message=message.error.message[:1024])
                body = peer_pb2.PeerReply(error=error).SerializeToString()
            start = _REPLY + _BODY
            self._view[start : start + len(body)] = body
            self._words[self._reply_seq + 1] = len(body)
            self._words[self._reply_seq] = seq

        return reply
