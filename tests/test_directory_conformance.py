"""One conformance suite for both directories (`static` and `etcd`): real hmcd processes, a real etcd.

Two nodes: `owner` registers buffers, `viewer` finds them. Each test runs against both
directories; where they differ by design (a partition), the test says what each does.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator

import pytest
from control_fixtures import DaemonSet, FakeAgent, Hmcd, etcd_server, submit_as_forwarder, wait_until

from hmc.agent._peer_process import wait_stopped
from hmc.errors import BufferWithdrawnError, StaleDescriptorError, UnavailableError, UnknownBufferError
from hmc.testing._etcd import EtcdServer
from hmc.v1 import common_pb2, daemon_pb2

TOKEN = "conformance-secret"
TTL_S = 2
KINDS = ["static", "etcd"]


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    yield from etcd_server()


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Cluster:
    """hmcd nodes under one directory kind: static peers on fixed ports, or one etcd prefix."""

    def __init__(self, kind: str, etcd: EtcdServer | None) -> None:
        self.kind = kind
        self.daemons = DaemonSet()
        self.ports = {"owner": _port(), "viewer": _port()}
        self.prefix = f"/conformance-{uuid.uuid4().hex[:8]}"
        self.etcd = etcd

    def _args(self, name: str) -> tuple[str, ...]:
        args = ("--listen", f"127.0.0.1:{self.ports[name]}")
        if self.kind == "etcd":
            assert self.etcd is not None
            return (*args, "--etcd", self.etcd.endpoint, "--etcd-lease-ttl", str(TTL_S), "--etcd-prefix", self.prefix)
        peers = tuple(f"--static-peer=127.0.0.1:{port}" for other, port in self.ports.items() if other != name)
        return (*args, *peers)

    def start(self, name: str) -> Hmcd:
        return self.daemons.start(name, token=TOKEN, extra_args=self._args(name))

    def restart(self, old: Hmcd) -> Hmcd:
        return self.daemons.restart(old, token=TOKEN, extra_args=self._args(old.name))

    def await_seen(self, viewer: Hmcd, node: str, up: bool = True) -> None:
        with viewer.client() as client:
            wait_until(lambda: any(p.node == node and p.up for p in client.node_info().peers) is up, timeout=10, what=f"{viewer.name} to see {node} {'up' if up else 'gone'}")


@pytest.fixture(params=KINDS)
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    etcd = request.getfixturevalue("etcd") if request.param == "etcd" else None
    built = Cluster(request.param, etcd)
    try:
        yield built
    finally:
        built.daemons.close()


@pytest.fixture
def nodes(cluster: Cluster) -> tuple[Hmcd, Hmcd]:
    owner, viewer = cluster.start("owner"), cluster.start("viewer")
    cluster.await_seen(viewer, "owner")
    return owner, viewer


def _eventually_found(viewer: Hmcd, name: str, epoch: int = 0) -> common_pb2.BufferDescriptor:
    """The viewer's answer for `name` once it has one (of `epoch` when given): a watch may lag by a moment."""
    found: list[common_pb2.BufferDescriptor] = []

    def look() -> bool:
        try:
            with viewer.client() as client:
                found.append(client.lookup(name))
        except (UnknownBufferError, UnavailableError):
            return False
        return not epoch or found[-1].registry_epoch == epoch

    wait_until(look, timeout=10, what=f"{viewer.name} to find {name!r}")
    return found[-1]


def test_lookup_by_name_and_by_id_across_nodes(nodes: tuple[Hmcd, Hmcd]) -> None:
    owner, viewer = nodes
    agent = FakeAgent(owner.config())
    try:
        registered = agent.register("conf-lookup", size=3 << 20)
        with owner.client() as client:
            epoch = client.node_info().registry_epoch
        found = _eventually_found(viewer, "conf-lookup")
        assert (found.id, found.size, found.owner.node, found.registry_epoch) == (registered.id, 3 << 20, "owner", epoch)
        with viewer.client() as client:
            assert client.lookup(f"id:{registered.id}").name == "conf-lookup"
            with pytest.raises(UnknownBufferError) as refused:
                client.lookup("conf-nobody-has-this")
            assert not isinstance(refused.value, UnavailableError)
    finally:
        agent.close()


def test_listing_shows_the_other_nodes_buffers_only_when_asked(nodes: tuple[Hmcd, Hmcd]) -> None:
    owner, viewer = nodes
    agent = FakeAgent(owner.config())
    try:
        ids = {agent.register(f"conf-list-{i}").id for i in range(3)}
        with viewer.client() as client:
            wait_until(lambda: ids <= {d.id for d in client.buffers()}, timeout=10, what="the listing")
            assert not ids & {d.id for d in client.buffers(local_only=True)}
    finally:
        agent.close()


def test_watch_relays_the_other_nodes_buffers_coming_and_going(nodes: tuple[Hmcd, Hmcd]) -> None:
    owner, viewer = nodes
    agent = FakeAgent(owner.config())
    try:
        with viewer.client() as client, client.events(timeout=15, include_peers=True) as events:
            descriptor = agent.register("conf-watch")
            _next_about(events, daemon_pb2.EVENT_KIND_BUFFER_ADDED, descriptor.id)
            agent.link.unregister(descriptor.id)
            gone = _next_about(events, daemon_pb2.EVENT_KIND_BUFFER_WITHDRAWN, descriptor.id)
            assert gone.buffer.name == "conf-watch" and gone.node == "owner"
    finally:
        agent.close()


def _next_about(events: Iterator[daemon_pb2.Event], kind: int, buffer_id: str) -> daemon_pb2.Event:
    for event in events:
        if event.kind == kind and event.buffer.id == buffer_id:
            return event
    raise AssertionError(f"the event stream ended before a {daemon_pb2.EventKind.Name(kind)} of {buffer_id}")


def test_a_dead_node_leaves_the_view_with_an_event(cluster: Cluster, nodes: tuple[Hmcd, Hmcd]) -> None:
    owner, viewer = nodes
    agent = FakeAgent(owner.config())
    try:
        agent.register("conf-dies")
        _eventually_found(viewer, "conf-dies")
        with viewer.client() as client, client.events(timeout=15, include_peers=True) as events:
            owner.process.kill()  # SIGKILL: no goodbye, the lease (etcd) or the health check (static) tells
            killed = time.monotonic()
            down = next(event for event in events if event.kind == daemon_pb2.EVENT_KIND_PEER_DOWN)
            waited = time.monotonic() - killed
        assert waited <= TTL_S + 1.0 or cluster.kind == "static", f"{waited:.2f}s"
        assert down.peer == owner.tcp_address and down.node == "viewer"  # the viewer's own event about its peer
        with viewer.client() as client, pytest.raises((UnknownBufferError, UnavailableError)):
            client.lookup("conf-dies")
    finally:
        agent.close()


def test_a_restarted_node_is_found_with_a_new_epoch_and_old_descriptors_are_refused(cluster: Cluster, nodes: tuple[Hmcd, Hmcd]) -> None:
    owner, viewer = nodes
    agent = FakeAgent(owner.config())
    executor = FakeAgent(owner.config(), auto_report=common_pb2.TRANSFER_STATE_DONE)
    try:
        executor.register("conf-src")
        agent.register("conf-restart")
        old = _eventually_found(viewer, "conf-restart")
        owner.process.kill()
        owner.process.wait(timeout=10)
        owner = cluster.restart(owner)  # the agents attach again and register the same buffers
        with owner.client() as client:
            epoch = client.node_info().registry_epoch
        assert epoch > old.registry_epoch
        new = _eventually_found(viewer, "conf-restart", epoch)
        assert new.id == old.id
        with viewer.client() as client:
            assert all(d.registry_epoch == epoch for d in client.buffers() if d.owner.node == "owner")
        wait_until(lambda: executor.link.registry_epoch == epoch, timeout=10, what="the executor to attach again")
        _eventually_found(owner, "conf-src", epoch)  # and to register its buffer again (attached first, then registered)
        with pytest.raises(StaleDescriptorError):
            submit_as_forwarder(owner, "conf-src", old)
        assert isinstance(StaleDescriptorError(""), BufferWithdrawnError)  # callers that handle "withdrawn" handle it too
        assert executor.instructions == []
    finally:
        agent.close()
        executor.close()


def test_a_partition_serves_what_it_can_and_never_guesses(cluster: Cluster, nodes: tuple[Hmcd, Hmcd]) -> None:
    """static: the peer itself is cut off (SIGSTOP): its buffers are unavailable, local registrations go on.
    etcd: etcd is cut off (SIGSTOP): cached entries are served read-only with their age; new registrations fail
    with UnavailableError within their deadline; all is well again once etcd is back."""
    owner, viewer = nodes
    agent = FakeAgent(owner.config())
    local = FakeAgent(viewer.config())
    try:
        registered = agent.register("conf-partition")
        _eventually_found(viewer, "conf-partition")
        if cluster.kind == "static":
            owner.process.send_signal(19)  # SIGSTOP
            try:
                wait_stopped(owner.process.pid, time.monotonic() + 10.0)
                with viewer.client() as client, pytest.raises(UnavailableError):
                    client.lookup("conf-partition")
                assert local.register("conf-local").name == "conf-local"
            finally:
                owner.process.send_signal(18)  # SIGCONT
            return
        assert cluster.etcd is not None
        with cluster.etcd.paused():
            with viewer.client() as client:
                wait_until(lambda: not client.node_info().directory.connected, timeout=10, what="the viewer to notice the partition")
                assert client.lookup("conf-partition").id == registered.id  # served from the cache
                listing = client.listing()
                assert registered.id in {d.id for d in listing.buffers} and listing.directory_age_s > 0
                status = client.node_info().directory
                assert status.partitioned_s > 0 and status.error
            started = time.monotonic()
            with pytest.raises(UnavailableError, match="etcd"):
                local.register("conf-during-partition")
            assert time.monotonic() - started < 10
        with viewer.client() as client:
            wait_until(lambda: client.node_info().directory.connected, timeout=10, what="the viewer to be in sync again")
        assert local.register("conf-after-partition").name == "conf-after-partition"
        _eventually_found(owner, "conf-after-partition")
    finally:
        agent.close()
        local.close()
