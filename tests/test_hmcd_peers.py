"""Two hmcd on one machine with static peers: health, lookups by name across nodes, forwarded transfers, relayed events."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from control_fixtures import PEER_CHECK_INTERVAL_S, DaemonSet, FakeAgent, Hmcd, daemon_set, start_peered, wait_until

from hmc.control import Client
from hmc.errors import UnavailableError, UnknownBufferError
from hmc.v1 import common_pb2, daemon_pb2

TOKEN = "cluster-secret"


@pytest.fixture(scope="module")
def daemons() -> Iterator[DaemonSet]:
    yield from daemon_set()


@pytest.fixture(scope="module")
def nodes(daemons: DaemonSet) -> tuple[Hmcd, Hmcd]:
    return start_peered(daemons, "node-a", "node-b", TOKEN)


@pytest.fixture(scope="module")
def node_a(nodes: tuple[Hmcd, Hmcd]) -> Hmcd:
    return nodes[0]


@pytest.fixture(scope="module")
def node_b(nodes: tuple[Hmcd, Hmcd]) -> Hmcd:
    return nodes[1]


@pytest.fixture(scope="module")
def agents(node_a: Hmcd, node_b: Hmcd) -> Iterator[tuple[FakeAgent, FakeAgent]]:
    on_a, on_b = FakeAgent(node_a.config()), FakeAgent(node_b.config())
    on_a.register("kv-on-a", size=1 << 20)
    on_b.register("kv-on-b", size=1 << 20)
    yield on_a, on_b
    on_a.close()
    on_b.close()


def test_peer_status_in_node_info(node_a: Hmcd, node_b: Hmcd) -> None:
    with node_a.client() as client:
        (peer,) = client.node_info().peers
    assert peer.address == node_b.tcp_address and peer.node == "node-b" and peer.up and not peer.error
    with Client(config=node_a.config()) as client:
        assert "hmc_peers_up 1.0" in client.metrics()


def test_lookup_by_name_falls_through_to_the_peer(node_a: Hmcd, agents: tuple[FakeAgent, FakeAgent]) -> None:
    on_a, _ = agents
    with node_a.client() as client:
        remote = client.lookup("kv-on-b")
        assert remote.owner.node == "node-b" and remote.size == 1 << 20
        assert client.lookup(f"id:{remote.id}").name == "kv-on-b"
        assert {b.name for b in client.buffers()} >= {"kv-on-a", "kv-on-b"}
        assert "kv-on-b" not in {b.name for b in client.buffers(local_only=True)}
        with pytest.raises(UnknownBufferError, match="node-b"):
            client.lookup("kv-nowhere")
    assert on_a.link.lookup("kv-on-b").owner.node == "node-b"  # the agent's lookups fall through too


def test_over_tcp_with_the_token(node_a: Hmcd, agents: tuple[FakeAgent, FakeAgent]) -> None:
    with Client(node_a.tcp_address, config=node_a.config()) as client:
        assert client.lookup("kv-on-b").owner.node == "node-b"
        choice = client.path("kv-on-a", "kv-on-b")
    assert choice.path.value == "ipc"  # two nodes, one host: same boot id
    assert any(path.value == "local" for path, _ in choice.rejected)


def test_transfer_from_a_peer_buffer_is_forwarded_to_its_hmcd(node_a: Hmcd, agents: tuple[FakeAgent, FakeAgent]) -> None:
    on_a, on_b = agents
    with node_a.client() as client:
        status = client.submit("kv-on-b", "kv-on-a", [0, 8192], [4096, 0], 4096, timeout=5.0)
        assert status.executor_agent == on_b.info.id
        wait_until(lambda: any(i.transfer_id == status.transfer_id for i in on_b.instructions), what="instruction on node-b")
        instruction = next(i for i in on_b.instructions if i.transfer_id == status.transfer_id)
        assert instruction.op == common_pb2.TRANSFER_OP_WRITE and instruction.remote.name == "kv-on-a"
        assert instruction.remote.owner.node == "node-a"
        on_b.link.report(daemon_pb2.TransferReport(transfer_id=status.transfer_id, state=common_pb2.TRANSFER_STATE_DONE, bytes_done=8192))
        done = client.wait(status.transfer_id, timeout=5.0)
        assert done.state == common_pb2.TRANSFER_STATE_DONE and done.bytes_done == 8192
        local = client.submit("kv-on-a", "kv-on-b", 0, 0, 4096, timeout=5.0)
        assert local.executor_agent == on_a.info.id
        wait_until(lambda: any(i.transfer_id == local.transfer_id for i in on_a.instructions), what="instruction on node-a")
        client.cancel(local.transfer_id)


def test_peer_events_are_relayed_and_peer_down_is_seen(daemons: DaemonSet, node_a: Hmcd, agents: tuple[FakeAgent, FakeAgent]) -> None:
    on_a, _ = agents
    node_c = daemons.start("node-c", token=TOKEN)
    node_d = daemons.start("node-d", token=TOKEN, static_peers=(node_c.tcp_address, node_a.tcp_address))
    agent_c = FakeAgent(node_c.config())
    try:
        with node_d.client() as client:
            wait_until(lambda: all(p.up for p in client.node_info().peers), what="node-d to see its peers")
            desc = agent_c.register("kv-on-c", size=4096)
            watcher_d = FakeAgent(node_d.config())
            try:
                with client.events(timeout=5.0 + 10 * PEER_CHECK_INTERVAL_S, include_peers=True) as events:
                    agent_c.close()
                    relayed = next(e for e in events if e.kind == daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN)
                    assert relayed.buffer.id == desc.id and relayed.node == "node-c" and relayed.peer == node_c.tcp_address
                    wait_until(lambda: any(e.buffer.id == desc.id for e in watcher_d.events), what="relayed withdrawal on node-d's agent stream")
                    node_c.stop()
                    down = next(e for e in events if e.kind == daemon_pb2.EVENT_KIND_PEER_DOWN)
                    assert down.peer == node_c.tcp_address and down.node == "node-d"
            finally:
                watcher_d.close()
            peers = {p.address: p for p in client.node_info().peers}
            assert not peers[node_c.tcp_address].up and "node-c" not in peers[node_c.tcp_address].error
            assert peers[node_a.tcp_address].up
            with pytest.raises(UnavailableError, match=node_c.tcp_address):  # node-c might hold it: not "unknown"
                client.lookup("kv-elsewhere")
            assert client.lookup("kv-on-a").owner.node == "node-a"
    finally:
        agent_c.close()
        node_d.stop()


def test_wrong_cluster_token_marks_the_peer_down(daemons: DaemonSet, node_b: Hmcd) -> None:
    stranger = daemons.start("stranger", token="other-secret", static_peers=(node_b.tcp_address,))
    with stranger.client() as client:
        wait_until(lambda: client.node_info().peers[0].error != "", what="a failed health check")
        (peer,) = client.node_info().peers
        assert not peer.up and "token" in peer.error
    stranger.stop()


def test_a_static_peer_list_that_names_this_node_is_fine(daemons: DaemonSet, node_b: Hmcd) -> None:
    with socket.socket() as probe:  # a free port (tiny race, acceptable in a test)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    own = f"127.0.0.1:{port}"
    shared = daemons.start("shared-list", token=TOKEN, static_peers=(own, node_b.tcp_address), extra_args=("--listen", own))
    assert shared.port == port
    with shared.client() as client:
        wait_until(lambda: [p.address for p in client.node_info().peers] == [node_b.tcp_address], what="self to be dropped from the peers")
    shared.stop()
