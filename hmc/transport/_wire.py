"""Framing of `hmc.v1.PeerFrame` on stream sockets, key proofs, and typed replies.

A frame is a 4-byte little-endian length followed by one serialized PeerFrame.
After a DataWrite (and after a reply announcing `payload_bytes`) the payload
follows directly, sent from registered memory in the same sendmsg as the frame.
A payload of up to `INLINE_MAX` bytes is inline: the length word has its top bit
set and a second word gives the payload's length, so the receiver reads frame and
payload together (usually one receive) and holds all of it before the caller
touches memory: a small write lands whole or not at all. A larger payload is
received straight into registered memory (`recv_into`), never copied through an
intermediate buffer beyond the few KiB read ahead with its frame.

Sockets stay non-blocking: a receive or send is tried first and waits (poll)
only when the kernel has nothing; a caller that expects an answer within
microseconds may spin for it briefly (`recv(spin_s=...)`) before sleeping, as a
sleeping thread takes tens of microseconds to wake.

This module is the transport layer's one boundary for socket errors: a socket
timeout becomes `TimeoutError`, EOF and every other `OSError` become
`BrokenResourceError`, an undecodable frame becomes `ProtocolError` (a failed
connect becomes `UnavailableError` in `hmc.transport._handshake`).

Handshake (`hmc.transport._handshake`): until a connection is authenticated its frames are bounded by
`HELLO_FRAME`, afterwards by `MAX_FRAME`; each end announces its bound in its hello and `send()` refuses a frame
past the other's (UnsupportedError) before any byte leaves. Access keys never travel: every request carries a
proof of one, valid on its connection only (`FrameStream.proof`, `key_proof`).

Every receive has a deadline: a frame whose first byte arrived must be complete
within `_FRAME_REST_S` whatever the caller asked, and an idle connection is
probed by TCP keepalive (`_handshake.tune_socket`), so a silent peer is detected.
`abort()` resets a connection (RST) and makes the kernel drop what it still
holds to send, lent pages included: a failed transfer's bytes never leave late.

Concurrency: a FrameStream holds two socket objects over one connection (the
second a dup), so one sending thread and one receiving thread can each apply
their own deadline. Sends are serialized by a lock; receives (and the bytes
read ahead) belong to a single reader thread. A timeout in the middle of a
frame breaks the stream.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import math
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence

import numpy as np
from google.protobuf.message import DecodeError

from hmc.errors import (
    BrokenResourceError,
    HMCError,
    ProtocolError,
    TimeoutError,
    UnsupportedError,
    error_from_code,
)
from hmc.transport._splice import LEND_MIN_BYTES, Lender
from hmc.v1 import common_pb2, peer_pb2

__all__ = ["FRAME_RANGES", "HELLO_FRAME", "INLINE_MAX", "IOV_MAX", "MAX_FRAME", "OK_FRAME", "PROTOCOL_VERSION",
    "FrameStream", "error_reply", "framed", "key_proof", "raise_for_reply"]

PROTOCOL_VERSION = 4
MAX_FRAME = 64 << 20
"""Largest frame an authenticated connection accepts (a range list of ~2.8 million ranges)."""
FRAME_RANGES = 1 << 18
"""Most ranges of a frame whose payload follows it (4 MiB of offsets and lengths): the owner makes a view per range."""
HELLO_FRAME = 64 << 10
"""Largest frame before a connection is authenticated: a hello or an Auth, never a range list."""
_PROOF_BYTES = 16
_NONCE_BYTES = 16
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_NO_DEADLINE_S = 86400.0
"""Stand-in for "no deadline": sockets always stay in timeout (non-blocking) mode."""
_HEADER = struct.Struct("<I")
_INLINE_HEADER = struct.Struct("<II")
_INLINE = 1 << 31
"""Length-word flag of an inline frame: a second word, the payload's length, follows (frames stay below 2 GiB)."""
INLINE_MAX = 64 << 10
"""Largest payload sent inline with its frame: above it, copying it out of the read-ahead buffer costs more than the
receives it saves (docs/decisions.md, "Staged host memory over TCP")."""
_INLINE_BODY_MAX = HELLO_FRAME
"""Largest frame that carries an inline payload: a frame and its payload fit the read-ahead buffer together."""
_AHEAD_BYTES = 16 << 10
"""Bytes read ahead with a frame at first; the buffer grows to hold the largest inline frame received."""
_LARGE_START = 1 << 20
"""A frame body past the read-ahead buffer is received into this much at first, doubled as its bytes arrive."""


_LAST_CHANCE_S = 0.001
"""A send (of lent pages) whose deadline passed still gets one short attempt."""
_POLL_MAX_MS = (1 << 31) - 1
"""poll()'s longest timeout: a peer's frame may name an expiry weeks away (a uint32 of milliseconds)."""
_LOWAT_BYTES = 1 << 20
"""Large payloads are received in steps of at least this much (SO_RCVLOWAT) instead of whatever arrived since the
last wake-up (about 0.3 MiB): staged 256 MiB over loopback on the 2-core VM 3.75 -> 4.25 GB/s."""
_FRAME_REST_S = 5.0
"""Once a frame's first byte arrived, the rest may take this long, whatever the caller's deadline."""


def _consume(pending: list[memoryview], index: int, got: int) -> int:
    """Account `got` received bytes against `pending` from `index` (trimming a view left part-filled); the next index."""
    while got:
        size = pending[index].nbytes
        if got < size:
            pending[index] = pending[index][got:]
            break
        got -= size
        index += 1
    return index


def _row_views(rows: np.ndarray, skip: int) -> list[memoryview | bytes]:
    """Views of the bytes that iovec `rows` describe, from byte `skip` on (what lending left to copy)."""
    views: list[memoryview | bytes] = []
    for address, length in rows.tolist():
        if skip >= length:
            skip -= length
            continue
        views.append(memoryview((ctypes.c_char * (length - skip)).from_address(address + skip)).cast("B"))
        skip = 0
    return views


def key_proof(access_key: bytes, nonce: bytes, epoch: int = 0) -> bytes:
    """What proves `access_key`, as served by registry `epoch`, on the connection whose listener sent `nonce`
    (the key itself never travels). Epoch 0 (a descriptor no hmcd served) proves the key alone; any other
    epoch proves a key derived from both, so that the owner can tell a descriptor of an earlier epoch of its
    hmcd (StaleDescriptorError) from a wrong key."""
    if epoch:
        access_key = hmac.new(access_key, b"hmc-registry-epoch:" + epoch.to_bytes(8, "little"), hashlib.sha256).digest()
    return hmac.new(access_key, nonce, hashlib.sha256).digest()[:_PROOF_BYTES]


class _SockaddrUnspec(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_char * 14)]


_LIBC = ctypes.CDLL(None, use_errno=True)
_UNSPEC = _SockaddrUnspec(socket.AF_UNSPEC)


def _disconnect(sock: socket.socket) -> None:
    """connect(AF_UNSPEC): the kernel resets the TCP connection (RST), drops its send queue (lent pages
    included) and wakes every thread blocked on the socket."""
    with contextlib.suppress(OSError, ValueError):
        _LIBC.connect(sock.fileno(), ctypes.byref(_UNSPEC), ctypes.sizeof(_UNSPEC))


def _remaining(deadline: float | None) -> float:
    if deadline is None:
        return _NO_DEADLINE_S
    return max(deadline - time.monotonic(), _LAST_CHANCE_S)


def _rest_of_frame(deadline: float | None) -> float:
    """The deadline of the rest of a frame whose first byte arrived: `_FRAME_REST_S` from now at least."""
    rest = time.monotonic() + _FRAME_REST_S
    return rest if deadline is None else max(deadline, rest)


def _await(poller: select.poll, deadline: float | None) -> None:
    """Sleep until the socket `poller` watches is ready; socket.timeout once `deadline` passed. A passed deadline waits
    no more (one look), so a peer trickling bytes cannot hold a receive open past it, as a short wait each did."""
    left = _NO_DEADLINE_S if deadline is None else deadline - time.monotonic()
    if not poller.poll(min(math.ceil(left * 1000), _POLL_MAX_MS) if left > 0 else 0):
        raise socket.timeout("timed out")


def _payload_bytes(payload: Sequence[memoryview]) -> int:
    return sum(view.nbytes for view in payload)


class FrameStream:
    """Length-prefixed PeerFrames plus raw payloads over one connected stream socket."""

    def __init__(self, sock: socket.socket, peer: str = "peer", *, max_frame: int = MAX_FRAME) -> None:
        self.peer = peer
        self.max_frame = max_frame
        """Largest frame `recv()` accepts: HELLO_FRAME until the listener authenticated the connection."""
        self.nonce = b""
        """The listener's nonce, which every key proof on this connection is computed over."""
        self.peer_max_frame = MAX_FRAME
        """Largest frame the other end announced it accepts: `send()` refuses a larger one before it leaves."""
        self.inline_bytes = 0
        """Payload bytes that came inline with the frame `recv()` returned last (0: none, or not inline)."""
        self._proofs: dict[tuple[bytes, int], bytes] = {}
        self._tx = sock
        self._rx = sock.dup()
        for end in (self._tx, self._rx):  # non-blocking: try first, poll only when the kernel has nothing
            end.settimeout(0.0)
        self._tx_ready = select.poll()
        self._tx_ready.register(self._tx.fileno(), select.POLLOUT)
        self._rx_ready = select.poll()
        self._rx_ready.register(self._rx.fileno(), select.POLLIN)
        self._send_lock = threading.Lock()  # serializes whole frames (+ payload) from several threads; guards _lender
        self._lender = Lender()
        self._lowat = max(1, min(_LOWAT_BYTES, self._rx.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4))
        """Bytes a large receive waits for before waking (a quarter of the receive buffer at most: more could never arrive)."""
        self._ahead = bytearray(_AHEAD_BYTES)
        self._ahead_view = memoryview(self._ahead)
        self._head = 0
        self._tail = 0
        """Bytes read ahead and not consumed yet: `_ahead[_head:_tail]` (the reader thread's)."""
        self._inline_left = 0
        """Of the last frame's inline payload, the bytes not consumed yet: no frame is read before they are."""
        self._broken: BrokenResourceError | None = None
        self._closed = False

    def proof(self, access_key: bytes, epoch: int = 0) -> bytes:
        """`key_proof(access_key, nonce, epoch)` of this connection, computed once per key and epoch."""
        proof = self._proofs.get((access_key, epoch))
        if proof is None:
            proof = self._proofs[(access_key, epoch)] = key_proof(access_key, self.nonce, epoch)
        return proof

    def send(
        self, frame: peer_pb2.PeerFrame, payload: Sequence[memoryview] = (), deadline: float | None = None, *, lend: np.ndarray | None = None
    ) -> None:
        """Send one frame and, directly after it, the payload views (no intermediate buffer; inline up to INLINE_MAX).

        `lend`: the payload given as iovec rows (`hmc.transport._ranges.iovec_rows`)
        instead of views, for memory the caller keeps unchanged until the peer has
        acknowledged the bytes: its pages are lent to the socket, not copied into it
        (`hmc.transport._splice`). Payloads under LEND_MIN_BYTES, and what the
        kernel will not lend, are copied.
        """
        self.send_serialized(frame.SerializeToString(), payload, deadline, lend=lend)

    def send_framed(self, data: bytes, deadline: float | None = None) -> None:
        """Send a frame, no payload, that `framed()` prefixed (a constant reply, once): one send() where the socket
        takes it all."""
        with self._send_lock:
            self._check()
            try:
                try:
                    sent = self._tx.send(data)
                except BlockingIOError:
                    sent = 0
                if sent != len(data):
                    self._sendmsg_all([memoryview(data)[sent:]], deadline)
            except OSError as exc:
                raise self._translate(exc) from exc

    def send_serialized(
        self, body: bytes, payload: Sequence[memoryview] = (), deadline: float | None = None, *, lend: np.ndarray | None = None
    ) -> None:
        """`send()` of a frame serialized beforehand (constant replies are serialized once)."""
        assert lend is None or not payload, "a payload is given as views or as rows to lend, not both"
        if len(body) > self.peer_max_frame:
            raise UnsupportedError(f"a frame of {len(body)} bytes exceeds the {self.peer_max_frame} {self.peer} accepts")
        if lend is not None and int(lend[:, 1].sum()) < LEND_MIN_BYTES:
            payload, lend = _row_views(lend, 0), None
        nbytes = (payload[0].nbytes if len(payload) == 1 else _payload_bytes(payload)) if payload else 0
        if 0 < nbytes <= INLINE_MAX and len(body) <= _INLINE_BODY_MAX:
            head = _INLINE_HEADER.pack(len(body) | _INLINE, nbytes) + body
        elif not nbytes and lend is None:  # the frame alone
            self.send_framed(framed(body), deadline)
            return
        else:
            head = framed(body)
        with self._send_lock:
            self._check()
            try:
                if lend is None:
                    self._sendmsg_all([head, *payload], deadline, total=len(head) + nbytes)
                else:
                    self._sendmsg_all([head], deadline, socket.MSG_MORE)
                    lent = self._lender.send(self._tx, lend, time.monotonic() + _remaining(deadline))
                    self._sendmsg_all(_row_views(lend, lent), deadline)
            except OSError as exc:
                raise self._translate(exc) from exc

    def _sendmsg_all(self, parts: list[memoryview | bytes], deadline: float | None, flags: int = 0, *, total: int = -1) -> None:
        """Send `parts` in order (`total` bytes, when the caller knows: usually one sendmsg sends them all)."""
        index = 0
        while index < len(parts):
            batch = parts[index : index + IOV_MAX]
            try:
                sent = self._tx.sendmsg(batch, (), flags)
            except BlockingIOError:
                _await(self._tx_ready, deadline)
                continue
            if sent == total:
                return
            for part in batch:
                size = len(part) if isinstance(part, bytes) else part.nbytes
                if sent < size:
                    parts[index] = memoryview(part)[sent:]
                    break
                sent -= size
                index += 1

    def recv(self, deadline: float | None = None, *, idle_ok: bool = False, spin_s: float = 0.0) -> peer_pb2.PeerFrame:
        """The next frame (an inline payload, `inline_bytes` of it, waits read for `recv_into`).

        With `idle_ok`, a timeout before its first byte leaves the stream usable.
        `spin_s`: poll this long for the first byte before sleeping (an answer expected within microseconds).
        """
        if self._inline_left:
            raise self._protocol_error(f"a frame from {self.peer} was read before the previous one's inline payload")
        self.inline_bytes = 0
        if self._tail - self._head < _HEADER.size:
            self._fill(_HEADER.size, deadline, spin_until=time.monotonic() + spin_s if spin_s > 0 else 0.0, keep=idle_ok)
        word = _HEADER.unpack_from(self._ahead, self._head)[0]
        length = word & ~_INLINE
        if length > self.max_frame:
            raise self._protocol_error(f"frame of {length} bytes from {self.peer} exceeds {self.max_frame}")
        inline = 0
        header = _HEADER.size
        if word & _INLINE:
            header = _INLINE_HEADER.size
            if self._tail - self._head < header:
                self._fill(header, _rest_of_frame(deadline))
            inline = _INLINE_HEADER.unpack_from(self._ahead, self._head)[1]
            if self.max_frame <= HELLO_FRAME or length > _INLINE_BODY_MAX or inline > INLINE_MAX:
                raise self._protocol_error(f"inline frame of {length} + {inline} bytes from {self.peer} exceeds what is allowed")
        if not inline and header + length > len(self._ahead):
            body = self._recv_large(header, length, _rest_of_frame(deadline))
        else:
            if self._tail - self._head < header + length + inline:  # an inline payload arrives whole before the frame is returned
                self._fill(header + length + inline, _rest_of_frame(deadline))
            start = self._head + header
            body = self._ahead_view[start : start + length]
            self._head = start + length
        frame = peer_pb2.PeerFrame()
        try:
            frame.ParseFromString(body)
        except DecodeError as exc:
            raise self._protocol_error(f"undecodable frame from {self.peer}") from exc
        finally:
            body.release()
        self.inline_bytes = self._inline_left = inline
        return frame

    def _recv_large(self, header: int, length: int, deadline: float) -> memoryview:
        """A frame body larger than the read-ahead buffer: what was read ahead of it, the rest received straight in,
        into a buffer that doubles as the bytes arrive (from `_LARGE_START`): a length word alone reserves no more."""
        self._head += header
        body = bytearray(min(length, max(_LARGE_START, self._tail - self._head)))
        got = min(len(body), self._tail - self._head)
        body[:got] = self._ahead_view[self._head : self._head + got]
        self._head += got
        if self._head == self._tail:
            self._head = self._tail = 0
        while got < length:
            if got == len(body):
                body.extend(bytes(min(len(body), length - len(body))))
            with memoryview(body) as view:
                got += self._receive([view[got:]], deadline)
        return memoryview(body)

    def _fill(self, nbytes: int, deadline: float | None, *, spin_until: float = 0.0, keep: bool = False) -> None:
        """Read ahead until at least `nbytes` wait in the buffer (growing it to hold them)."""
        buffered = self._tail - self._head
        if buffered >= nbytes:
            return
        if self._head + nbytes > len(self._ahead):  # no room behind what is buffered: move it to the front
            if nbytes > len(self._ahead):
                grown = bytearray(max(nbytes, 2 * len(self._ahead)))
                grown[:buffered] = self._ahead_view[self._head : self._tail]
                self._ahead, self._ahead_view = grown, memoryview(grown)
            else:
                self._ahead[:buffered] = self._ahead[self._head : self._tail]
            self._head, self._tail = 0, buffered
        while self._tail - self._head < nbytes:
            self._tail += self._receive([self._ahead_view[self._tail :]], deadline, spin_until=spin_until, keep=keep and self._tail == self._head)

    def _take_ahead(self, pending: list[memoryview]) -> int:
        """Fill `pending` (no empty views) in order from the bytes read ahead (trimming a view left part-filled); the
        index of the first view not filled."""
        index = 0
        head, tail, ahead = self._head, self._tail, self._ahead_view
        while head < tail and index < len(pending):
            view = pending[index]
            if view.format != "B":
                view = pending[index] = view.cast("B")
            count = min(view.nbytes, tail - head)
            view[:count] = ahead[head : head + count]
            head += count
            index = _consume(pending, index, count)
        self._head = head
        if head == tail:
            self._head = self._tail = 0
        return index

    def _receive(
        self, into: list[memoryview], deadline: float | None, *, spin_until: float = 0.0, keep: bool = False, wait: bool = False
    ) -> int:
        """One receive of at least one byte into `into` (scattered); sleeps (after spinning until `spin_until`) only
        while nothing arrived, or first when `wait`."""
        sock = self._rx
        while True:
            if self._broken is not None:
                raise BrokenResourceError(str(self._broken))
            try:
                if wait:
                    _await(self._rx_ready, deadline)
                got = sock.recv_into(into[0]) if len(into) == 1 else sock.recvmsg_into(into)[0]
            except BlockingIOError:
                wait = not spin_until or time.monotonic() >= spin_until
                continue
            except OSError as exc:
                raise self._translate(exc, keep=keep) from exc
            if got == 0:
                raise self._eof()
            return got

    def readable(self, timeout: float = 0.0) -> bool:
        """True when a receive would not block (bytes wait, or the stream is broken), waiting up to `timeout` for it."""
        if self._broken is not None or self._tail > self._head:
            return True
        try:  # poll, not select: select refuses descriptors past 1023, and a serving engine holds thousands
            poller = select.poll()  # its own: a poll object refuses two threads at once
            poller.register(self._rx, select.POLLIN)
            if 0 < timeout < 1e-3:  # poll() counts whole milliseconds: a shorter nap is a look, a sleep, a look
                if poller.poll(0):
                    return True
                time.sleep(timeout)
                timeout = 0.0
            return bool(poller.poll(min(math.ceil(timeout * 1000), _POLL_MAX_MS) if timeout > 0 else 0))
        except (OSError, ValueError):  # closed meanwhile: a receive fails at once
            return True

    def recv_into(self, views: Sequence[memoryview], deadline: float | None = None, *, spin_s: float = 0.0) -> None:
        """Fill `views` in order with the payload that follows (scatter receive, zero copy beyond what was read
        ahead with the frame). An inline payload must be taken whole by one call, and no more than it.

        While at least twice `_lowat` bytes are left, the socket wakes this
        thread only once `_lowat` bytes wait (SO_RCVLOWAT): fewer, larger receives.
        Below that, `spin_s` of the call may be spent polling instead of sleeping
        (the rest of a payload whose frame just arrived is microseconds away).
        """
        self._check()
        if self._inline_left:  # all of it is here: copy it out
            asked = views[0].nbytes if len(views) == 1 else _payload_bytes(views)
            if asked != self._inline_left:
                raise self._protocol_error(f"{self.peer} sent {self._inline_left} bytes inline where {asked} were expected")
            self._inline_left = 0
            self._take_ahead([view for view in views if view.nbytes])  # an empty view would never be consumed
            return
        pending = [view for view in views if view.nbytes]
        index = self._take_ahead(pending) if self._tail > self._head else 0
        if index < len(pending):
            self._recv_exact_views(pending, index, deadline, time.monotonic() + spin_s if spin_s > 0 else 0.0)

    def _recv_exact_views(self, pending: list[memoryview], index: int, deadline: float | None, spin_until: float) -> None:
        left = _payload_bytes(pending[index:])
        sock = self._rx
        lowat = 1
        wait = False
        wait_from: float | None = None  # the first receive is the one look a passed deadline still gets
        try:
            while index < len(pending):
                if wait_from is not None and time.monotonic() > wait_from:  # nothing lands after the deadline
                    raise self._translate(socket.timeout("timed out"))
                wait_from = deadline
                want = self._lowat if left >= 2 * self._lowat else 1
                if want != lowat:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                    except OSError as exc:
                        raise self._translate(exc) from exc
                    lowat = want
                got = self._receive(pending[index : index + IOV_MAX], deadline, spin_until=0.0 if wait else spin_until, wait=wait)
                wait = lowat > 1  # a large receive sleeps until `_lowat` bytes wait rather than taking each trickle
                left -= got
                index = _consume(pending, index, got)
        finally:
            if lowat != 1:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)

    def discard(self, nbytes: int, deadline: float | None = None) -> None:
        """Read and drop `nbytes` of payload (a refused DataWrite's)."""
        if self._inline_left:  # at most INLINE_MAX bytes: a claim of more is refused before it is allocated
            if nbytes != self._inline_left:
                raise self._protocol_error(f"{self.peer} sent {self._inline_left} bytes inline where {nbytes} were expected")
            self.recv_into([memoryview(bytearray(nbytes))], deadline)
            return
        scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
        while nbytes > 0:
            self.recv_into([scratch[: min(nbytes, scratch.nbytes)]], deadline)
            nbytes -= min(nbytes, scratch.nbytes)

    def _translate(self, exc: OSError, *, keep: bool = False) -> HMCError:
        """The boundary: a socket timeout becomes TimeoutError (the stream survives only if `keep`), anything else breaks it."""
        if isinstance(exc, socket.timeout):
            if not keep:
                self._break(BrokenResourceError(f"stream to {self.peer} timed out mid-frame"))
            return TimeoutError(f"deadline passed talking to {self.peer}")
        error = BrokenResourceError(f"connection to {self.peer} broke: {exc}")
        self._break(error)
        return error

    def _protocol_error(self, message: str) -> ProtocolError:
        error = ProtocolError(message)
        self._break(error)
        return error

    def _eof(self) -> BrokenResourceError:
        error = BrokenResourceError(f"{self.peer} closed the connection")
        self._break(error)
        return error

    def _check(self) -> None:
        if self._broken is not None:
            raise BrokenResourceError(str(self._broken))

    def _break(self, error: BaseException) -> None:
        if self._broken is None:
            self._broken = BrokenResourceError(f"stream to {self.peer} is broken: {error}")

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def peer_left(self) -> bool:
        """Whether the peer closed or reset the connection, seen without reading anything (frames it sent before
        still wait to be read): an owner asks before serving a request that waited while it was not looking."""
        if self._broken is not None:
            return True
        poller = select.poll()
        poller.register(self._rx, select.POLLRDHUP)  # POLLHUP and POLLERR are always reported
        try:
            return bool(poller.poll(0))
        except OSError:
            return True

    def abort(self) -> None:
        """Reset the connection now: what the kernel still holds to send (lent pages included) is dropped, never
        sent, and every thread blocked on the stream wakes with BrokenResourceError."""
        self._break(BrokenResourceError("aborted locally"))
        _disconnect(self._tx)
        self.shutdown()

    def shutdown(self) -> None:
        """Wake any thread blocked on this stream; it sees BrokenResourceError."""
        self._break(BrokenResourceError("closed locally"))
        with contextlib.suppress(OSError):
            self._tx.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Shut down and release both socket objects; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.shutdown()
        self._tx.close()
        self._rx.close()
        if self._send_lock.acquire(timeout=_FRAME_REST_S):  # a sender on the shut-down socket fails at once
            try:
                self._lender.close()
            finally:
                self._send_lock.release()


def error_reply(exc: BaseException) -> peer_pb2.PeerReply:
    """A PeerReply carrying `exc` as an hmc.v1.Error (non-HMC errors travel as INTERNAL)."""
    code = exc.code if isinstance(exc, HMCError) else common_pb2.ERROR_CODE_INTERNAL
    return peer_pb2.PeerReply(error=common_pb2.Error(code=int(code), message=str(exc) or type(exc).__name__))


def raise_for_reply(reply: peer_pb2.PeerReply) -> None:
    """Raise the typed error a reply carries, if any."""
    if reply.HasField("error") and reply.error.code != common_pb2.ERROR_CODE_OK:
        raise error_from_code(reply.error.code, reply.error.message)


def framed(body: bytes) -> bytes:
    """A serialized frame with its length word, as `FrameStream.send_framed` sends it (no payload)."""
    return _HEADER.pack(len(body)) + body


OK_FRAME = framed(peer_pb2.PeerFrame(reply=peer_pb2.PeerReply()).SerializeToString())
"""The reply to almost every data request, framed once (a request id of 0 is not on the wire)."""
