"""Third-party transfers through hmcd, with fake agents that report what a real agent would."""

from __future__ import annotations

import concurrent.futures
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from control_fixtures import DaemonSet, FakeAgent, Hmcd, daemon_set, wait_until

from hmc.config import Config
from hmc.control import Client
from hmc.control._registry import MAX_NAME_BYTES
from hmc.errors import AccessDeniedError, ArgumentError, BrokenResourceError, CancelledError, NoPathError, OutOfRangeError, ProtocolError, TimeoutError, UnavailableError, UnknownBufferError
from hmc.transport._ranges import MAX_NOTIFY_BYTES, MAX_TRANSFER_ID, RangeList
from hmc.v1 import common_pb2, daemon_pb2

FINAL = (common_pb2.TRANSFER_STATE_DONE, common_pb2.TRANSFER_STATE_FAILED, common_pb2.TRANSFER_STATE_CANCELLED)


@pytest.fixture(scope="module")
def daemons() -> Iterator[DaemonSet]:
    yield from daemon_set()


@pytest.fixture(scope="module")
def hmcd(daemons: DaemonSet) -> Hmcd:
    return daemons.start("xfer")


@pytest.fixture
def client(hmcd: Hmcd) -> Iterator[Client]:
    with hmcd.client() as c:
        yield c


@pytest.fixture
def pair(hmcd: Hmcd) -> Iterator[tuple[FakeAgent, FakeAgent]]:
    src, dst = FakeAgent(hmcd.config()), FakeAgent(hmcd.config())
    yield src, dst
    src.close()
    dst.close()


def submit_4k(client: Client, pair: tuple[FakeAgent, FakeAgent], prefix: str, timeout: float) -> daemon_pb2.TransferStatus:
    """4 KiB from `<prefix>-src` (the pair's first agent) to `<prefix>-dst` (its second), submitted through `client`."""
    src_agent, dst_agent = pair
    src_agent.register(f"{prefix}-src", size=4096)
    dst_agent.register(f"{prefix}-dst", size=4096)
    return client.submit(f"{prefix}-src", f"{prefix}-dst", 0, 0, 4096, timeout=timeout)


def test_src_owner_is_instructed_to_write(client: Client, pair: tuple[FakeAgent, FakeAgent]) -> None:
    src_agent, dst_agent = pair
    src = src_agent.register("t-src", size=1 << 16)
    dst = dst_agent.register("t-dst", size=1 << 16)
    rng = np.random.default_rng(7)
    offsets = rng.choice(np.arange(0, 1 << 16, 1024), size=32, replace=False)
    status = client.submit("t-src", "t-dst", offsets, offsets[::-1], 1024, notify=b"kv-ready", timeout=3.0)
    assert status.state == common_pb2.TRANSFER_STATE_PENDING
    assert status.bytes_total == 32 * 1024 and status.executor_agent == src_agent.info.id and status.path == "ipc"
    wait_until(lambda: src_agent.instructions, what="instruction")
    instruction = src_agent.instructions[0]
    assert instruction.transfer_id == status.transfer_id
    assert instruction.op == common_pb2.TRANSFER_OP_WRITE
    assert instruction.local_buffer_id == src.id
    assert instruction.remote.id == dst.id and instruction.remote.access_key == dst.access_key
    assert instruction.notification == b"kv-ready" and instruction.timeout_s == 3.0
    ranges = RangeList.from_proto(instruction.ranges)
    assert ranges.src.tolist() == offsets.tolist() and ranges.dst.tolist() == offsets[::-1].tolist()
    assert not dst_agent.instructions
    assert client.status(status.transfer_id).state == common_pb2.TRANSFER_STATE_PENDING
    src_agent.link.report(daemon_pb2.TransferReport(transfer_id=status.transfer_id, state=common_pb2.TRANSFER_STATE_RUNNING))
    wait_until(lambda: client.status(status.transfer_id).state == common_pb2.TRANSFER_STATE_RUNNING, what="running")
    src_agent.link.report(daemon_pb2.TransferReport(transfer_id=status.transfer_id, state=common_pb2.TRANSFER_STATE_DONE, bytes_done=32 * 1024, path="ipc"))
    done = client.wait(status.transfer_id, timeout=3.0)
    assert done.state == common_pb2.TRANSFER_STATE_DONE and done.bytes_done == 32 * 1024
    assert 'hmc_transfers_total{state="done"}' in client.metrics()


def test_migrate_waits_for_done(hmcd: Hmcd, client: Client) -> None:
    src_agent = FakeAgent(hmcd.config(), auto_report=common_pb2.TRANSFER_STATE_DONE)
    dst_agent = FakeAgent(hmcd.config())
    try:
        src_agent.register("m-src", size=4096)
        dst_agent.register("m-dst", size=4096)
        status = client.migrate("m-src", "m-dst", ([0, 2048], [2048, 0], [1024, 1024]), timeout=3.0)
        assert status.state == common_pb2.TRANSFER_STATE_DONE and status.bytes_done == 2048
    finally:
        src_agent.close()
        dst_agent.close()


def test_reported_failure_is_the_typed_error(client: Client, pair: tuple[FakeAgent, FakeAgent]) -> None:
    src_agent = pair[0]
    status = submit_4k(client, pair, "f", 3.0)
    wait_until(lambda: src_agent.instructions, what="instruction")
    error = common_pb2.Error(code=common_pb2.ERROR_CODE_ACCESS_DENIED, message="wrong access key for buffer f-dst")
    src_agent.link.report(daemon_pb2.TransferReport(transfer_id=status.transfer_id, state=common_pb2.TRANSFER_STATE_FAILED, error=error))
    with pytest.raises(AccessDeniedError, match="wrong access key"):
        client.wait(status.transfer_id, timeout=3.0)


def test_executor_leaving_fails_its_transfers_with_peer_lost(client: Client, pair: tuple[FakeAgent, FakeAgent]) -> None:
    src_agent = pair[0]
    status = submit_4k(client, pair, "l", 10.0)
    wait_until(lambda: src_agent.instructions, what="instruction")
    src_agent.close()
    with pytest.raises(BrokenResourceError, match="disconnected"):
        client.wait(status.transfer_id, timeout=3.0)


def test_cancel_ends_the_transfer_when_its_executor_confirms(client: Client, pair: tuple[FakeAgent, FakeAgent]) -> None:
    """Cancel tells the executor and answers once it reported the end: until then nothing says it ended (it could
    still land bytes); a report after the end changes nothing."""
    src_agent = pair[0]
    status = submit_4k(client, pair, "c", 10.0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        cancelling = pool.submit(client.cancel, status.transfer_id)
        wait_until(lambda: status.transfer_id in src_agent.cancels, what="cancel pushed to the executor")
        assert client.status(status.transfer_id).state not in FINAL and not cancelling.done()
        stopped = daemon_pb2.TransferReport(transfer_id=status.transfer_id, state=common_pb2.TRANSFER_STATE_CANCELLED)
        stopped.error.code, stopped.error.message = int(CancelledError.code), "stopped"
        src_agent.link.report(stopped)
        assert cancelling.result(timeout=10).state == common_pb2.TRANSFER_STATE_CANCELLED
    with pytest.raises(CancelledError):
        client.wait(status.transfer_id, timeout=1.0)
    src_agent.link.report(daemon_pb2.TransferReport(transfer_id=status.transfer_id, state=common_pb2.TRANSFER_STATE_DONE))  # late: ignored
    assert client.status(status.transfer_id).state == common_pb2.TRANSFER_STATE_CANCELLED


def test_a_cancel_waiting_for_an_executor_that_dies_ends_with_peer_lost(client: Client, pair: tuple[FakeAgent, FakeAgent]) -> None:
    """The executor's stream ends while Cancel waits for its confirmation: Cancel answers at once with PEER_LOST."""
    src_agent = pair[0]
    status = submit_4k(client, pair, "x", 10.0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        cancelling = pool.submit(client.cancel, status.transfer_id)
        wait_until(lambda: status.transfer_id in src_agent.cancels, what="cancel pushed to the executor")
        src_agent.close()
        ended = cancelling.result(timeout=10)
    assert ended.state == common_pb2.TRANSFER_STATE_FAILED and ended.error.code == int(BrokenResourceError.code)


def test_a_cancel_the_executor_does_not_confirm_leaves_the_transfer_running(hmcd: Hmcd, pair: tuple[FakeAgent, FakeAgent]) -> None:
    """An executor that finishes the transfer instead: Cancel answers (within its deadline) with it still running,
    and the transfer ends DONE, as it did."""
    src_agent = pair[0]
    with hmcd.client(timeout=1.0) as client:
        status = submit_4k(client, pair, "u", 10.0)
        answered = client.cancel(status.transfer_id)
        assert answered.state not in FINAL
        src_agent.link.report(daemon_pb2.TransferReport(transfer_id=status.transfer_id, state=common_pb2.TRANSFER_STATE_DONE, bytes_done=4096))
        assert client.wait(status.transfer_id, timeout=5.0).state == common_pb2.TRANSFER_STATE_DONE


def test_stopping_hmcd_tells_executors_to_stop_before_it_fails_their_transfers(daemons: DaemonSet) -> None:
    """SIGTERM: each executor is told to cancel and given the stop's grace to confirm; only then does the transfer
    fail (UNAVAILABLE either way), so hmcd's verdict does not come while the executor still writes. A submit that
    arrives meanwhile is refused UNAVAILABLE and instructs nobody (one started then would run on after hmcd stopped)."""
    stopping = daemons.start("xstop")
    confirming, silent = FakeAgent(stopping.config(), confirm_cancels=True), FakeAgent(stopping.config())
    dst_agent, later = FakeAgent(stopping.config()), FakeAgent(stopping.config())
    try:
        with stopping.client() as client:
            dst_agent.register("s-dst", size=8192)
            confirming.register("s-src1", size=4096)
            silent.register("s-src2", size=4096)
            later.register("s-src3", size=4096)
            first = client.submit("s-src1", "s-dst", 0, 0, 4096, timeout=30.0)
            second = client.submit("s-src2", "s-dst", 0, 4096, 4096, timeout=30.0)
            wait_until(lambda: confirming.instructions and silent.instructions, what="instructions")
            stopping.process.send_signal(signal.SIGTERM)
            wait_until(lambda: silent.cancels == [second.transfer_id], what="the stop's cancels")  # its grace runs now
            with pytest.raises(UnavailableError, match="stopping"):
                client.submit("s-src3", "s-dst", 0, 0, 4096, timeout=30.0)
        stopping.stop()
        assert confirming.cancels == [first.transfer_id] and silent.cancels == [second.transfer_id]
        assert later.instructions == []
        log = stopping.log_text()
        assert f"transfer {first.transfer_id} ended TRANSFER_STATE_FAILED: hmcd stopped (the executor stopped the transfer)" in log
        assert f"transfer {second.transfer_id} ended TRANSFER_STATE_FAILED: hmcd stopped (its executor had not confirmed" in log
    finally:
        stopping.stop()
        for agent in (confirming, silent, dst_agent, later):
            agent.close()


def test_a_wait_after_hmcd_restarted_says_the_transfer_was_lost_with_it_not_that_the_id_is_bad(daemons: DaemonSet) -> None:
    """hmcd is SIGKILLed after accepting a transfer: the restarted hmcd cannot know its outcome, and says so with
    BrokenResourceError (retry the ranges), not ArgumentError, which tells the caller its id was never valid."""
    first = daemons.start("xlost")
    src_agent, dst_agent = FakeAgent(first.config()), FakeAgent(first.config())
    try:
        src_agent.register("l-src", size=4096)
        dst_agent.register("l-dst", size=4096)
        with first.client() as client:
            accepted = client.submit("l-src", "l-dst", 0, 0, 4096, timeout=30.0)
        wait_until(lambda: src_agent.instructions, what="the instruction")
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(timeout=10)
        second = daemons.restart(first)
        with second.client() as client:
            for ask in (client.status, client.wait, client.cancel):
                with pytest.raises(BrokenResourceError, match=f"transfer {accepted.transfer_id} was accepted by hmcd on node xlost before it restarted"):
                    ask(accepted.transfer_id)
            epoch, _, rest = accepted.transfer_id.partition("-")
            for never_given in (f"{int(epoch, 16) + 10**9:x}-{rest}", "made-up", f"{epoch}-{rest[:-1]}"):
                with pytest.raises(ArgumentError, match="unknown or long finished"):
                    client.status(never_given)
    finally:
        src_agent.close()
        dst_agent.close()


def test_deadlines(client: Client, pair: tuple[FakeAgent, FakeAgent]) -> None:
    status = submit_4k(client, pair, "d", 0.2)
    with pytest.raises(TimeoutError, match="still"):
        client.wait(status.transfer_id, timeout=0.2)
    with pytest.raises(TimeoutError, match="did not finish within"):  # hmcd's own deadline: timeout_s + grace
        client.wait(status.transfer_id, timeout=5.0)


def test_bad_submissions_are_refused_up_front(client: Client, pair: tuple[FakeAgent, FakeAgent]) -> None:
    src_agent, dst_agent = pair
    src_agent.register("b-src", size=4096)
    dst_agent.register("b-dst", size=1024)
    with pytest.raises(OutOfRangeError, match="destination"):
        client.submit("b-src", "b-dst", 0, 0, 2048)
    with pytest.raises(OutOfRangeError):
        client.submit("b-src", "b-dst", -8, 0, 8)
    with pytest.raises(ArgumentError, match="no ranges"):
        client.submit("b-src", "b-dst", [], [], [])
    with pytest.raises(ArgumentError, match="no transfer"):
        client.wait("not-a-transfer", timeout=1.0)
    many = np.zeros((64 << 20) // 24 + 1, dtype=np.int64)  # past hmcd's 64 MiB message: gRPC's refusal would read as BUSY
    with pytest.raises(ArgumentError, match="submit fewer ranges at once"):
        client.submit("b-src", "b-dst", many, many, many + 1)
    long = "n" * (MAX_NAME_BYTES + 1)
    for refused in (lambda: client.submit(long, "b-dst", 0, 0, 8), lambda: client.lookup(long), lambda: client.path("b-src", long)):
        with pytest.raises(ArgumentError, match=f"at most {MAX_NAME_BYTES}"):
            refused()
    with pytest.raises(ArgumentError, match=f"at most {MAX_NAME_BYTES}"):  # past the client: hmcd answers its own error, not BUSY
        client._call(client._registry.LookupBuffer, daemon_pb2.LookupBufferRequest(ref=daemon_pb2.BufferRef(name="n" * (2 << 20))))  # noqa: SLF001
    assert not src_agent.instructions
    with pytest.raises(ArgumentError, match="notify of 1048577 bytes"):  # the client's own check
        client.submit("b-src", "b-dst", 0, 0, 8, notify=b"n" * (MAX_NOTIFY_BYTES + 1))
    ranges = common_pb2.RangeList(src_offsets=bytes(8), dst_offsets=bytes(8), lengths=(8).to_bytes(8, "little"))
    for oversized in ({"notification": b"n" * (MAX_NOTIFY_BYTES + 1)}, {"transfer_id": "t" * (MAX_TRANSFER_ID + 1)}):  # past the client: hmcd checks
        request = daemon_pb2.SubmitTransferRequest(src=daemon_pb2.BufferRef(name="b-src"), dst=daemon_pb2.BufferRef(name="b-dst"), ranges=ranges, **oversized)
        with pytest.raises(ArgumentError, match="at most"):
            client._call(client._transfers.Submit, request)  # noqa: SLF001 - a raw request on purpose
    assert not src_agent.instructions
    request.transfer_id = "t" * MAX_TRANSFER_ID  # the longest id passes
    client._call(client._transfers.Submit, request)  # noqa: SLF001
    wait_until(lambda: src_agent.instructions, what="instruction")
    assert [i.transfer_id for i in src_agent.instructions] == [request.transfer_id]
    src_agent.link.report(daemon_pb2.TransferReport(transfer_id=request.transfer_id, state=common_pb2.TRANSFER_STATE_DONE, bytes_done=8, path="ipc"))
    assert client.wait(request.transfer_id, timeout=5.0).state == common_pb2.TRANSFER_STATE_DONE


def test_no_path_is_refused(hmcd: Hmcd, client: Client) -> None:
    strict = Config(node=hmcd.name, socket=hmcd.socket, timeout_s=5.0)
    src_agent, dst_agent = FakeAgent(strict), FakeAgent(strict)
    try:
        src_agent.register("np-src", size=64)
        desc = dst_agent.register("np-dst", size=64)
        assert client.path("np-src", "np-dst").path.value == "ipc"
        other = FakeAgent(strict)
        try:
            bare = desc.__class__()
            bare.CopyFrom(desc)
            bare.id, bare.name = "bare-id", "np-bare"
            bare.owner.CopyFrom(other.info)
            del bare.owner.transports[:]
            other.link.register(bare)
            with pytest.raises(NoPathError, match="no path"):
                client.path("np-src", "np-bare")
            with pytest.raises(NoPathError):
                client.submit("np-src", "np-bare", 0, 0, 8)
        finally:
            other.close()
    finally:
        src_agent.close()
        dst_agent.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    src=st.binary(max_size=40),
    dst=st.binary(max_size=40),
    lengths=st.binary(max_size=40),
    name=st.sampled_from(["fz-src", "fz-dst", "", "absent"]),
    timeout=st.floats(min_value=-5, max_value=5, allow_nan=False),
)
def test_fuzzed_submissions_never_crash_hmcd(fuzz_pair: Client, src: bytes, dst: bytes, lengths: bytes, name: str, timeout: float) -> None:
    request = daemon_pb2.SubmitTransferRequest(
        src=daemon_pb2.BufferRef(name=name),
        dst=daemon_pb2.BufferRef(name="fz-dst"),
        ranges=common_pb2.RangeList(src_offsets=src, dst_offsets=dst, lengths=lengths),
        timeout_s=timeout,
    )
    try:
        status = fuzz_pair._call(fuzz_pair._transfers.Submit, request)  # noqa: SLF001 - raw requests on purpose
    except (ArgumentError, ProtocolError, UnknownBufferError, NoPathError):
        return
    fuzz_pair.cancel(status.transfer_id)


@pytest.fixture(scope="module")
def fuzz_pair(hmcd: Hmcd) -> Iterator[Client]:
    src_agent, dst_agent = FakeAgent(hmcd.config()), FakeAgent(hmcd.config())
    src_agent.register("fz-src", size=4096)
    dst_agent.register("fz-dst", size=4096)
    with hmcd.client() as client:
        yield client
        assert client.health().serving
        assert 'code="INTERNAL"' not in client.metrics()
    src_agent.close()
    dst_agent.close()


@pytest.mark.parametrize("reads_hmcds_clock", [True, False])
def test_an_agent_of_another_host_id_gets_hmcds_deadline_where_its_hello_says_it_reads_hmcds_clock(
    hmcd: Hmcd, client: Client, monkeypatch: pytest.MonkeyPatch, reads_hmcds_clock: bool,
) -> None:  # fmt: skip
    """Agents of hmcd's host id always get the deadline; another host id's only where the agent reads it through its
    hello's round trip (an agent of an older release compares it with its own clock, which may be another's)."""
    real = daemon_pb2.AgentHello
    if not reads_hmcds_clock:  # what an agent of an older release says
        monkeypatch.setattr(daemon_pb2, "AgentHello", lambda **fields: real(**{**fields, "reads_daemon_clock": False}))
    monkeypatch.setenv("HMC_HOST_ID", "xfer-elsewhere")
    src_agent = FakeAgent(hmcd.config())
    monkeypatch.delenv("HMC_HOST_ID")
    dst_agent = FakeAgent(hmcd.config())
    try:
        before = time.monotonic()
        submit_4k(client, (src_agent, dst_agent), f"clock-{reads_hmcds_clock}", timeout=3.0)
        wait_until(lambda: src_agent.instructions, what="instruction")
        deadline = src_agent.instructions[0].deadline_monotonic_s
        if reads_hmcds_clock:  # one kernel here: hmcd's clock is ours, and the link read the offset as 0
            assert before + 3.0 <= deadline <= time.monotonic() + 3.0
        else:
            assert deadline == 0.0
    finally:
        src_agent.close()
        dst_agent.close()
