"""Control channels asked at once (`request_each`): every request has the whole deadline, whatever the others do.

Real channels over socket pairs; the owners' handlers answer at once, refuse, never answer, or go away.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from hmc.errors import AccessDeniedError, BrokenResourceError, TimeoutError
from hmc.transport._channel import DEFERRED, Channel, request_each
from hmc.transport._wire import FrameStream
from hmc.v1 import peer_pb2

Handler = Callable[[peer_pb2.PeerFrame], peer_pb2.PeerReply]


@pytest.fixture
def connect() -> Iterator[Callable[[Handler], Channel]]:
    """A channel to an owner whose requests `handler` answers (both ends closed at teardown)."""
    made: list[Channel] = []

    def make(handler: Handler) -> Channel:
        a, b = socket.socketpair()
        owner = Channel(FrameStream(b, "initiator"), handler, name="hmc-test-owner").start()
        asker = Channel(FrameStream(a, "owner"), lambda frame: peer_pb2.PeerReply(), name="hmc-test-asker").start()
        made.extend((owner, asker))
        return asker

    yield make
    for channel in made:
        channel.close()


def _withdrawn() -> peer_pb2.PeerFrame:
    return peer_pb2.PeerFrame(withdrawn=peer_pb2.Withdrawn(buffer_id="b"))


def test_a_silent_peer_costs_the_others_nothing(connect: Callable[[Handler], Channel]) -> None:
    """The silent owner is asked first. Asked one after the other, the owners after it got what was left of the
    deadline after the first had used it all: nothing, so each timed out too."""
    seen = threading.Event()

    def silent(frame: peer_pb2.PeerFrame) -> peer_pb2.PeerReply:
        seen.set()
        return DEFERRED  # and never replies

    def refuse(frame: peer_pb2.PeerFrame) -> peer_pb2.PeerReply:
        raise AccessDeniedError("not yours")

    channels = [connect(silent), connect(lambda frame: peer_pb2.PeerReply(payload_bytes=7)), connect(refuse)]
    started = time.monotonic()
    outcomes = request_each([(channel, _withdrawn()) for channel in channels], started + 0.5)
    assert seen.is_set() and isinstance(outcomes[0], TimeoutError)
    assert isinstance(outcomes[1], peer_pb2.PeerReply) and outcomes[1].payload_bytes == 7
    assert isinstance(outcomes[2], AccessDeniedError)
    assert time.monotonic() - started < 5.0  # bounded by the deadline (and the channel's expiry tick), not hung


def test_a_closed_or_vanishing_peer_is_a_typed_error_and_nothing_waits_for_it(connect: Callable[[Handler], Channel]) -> None:
    gone = connect(lambda frame: peer_pb2.PeerReply())
    gone.close()
    owners: list[Channel] = []

    def vanish(frame: peer_pb2.PeerFrame) -> peer_pb2.PeerReply:
        owners[0].stream.shutdown()  # the owner goes away while the request is pending
        return DEFERRED

    vanishing = connect(vanish)
    owners.append(vanishing)  # (its own end: shutting the stream down breaks the connection for both)
    answering = connect(lambda frame: peer_pb2.PeerReply(payload_bytes=1))
    outcomes = request_each([(gone, _withdrawn()), (vanishing, _withdrawn()), (answering, _withdrawn())], time.monotonic() + 30)
    assert isinstance(outcomes[0], BrokenResourceError) and isinstance(outcomes[1], BrokenResourceError)
    assert isinstance(outcomes[2], peer_pb2.PeerReply) and outcomes[2].payload_bytes == 1
    assert request_each([], time.monotonic()) == []
