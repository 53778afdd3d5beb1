"""HMCConnector's parts without an engine: KV layouts, compatibility, messages, and the two halves.

The scheduler half runs against a real VllmConfig and real vLLM Requests; the worker half runs as two
real workers (two HMC agents, real ipc transfers) over real KV tensors shaped like vLLM's CPU caches.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(300),
    # vLLM's own imports warn about things that are not ours (pynvml, torch internals).
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"),
]

if importlib.util.find_spec("vllm") is not None:
    import torch

    from hmc.errors import ArgumentError, ProtocolError
    from hmc_vllm.compat import refusal
    from hmc_vllm.connector import ConnectorSettings
    from hmc_vllm.layout import KVLayout, block_ranges, describe, storages
    from hmc_vllm.metadata import HMCConnectorMetadata, RecvTask, SendTask, WorkerHandshake, decode, encode
    from hmc_vllm.worker import HMCConnectorWorker

NUM_BLOCKS = 64


def cpu_caches(num_blocks: int = NUM_BLOCKS, layers: int = 2, head_dim: int = 32) -> dict[str, Any]:
    """Layer views over one allocation, as vLLM's CPU backend lays them out: [blocks, heads, tokens, K|V]."""
    flat = torch.empty(layers * num_blocks * 1 * 32 * 2 * head_dim, dtype=torch.float32)
    per_layer = flat.view(layers, num_blocks, 1, 32, 2 * head_dim)
    return {f"model.layers.{i}.self_attn.attn": per_layer[i] for i in range(layers)}


def split_caches(num_blocks: int = NUM_BLOCKS, layers: int = 2) -> dict[str, Any]:
    """One allocation per layer with K and V planes apart: [2, blocks, tokens, heads, head_dim]."""
    return {f"layer{i}": torch.empty(2, num_blocks, 32, 1, 32, dtype=torch.float32) for i in range(layers)}


def block_bytes(caches: dict[str, Any], layout: KVLayout, block: int) -> bytes:
    flat = storages(caches)
    return b"".join(bytes(flat[b][o + block * s : o + block * s + layout.block_bytes].numpy()) for b, o, s in layout.segments)


# -- layouts ----------------------------------------------------------------------------------


def test_cpu_layout_is_one_run_per_layer_in_one_buffer() -> None:
    caches = cpu_caches()
    layout = describe(caches, storages(caches), NUM_BLOCKS)
    assert len(storages(caches)) == 1
    assert layout.block_bytes == 32 * 64 * 4
    assert layout.segments == ((0, 0, 8192), (0, NUM_BLOCKS * 8192, 8192))


def test_split_layout_is_two_runs_per_layer_one_buffer_each() -> None:
    caches = split_caches()
    layout = describe(caches, storages(caches), NUM_BLOCKS)
    assert [s[0] for s in layout.segments] == [0, 0, 1, 1]
    assert layout.segments[1][1] == NUM_BLOCKS * 32 * 32 * 4 and layout.block_bytes == 32 * 32 * 4


def randomize_and_poison(src: dict[str, Any], dst: dict[str, Any]) -> None:
    """Random values in every source cache, poison (-7.0) in every destination cache."""
    for t in src.values():
        t.copy_(torch.randn(t.shape))
    for t in dst.values():
        t.fill_(-7.0)


@pytest.mark.parametrize("make", [cpu_caches, split_caches], ids=["cpu", "split"])
def test_block_ranges_copy_exactly_the_named_blocks(make: Any) -> None:
    src, dst = make(), make()
    randomize_and_poison(src, dst)
    s_flat, d_flat = storages(src), storages(dst)
    s_layout, d_layout = describe(src, s_flat, NUM_BLOCKS), describe(dst, d_flat, NUM_BLOCKS)
    poisoned = block_bytes(dst, d_layout, 0)
    src_blocks, dst_blocks = [5, 6, 7, 40], [9, 10, 11, 3]
    for (sb, db), (s_off, d_off, lengths) in block_ranges(s_layout, d_layout, src_blocks, dst_blocks).items():
        for so, do, n in zip(s_off.tolist(), d_off.tolist(), lengths.tolist(), strict=True):
            d_flat[db][do : do + n] = s_flat[sb][so : so + n]
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        assert block_bytes(dst, d_layout, d) == block_bytes(src, s_layout, s)
    assert block_bytes(dst, d_layout, 0) == poisoned


def test_block_ranges_refuse_other_layouts_and_unknown_blocks() -> None:
    cpu, split = cpu_caches(), split_caches()
    a, b = describe(cpu, storages(cpu), NUM_BLOCKS), describe(split, storages(split), NUM_BLOCKS)
    with pytest.raises(ArgumentError, match="layouts differ"):
        block_ranges(a, b, [1], [1])
    with pytest.raises(ArgumentError, match="outside"):
        block_ranges(a, a, [1], [NUM_BLOCKS])
    with pytest.raises(ArgumentError, match="2 source blocks for 1"):
        block_ranges(a, a, [1, 2], [1])


# -- compatibility and messages ---------------------------------------------------------------------


def test_refusal_names_every_difference_with_both_values() -> None:
    here = {"model": "m", "dtype": "float32", "block_size": 32, "head_size": 32}
    assert refusal(here, dict(here)) is None
    message = refusal(here, {**here, "block_size": 64, "dtype": "bfloat16"})
    assert message is not None
    assert "block_size: peer 64, here 32" in message and "dtype: peer 'bfloat16', here 'float32'" in message


def test_messages_round_trip_and_garbage_is_a_protocol_error() -> None:
    assert decode(encode("kv", dreq="r1", part=0, parts=2)) == {"t": "kv", "dreq": "r1", "part": 0, "parts": 2}
    for payload in (b"\xff\xfe", b"[1, 2]", b'{"t": "other"}'):
        with pytest.raises(ProtocolError):
            decode(payload)
    with pytest.raises(ProtocolError):
        WorkerHandshake.from_wire({"buffers": ["not base64!"]})


def test_settings_defaults_and_bad_mode() -> None:
    settings = ConnectorSettings.from_extra({"lease_s": 5})
    assert (settings.mode, settings.lease_s, settings.load_timeout_s) == ("push", 5.0, 5.0)
    with pytest.raises(ValueError, match="one of 'push', 'pull', 'hmcd'"):
        ConnectorSettings.from_extra({"mode": "teleport"})


# -- the scheduler half, with a real VllmConfig and real Requests --------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hmc_vllm.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


def engine_config(model: Path, role: str, block_size: int = 32, policy: str = "fail") -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    transfer = KVTransferConfig(kv_connector="HMCConnector", kv_role=role, kv_load_failure_policy=policy)  # type: ignore[arg-type]
    args = EngineArgs(model=str(model), block_size=block_size, dtype="float32", max_model_len=512, enforce_eager=True, kv_transfer_config=transfer)
    return args.create_engine_config()


def request(request_id: str, tokens: int | list[int], params: dict[str, Any]) -> Any:
    """A vLLM Request of `tokens` (a prompt, or its length: the prompt 1..n) carrying `params`."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    prompt = list(range(1, tokens + 1)) if isinstance(tokens, int) else tokens
    return Request(request_id, prompt, SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}), None)


def scheduler(config: Any) -> Any:
    from hmc_vllm.scheduler import HMCConnectorScheduler

    return HMCConnectorScheduler(config, config.kv_transfer_config.engine_id, ConnectorSettings.from_extra({}))


def blocks(ids: list[int]) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def handshake(layout_caches: dict[str, Any] | None = None) -> WorkerHandshake:
    caches = layout_caches or cpu_caches()
    return WorkerHandshake((b"descriptor",), describe(caches, storages(caches), NUM_BLOCKS))


def prefill_params(tiny_model: Path, block_size: int = 32, tokens: int | list[int] = 70, request_id: str = "p-1", **extra: Any) -> dict[str, Any]:
    from vllm.v1.request import RequestStatus

    p = scheduler(engine_config(tiny_model, "kv_producer", block_size))
    p.set_handshakes({(0, 0): handshake()})
    finished = request(request_id, tokens, {"do_remote_decode": True, **extra})
    finished.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p.request_finished(finished, [4, 5, 6])
    assert delay is True and params is not None
    assert [s.block_ids for s in p.build_connector_meta().sends] == [(4, 5, 6)]
    return params


def test_prefill_holds_blocks_and_returns_what_decode_needs(tiny_model: Path) -> None:
    from hmc_vllm.identity import prompt_digest

    params = prefill_params(tiny_model)
    assert params["do_remote_prefill"] is True and params["remote_block_ids"] == [4, 5, 6] and params["remote_request_id"] == "p-1"
    assert params["hmc"]["factors"]["block_size"] == 32 and params["hmc"]["factors"]["block_bytes"] == 8192
    assert params["hmc"]["workers"]["0"]["buffers"]
    assert params["hmc"]["prompt"] == prompt_digest(list(range(1, 71))) and params["hmc"]["loads"] == 1
    assert params["hmc"]["factors"]["tokenizer"] and params["hmc"]["factors"]["chat_template"]
    assert str(tiny_model) not in json.dumps(params["hmc"]["factors"])  # the model is its identity, not its path


@pytest.mark.parametrize("loads", [0, -1, 1025, 2.0, "2", None, True])
def test_prefill_offers_nothing_for_a_bad_load_count(tiny_model: Path, loads: Any) -> None:
    from vllm.v1.request import RequestStatus

    p = scheduler(engine_config(tiny_model, "kv_producer"))
    p.set_handshakes({(0, 0): handshake()})
    finished = request("p-9", 70, {"do_remote_decode": True, "hmc_loads": loads})
    finished.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert p.request_finished(finished, [4, 5, 6]) == (False, None)
    assert p.build_connector_meta().sends == []


def test_a_release_request_frees_only_this_engines_offer(tiny_model: Path) -> None:
    params = prefill_params(tiny_model)
    p = scheduler(engine_config(tiny_model, "kv_producer"))
    p.engine_id = params["remote_engine_id"]
    assert p.request_finished(request("r-1", 1, {**params, "hmc_release": True}), []) == (False, None)
    assert p.request_finished(request("r-2", 1, {**params, "remote_engine_id": "someone-else", "hmc_release": True}), []) == (False, None)
    assert p.build_connector_meta().releases == ["p-1"]


def test_decode_loads_the_prompt_asynchronously_once(tiny_model: Path) -> None:
    params = prefill_params(tiny_model)
    d = scheduler(engine_config(tiny_model, "kv_consumer"))
    d.set_handshakes({(0, 0): handshake()})
    incoming = request("d-1", 70, params)
    assert d.get_num_new_matched_tokens(incoming, 0) == (70, True)
    d.update_state_after_alloc(incoming, blocks([11, 12, 13]), 70)
    d.update_state_after_alloc(incoming, blocks([11, 12, 13]), 70)  # vLLM may call it twice
    [task] = d.build_connector_meta().recvs
    assert (task.request_id, task.remote_request_id, task.local_blocks, task.remote_blocks, task.refused) == ("d-1", "p-1", (11, 12, 13), (4, 5, 6), None)
    assert d.get_num_new_matched_tokens(incoming, 0) == (0, False)


def test_incompatible_peer_is_refused_with_what_differs(tiny_model: Path) -> None:
    params = prefill_params(tiny_model, block_size=64)
    d = scheduler(engine_config(tiny_model, "kv_consumer"))
    d.set_handshakes({(0, 0): handshake()})
    incoming = request("d-2", 70, params)
    assert d.get_num_new_matched_tokens(incoming, 0) == (70, True)  # policy "fail": the load fails, as data
    d.update_state_after_alloc(incoming, blocks([1, 2, 3]), 70)
    [task] = d.build_connector_meta().recvs
    assert task.refused is not None and "block_size: peer 64, here 32" in task.refused

    recompute = scheduler(engine_config(tiny_model, "kv_consumer", policy="recompute"))
    recompute.set_handshakes({(0, 0): handshake()})
    refused = request("d-3", 70, prefill_params(tiny_model, block_size=64))
    assert recompute.get_num_new_matched_tokens(refused, 0) == (0, False)
    recompute.update_state_after_alloc(refused, blocks([]), 0)
    [release] = recompute.build_connector_meta().recvs  # the prefill's blocks are released at once
    assert release.local_blocks == () and release.remote_request_id == "p-1" and release.refused


def decoder(tiny_model: Path, policy: str = "fail") -> Any:
    d = scheduler(engine_config(tiny_model, "kv_consumer", policy=policy))
    d.set_handshakes({(0, 0): handshake()})
    return d


def test_each_prompt_of_a_batch_takes_the_offer_for_its_own_prompt(tiny_model: Path) -> None:
    short, long = [7] * 40, list(range(3, 90))
    batch = {"do_remote_prefill": True, "hmc_batch": [prefill_params(tiny_model, tokens=long, request_id="p-long"), prefill_params(tiny_model, tokens=short, request_id="p-short")]}
    d = decoder(tiny_model)
    first, second = request("d-short", short, json.loads(json.dumps(batch))), request("d-long", long, json.loads(json.dumps(batch)))
    assert d.get_num_new_matched_tokens(first, 0) == (40, True) and d.get_num_new_matched_tokens(second, 0) == (87, True)
    d.update_state_after_alloc(first, blocks([1, 2]), 40)
    d.update_state_after_alloc(second, blocks([3, 4, 5]), 87)
    tasks = {t.request_id: t for t in d.build_connector_meta().recvs}
    assert tasks["d-short"].remote_request_id == "p-short" and tasks["d-long"].remote_request_id == "p-long"
    assert tasks["d-short"].refused is None and tasks["d-long"].refused is None


def test_n_sub_requests_share_one_offer_of_n_loads_and_no_more(tiny_model: Path) -> None:
    params = prefill_params(tiny_model, hmc_loads=2)
    d = decoder(tiny_model)
    children = [request(f"{i}_d", 70, json.loads(json.dumps(params))) for i in range(3)]
    assert [d.get_num_new_matched_tokens(c, 0) for c in children] == [(70, True)] * 3  # policy "fail": the third fails as data
    for i, child in enumerate(children):
        d.update_state_after_alloc(child, blocks([10 + i, 20 + i, 30 + i]), 70)
    first, second, third = d.build_connector_meta().recvs
    assert first.refused is None and second.refused is None and first.remote_request_id == second.remote_request_id == "p-1"
    assert third.refused is not None and "all taken" in third.refused


def test_kv_offered_for_another_prompt_is_refused_and_released(tiny_model: Path) -> None:
    """The swapped-params attack: prompt B sent with the params prefill returned for A (same length, one token differs)."""
    a = list(range(1, 71))
    b = a[:35] + [999] + a[36:]
    d = decoder(tiny_model)
    swapped = request("d-b", b, prefill_params(tiny_model, tokens=a))
    assert d.get_num_new_matched_tokens(swapped, 0) == (70, True)
    d.update_state_after_alloc(swapped, blocks([1, 2, 3]), 70)
    [task] = d.build_connector_meta().recvs
    assert task.refused is not None and "another prompt" in task.refused and task.release_all

    recompute = decoder(tiny_model, "recompute")
    swapped = request("d-b2", b, prefill_params(tiny_model, tokens=a))
    assert recompute.get_num_new_matched_tokens(swapped, 0) == (0, False)  # computed here, from B's own tokens


def test_a_batch_never_releases_offers_its_siblings_may_take(tiny_model: Path) -> None:
    a, b = list(range(1, 71)), list(range(2, 72))
    batch = {"do_remote_prefill": True, "hmc_batch": [prefill_params(tiny_model, tokens=a, request_id="p-a")]}
    d = decoder(tiny_model, "recompute")
    stranger = request("d-b", b, json.loads(json.dumps(batch)))  # its own prompt's offer is missing (P returned none)
    assert d.get_num_new_matched_tokens(stranger, 0) == (0, False)
    d.update_state_after_alloc(stranger, blocks([]), 0)
    assert d.build_connector_meta().recvs == []  # p-a stays held for the sibling whose prompt it is


def test_a_request_without_token_ids_neither_offers_nor_loads(tiny_model: Path) -> None:
    from vllm.v1.request import RequestStatus

    p = scheduler(engine_config(tiny_model, "kv_producer"))
    p.set_handshakes({(0, 0): handshake()})
    embedded = request("p-e", 4, {"do_remote_decode": True})
    embedded.prompt_token_ids = None
    embedded.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert p.request_finished(embedded, [1]) == (False, None)
    d = decoder(tiny_model)
    incoming = request("d-e", 70, prefill_params(tiny_model))
    incoming.prompt_token_ids = None
    d.get_num_new_matched_tokens(incoming, 0)
    d.update_state_after_alloc(incoming, blocks([1, 2, 3]), 70)
    [task] = d.build_connector_meta().recvs
    assert task.refused is not None and "prompt embeddings" in task.refused


def test_malformed_params_are_refused_not_raised(tiny_model: Path) -> None:
    params = prefill_params(tiny_model)
    d = decoder(tiny_model)
    hostile = [
        {**params, "remote_block_ids": "4,5"},
        {**params, "remote_block_ids": [4, 5, 2**63]},
        {**params, "hmc": {**params["hmc"], "loads": float("nan")}},
        {**params, "hmc": {**params["hmc"], "workers": {"0": {"buffers": [], "segments": [], "block_bytes": 1, "num_blocks": 1}}}},
        {**params, "hmc": {**params["hmc"], "workers": {"0": {"buffers": ["%%%"], "segments": [], "block_bytes": 1, "num_blocks": 1}}}},
        {**params, "remote_lease_expiry": float("inf")},
        {"do_remote_prefill": True, "hmc_batch": {"x": 1}},
        {"do_remote_prefill": True, "hmc_batch": [params, "not an offer"]},
    ]
    for i, bad in enumerate(hostile):
        incoming = request(f"d-bad-{i}", 70, bad)
        assert d.get_num_new_matched_tokens(incoming, 0) == (70, True)
        d.update_state_after_alloc(incoming, blocks([1, 2, 3]), 70)
        [task] = d.build_connector_meta().recvs
        assert task.refused is not None and "malformed" in task.refused


# -- the worker half: two real workers, real agents ---------------------------------------------------


def fresh_worker(name: str, settings: ConnectorSettings, caches: dict[str, Any] | None = None) -> tuple[HMCConnectorWorker, dict[str, Any]]:
    caches = caches or cpu_caches()
    worker = HMCConnectorWorker(name, 0, NUM_BLOCKS, settings)
    worker.register_kv_caches(caches)
    return worker, caches


@pytest.fixture
def settings() -> ConnectorSettings:
    return ConnectorSettings(lease_s=3.0, load_timeout_s=3.0, message_timeout_s=3.0)


@pytest.fixture
def pair(settings: ConnectorSettings) -> Iterator[tuple[HMCConnectorWorker, dict[str, Any], HMCConnectorWorker, dict[str, Any]]]:
    yield from worker_pair(settings)


def worker_pair(settings: ConnectorSettings) -> Iterator[tuple[HMCConnectorWorker, dict[str, Any], HMCConnectorWorker, dict[str, Any]]]:
    """A prefill worker P with random KV and a decode worker D with poisoned KV, closed at the end."""
    p, p_caches = fresh_worker("P", settings)
    d, d_caches = fresh_worker("D", settings)
    randomize_and_poison(p_caches, d_caches)
    try:
        yield p, p_caches, d, d_caches
    finally:
        p.close()
        d.close()


def collect(worker: HMCConnectorWorker, until: Any, timeout: float = 10.0) -> tuple[set[str], set[str], set[str]]:
    """Accumulate a worker's results until `until(sending, recving, failed)` holds; fails after `timeout`."""
    got: tuple[set[str], set[str], set[str]] = (set(), set(), set())
    deadline = time.monotonic() + timeout
    while not until(*got):
        assert time.monotonic() < deadline, f"still waiting; got {got}"
        for mine, new in zip(got, worker.get_transfer_results(), strict=True):
            mine |= new
        time.sleep(0.005)
    return got


def recv_task(
    p: HMCConnectorWorker, request_id: str, remote_request_id: str, local: tuple[int, ...], remote: tuple[int, ...], seconds: float = 3.0, prompt: str = "",
) -> RecvTask:
    wire = p.handshake()
    assert wire is not None
    return RecvTask(request_id, remote_request_id, "P", {"0": wire.to_wire()}, local, remote, time.time() + seconds, prompt)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_blocks_arrive_byte_for_byte_and_both_sides_finish(mode: str) -> None:
    settings = ConnectorSettings(mode=mode, lease_s=5.0, load_timeout_s=5.0, message_timeout_s=5.0)
    p, p_caches = fresh_worker("P", settings)
    d, d_caches = fresh_worker("D", settings)
    try:
        randomize_and_poison(p_caches, d_caches)
        assert p.layout is not None and d.layout is not None
        untouched = block_bytes(d_caches, d.layout, 0)
        p.submit(HMCConnectorMetadata(sends=[SendTask("p-1", (3, 4, 5, 20), time.time() + 5)]))
        d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "d-1", "p-1", (7, 8, 9, 63), (3, 4, 5, 20))]))
        _, recving, failed = collect(d, lambda s, r, f: "d-1" in r)
        assert not failed
        collect(p, lambda s, r, f: "p-1" in s)
        for src, dst in zip((3, 4, 5, 20), (7, 8, 9, 63), strict=True):
            assert block_bytes(d_caches, d.layout, dst) == block_bytes(p_caches, p.layout, src)
        assert block_bytes(d_caches, d.layout, 0) == untouched
        assert d.block_ids_with_load_errors() == set()
    finally:
        p.close()
        d.close()


def test_unclaimed_blocks_are_freed_when_the_lease_expires(pair: Any) -> None:
    p, _, _, _ = pair
    p.submit(HMCConnectorMetadata(sends=[SendTask("p-2", (1,), time.time() + 0.5)]))
    sending, _, _ = collect(p, lambda s, r, f: "p-2" in s, timeout=5)
    assert sending == {"p-2"}


def test_asking_for_a_request_the_prefill_side_does_not_hold_fails_the_load_as_data(pair: Any) -> None:
    p, _, d, d_caches = pair
    assert d.layout is not None
    untouched = block_bytes(d_caches, d.layout, 10)
    started = time.monotonic()
    d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "d-3", "never-prefilled", (10, 11), (1, 2))]))
    _, recving, failed = collect(d, lambda s, r, f: "d-3" in f, timeout=10)
    assert recving == failed == {"d-3"} and time.monotonic() - started < 8
    assert d.block_ids_with_load_errors() == {10, 11}
    assert block_bytes(d_caches, d.layout, 10) == untouched


def test_a_dead_prefill_instance_fails_the_load_within_its_deadline(pair: Any) -> None:
    p, _, d, _ = pair
    task = recv_task(p, "d-4", "p-4", (2,), (2,), seconds=2.0)
    p.close()
    started = time.monotonic()
    d.submit(HMCConnectorMetadata(recvs=[task]))
    _, _, failed = collect(d, lambda s, r, f: "d-4" in f, timeout=10)
    assert failed == {"d-4"} and time.monotonic() - started < 6


def test_a_decode_side_with_another_block_layout_is_refused_by_the_prefill_side(settings: ConnectorSettings) -> None:
    p, _ = fresh_worker("P", settings)
    d, _ = fresh_worker("D", settings, cpu_caches(head_dim=64))
    try:
        p.submit(HMCConnectorMetadata(sends=[SendTask("p-5", (1,), time.time() + 5)]))
        d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "d-5", "p-5", (1,), (1,))]))
        _, _, failed = collect(d, lambda s, r, f: "d-5" in f)
        assert failed == {"d-5"}
        sending, _, _ = collect(p, lambda s, r, f: "p-5" in s)  # the refused push frees P's blocks at once
        assert sending == {"p-5"}
    finally:
        p.close()
        d.close()


def test_a_refused_task_fails_immediately_and_the_prefill_side_frees_its_blocks(pair: Any) -> None:
    p, _, d, _ = pair
    wire = p.handshake()
    assert wire is not None
    p.submit(HMCConnectorMetadata(sends=[SendTask("p-6", (4,), time.time() + 30)]))
    task = RecvTask("d-6", "p-6", "P", {"0": wire.to_wire()}, (4,), (4,), time.time() + 30, refused="HMCConnector: incompatible KV caches (dtype)")
    d.submit(HMCConnectorMetadata(recvs=[task]))
    _, _, failed = collect(d, lambda s, r, f: "d-6" in f, timeout=2)
    assert failed == {"d-6"} and d.block_ids_with_load_errors() == {4}
    sending, _, _ = collect(p, lambda s, r, f: "p-6" in s, timeout=2)  # not after the 30 s lease
    assert sending == {"p-6"}


def test_one_offer_serves_its_loads_then_is_freed(pair: Any) -> None:
    p, p_caches, d, d_caches = pair
    assert p.layout is not None and d.layout is not None
    p.submit(HMCConnectorMetadata(sends=[SendTask("p-8", (3, 9), time.time() + 30, prompt="A", loads=2)]))
    first = recv_task(p, "0_d-8", "p-8", (11, 12), (3, 9), prompt="A")
    d.submit(HMCConnectorMetadata(recvs=[first]))
    collect(d, lambda s, r, f: "0_d-8" in r)
    assert p.get_transfer_results()[0] == set()  # one load of two: still held
    d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "1_d-8", "p-8", (21, 22), (3, 9), prompt="A")]))
    _, recving, failed = collect(d, lambda s, r, f: "1_d-8" in r)
    assert not failed
    collect(p, lambda s, r, f: "p-8" in s)
    for src, dst in ((3, 11), (9, 12), (3, 21), (9, 22)):
        assert block_bytes(d_caches, d.layout, dst) == block_bytes(p_caches, p.layout, src)


def test_a_want_for_another_prompt_is_refused_and_nothing_is_written(pair: Any) -> None:
    p, _, d, d_caches = pair
    assert d.layout is not None
    untouched = block_bytes(d_caches, d.layout, 11)
    p.submit(HMCConnectorMetadata(sends=[SendTask("p-10", (3,), time.time() + 30, prompt="A")]))
    d.submit(HMCConnectorMetadata(recvs=[recv_task(p, "d-10", "p-10", (11,), (3,), prompt="B")]))
    _, _, failed = collect(d, lambda s, r, f: "d-10" in f)
    assert failed == {"d-10"} and d.block_ids_with_load_errors() == {11}
    assert block_bytes(d_caches, d.layout, 11) == untouched
    sending, _, _ = collect(p, lambda s, r, f: "p-10" in s)  # its one load is spent on the refusal
    assert sending == {"p-10"}


def test_a_release_of_everything_frees_the_request_at_once(pair: Any) -> None:
    p, _, d, _ = pair
    p.submit(HMCConnectorMetadata(sends=[SendTask("p-11", (3,), time.time() + 30, prompt="A", loads=4)]))
    release = RecvTask("d-11", "p-11", "P", {"0": p.handshake().to_wire()}, (), (), time.time() + 30, "A", release_all=True)  # type: ignore[union-attr]
    d.submit(HMCConnectorMetadata(recvs=[release]))
    sending, _, _ = collect(p, lambda s, r, f: "p-11" in s, timeout=3)
    assert sending == {"p-11"}
    p.submit(HMCConnectorMetadata(sends=[SendTask("p-12", (3,), time.time() + 30, prompt="A", loads=4)]))
    p.submit(HMCConnectorMetadata(releases=["p-12"]))  # a step with nothing but the release (the proxy's hmc_release)
    sending, _, _ = collect(p, lambda s, r, f: "p-12" in s, timeout=3)
    assert sending == {"p-12"}


def test_worker_needs_its_peer_of_the_same_tensor_parallel_rank(pair: Any) -> None:
    p, _, d, _ = pair
    wire = p.handshake()
    assert wire is not None
    task = RecvTask("d-7", "p-7", "P", {"1": wire.to_wire()}, (4,), (4,), time.time() + 30)
    d.submit(HMCConnectorMetadata(recvs=[task]))
    _, _, failed = collect(d, lambda s, r, f: "d-7" in f, timeout=2)
    assert failed == {"d-7"}


# -- registration -----------------------------------------------------------------------------------


def test_plugin_registers_once_and_both_ways_find_the_connector() -> None:
    from importlib.metadata import entry_points

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from hmc_vllm.connector import HMCConnector
    from hmc_vllm.plugin import register

    [plugin] = [e for e in entry_points(group="vllm.general_plugins") if e.value == "hmc_vllm.plugin:register"]
    assert plugin.load() is register
    register()
    register()  # vLLM runs every plugin in every process, some more than once
    assert KVConnectorFactory.get_connector_class_by_name("HMCConnector") is HMCConnector
    by_path = KVTransferConfig(kv_connector="HMCConnector", kv_role="kv_both", kv_connector_module_path="hmc_vllm.connector")
    assert KVConnectorFactory.get_connector_class(by_path) is HMCConnector
