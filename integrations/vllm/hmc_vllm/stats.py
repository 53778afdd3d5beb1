"""HMCConnector's transfer metrics, carried to the log and to /metrics by vLLM's own KVConnectorStats.

The way of one observation (vLLM 0.32):
  worker, connector thread   `TransferRecorder.record` / `.failure` as a transfer ends
  worker, engine thread      every step `HMCConnector.get_kv_connector_stats` -> `TransferRecorder.take`
  engine core                the workers' `HMCKVConnectorStats` arrive pickled in their ModelRunnerOutput;
                             vLLM `aggregate`s them and sends `to_dict()` (plain lists and ints) in
                             SchedulerStats, msgpack-encoded, to the front end
  front end                  `HMCConnector.build_kv_connector_stats(data)` for the periodic "KV Transfer
                             metrics:" log line (`aggregate` over the interval, then `reduce`), and
                             `HMCPromMetrics.observe(data)` for /metrics
Kinds: "load" is the decode side (one request's blocks landed here), "push" the prefill side (one
request's blocks written to a decode instance). A failure is a transfer that failed, was refused or
whose lease expired.

Concurrency: a `TransferRecorder` is shared by the connector thread (record, failure) and vLLM's engine
thread (take); its lock guards the pending stats. An `HMCKVConnectorStats` belongs to one thread at a
time (vLLM hands it on and never shares it).
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from hmc.errors import ArgumentError

#: What moved: "load" on the decode side, "push" on the prefill side.
TransferKind = Literal["load", "push"]
KINDS: tuple[TransferKind, ...] = ("load", "push")
_PLURAL = {"load": "loads", "push": "pushes"}

#: Seconds of one transfer: a load waits for the prefill side's push, up to the lease (30 s by default).
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Bytes of one transfer: 4 KiB to 16 GiB in steps of 4.
BYTES_BUCKETS = tuple(float(4**k) for k in range(6, 18))


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ArgumentError(f"transfer kind must be one of {', '.join(KINDS)}, not {kind!r}")


@dataclass
class HMCKVConnectorStats(KVConnectorStats):
    """HMC transfers since the last take: per kind, each transfer's seconds and bytes, and the failures.

    `data` is what travels (msgpack): {kind: {"seconds": [float], "bytes": [int], "failures": int}}.
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HMCKVConnectorStats:
        """A copy of `data` as sent by `to_dict` (a copy: vLLM hands the same dict to every stat logger)."""
        return cls({kind: {"seconds": [float(s) for s in data[kind]["seconds"]], "bytes": [int(b) for b in data[kind]["bytes"]],
                           "failures": int(data[kind]["failures"])} for kind in KINDS})

    def reset(self) -> None:
        self.data = {kind: {"seconds": [], "bytes": [], "failures": 0} for kind in KINDS}

    def add(self, kind: TransferKind, nbytes: int, seconds: float) -> None:
        """One finished transfer of `kind`."""
        _check_kind(kind)
        self.data[kind]["seconds"].append(float(seconds))
        self.data[kind]["bytes"].append(int(nbytes))

    def add_failure(self, kind: TransferKind) -> None:
        """One failed, refused or expired transfer of `kind`."""
        _check_kind(kind)
        self.data[kind]["failures"] += 1

    def transfers(self, kind: TransferKind) -> int:
        return len(self.data[kind]["seconds"])

    def failures(self, kind: TransferKind) -> int:
        return int(self.data[kind]["failures"])

    def is_empty(self) -> bool:
        return not any(self.transfers(kind) or self.failures(kind) for kind in KINDS)

    def aggregate(self, other: KVConnectorStats) -> HMCKVConnectorStats:
        """Add `other`'s observations to these (another worker's, or a later step's); returns self, as vLLM expects."""
        if not isinstance(other, HMCKVConnectorStats):
            raise ArgumentError(f"cannot aggregate {type(other).__name__} into HMCKVConnectorStats")
        for kind in KINDS:
            mine, theirs = self.data[kind], other.data[kind]
            mine["seconds"].extend(theirs["seconds"])
            mine["bytes"].extend(theirs["bytes"])
            mine["failures"] += theirs["failures"]
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary for the log line, for each kind that saw a transfer or a failure."""
        out: dict[str, int | float] = {}
        for kind in KINDS:
            n, failed = self.transfers(kind), self.failures(kind)
            if not n and not failed:
                continue
            seconds, total_mb = sorted(self.data[kind]["seconds"]), sum(self.data[kind]["bytes"]) / 2**20
            out[_PLURAL[kind].capitalize()] = n
            if n:
                out[f"Avg {kind} time (ms)"] = round(1e3 * statistics.fmean(seconds), 3)
                out[f"P90 {kind} time (ms)"] = round(1e3 * seconds[math.ceil(0.9 * n) - 1], 3)
                out[f"{kind.capitalize()} MB"] = round(total_mb, 3)
                out[f"{kind.capitalize()} MB/s"] = round(total_mb / sum(seconds), 3) if sum(seconds) > 0 else 0.0
            out[f"Failed {_PLURAL[kind]}"] = failed
        return out


class TransferRecorder:
    """The worker's pending stats: the connector thread records transfers, vLLM's engine thread takes them each step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _pending (connector thread "hmc-connector" vs the engine's thread)
        self._pending = HMCKVConnectorStats()

    def record(self, kind: TransferKind, nbytes: int, seconds: float) -> None:
        """A transfer of `kind` moved `nbytes` in `seconds` (record it before reporting the request finished)."""
        with self._lock:
            self._pending.add(kind, nbytes, seconds)

    def failure(self, kind: TransferKind) -> None:
        """A transfer of `kind` failed, was refused, or its lease expired."""
        with self._lock:
            self._pending.add_failure(kind)

    def take(self) -> HMCKVConnectorStats | None:
        """What was recorded since the last take, or None when nothing was."""
        with self._lock:
            if self._pending.is_empty():
                return None
            taken, self._pending = self._pending, HMCKVConnectorStats()
        return taken


class HMCPromMetrics(KVConnectorPromMetrics):
    """/metrics series of HMC transfers, with vLLM's labels (model_name, engine) plus `kind` (load, push).

    vllm:hmc_transfer_time_seconds  histogram of one transfer's seconds (its _count is the transfers)
    vllm:hmc_transfer_bytes         histogram of one transfer's bytes (its _sum is the bytes moved)
    vllm:hmc_failed_transfers_total transfers that failed, were refused, or whose lease expired
    """

    def __init__(
        self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]], labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = [*labelnames, "kind"]
        self.seconds = self._per_kind(self._histogram_cls(
            name="vllm:hmc_transfer_time_seconds", labelnames=names, buckets=TIME_BUCKETS,
            documentation="Seconds of one HMC KV transfer: kind=load from a decode request's load starting to its last block landing, "
                          "kind=push from a prefill request's writes being posted to their completion.",
        ))
        self.bytes = self._per_kind(self._histogram_cls(
            name="vllm:hmc_transfer_bytes", labelnames=names, buckets=BYTES_BUCKETS,
            documentation="Bytes of one HMC KV transfer (kind=load: landed here, kind=push: written to a decode instance).",
        ))
        self.failures = self._per_kind(self._counter_cls(
            name="vllm:hmc_failed_transfers", labelnames=names,
            documentation="HMC KV transfers that failed, were refused, or whose lease expired (kind=load: decode side, kind=push: prefill side).",
        ))

    def _per_kind(self, metric: PromMetric) -> dict[str, dict[int, PromMetric]]:
        """The metric's child for each kind and engine, created now so that every series shows from the start."""
        return {kind: create_metric_per_engine(metric, {i: [*values, kind] for i, values in self.per_engine_labelvalues.items()}) for kind in KINDS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = HMCKVConnectorStats.from_dict(transfer_stats_data)
        for kind in KINDS:
            for seconds, nbytes in zip(stats.data[kind]["seconds"], stats.data[kind]["bytes"], strict=True):
                self.seconds[kind][engine_idx].observe(seconds)
                self.bytes[kind][engine_idx].observe(nbytes)
            if stats.failures(kind):
                self.failures[kind][engine_idx].inc(stats.failures(kind))
