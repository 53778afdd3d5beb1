"""The ipc path's dispatcher (one transport per path name, a mover per memory kind) and what device memory
meets on the CPU-only paths: declarations, routing, the owner's grant, and staged refusing device memory."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import types
from typing import Any

import numpy as np
import pytest

from hmc.agent import Agent
from hmc.agent._buffers import ConnBuffer
from hmc.config import Config
from hmc.control._inventory import transports
from hmc.errors import BrokenResourceError, DeviceError, UnsupportedError
from hmc.memory import Device, DeviceKind, MemoryKind, MemoryRegion, Vendor
from hmc.memory._host import HOST_DEVICE
from hmc.transport._base import Capabilities, PathName, TransferOp, TransferRequest, Transport
from hmc.transport._gpu_copy import _parts, pieces
from hmc.transport._ipc_path import IpcPath
from hmc.transport._ranges import RangeList
from hmc.transport._staged import StagedTransport
from hmc.v1 import common_pb2

GPU = Device("cuda:0", DeviceKind.CUDA, 0, Vendor.NVIDIA, Vendor.NVIDIA, uuid="GPU-0")


class FakeMover(Transport):
    """Records what it is asked; declares ipc for the given kinds."""

    def __init__(self, kinds: set[DeviceKind], detail: str, *, unavailable: str | None = None) -> None:
        self.capabilities = Capabilities(PathName.IPC, frozenset(kinds), one_sided=True, same_host_only=True, detail=detail)
        self.unavailable = unavailable
        self.calls: list[tuple[str, Any]] = []
        self.closed = False

    def unavailable_reason(self) -> str | None:
        return self.unavailable

    def export(self, buffer: Any) -> dict[str, Any]:
        return {self.capabilities.detail: buffer.id}

    def withdraw(self, buffer_id: str) -> None:
        self.calls.append(("withdraw", buffer_id))

    def forget_peer(self, agent: common_pb2.AgentInfo) -> None:
        self.calls.append(("forget", agent.id))

    def post(self, request: TransferRequest) -> None:
        self.calls.append(("post", request.transfer_id))
        request.completion.finish()

    def close(self) -> None:
        self.closed = True


class Done:
    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.cancelled = False

    def set_running(self) -> None: ...

    def add_bytes(self, nbytes: int) -> None: ...

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.finished.set()


def _local(kind: MemoryKind = MemoryKind.HOST, device: Device = HOST_DEVICE, buffer_id: str = "local") -> ConnBuffer:
    region = MemoryRegion(device=device, address=0x1000, size=4096, kind=kind)
    return ConnBuffer(region, common_pb2.BufferDescriptor(id=buffer_id, size=4096))


def _remote(kind: int = common_pb2.DEVICE_KIND_HOST) -> common_pb2.BufferDescriptor:
    return common_pb2.BufferDescriptor(id="remote", size=4096, device=common_pb2.DeviceInfo(name="x", kind=kind))


def _request(local: ConnBuffer, remote: common_pb2.BufferDescriptor, done: Done, transfer_id: str = "t") -> TransferRequest:
    return TransferRequest(transfer_id, TransferOp.WRITE, local, remote, RangeList.single(0, 0, 16), time.monotonic() + 5, done)


def test_declares_the_union_of_its_movers() -> None:
    path = IpcPath({DeviceKind.HOST: FakeMover({DeviceKind.HOST}, "cma"), DeviceKind.CUDA: FakeMover({DeviceKind.CUDA}, "cuda ipc")})
    caps = path.capabilities
    assert caps.path is PathName.IPC and caps.memory_kinds == {DeviceKind.HOST, DeviceKind.CUDA}
    assert caps.one_sided and caps.same_host_only and caps.detail == "cma; cuda ipc"
    assert sorted(path.capabilities.to_proto().memory_kinds) == [common_pb2.DEVICE_KIND_HOST, common_pb2.DEVICE_KIND_CUDA]


def test_routes_by_the_pairs_device_memory() -> None:
    host, cuda = FakeMover({DeviceKind.HOST}, "cma"), FakeMover({DeviceKind.CUDA}, "cuda ipc")
    path = IpcPath({DeviceKind.HOST: host, DeviceKind.CUDA: cuda})
    cases = [
        ("host-host", _local(), _remote(), host),
        ("host-cuda", _local(), _remote(common_pb2.DEVICE_KIND_CUDA), cuda),
        ("cuda-host", _local(MemoryKind.DEVICE, GPU), _remote(), cuda),
        ("pinned-cuda", _local(MemoryKind.HOST_PINNED), _remote(common_pb2.DEVICE_KIND_CUDA), cuda),
        ("unspecified", _local(), _remote(common_pb2.DEVICE_KIND_UNSPECIFIED), host),
    ]
    for name, local, remote, mover in cases:
        done = Done()
        path.post(_request(local, remote, done, name))
        assert done.error is None and ("post", name) in mover.calls, name


def test_a_kind_without_mover_is_refused_with_the_reason() -> None:
    path = IpcPath({DeviceKind.HOST: FakeMover({DeviceKind.HOST}, "cma")})
    done = Done()
    path.post(_request(_local(), _remote(common_pb2.DEVICE_KIND_CUDA), done))
    assert isinstance(done.error, UnsupportedError) and "cannot move cuda memory" in str(done.error)


def test_unavailable_movers_are_dropped_and_closed() -> None:
    host, cuda = FakeMover({DeviceKind.HOST}, "cma", unavailable="ptrace_scope=3"), FakeMover({DeviceKind.CUDA}, "cuda ipc")
    path = IpcPath({DeviceKind.HOST: host, DeviceKind.CUDA: cuda})
    assert path.unavailable_reason() is None
    assert host.closed and path.capabilities.memory_kinds == {DeviceKind.CUDA}
    assert list(path.movers()) == [DeviceKind.CUDA]
    only = IpcPath({DeviceKind.HOST: FakeMover({DeviceKind.HOST}, "cma", unavailable="no cma")})
    assert only.unavailable_reason() == "host memory: no cma"


def test_lifecycle_calls_reach_every_mover() -> None:
    host, cuda = FakeMover({DeviceKind.HOST}, "cma"), FakeMover({DeviceKind.CUDA}, "cuda")
    path = IpcPath({DeviceKind.HOST: host, DeviceKind.CUDA: cuda})
    assert path.export(_local(buffer_id="b1")) == {"cma": "b1", "cuda": "b1"}
    path.withdraw("b1")
    path.forget_peer(common_pb2.AgentInfo(id="gone"))
    path.close()
    for mover in (host, cuda):
        assert mover.calls == [("withdraw", "b1"), ("forget", "gone")] and mover.closed


def test_a_mover_must_declare_the_kind_it_serves() -> None:
    with pytest.raises(ValueError, match="does not declare ipc for cuda"):
        IpcPath({DeviceKind.CUDA: FakeMover({DeviceKind.HOST}, "cma")})


def test_agent_declares_ipc_through_the_dispatcher(config: Config) -> None:
    with Agent(config, daemon=False) as agent:
        [ipc] = [t for t in agent.info.transports if t.path == "ipc"]
        assert common_pb2.DEVICE_KIND_HOST in ipc.memory_kinds  # CUDA joins where the CUDA backend is present
        assert "cma" in ipc.detail


def test_inventory_declares_cuda_ipc_where_a_gpu_is() -> None:
    kinds = frozenset({DeviceKind.HOST, DeviceKind.CUDA})
    [ipc] = [c for c in transports(kinds, ptrace_scope=0) if c.path is PathName.IPC]
    assert ipc.memory_kinds == kinds and ipc.same_vendor_only
    [cuda_only] = [c for c in transports(kinds, ptrace_scope=3) if c.path is PathName.IPC]
    assert cuda_only.memory_kinds == {DeviceKind.CUDA}
    assert "ipc" not in [c.path.value for c in transports(frozenset({DeviceKind.HOST}), ptrace_scope=3)]


def test_the_grant_of_device_memory_carries_its_cuda_ipc_handle() -> None:
    descriptor = common_pb2.BufferDescriptor(id="d", size=4096)
    descriptor.handles.cuda_ipc.CopyFrom(common_pb2.CudaIpcHandle(handle=bytes(64), offset=512, pid=7))
    gpu_buffer = ConnBuffer(MemoryRegion(device=GPU, address=0x7000, size=4096, kind=MemoryKind.DEVICE), descriptor)
    grant = IpcPath({}).grant
    handles = grant(gpu_buffer)
    assert handles.cuda_ipc.offset == 512 and handles.cma.address == 0x7000
    bare = ConnBuffer(MemoryRegion(device=GPU, address=0x7000, size=4096, kind=MemoryKind.DEVICE), common_pb2.BufferDescriptor(id="v"))
    with pytest.raises(UnsupportedError, match="no IPC handle"):
        grant(bare)
    assert not grant(_local()).HasField("cuda_ipc")


def test_staged_declares_device_memory_and_takes_it_to_another_host_over_the_tcp_ring() -> None:
    unreachable = BrokenResourceError("the owner cannot be reached")
    asked: list[str] = []

    def connect(owner: common_pb2.AgentInfo, deadline: float) -> Any:
        asked.append(threading.current_thread().name)
        raise unreachable

    staged = StagedTransport(connect, memory_kinds=frozenset({DeviceKind.CUDA}))
    assert staged.capabilities.memory_kinds == {DeviceKind.HOST, DeviceKind.CUDA}
    for local, remote in ((_local(MemoryKind.DEVICE, GPU), _remote()), (_local(), _remote(common_pb2.DEVICE_KIND_CUDA))):
        done = Done()
        staged.post(_request(local, remote, done))  # the owner declares no host id: another host
        assert done.finished.wait(5.0) and done.error is unreachable
    assert len(asked) == 2  # small transfers run on the caller's thread: the ring that ran them says which wire
    assert staged._tcp_ring._links and not staged._shm._links
    staged.close()


def test_cut_long_ranges_into_pieces_keeping_alignment() -> None:
    src, dst, lengths = np.array([0, 1000], np.int64), np.array([5, 3], np.int64), np.array([10, 600000], np.int64)
    s, d, n = pieces(src, dst, lengths, piece=262144)
    assert n.tolist() == [10, 262144, 262144, 75712]
    assert s.tolist() == [0, 1000, 263144, 525288] and d.tolist() == [5, 3, 262147, 524291]
    short = pieces(src, dst, np.array([10, 20], np.int64), piece=262144)
    assert [a.tolist() for a in short] == [[0, 1000], [5, 3], [10, 20]]


@pytest.mark.parametrize("rows", [1, 5, 1024, 2047, 2048, 4096, 16384, 100001])
def test_a_batch_is_launched_in_growing_parts_that_cover_each_row_once(rows: int) -> None:
    parts = list(_parts(rows))
    assert parts[0][0] == 0 and parts[-1][1] == rows
    assert all(stop == start for (_, stop), (start, _) in itertools.pairwise(parts))
    sizes = [stop - start for start, stop in parts]
    assert all(size > 0 for size in sizes)
    assert sizes[0] == min(rows, 1024) or len(sizes) == 1
    assert all(later >= earlier for earlier, later in itertools.pairwise(sizes))  # the GPU copies a part while the next is written
    assert len(parts) == (1 if rows < 2048 else 2 if rows < 1024 + 2 * 4096 else 3 if rows < 1024 + 4096 + 2 * 16384 else 4)


class _TableRuntime:
    """The runtime calls `Lane._launch` makes, on host memory: events are tokens, `recorded` lists what was recorded."""

    not_ready, ok = 600, 0

    def __init__(self) -> None:
        self.recorded: list[object] = []

    def event_create(self) -> object:
        return object()

    def event_query(self, event: object) -> tuple[int]:
        return (0,)

    def event_record(self, event: object, stream: object) -> None:
        self.recorded.append(event)

    def check(self, result: object) -> None:
        return None

    def use(self, ordinal: int) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def mapped_pointer(self, address: int) -> int:
        return address  # the rows, as the kernel would read them in place


class _HostRows:
    def __init__(self, size: int) -> None:
        self.array = np.zeros(size, np.uint8)
        self.address, self.size = self.array.ctypes.data, size

    def numpy(self) -> np.ndarray:
        return self.array

    def free(self) -> None:
        pass


class _ReadingKernel:
    """Reads its part's rows out of the table when launched, as the GPU would; the `fail_at`-th launch raises."""

    def __init__(self, lane: Any, fail_at: int = 0) -> None:
        self.lane, self.fail_at, self.parts = lane, fail_at, []

    def launch(self, grid: int, block: int, columns: tuple[int, int, int], stream: object) -> None:
        if len(self.parts) + 1 == self.fail_at:
            raise DeviceError("the launch failed")
        table = next(t for t in self.lane._tables if t.host is not None and t.host.address <= columns[0] < t.host.address + t.host.size)
        rows = [(column - table.host.address) // 8 for column in columns]
        self.parts.append(tuple(table.array[row : row + grid].copy() for row in rows))


def _host_lane() -> Any:
    from hmc.transport import _gpu_copy

    lane = _gpu_copy.Lane.__new__(_gpu_copy.Lane)
    lane._rt, lane.ordinal, lane._native, lane._turn = _TableRuntime(), 0, None, 0
    lane._backend = types.SimpleNamespace(allocate_pinned_host=_HostRows)
    lane._tables = [_gpu_copy._Table(lane._rt) for _ in range(8)]
    return lane


@pytest.mark.parametrize("count", [5, 2047, 2048, 5300, 16384])
def test_a_lane_launch_hands_every_part_its_own_rows(count: int) -> None:
    """`Lane._launch` on host memory with a kernel that reads its rows as the GPU would: every piece (ranges longer than
    256 KiB cut first) reaches exactly one part, base added, and the table's reader is recorded after the last."""
    from hmc.transport._gpu_copy import _cut

    rng = np.random.default_rng(count)
    lengths = rng.integers(1, 600000, count).astype(np.int64)
    src, dst = rng.integers(0, 1 << 40, count).astype(np.int64), rng.integers(0, 1 << 40, count).astype(np.int64)
    lane = _host_lane()
    kernel = _ReadingKernel(lane)
    lane._launch(kernel, src, 1000, dst, 7, lengths, time.monotonic() + 5)
    pieces_src, pieces_dst, pieces_lengths, _ = _cut(src, dst, lengths)
    got = [np.concatenate(column) for column in zip(*kernel.parts)]
    assert got[0].tolist() == (pieces_src + 1000).tolist() and got[1].tolist() == (pieces_dst + 7).tolist()
    assert got[2].tolist() == pieces_lengths.tolist()
    assert len(kernel.parts) == len(list(_parts(pieces_lengths.size))) and len(lane._rt.recorded) == 1


def test_a_failed_later_launch_still_marks_the_table_read_by_the_parts_queued_before() -> None:
    """Part 2's launch fails after part 1 was queued: the table's reader is recorded all the same, so it is not
    rewritten while part 1 may still read it."""
    lane = _host_lane()
    kernel = _ReadingKernel(lane, fail_at=2)
    lengths = np.full(3000, 64, np.int64)
    with pytest.raises(DeviceError):
        lane._launch(kernel, np.zeros(3000, np.int64), 0, np.arange(3000, dtype=np.int64) * 64, 0, lengths, time.monotonic() + 5)
    assert len(kernel.parts) == 1 and len(lane._rt.recorded) == 1


class _FakeLane:
    """Stands in for a CUDA lane: an event is done once `done` holds it."""

    def __init__(self) -> None:
        self.done: set[int] = set()
        self.released: list[int] = []
        self.looks: list[str] = []

    def event_wait(self, event: int, deadline: float) -> bool:
        self.looks.append(threading.current_thread().name)
        while event not in self.done:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True

    def event_done(self, event: int) -> bool:
        self.looks.append(threading.current_thread().name)
        return event in self.done

    def release_event(self, event: int) -> None:
        self.released.append(event)


def test_cuda_ipc_requests_complete_on_the_waiting_thread_once() -> None:
    from hmc.agent._transfer import TransferHandle
    from hmc.transport._gpu_ipc_completion import _Pending, _Waiter

    lane, waiter = _FakeLane(), _Waiter(interval=0.05)
    handle = TransferHandle("ipc", 8, time.monotonic() + 5)
    outcomes: list[BaseException | None] = []

    def on_done(error: BaseException | None) -> None:
        outcomes.append(error)
        handle.finish(error)

    pending = _Pending(lane, 1, handle.deadline, on_done, lambda: None)  # type: ignore[arg-type]
    handle.drive_with(pending.drive)
    waiter.watch(pending)
    assert not handle.done()
    threading.Timer(0.01, lambda: lane.done.add(1)).start()
    handle.wait()
    assert handle.state.value == "done" and outcomes == [None] and lane.released == [1]
    assert lane.looks[-1] == threading.current_thread().name
    time.sleep(0.12)  # the backstop sees it settled and drops it, completing nothing twice
    waiter.close()
    assert outcomes == [None] and lane.released == [1]


def test_cuda_ipc_backstop_completes_requests_nobody_waits_on() -> None:
    from hmc.transport._gpu_ipc_completion import _Pending, _Waiter

    lane, waiter = _FakeLane(), _Waiter(interval=0.001)
    outcomes: list[BaseException | None] = []
    late: list[bool] = []
    pending = _Pending(lane, 2, time.monotonic() + 0.01, outcomes.append, lambda: late.append(True))  # type: ignore[arg-type]
    waiter.watch(pending)
    time.sleep(0.05)
    assert late == [True] and not outcomes  # past its deadline: expired once, still watched
    lane.done.add(2)
    limit = time.monotonic() + 2
    while not outcomes and time.monotonic() < limit:
        time.sleep(0.002)
    waiter.close()
    assert outcomes == [None] and lane.released == [2] and pending.settled
    pending.drive(time.monotonic() + 1)  # a late wait finds it settled
    assert outcomes == [None]
