"""The staged path (pipelined TCP streams) between real processes."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import numpy as np

from hmc.agent import Agent
from hmc.config import Config, PathPolicy
from hmc.testing import PeerProcess, TransportPair, check_transport

POISON = 0xA5
STAGED = PathPolicy(allow=("staged",))


def test_staged_conforms(config: Config, make_peer: Callable[..., PeerProcess]) -> None:
    @contextlib.contextmanager
    def pair() -> Iterator[TransportPair]:
        peer = make_peer(("staged",))
        with Agent(config.replace(policy=STAGED), daemon=False) as a:
            yield TransportPair(a, peer, "staged", stalled=peer.stalled)

    check_transport(pair)


def test_peer_process_writes_and_reads_our_buffer(config: Config, make_peer: Callable[..., PeerProcess], rng: np.random.Generator) -> None:
    peer = make_peer(("staged",))
    with Agent(config, daemon=False) as a:
        mine = a.register(np.full((1 << 20) + 1, POISON, np.uint8))
        theirs = peer.register(1 << 20)
        data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
        peer.fill(theirs.id, data.tobytes())
        assert peer.transfer("write", theirs.id, mine.descriptor, 1, 0, (1 << 20) - 1, notify=b"x") == "staged"
        expected = np.full(mine.size, POISON, np.uint8)
        expected[: (1 << 20) - 1] = data[1:]
        assert np.array_equal(mine.numpy(), expected)
        assert [n.payload for n in a.notifications(5.0)] == [b"x"]
        assert peer.transfer("read", theirs.id, mine.descriptor, 0, 0, 1 << 20) == "staged"
        assert peer.contents(theirs.id) == mine.numpy()[: 1 << 20].tobytes()


def test_many_small_ranges_pipeline_over_reused_streams(config: Config, make_peer: Callable[..., PeerProcess], rng: np.random.Generator) -> None:
    peer = make_peer()
    size = 16 << 20
    remote = peer.register(size, fill=POISON)
    with Agent(config.replace(policy=STAGED, staged_chunk_bytes=64 << 10, staged_streams=3), daemon=False) as a:
        src = a.register(rng.integers(0, 256, size, dtype=np.uint8))
        count = 6000
        slots = rng.permutation(size // 2048)[:count]
        lengths = rng.integers(1, 2049, count)
        offsets = rng.integers(0, size - 2048, count)
        for _ in range(2):
            handle = a.write(src, remote, offsets, slots * 2048, lengths)
            handle.wait()
            assert handle.bytes_done == int(lengths.sum())
        expected = np.full(size, POISON, np.uint8)
        for s, d, n in zip(offsets.tolist(), (slots * 2048).tolist(), lengths.tolist()):
            expected[d : d + n] = src.numpy()[s : s + n]
        assert np.array_equal(np.frombuffer(peer.contents(remote.id), np.uint8), expected)
        back = a.register(np.zeros(size, np.uint8))
        a.read(back, remote, slots * 2048, offsets, lengths).wait()
        check = np.zeros(size, np.uint8)
        for s, d, n in zip((slots * 2048).tolist(), offsets.tolist(), lengths.tolist()):
            check[d : d + n] = expected[s : s + n]
        assert np.array_equal(back.numpy(), check)
        senders = [t.name for t in threading.enumerate() if t.name.startswith("hmc-staged-tx-")]
        assert len(senders) == 3, senders


def test_zero_length_batch_completes_without_traffic(config: Config, peer: PeerProcess) -> None:
    remote = peer.register(4096, fill=POISON)
    with Agent(config.replace(policy=STAGED), daemon=False) as a:
        src = a.register(np.ones(4096, np.uint8))
        handle = a.write(src, remote, np.array([], np.int64), np.array([], np.int64), np.array([], np.int64))
        handle.wait()
        assert handle.bytes_total == 0
        assert peer.contents(remote.id) == bytes([POISON]) * 4096
