"""What only the etcd directory does: cluster-wide names, node names held by one host, several endpoints, TLS,
a hostile etcd, the lease taken over on a fast restart. Real hmcd processes, a real etcd (Debian's etcd-server)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from control_fixtures import DaemonSet, FakeAgent, clean_env, descriptor, etcd_server, wait_until

from hmc.config import Config
from hmc.control import Client
from hmc.control._etcd import EtcdClient, EtcdSettings, prefix_end
from hmc.errors import ArgumentError, BusyResourceError, UnavailableError, UnknownBufferError
from hmc.testing import EtcdServer, HmcdProcess, etcd_available, make_certificates

TTL_S = 2


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    yield from etcd_server()


@pytest.fixture
def daemons() -> Iterator[DaemonSet]:
    built = DaemonSet()
    yield built
    built.close()


def _args(etcd: EtcdServer | str, prefix: str, *more: str) -> tuple[str, ...]:
    endpoint = etcd if isinstance(etcd, str) else etcd.endpoint
    return ("--etcd", endpoint, "--etcd-lease-ttl", str(TTL_S), "--etcd-prefix", prefix, *more)


def _prefix() -> str:
    return f"/test-{uuid.uuid4().hex[:8]}"


def _etcd_call(etcd: EtcdServer, coroutine_factory: object) -> object:
    async def run() -> object:
        client = EtcdClient(EtcdSettings([etcd.endpoint]))
        try:
            return await coroutine_factory(client)  # type: ignore[operator]
        finally:
            await client.close()

    return asyncio.run(run())


def test_names_are_unique_across_the_cluster(etcd: EtcdServer, daemons: DaemonSet) -> None:
    prefix = _prefix()
    a, b = daemons.start("uniq-a", extra_args=_args(etcd, prefix)), daemons.start("uniq-b", extra_args=_args(etcd, prefix))
    on_a, on_b = FakeAgent(a.config()), FakeAgent(b.config())
    try:
        held = on_a.register("the-name")
        with pytest.raises(BusyResourceError, match="held cluster-wide by buffer.*uniq-a"):
            on_b.register("the-name")
        with b.client() as client:
            assert client.buffers(local_only=True) == []  # refused means nothing registered
        on_a.link.unregister(held.id)
        with b.client() as client:
            wait_until(lambda: "the-name" not in {d.name for d in client.buffers()}, what="the name to be free")
        assert on_b.register("the-name").name == "the-name"  # free once its holder let go
    finally:
        on_a.close()
        on_b.close()


def test_two_nodes_racing_for_one_name_get_one_winner(etcd: EtcdServer, daemons: DaemonSet) -> None:
    prefix = _prefix()
    nodes = [daemons.start(f"race-{i}", extra_args=_args(etcd, prefix)) for i in range(2)]
    agents = [FakeAgent(node.config()) for node in nodes for _ in range(3)]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(agents)) as pool:
            outcomes = list(pool.map(lambda agent: _try_register(agent, "contended"), agents))
        assert sum(outcome == "ok" for outcome in outcomes) == 1, outcomes
        assert all(outcome in ("ok", "BusyResourceError") for outcome in outcomes), outcomes
    finally:
        for agent in agents:
            agent.close()


def _try_register(agent: FakeAgent, name: str) -> str:
    try:
        agent.register(name)
    except BusyResourceError:
        return "BusyResourceError"
    return "ok"


def test_a_node_name_is_held_by_one_host(etcd: EtcdServer, daemons: DaemonSet) -> None:
    prefix = _prefix()
    daemons.start("twin", extra_args=_args(etcd, prefix))
    other = Path(daemons.directory, "other-host")
    other.mkdir(mode=0o700)
    with pytest.raises(UnavailableError, match="held in etcd by an hmcd on host"):
        HmcdProcess.start(other, "twin", args=_args(etcd, prefix), env=clean_env(HMC_HOST_ID="another-host"))


def test_a_restart_faster_than_the_ttl_takes_the_old_lease_over(etcd: EtcdServer, daemons: DaemonSet) -> None:
    prefix = _prefix()
    watcher = daemons.start("over-watcher", extra_args=_args(etcd, prefix, "--etcd-lease-ttl", "30"))
    node = daemons.start("over-node", extra_args=_args(etcd, prefix, "--etcd-lease-ttl", "30"))  # a TTL the test would not wait out
    agent = FakeAgent(node.config())
    try:
        agent.register("over-buffer")
        with watcher.client() as client:
            wait_until(lambda: "over-buffer" in {d.name for d in client.buffers()}, what="the buffer at the watcher")
            old_epoch = client.lookup("over-buffer").registry_epoch
        node.kill()
        node = daemons.restart(node, extra_args=_args(etcd, prefix, "--etcd-lease-ttl", "30"))
        with watcher.client() as client, node.client() as own:
            epoch = own.node_info().registry_epoch
            wait_until(lambda: _epoch_of(client, "over-buffer") == epoch > old_epoch, timeout=5, what="the new epoch at the watcher")
            assert [n.epoch for n in client.node_info().directory.nodes if n.node == "over-node"] == [epoch]
    finally:
        agent.close()


def _epoch_of(client: Client, name: str) -> int:
    """The registry epoch of the descriptor `client` finds for `name` (0 while it finds none)."""
    try:
        return client.lookup(name).registry_epoch
    except UnknownBufferError:
        return 0


def test_a_dead_endpoint_is_skipped(etcd: EtcdServer, daemons: DaemonSet) -> None:
    prefix = _prefix()
    dead = f"http://127.0.0.1:{_closed_port()}"
    node = daemons.start("endpoints", extra_args=("--etcd", dead, *_args(etcd, prefix)))
    agent = FakeAgent(node.config())
    try:
        agent.register("via-second-endpoint")
        with node.client() as client:
            status = client.node_info().directory
            assert status.connected and list(status.endpoints) == [dead, etcd.endpoint]
        keys = _etcd_call(etcd, lambda c: c.get_prefix(prefix.encode() + b"/", 5))
        assert any(kv.key.endswith(b"/names/via-second-endpoint") for kv in keys.kvs)  # type: ignore[attr-defined]
    finally:
        agent.close()


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_without_etcd_hmcd_serves_locally_and_refuses_to_guess(daemons: DaemonSet) -> None:
    node = daemons.start("no-etcd", extra_args=_args(f"http://127.0.0.1:{_closed_port()}", _prefix()))
    agent = FakeAgent(node.config())
    try:
        with node.client() as client:
            info = client.node_info()
            assert not info.directory.connected and "unreachable" in info.directory.error
            with pytest.raises(UnavailableError, match="etcd"):
                client.lookup("anything")
        with pytest.raises(UnavailableError, match="etcd"):
            agent.register("cannot-be-published")
    finally:
        agent.close()


def test_a_registration_waiting_for_etcd_holds_up_nothing_else_on_its_stream(etcd: EtcdServer, daemons: DaemonSet) -> None:
    node = daemons.start("waiting", extra_args=_args(etcd, _prefix()))
    agent = FakeAgent(node.config())
    try:
        held = agent.register("registered-before")
        with etcd.paused(), concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(agent.register, "registered-during")  # waits for etcd, at most the TTL
            agent.link.unregister(held.id)  # answered meanwhile, on the same stream
            assert not waiting.done()
            with pytest.raises(UnavailableError, match="etcd"):
                waiting.result(timeout=15)
        with node.client() as client:
            assert {d.name for d in client.buffers(local_only=True)} == set()  # neither the withdrawn nor the refused one
    finally:
        agent.close()


def test_foreign_and_corrupt_keys_under_the_prefix_are_ignored(etcd: EtcdServer, daemons: DaemonSet) -> None:
    prefix = _prefix()
    node = daemons.start("hostile", extra_args=_args(etcd, prefix))
    agent = FakeAgent(node.config())
    try:

        async def plant(client: EtcdClient) -> None:
            for key, value in [("nodes/evil", b"\xff" * 64), ("buffers/evil/x", b"not a descriptor"), ("names/evil-name", b"\x00\x01"), ("unknown/x", b"?"), ("", b"root")]:
                await client.put(f"{prefix}/{key}".encode(), value, 5)

        _etcd_call(etcd, plant)
        registered = agent.register("after-garbage")
        with node.client() as client:
            assert client.node_info().directory.connected
            assert client.lookup("after-garbage").id == registered.id
            with pytest.raises(UnknownBufferError):
                client.lookup("evil-name")
    finally:
        agent.close()


def test_garbage_at_our_own_record_and_at_a_name_we_then_claim(etcd: EtcdServer, daemons: DaemonSet) -> None:
    prefix = _prefix()

    async def plant(client: EtcdClient) -> None:
        await client.put(f"{prefix}/nodes/garbled".encode(), b"\xff" * 32, 5)  # our node record, unreadable, no lease
        await client.put(f"{prefix}/names/poisoned".encode(), b"\xff\x01", 5)
        await client.put(f"{prefix}/nodes/garbled/extra".encode(), b"?", 5)  # a foreign key shape

    _etcd_call(etcd, plant)
    node = daemons.start("garbled", extra_args=_args(etcd, prefix))
    viewer = daemons.start("garbled-viewer", extra_args=_args(etcd, prefix))
    agent = FakeAgent(node.config())
    try:
        with node.client() as client:
            assert client.node_info().directory.connected
        with pytest.raises(BusyResourceError, match="cannot read"):
            agent.register("poisoned")
        registered = agent.register("healthy")  # the writer lives on
        with viewer.client() as client:
            wait_until(lambda: _epoch_of(client, "healthy") > 0, what="the viewer to find the buffer after the garbage")
            assert client.lookup("healthy").id == registered.id
            assert [n.node for n in client.node_info().directory.nodes] == ["garbled"]
    finally:
        agent.close()


def test_one_buffer_id_on_two_nodes_is_never_confused(etcd: EtcdServer, daemons: DaemonSet) -> None:
    """Ids are each owner's to choose: a node reusing another's id cannot take its name or its lookups."""
    prefix = _prefix()
    v, m, viewer = (daemons.start(name, extra_args=_args(etcd, prefix)) for name in ("idv", "idm", "idviewer"))
    on_v, on_m = FakeAgent(v.config()), FakeAgent(m.config())
    try:
        shared = uuid.uuid4().hex
        on_v.link.register(descriptor("victim-kv", buffer_id=shared))
        with viewer.client() as client:
            wait_until(lambda: _epoch_of(client, "victim-kv") > 0, what="the victim's buffer")
        on_m.link.register(descriptor("mallory-kv", buffer_id=shared))
        with viewer.client() as client:
            wait_until(lambda: _epoch_of(client, "mallory-kv") > 0, what="the second buffer")
            assert client.lookup("victim-kv").owner.node == "idv" and client.lookup("mallory-kv").owner.node == "idm"
            with pytest.raises(UnavailableError, match="several nodes"):
                client.lookup(f"id:{shared}")
        on_m.link.unregister(shared)
        with viewer.client() as client:
            wait_until(lambda: _epoch_of(client, "mallory-kv") == 0, what="the second buffer gone")
            assert client.lookup("victim-kv").owner.node == "idv" and client.lookup(f"id:{shared}").owner.node == "idv"
    finally:
        on_v.close()
        on_m.close()


def test_tls_to_etcd(tmp_path: Path, daemons: DaemonSet) -> None:
    if not etcd_available()[0]:
        pytest.skip(etcd_available()[1])
    ca, cert, key = make_certificates(tmp_path)
    with EtcdServer(tls=(str(cert), str(key), str(ca))) as secure:
        prefix = _prefix()
        node = daemons.start("tls-node", extra_args=("--etcd", secure.endpoint, "--etcd-lease-ttl", str(TTL_S), "--etcd-prefix", prefix, "--etcd-ca", str(ca), "--etcd-cert", str(cert), "--etcd-key", str(key)))
        agent = FakeAgent(node.config())
        try:
            agent.register("over-tls")
            with node.client() as client:
                assert client.node_info().directory.connected
        finally:
            agent.close()
        # the right server, but no certificate and no CA to trust it: hmcd serves locally and never joins
        untrusting = daemons.start("tls-untrusting", extra_args=("--etcd", secure.endpoint, "--etcd-prefix", prefix))
        with untrusting.client() as client:
            status = client.node_info().directory
            assert not status.connected and "unreachable" in status.error
            with pytest.raises(UnavailableError):
                client.lookup("over-tls")




@pytest.mark.parametrize(
    "endpoints, match",
    [((), "at least one endpoint"), (("ftp://h:1",), "must look like"), (("http://",), "must look like"), (("http://h:1/path",), "must look like")],
)
def test_bad_etcd_endpoints_are_refused(endpoints: tuple[str, ...], match: str) -> None:
    with pytest.raises(ArgumentError, match=match):
        EtcdSettings(endpoints)


def test_a_client_certificate_needs_its_key() -> None:
    with pytest.raises(ArgumentError, match="both"):
        EtcdSettings(["https://h:1"], cert="/c.pem")
    with pytest.raises(ArgumentError, match="cannot read"):
        EtcdSettings(["https://h:1"], ca="/nonexistent/ca.pem")


def test_the_etcd_directory_refuses_a_node_name_with_a_slash(etcd: EtcdServer) -> None:
    from hmc.control._hmcd import Daemon

    with pytest.raises(ArgumentError, match="may not contain '/'"):
        Daemon(Config(node="a/b", directory="etcd", etcd_endpoints=(etcd.endpoint,)))


def test_prefix_end() -> None:
    assert prefix_end(b"/hmc/") == b"/hmc0" and prefix_end(b"a\xff") == b"b" and prefix_end(b"\xff") == b"\0"
