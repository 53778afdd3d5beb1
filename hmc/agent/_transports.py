"""The transports an agent offers unless it is given its own: one per path, in the order of preference."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from hmc.agent._buffers import BufferTable
from hmc.agent._peers import Peers
from hmc.config import Config
from hmc.errors import DeviceError
from hmc.memory import DeviceKind
from hmc.transport._base import PathName, Transport
from hmc.transport._gpu_ipc import GpuIpcTransport
from hmc.transport._ipc import IpcTransport
from hmc.transport._ipc_path import IpcPath
from hmc.transport._local import LocalTransport
from hmc.transport._staged import StagedTransport
from hmc.transport._ucx import UcxTransport
from hmc.v1 import common_pb2

__all__ = ["default_transports", "withdraw_everywhere"]


def default_transports(
    config: Config, buffers: BufferTable, peers: Peers, agent_id: str = "", on_measured: Callable[[common_pb2.PathMeasurement], None] | None = None
) -> list[Transport]:
    """local, ipc (a mover per memory kind this process has), rdma and ucx (one UCX engine each; `on_measured` hears
    what they measure between agent `agent_id` and others), staged."""
    local = LocalTransport(buffers)
    host_ipc = IpcTransport(peers.open_grant, threads=config.ipc_threads)
    ipc_movers: dict[DeviceKind, Transport] = {DeviceKind.HOST: host_ipc}
    for kind in (DeviceKind.CUDA, DeviceKind.HIP):  # vendor IPC for each GPU family this process has
        mover = GpuIpcTransport.probe(kind, peers.open_grant, host=host_ipc, timeout_s=config.timeout_s)
        if mover is not None:
            ipc_movers[kind] = mover
    ucx = [
        UcxTransport(
            functools.partial(peers.open_grant, path=path.value), peers.push, path=path,
            transports=config.ucx_transports, library=config.ucx_library, workers=config.ucx_workers, timeout_s=config.timeout_s,
            agent_id=agent_id, on_measured=on_measured, map_peers=config.ucx_map_peers,
        )  # fmt: skip
        for path in (PathName.RDMA, PathName.UCX)
    ]
    staged = StagedTransport(
        peers.connect_data,
        streams=config.staged_streams,
        chunk_bytes=config.staged_chunk_bytes,
        stall_s=config.timeout_s,
        memory_kinds=local.capabilities.memory_kinds,
    )
    return [local, IpcPath(ipc_movers), *ucx, staged]


def withdraw_everywhere(transports: Iterable[Transport], buffer_id: str) -> None:
    """Withdraw a buffer from every transport; then the first DeviceError, if one said transfers of it may still
    run (the memory must be kept)."""
    unsettled: list[DeviceError] = []
    for transport in transports:
        try:
            transport.withdraw(buffer_id)
        except DeviceError as exc:
            unsettled.append(exc)
    if unsettled:
        raise unsettled[0]
