"""PdstackConnector across the emulated WAN: a vLLM prefill and a vLLM decode in two network namespaces joined by
pdstack's WAN link (1 Gbit/s, 20 ms RTT), the KV crossing it and nothing else (HTTP reaches each side over an
unshaped veth pair). Decode runs with kv_load_failure_policy `fail`, so an answer equal to colocated cannot come
from a silent local recompute. Needs root, /dev/net/tun and iproute2 (CI runs as root; scripts/host-setup.sh).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.vllm_ttft import measure_point
from pdserve.kv.auth import SecretKey
from pdstack.wanlink import LinkSpec
from tests.vllm.conftest import BLOCK_SIZE, MODEL_CONFIG, Pair, WanSites, start_pair
from tests.vllm.test_connector import MAX_TOKENS, loaded, prompt_of, token_ids

RATE_MBIT, RTT_MS = 1000.0, 20.0
RECEIVED = ("pdserve_kv_transfer_bytes_total", 'role="receiver"')


@pytest.fixture(scope="module")
def wan() -> Iterator[WanSites]:
    with WanSites(LinkSpec(RATE_MBIT, RTT_MS)) as sites:
        yield sites


@pytest.fixture(scope="module")
def wan_pair(
    wan: WanSites, model_dir: Path, key_file: Path, kv_key: SecretKey, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    yield from start_pair(model_dir, key_file, kv_key, tmp_path_factory, "fail", sites=wan.sites)


def test_kv_crosses_the_wan_and_output_equals_colocated(wan: WanSites, wan_pair: Pair) -> None:
    prompt = prompt_of(30 * BLOCK_SIZE + 5, seed=31)
    colocated = token_ids(wan_pair.prefill.complete(prompt, MAX_TOKENS))
    received_before = wan_pair.decode.metric(*RECEIVED)
    link_before = wan.link_bytes()

    params = wan_pair.prefill_params(prompt)
    assert (params["remote_host"], params["remote_port"]) == (wan.sites[0].kv_host, wan_pair.kv_port)
    answer = wan_pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params)

    assert token_ids(answer) == colocated
    assert loaded(wan_pair, params["remote_request_id"]), wan_pair.decode.log_tail()
    kv_bytes = wan_pair.decode.wait_metric(RECEIVED[0], lambda v: v > received_before, RECEIVED[1]) - received_before
    layers, kv_heads, head_dim = (MODEL_CONFIG[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim"))
    assert kv_bytes == len(params["remote_block_ids"]) * layers * kv_heads * BLOCK_SIZE * 2 * head_dim * 4
    moved = wan.link_bytes()
    assert moved["prefill_to_decode"] - link_before["prefill_to_decode"] >= kv_bytes
    assert moved["decode_to_prefill"] > link_before["decode_to_prefill"]  # decode's requests and ACKs


def test_ttft_bench_measures_a_point_over_the_wan(wan: WanSites, wan_pair: Pair) -> None:
    """bench/vllm_ttft.py's code path at a tiny size: its figures are those of a KV that crossed the link."""
    point = measure_point(wan_pair, wan, length=2 * BLOCK_SIZE, repeats=1, flows=("proxy",))
    proxy = point["flows"]["proxy"]
    median = proxy["median"]
    assert median["kv_bytes"] > 0 and median["link_bytes"] >= median["kv_bytes"]
    # The decode's first token came after prefill answered and at least one RTT of pulling over the link.
    assert median["ttft_s"] > median["prefill_leg_s"] + RTT_MS / 1000
    assert proxy["bound_s"] >= point["colocated_ttft_s"] + RTT_MS / 1000
