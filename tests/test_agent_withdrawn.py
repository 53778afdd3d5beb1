"""What an agent does with hmcd's word that another agent's buffer left or came back: a descriptor of an epoch
the buffer was registered again after is stale; one of the epoch it left at is withdrawn until it is back; a
buffer its owner withdrew stays withdrawn. Two real agents; the events as hmcd delivers them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from hmc.agent import Agent
from hmc.agent._withdrawals import RemoteWithdrawals
from hmc.errors import BufferWithdrawnError, HMCError, StaleDescriptorError, UnknownBufferError
from hmc.v1 import common_pb2, daemon_pb2

EPOCH = 1_000
POISON = 0xA5


@pytest.fixture
def pair(make_agent: Callable[..., Agent], rng: np.random.Generator) -> tuple[Agent, object, Callable[[int], str], np.ndarray, np.ndarray]:
    initiator, owner = make_agent(), make_agent()
    data = rng.integers(0, 256, 4096, dtype=np.uint8)
    source = initiator.register(data.copy())
    target = np.full(4096, POISON, dtype=np.uint8)
    buffer = owner.register(target)

    def outcome(epoch: int) -> str:
        remote = common_pb2.BufferDescriptor()
        remote.CopyFrom(buffer.descriptor)
        remote.registry_epoch = epoch
        try:
            initiator.write(source, remote, 0, 0, 4096).wait(5.0)
        except StaleDescriptorError:
            return "stale"
        except BufferWithdrawnError:
            return "withdrawn"
        except HMCError:
            return "refused by the owner"  # an epoch the owner (embedded: epoch 0) does not know
        return "written"

    return initiator, buffer, outcome, target, data


def _event(kind: int, buffer: object, epoch: int) -> daemon_pb2.Event:
    descriptor = common_pb2.BufferDescriptor()
    descriptor.CopyFrom(buffer.descriptor)  # type: ignore[attr-defined]
    descriptor.registry_epoch = epoch
    return daemon_pb2.Event(kind=kind, buffer=descriptor, agent_id=descriptor.owner.id, node="elsewhere")


def test_a_node_that_left_and_came_back_at_the_same_epoch(pair: tuple) -> None:
    initiator, buffer, outcome, target, data = pair
    initiator._on_hmcd_event(_event(daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN, buffer, EPOCH))  # its node's lease ran out
    assert (outcome(EPOCH), outcome(0)) == ("withdrawn", "withdrawn")
    assert np.all(target == POISON)  # nothing moved
    initiator._on_hmcd_event(_event(daemon_pb2.EVENT_KIND_BUFFER_ADDED, buffer, EPOCH))  # back, same start of its hmcd
    assert outcome(EPOCH) == "refused by the owner" and outcome(0) == "written"
    assert np.array_equal(target, data)


def test_a_node_that_started_again(pair: tuple) -> None:
    initiator, buffer, outcome, _, _ = pair
    initiator._on_hmcd_event(_event(daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN, buffer, EPOCH))
    initiator._on_hmcd_event(_event(daemon_pb2.EVENT_KIND_BUFFER_ADDED, buffer, 2 * EPOCH))
    assert outcome(EPOCH) == "stale" and outcome(EPOCH - 1) == "stale"
    assert outcome(2 * EPOCH) == "refused by the owner" and outcome(0) == "written"


def test_a_buffer_its_owner_withdrew_stays_withdrawn(pair: tuple) -> None:
    initiator, buffer, outcome, target, _ = pair
    initiator._on_hmcd_event(_event(daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN, buffer, EPOCH))
    initiator._on_hmcd_event(_event(daemon_pb2.EVENT_KIND_BUFFER_ADDED, buffer, 2 * EPOCH))
    initiator._remote_withdrawn(buffer.descriptor.owner.id, buffer.id)  # the owner's own Withdrawn frame
    assert {outcome(e) for e in (0, EPOCH, 2 * EPOCH, 3 * EPOCH)} == {"withdrawn"}
    initiator._on_hmcd_event(_event(daemon_pb2.EVENT_KIND_BUFFER_ADDED, buffer, 3 * EPOCH))  # never undoes the owner's word
    assert outcome(3 * EPOCH) == "withdrawn" and np.all(target == POISON)


def test_the_withdrawals_remembered_are_bounded_and_a_forgotten_one_is_refused_by_its_owner(
    make_agent: Callable[..., Agent], rng: np.random.Generator
) -> None:
    """hmcd relays every withdrawal of the cluster, so an agent remembers the most recent ones only; a descriptor of a
    buffer it forgot is still refused, typed, by the buffer's owner, and nothing lands."""
    initiator, owner = make_agent(), make_agent()
    initiator._withdrawn_remote = RemoteWithdrawals(remember=4)
    source = initiator.register(rng.integers(0, 256, 4096, dtype=np.uint8))
    target = np.full(4096, POISON, dtype=np.uint8)
    gone = owner.register(target)
    descriptor = gone.descriptor
    owner.unregister(gone)
    initiator._remote_withdrawn(owner.id, gone.id)  # as hmcd relays it
    with pytest.raises(BufferWithdrawnError, match="withdrawn by its owner"):  # refused here, before any path runs
        initiator.write(source, descriptor, 0, 0, 4096)
    for n in range(4):  # four later withdrawals elsewhere in the cluster push it out
        initiator._remote_withdrawn("elsewhere", f"other-{n}")
    with pytest.raises(UnknownBufferError) as refused:  # its owner refuses it (BufferWithdrawnError is one)
        initiator.write(source, descriptor, 0, 0, 4096).wait(5.0)
    assert "by its owner" not in str(refused.value)  # the owner's word ("was withdrawn"), not this agent's record's
    assert np.all(target == POISON)


def test_the_record_forgets_the_withdrawal_seen_longest_ago() -> None:
    record = RemoteWithdrawals(remember=2)
    a, b, c = (common_pb2.BufferDescriptor(id=name) for name in "abc")
    record.withdrawn("a")
    record.withdrawn("b")
    record.withdrawn("a")  # seen again: the most recent
    record.withdrawn("c")  # b goes
    for kept in (a, c):
        with pytest.raises(BufferWithdrawnError):
            record.check(kept)
    record.check(b)
