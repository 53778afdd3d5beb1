"""Prepared transfers: checked once, posted again and again, with a real peer agent in another process."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hmc import PreparedTransfer
from hmc.agent import Agent
from hmc.agent._transfer import _FinishedHandle
from hmc.config import Config
from hmc.errors import AccessDeniedError, BufferWithdrawnError, ClosedResourceError, NoPathError
from hmc.testing import PeerProcess
from hmc.testing import ranges_digest as _digest

SIZE = 1 << 20
POISON = 0xA5


@pytest.mark.parametrize("path", [None, "staged"])
def test_a_prepared_single_range_write_moves_fresh_bytes_on_every_post(agent: Agent, peer: PeerProcess, rng: np.random.Generator, path: str | None) -> None:
    source = agent.register(rng.integers(0, 256, SIZE, dtype=np.uint8))
    remote = peer.register(SIZE)
    peer.poison(remote.id, POISON)
    prepared = agent.prepare_write(source, remote, 4093, 65_537, 300_001, path=path)
    assert isinstance(prepared, PreparedTransfer) and prepared.nbytes == 300_001
    for round_ in range(4):
        source.numpy()[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)  # new bytes each time: every post must move them
        handle = prepared.post()
        handle.wait()
        assert handle.path == (path or "ipc")
        assert peer.digest(remote.id, [65_537], [300_001]) == _digest(source.numpy(), np.array([4093]), np.array([300_001])), round_
    untouched = np.full(SIZE, POISON, np.uint8)
    assert peer.digest(remote.id, [0, 365_538], [65_537, SIZE - 365_538]) == _digest(untouched, np.array([0, 365_538]), np.array([65_537, SIZE - 365_538]))


def test_a_prepared_small_write_takes_the_fast_path_once_the_pair_has_one(agent: Agent, peer: PeerProcess, rng: np.random.Generator) -> None:
    source = agent.register(rng.integers(0, 256, SIZE, dtype=np.uint8))
    remote = peer.register(SIZE)
    prepared = agent.prepare_write(source, remote, 0, 8192, 4096)
    first = prepared.post()  # the pair has moved nothing yet: the full path, which learns the route
    first.wait()
    assert type(first) is not _FinishedHandle
    later = prepared.post()
    assert type(later) is _FinishedHandle and later.path == "ipc" and later.bytes_total == 4096
    assert prepared.post() is later  # one request, reposted: fast-path posts share their finished handle
    assert prepared.post(notify=b"n") is not later  # a notification takes the full path, with a handle of its own
    assert peer.digest(remote.id, [8192], [4096]) == _digest(source.numpy(), np.array([0]), np.array([4096]))


def test_a_prepared_batch_write_and_read_move_every_range(agent: Agent, peer: PeerProcess, rng: np.random.Generator) -> None:
    block, count = 16 << 10, 48
    src_offsets = rng.permutation(SIZE // block)[:count] * block
    dst_offsets = rng.permutation(SIZE // block)[:count] * block
    lengths = np.full(count, block)
    source = agent.register(rng.integers(0, 256, SIZE, dtype=np.uint8))
    sink = agent.register(np.full(SIZE, POISON, np.uint8))
    remote = peer.register(SIZE)
    peer.poison(remote.id, POISON)
    write = agent.prepare_write(source, remote, src_offsets, dst_offsets, lengths)
    read = agent.prepare_read(sink, remote, dst_offsets, src_offsets, lengths)
    for _ in range(2):
        source.numpy()[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
        sink.numpy()[:] = POISON
        write.post().wait()
        assert peer.digest(remote.id, dst_offsets, lengths) == _digest(source.numpy(), src_offsets, lengths)
        read.post().wait()
        assert _digest(sink.numpy(), src_offsets, lengths) == _digest(source.numpy(), src_offsets, lengths)
    outside = np.setdiff1d(np.arange(SIZE // block) * block, src_offsets)
    assert (sink.numpy().reshape(-1, block)[outside // block] == POISON).all()


@pytest.mark.parametrize("path", [None, "staged"])
def test_a_prepared_batch_moves_the_ranges_it_was_given_whatever_the_caller_writes_into_its_arrays_later(
    agent: Agent, peer: PeerProcess, rng: np.random.Generator, path: str | None,
) -> None:
    """The caller's offset and length arrays are copied when the transfer is prepared: offsets rewritten afterwards,
    one of them past the end of the remote buffer, change nothing: the checked ranges move, no byte lands elsewhere."""
    block, count = 4096, 16
    src_offsets = (rng.permutation(SIZE // block)[:count] * block).astype(np.int64)
    dst_offsets = (rng.permutation(SIZE // block)[:count] * block).astype(np.int64)
    lengths = np.full(count, block, np.int64)
    source = agent.register(rng.integers(0, 256, SIZE, dtype=np.uint8))
    remote = peer.register(SIZE)
    peer.poison(remote.id, POISON)
    prepared = agent.prepare_write(source, remote, src_offsets, dst_offsets, lengths, path=path)
    checked = dst_offsets.copy()
    dst_offsets[:] = dst_offsets[::-1]
    dst_offsets[-1] = SIZE - block // 2  # half past the end
    lengths[0] = SIZE
    prepared.post().wait()
    assert peer.digest(remote.id, checked, np.full(count, block)) == _digest(source.numpy(), src_offsets, np.full(count, block))
    rest = np.setdiff1d(np.arange(SIZE // block) * block, checked)
    assert peer.digest(remote.id, rest, np.full(rest.size, block)) == _digest(np.full(SIZE, POISON, np.uint8), rest, np.full(rest.size, block))


def test_prepared_notifications_arrive_once_per_post(agent: Agent, peer: PeerProcess, rng: np.random.Generator) -> None:
    source = agent.register(rng.integers(0, 256, SIZE, dtype=np.uint8))
    remote = peer.register(SIZE)
    prepared = agent.prepare_write(source, remote, 0, 0, 4096)
    for index in range(3):
        prepared.post(notify=b"slot-%d" % index).wait()
    deadline = time.monotonic() + 10
    got: list[tuple[bytes, str]] = []
    while len(got) < 3 and time.monotonic() < deadline:
        got += [(n.payload, n.transfer_id) for n, _ in peer.notifications(timeout=1.0)]
    assert [payload for payload, _ in got] == [b"slot-0", b"slot-1", b"slot-2"]
    assert len({transfer_id for _, transfer_id in got}) == 3  # three transfers, not one reposted id


def test_what_a_pair_cannot_do_is_refused_when_prepared(agent: Agent, peer: PeerProcess) -> None:
    remote = peer.register(SIZE)
    frozen = agent.register(memoryview(bytes(SIZE)))  # read-only memory never receives a read
    with pytest.raises(AccessDeniedError):
        agent.prepare_read(frozen, remote, 0, 0, 16)
    with pytest.raises(NoPathError):  # a path this pair does not have
        agent.prepare_write(agent.register(np.ones(SIZE, np.uint8)), remote, 0, 0, 16, path="rdma")


def test_a_prepared_write_to_a_withdrawn_buffer_fails_typed(agent: Agent, peer: PeerProcess, rng: np.random.Generator) -> None:
    source = agent.register(rng.integers(0, 256, SIZE, dtype=np.uint8))
    remote = peer.register(SIZE)
    prepared = agent.prepare_write(source, remote, 0, 0, 4096)
    prepared.post().wait()
    prepared.post().wait()
    peer.unregister(remote.id)
    deadline = time.monotonic() + 10
    while remote.id in source.inline_routes and time.monotonic() < deadline:  # the owner's withdrawal reaches us
        time.sleep(0.01)
    with pytest.raises(BufferWithdrawnError):
        prepared.post().wait()


def test_a_prepared_transfer_keeps_its_own_copy_of_the_descriptor(agent: Agent, peer: PeerProcess, rng: np.random.Generator) -> None:
    source = agent.register(rng.integers(0, 256, SIZE, dtype=np.uint8))
    remote = peer.register(SIZE)
    prepared = agent.prepare_write(source, remote, 0, 0, 4096)
    remote.access_key = b"x" * 16  # the caller's message changes; the prepared transfer does not
    prepared.post().wait()
    prepared.post().wait()
    assert peer.digest(remote.id, [0], [4096]) == _digest(source.numpy(), np.array([0]), np.array([4096]))


def test_posting_on_a_closed_agent_is_refused(config: Config, peer: PeerProcess) -> None:
    agent = Agent(config, daemon=False)
    source = agent.register(np.ones(SIZE, np.uint8))
    prepared = agent.prepare_write(source, peer.register(SIZE), 0, 0, 4096)
    prepared.post().wait()
    agent.close()
    with pytest.raises(ClosedResourceError):
        prepared.post()
