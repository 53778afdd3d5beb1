"""Pipeline-parallel intermediate tensors over HMC: the StageLink protocol with two real agents, then real vLLM.

The unit tests run two embedded agents in this process (their data crosses the ipc path): random tensors
into a poisoned ring, every byte compared; credits, growth, deadlines and version checks. The end-to-end
test runs vLLM with `pipeline_parallel_size=2` on CPU in a subprocess (tests/_pp_generate.py) with and
without the HMC transport and compares greedy tokens; each PP rank's stats file proves HMC carried them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hmc
from hmc.config import Config
from hmc.errors import ProtocolError, TimeoutError, UnsupportedError, VersionMismatchError
from hmc_vllm.pp import PP_PROTOCOL_VERSION, STATS_ENV, StageLink

POISON = 0xA5
_HERE = Path(__file__).parent


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """Random tensors, seeded per test."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def stages(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[StageLink, StageLink]]:
    """Stage 0 sends to stage 1 (two embedded agents, handshaken by hand); parametrize with (slots, slot_bytes)."""
    slots, slot_bytes = getattr(request, "param", (4, 1 << 16))
    config = Config(socket=str(tmp_path / "no-hmcd.sock"), timeout_s=10.0)
    first = StageLink(hmc.Agent(config, daemon=False), rank=0, slots=slots, slot_bytes=slot_bytes)
    second = StageLink(hmc.Agent(config, daemon=False), rank=1, slots=slots, slot_bytes=slot_bytes)
    first.connect(prev_hello=second.hello(), next_hello=second.hello())
    second.connect(prev_hello=first.hello(), next_hello=first.hello())
    second._memory[second._ring.id].fill(POISON)
    yield first, second
    first.close()
    second.close()


def _random(gen: torch.Generator, tokens: int, hidden: int = 64, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    raw = torch.randint(0, 256, (tokens * hidden * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(tokens, hidden)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def test_tensors_and_values_cross_in_one_write_every_byte(stages: tuple[StageLink, StageLink], gen: torch.Generator) -> None:
    first, second = stages
    sent = {
        "hidden_states": _random(gen, 37),
        "residual": _random(gen, 37, dtype=torch.bfloat16),
        "positions": torch.arange(37, dtype=torch.int64)[::2],  # not contiguous
        "empty": torch.empty(0, 64),
        "step": 7, "note": "prefill", "none": None,
    }
    handle = first.send(sent)
    handle.wait()
    got = second.recv()
    assert list(got) == list(sent)
    for key, value in sent.items():
        assert _same_bytes(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value
    assert handle.path == "ipc" and first.stats.paths == ["ipc"]
    assert first.stats.sent_messages == second.stats.received_messages == 1
    assert first.stats.sent_bytes >= second.stats.received_bytes == sum(v.numel() * v.element_size() for v in sent.values() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("stages", [(2, 1 << 16)], indirect=True)
def test_credits_stop_the_sender_until_the_receiver_acks(stages: tuple[StageLink, StageLink], gen: torch.Generator) -> None:
    first, second = stages
    batches = [{"hidden_states": _random(gen, n)} for n in (5, 9, 13, 17)]
    first.send(batches[0]).wait()
    first.send(batches[1]).wait()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="ack"):
        first.send(batches[2], timeout=0.3)  # both slots hold unread messages
    assert time.monotonic() - started < 2.0
    assert _same_bytes(second.recv()["hidden_states"], batches[0]["hidden_states"])
    first.send(batches[2]).wait()  # the ack of slot 0 came back
    assert _same_bytes(second.recv()["hidden_states"], batches[1]["hidden_states"])
    first.send(batches[3]).wait()
    for expected in batches[2:]:
        assert _same_bytes(second.recv()["hidden_states"], expected["hidden_states"])
    assert first.stats.sent_messages == second.stats.received_messages == 4


def test_tickets_keep_irecv_order_whatever_the_wait_order(stages: tuple[StageLink, StageLink], gen: torch.Generator) -> None:
    first, second = stages
    batches = [{"x": _random(gen, n)} for n in (3, 4)]
    early, late = second.ticket(), second.ticket()
    for batch in batches:
        first.send(batch)
    assert _same_bytes(second.recv(late)["x"], batches[1]["x"])
    assert _same_bytes(second.recv(early)["x"], batches[0]["x"])


@pytest.mark.parametrize("stages", [(2, 4096)], indirect=True)
def test_a_message_larger_than_a_slot_grows_the_ring(stages: tuple[StageLink, StageLink], gen: torch.Generator) -> None:
    first, second = stages
    small, big = {"h": _random(gen, 4)}, {"h": _random(gen, 300), "r": _random(gen, 300)}  # 1 KiB, then 150 KiB
    first.send(small)
    assert _same_bytes(second.recv()["h"], small["h"])
    received: dict[str, Any] = {}
    receiver = threading.Thread(target=lambda: received.update(second.recv()), name="test-pp-recv")
    receiver.start()  # the receiver answers the grow request while it waits
    first.send(big).wait()
    receiver.join(15)
    assert not receiver.is_alive()
    assert _same_bytes(received["h"], big["h"]) and _same_bytes(received["r"], big["r"])
    assert first.stats.grows == second.stats.grows == 1 and second._ring.size == 2 * (1 << 18)


def test_a_receiver_waiting_for_nothing_fails_within_its_deadline(stages: tuple[StageLink, StageLink]) -> None:
    _, second = stages
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="message 0 from the previous stage"):
        second.recv(timeout=0.5)
    assert 0.5 <= time.monotonic() - started < 2.5


def test_peers_of_another_protocol_version_and_odd_values_are_refused(stages: tuple[StageLink, StageLink]) -> None:
    first, second = stages
    import msgpack

    with pytest.raises(VersionMismatchError, match=f"this rank {PP_PROTOCOL_VERSION}"):
        first.connect(prev_hello=msgpack.packb({"v": PP_PROTOCOL_VERSION + 1, "kind": "hello"}), next_hello=None)
    with pytest.raises(ProtocolError):
        first.connect(prev_hello=b"\xc1garbage", next_hello=None)
    with pytest.raises(UnsupportedError, match="'obj' of type object"):
        first.send({"obj": object()})


# -- end to end: real vLLM, two PP stages on CPU -----------------------------------------


def _generate(model: Path, pp: int, out: Path, log: Path, env: dict[str, str], timeout: float = 900.0) -> list[list[int]]:
    """Run tests/_pp_generate.py in its own session; kill the whole group (engine, workers) whatever happens."""
    with open(log, "wb") as sink:
        process = subprocess.Popen([sys.executable, str(_HERE / "_pp_generate.py"), str(model), str(pp), str(out)],
                                   env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
    assert code == 0 and out.exists(), f"pp={pp} run {'timed out' if code is None else f'exited {code}'}:\n{tail}"
    return json.loads(out.read_text())["tokens"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_pp_stages_over_hmc_give_the_one_stage_tokens(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:  # not imported here: vLLM only runs in the subprocesses
        pytest.skip("vLLM is not installed")
    from hmc_vllm.testing import PROMPTS, make_tiny_llama, server_env

    model = make_tiny_llama(tmp_path / "tiny")
    stats = tmp_path / "stats"
    stats.mkdir()
    env = server_env(
        VLLM_CPU_OMP_THREADS_BIND="nobind",  # auto binding wants one NUMA node per worker (vllm/utils/ompmultiprocessing.py:216)
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # _pp_generate.py sends a function to the workers (collective_rpc)
        HMC_SOCKET=str(tmp_path / "no-hmcd.sock"),  # embedded agents: no hmcd of someone else's
        VLLM_LOGGING_LEVEL="INFO",
    )
    one = _generate(model, 1, tmp_path / "pp1.json", tmp_path / "pp1.log", env)
    two = _generate(model, 2, tmp_path / "pp2.json", tmp_path / "pp2.log", {**env, "HMC_VLLM_PP": "1", STATS_ENV: str(stats)})
    assert len(one) == len(PROMPTS) and all(len(t) == 12 for t in one)
    assert two == one
    ranks = {p.name: json.loads(p.read_text()) for p in sorted(stats.glob("pp-rank*.json"))}
    assert set(ranks) == {"pp-rank0.json", "pp-rank1.json"}, ranks
    sender, receiver = ranks["pp-rank0.json"], ranks["pp-rank1.json"]
    assert sender["sent_messages"] == receiver["received_messages"] >= 12  # one per step: a prefill and 11 decodes at least
    assert receiver["received_bytes"] > 0 and receiver["received_bytes"] % (2 * 64 * 4) == 0  # hidden_states + residual, fp32, hidden 64
    assert sender["sent_bytes"] == receiver["received_bytes"]
    assert sender["paths"] and set(sender["paths"]) <= {p.value for p in hmc.PathName}, sender["paths"]
    assert "HMC PP transport installed" in (tmp_path / "pp2.log").read_text()
