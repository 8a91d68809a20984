"""PdstackConnector between a real vLLM prefill and a real vLLM decode, driven as vLLM's proxy drives a P/D pair.

The colocated reference is the prefill instance answering the whole request itself (no kv_transfer_params: the
connector takes no part). Every disaggregated answer must equal it token for token, and the decode log must show
the KV was loaded (or, for the faults, refused or rejected and recomputed) for that very request.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from pdserve.kv import KVTransferError, pull
from pdserve.kv.auth import SecretKey
from pdstack.canary.prom import Prometheus, queries
from pdstack.contract.components import Component
from tests.support.cluster import wait_for
from tests.support.ports import free_port
from tests.support.prometheus import scraping
from tests.vllm.conftest import (
    BLOCK_SIZE,
    DO_REMOTE_DECODE,
    LEASE_SECONDS,
    MAX_TOKENS,
    RELEASE,
    FlippingProxy,
    Pair,
    SilentServer,
    VLLMServer,
    failure_line,
    loaded,
    prompt_of,
    token_ids,
)
from tests.vllm.kvhelpers import early_dispatch_params


@pytest.mark.parametrize(
    "length",
    [
        pytest.param(11, id="under-one-block"),
        pytest.param(3 * BLOCK_SIZE, id="three-blocks-aligned"),
        pytest.param(5 * BLOCK_SIZE + 7, id="not-block-aligned"),
        pytest.param(600, id="chunked-prefill-19-blocks"),
    ],
)
def test_disaggregated_greedy_output_equals_colocated(pair: Pair, length: int) -> None:
    prompt = prompt_of(length, seed=length)
    colocated = token_ids(pair.prefill.complete(prompt, MAX_TOKENS))
    hits_before = pair.decode.metric("vllm:external_prefix_cache_hits_total")
    received_before = pair.decode.metric("pdserve_kv_transfer_bytes_total", 'role="receiver"')

    params = pair.prefill_params(prompt)
    assert params["do_remote_prefill"] is True
    assert params["remote_port"] == pair.kv_port
    assert params["num_tokens"] == length
    assert len(params["remote_block_ids"]) == -(-length // BLOCK_SIZE)
    assert params["kv_checksum"].startswith("sha256:")
    assert params["kv_fingerprint_fields"]["block_size"] == BLOCK_SIZE
    disaggregated = token_ids(pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params))

    assert disaggregated == colocated
    assert loaded(pair, params["remote_request_id"]), pair.decode.log_tail()
    assert pair.decode.metric("vllm:external_prefix_cache_hits_total") - hits_before == length
    # The blocks the prompt fills, 4 layers of [2 KV heads, 32 slots, 2 x 64] fp32 each, in decode's /metrics.
    kv_bytes = len(params["remote_block_ids"]) * 4 * 2 * BLOCK_SIZE * 128 * 4
    pair.decode.wait_metric(
        "pdserve_kv_transfer_bytes_total", lambda v: v - received_before == kv_bytes, 'role="receiver"'
    )
    # each pull stream ran on a connection, new or pooled: what the KV dashboard's cold/warm panel reads
    assert pair.decode.metric("pdserve_kv_connections_total", 'role="receiver"') > 0


def test_decode_loads_only_the_blocks_its_prefix_cache_lacks(pair: Pair) -> None:
    first = prompt_of(5 * BLOCK_SIZE + 10, seed=5)
    pair.decode.complete(first, MAX_TOKENS, kv_transfer_params=pair.prefill_params(first))
    # Shares its first 4 blocks with `first`, whose KV decode now holds in its prefix cache.
    prompt = first[: 4 * BLOCK_SIZE] + prompt_of(50, seed=6)
    colocated = token_ids(pair.prefill.complete(prompt, MAX_TOKENS))
    hits_before = pair.decode.metric("vllm:external_prefix_cache_hits_total")
    received_before = pair.decode.metric("pdserve_kv_transfer_bytes_total", 'role="receiver"')

    params = pair.prefill_params(prompt)
    disaggregated = token_ids(pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params))

    assert disaggregated == colocated
    assert loaded(pair, params["remote_request_id"])
    assert pair.decode.metric("vllm:external_prefix_cache_hits_total") - hits_before == 50
    # Only the 2 blocks past the 4-block local hit cross the wire (a range pull), 4 layers of them.
    lacking_bytes = 2 * 4 * 2 * BLOCK_SIZE * 128 * 4
    pair.decode.wait_metric(
        "pdserve_kv_transfer_bytes_total", lambda v: v - received_before == lacking_bytes, 'role="receiver"'
    )


def test_chat_streamed_from_decode_equals_colocated(pair: Pair) -> None:
    messages = [{"role": "user", "content": "Name the three largest rivers and the seas they flow into."}]
    colocated = pair.prefill.chat(messages, MAX_TOKENS)["choices"][0]["message"]["content"]
    prefilled = pair.prefill.chat(messages, 1, kv_transfer_params=DO_REMOTE_DECODE)
    params = prefilled["kv_transfer_params"]
    streamed = pair.decode.chat_stream(messages, MAX_TOKENS, kv_transfer_params=params)
    assert streamed == colocated
    assert loaded(pair, params["remote_request_id"])


def test_flipped_byte_on_the_wire_is_recomputed(pair: Pair) -> None:
    checksum_failures = pair.decode.metric("pdserve_kv_transfer_failures_total", 'cause="checksum"')
    prompt = prompt_of(2 * BLOCK_SIZE + 3, seed=7)
    colocated = token_ids(pair.prefill.complete(prompt, MAX_TOKENS))
    params = pair.prefill_params(prompt)
    # Past the handshake and the manifest: the byte lands in a DATA frame of the stream that carries data.
    with FlippingProxy(pair.kv_port, flip_at=4096) as proxy:
        through_proxy = pair.resign(params, remote_port=proxy.port)
        answer = pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=through_proxy)
    assert proxy.flipped >= 1
    assert token_ids(answer) == colocated
    assert not loaded(pair, params["remote_request_id"])
    assert "checksum" in failure_line(pair, answer)
    pair.decode.wait_metric("pdserve_kv_transfer_failures_total", lambda v: v > checksum_failures, 'cause="checksum"')


def test_a_failed_kv_load_reaches_the_canary_judge_under_the_engines_release(pair: Pair, tmp_path: Path) -> None:
    """The seam between the connector's metrics and the canary judge: a real Prometheus scrapes the decode engine
    as roles/prometheus labels it, and the judge's own query (pdstack.canary.prom.queries) attributes a failed KV
    load to the release the engine serves (kv_connector_extra_config.release_version), and to no other release."""
    build = [pair.decode.metric("pdserve_build_info", label) for label in (f'version="{RELEASE}"', 'role="decode"')]
    assert build == [1, 1]  # one series (labels in either order: vLLM's multiprocess registry sorts them)
    labels = {"datacenter": "dc2", "role": "decode", "pool": "decode"}
    with scraping(tmp_path, {Component.DECODE.job: (pair.decode.url, labels)}) as url:
        prom = Prometheus(url)
        failures = {v: queries(v, window_s=120, rate_window_s=5)["kv_transfer_failures"] for v in (RELEASE, "other")}
        time.sleep(3)  # the series at their values before the failure, scraped
        prompt = prompt_of(2 * BLOCK_SIZE + 5, seed=9)
        params = pair.prefill_params(prompt)
        with FlippingProxy(pair.kv_port, flip_at=4096) as proxy:
            pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=pair.resign(params, remote_port=proxy.port))
        assert proxy.flipped >= 1
        wait_for(
            lambda: round(prom.scalar(failures[RELEASE], time.time())) >= 1,
            timeout=30,
            what=f"the judge's KV failures of {RELEASE} counting the failed load",
        )
        assert prom.scalar(failures["other"], time.time()) == 0


def test_forged_params_cause_no_connection(pair: Pair) -> None:
    prompt = prompt_of(40, seed=8)
    colocated = token_ids(pair.prefill.complete(prompt, MAX_TOKENS))
    params = pair.prefill_params(prompt)
    with FlippingProxy(pair.kv_port, flip_at=10**9) as proxy:
        forged = {**params, "remote_port": proxy.port}  # edited without the key: the signature no longer matches
        answer = pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=forged)
    assert proxy.connections == 0
    assert token_ids(answer) == colocated
    assert "kv_transfer_params.pdstack_signature" in failure_line(pair, answer)


def test_fingerprint_mismatch_is_refused_naming_the_field(pair: Pair) -> None:
    prompt = prompt_of(50, seed=9)
    colocated = token_ids(pair.prefill.complete(prompt, MAX_TOKENS))
    params = pair.prefill_params(prompt)
    other_layout = {**params["kv_fingerprint_fields"], "block_size": 2 * BLOCK_SIZE}
    with FlippingProxy(pair.kv_port, flip_at=10**9) as proxy:
        mismatched = pair.resign(params, kv_fingerprint_fields=other_layout, remote_port=proxy.port)
        answer = pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=mismatched)
    assert proxy.connections == 0  # refused before connecting
    assert token_ids(answer) == colocated
    line = failure_line(pair, answer)
    assert "kv_fingerprint_fields.block_size" in line and str(2 * BLOCK_SIZE) in line
    pair.decode.wait_metric("pdserve_kv_transfer_failures_total", lambda v: v >= 1, 'cause="fingerprint"')


def test_unauthenticated_kv_client_is_refused(pair: Pair) -> None:
    params = pair.prefill_params(prompt_of(20, seed=10))
    refused_before = pair.prefill.metric("pdserve_kv_auth_refused_total")
    request_id, checksum = params["remote_request_id"], params["kv_checksum"]
    wrong_key = SecretKey(b"not the channel key, but long enough")
    with pytest.raises(KVTransferError) as refused:
        asyncio.run(pull("127.0.0.1", pair.kv_port, request_id, checksum, key=wrong_key, retries=0))
    assert refused.value.cause == "auth"
    pair.prefill.complete(prompt_of(5, seed=15), 1)  # an engine step, which carries the connector's stats
    pair.prefill.wait_metric("pdserve_kv_auth_refused_total", lambda v: v > refused_before)
    # The same pull with the channel key gets the KV: the refusal was the key, not a missing lease.
    blob = asyncio.run(pull("127.0.0.1", pair.kv_port, request_id, checksum, key=pair.key))
    assert blob.meta.token_count == 20


def test_unreachable_prefill_is_recomputed(pair: Pair) -> None:
    prompt = prompt_of(45, seed=11)
    colocated = token_ids(pair.prefill.complete(prompt, MAX_TOKENS))
    nowhere = pair.resign(pair.prefill_params(prompt), remote_port=free_port())  # nothing listens there
    answer = pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=nowhere)
    assert token_ids(answer) == colocated
    assert "connection: cannot connect" in failure_line(pair, answer)


def test_expired_lease_is_recomputed(pair: Pair) -> None:
    prompt = prompt_of(3 * BLOCK_SIZE + 1, seed=12)
    colocated = token_ids(pair.prefill.complete(prompt, MAX_TOKENS))
    params = pair.prefill_params(prompt)
    time.sleep(LEASE_SECONDS + 2)  # prefill's reaper frees it once the lease is over
    with pytest.raises(KVTransferError) as gone:
        asyncio.run(pull("127.0.0.1", pair.kv_port, params["remote_request_id"], params["kv_checksum"], key=pair.key))
    assert gone.value.cause == "expired"
    answer = pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params)
    assert token_ids(answer) == colocated
    assert "expired" in failure_line(pair, answer)
    # Every lease of this module has been acknowledged or has expired: prefill holds no KV any more.
    pair.prefill.complete(prompt_of(5, seed=16), 1)  # an engine step, which carries the connector's stats
    pair.prefill.wait_metric("pdserve_kv_leases_released_total", lambda v: v >= 1, 'reason="expired"')
    pair.prefill.wait_metric("pdserve_kv_lease_bytes", lambda v: v == 0)


def test_decode_aborted_while_waiting_for_kv_keeps_serving(pair: Pair) -> None:
    prompt = prompt_of(70, seed=13)
    usage_before = pair.decode.metric("vllm:kv_cache_usage_perc")
    failures_before = pair.decode.log().count("left to kv_load_failure_policy")
    with SilentServer() as hanging:
        params = pair.resign(pair.prefill_params(prompt), remote_port=hanging.port)
        aborted = pair.decode.aborted()
        hang_up(pair.decode, prompt, MAX_TOKENS, after=1.0, kv_transfer_params=params)  # while decode waits
        deadline = time.monotonic() + 30
        while pair.decode.aborted() == aborted:
            assert time.monotonic() < deadline, "decode did not abort the request of the client that went away"
            time.sleep(0.5)
        deadline = time.monotonic() + 120
        while pair.decode.log().count("left to kv_load_failure_policy") == failures_before:
            assert time.monotonic() < deadline, pair.decode.log_tail()
            time.sleep(1)
    assert hanging.connections >= 1
    failures = [line for line in pair.decode.log().splitlines() if "left to kv_load_failure_policy" in line]
    assert "timeout" in failures[-1], failures[-1]
    # The EngineCore survived the report for an aborted request, freed its blocks, and serves the next one.
    assert httpx.get(pair.decode.url + "/health", timeout=5).status_code == 200
    assert_decode_serves_disaggregated(pair)
    deadline = time.monotonic() + 30
    while pair.decode.metric("vllm:kv_cache_usage_perc") != usage_before:
        assert time.monotonic() < deadline, "decode's KV cache usage did not return to its baseline"
        time.sleep(1)


def test_a_hundred_disconnecting_clients_leak_nothing(pair: Pair) -> None:
    decode_usage = pair.decode.metric("vllm:kv_cache_usage_perc")
    prefill_usage = pair.prefill.metric("vllm:kv_cache_usage_perc")
    aborted = {server.name: server.aborted() for server in (pair.prefill, pair.decode)}
    for index in range(100):
        prompt = prompt_of(20 + index, seed=100 + index)
        # Half hang up on prefill (its KV is then held for nobody), half on decode (which may be pulling). Both
        # generate long enough that vLLM is still at work when the client goes: a one-token prefill can finish
        # before the hang-up is noticed, and then nothing is aborted.
        if index % 2:
            hang_up(pair.prefill, prompt, 8 * MAX_TOKENS, kv_transfer_params=DO_REMOTE_DECODE)
        else:
            hang_up(pair.decode, prompt, 8 * MAX_TOKENS, kv_transfer_params=pair.prefill_params(prompt))
    for server in (pair.prefill, pair.decode):  # vLLM saw clients go and aborted their requests
        # vLLM notices a hang-up at its next write and logs the abort after it: the last ones lag the loop.
        wait_for(lambda s=server: s.aborted() > aborted[s.name], what=f"{server.name} to log an aborted request")
    assert_decode_serves_disaggregated(pair)
    pair.decode.wait_metric("vllm:kv_cache_usage_perc", lambda v: v == decode_usage)
    pair.prefill.wait_metric("vllm:kv_cache_usage_perc", lambda v: v == prefill_usage)
    time.sleep(LEASE_SECONDS + 2)  # KV held for clients that went away expires
    pair.prefill.complete(prompt_of(5, seed=17), 1)  # an engine step, which carries the connector's stats
    pair.prefill.wait_metric("pdserve_kv_lease_bytes", lambda v: v == 0)


def assert_decode_serves_disaggregated(pair: Pair) -> None:
    prompt = prompt_of(30, seed=14)
    colocated = token_ids(pair.prefill.complete(prompt, MAX_TOKENS))
    assert (
        token_ids(pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=pair.prefill_params(prompt))) == colocated
    )


def hang_up(server: VLLMServer, prompt: list[int], max_tokens: int, after: float = 0.0, **extra: object) -> None:
    """Send a streamed completion request and close the connection `after` seconds later without reading the
    answer; vLLM aborts the request of a client that went away (and logs it, see VLLMServer.aborted)."""
    body = json.dumps(
        {
            "model": str(server.model),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            **extra,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as connection:
        connection.sendall(head + body)
        time.sleep(after)


def test_early_dispatch_decode_asked_first_equals_colocated(pair: Pair) -> None:
    """The gateway's early dispatch: decode gets params naming a transfer id before prefill has even seen the
    request; its pull waits for prefill to hold the KV under that id, and the output equals colocated greedy."""
    prompt = prompt_of(3 * BLOCK_SIZE + 5, seed=41)
    colocated = token_ids(pair.prefill.complete(prompt, MAX_TOKENS))
    fingerprint = pair.prefill_params(prompt_of(5, seed=42))["kv_fingerprint"]
    transfer = secrets.token_hex(16)
    answers: dict[str, dict[str, object]] = {}
    decoding = threading.Thread(
        target=lambda: answers.update(
            decode=pair.decode.complete(
                prompt, MAX_TOKENS, kv_transfer_params=early_dispatch_params(pair, transfer, fingerprint)
            )
        )
    )
    decoding.start()
    time.sleep(0.5)  # decode asks first
    prefilled = pair.prefill.complete(
        prompt, 1, kv_transfer_params={**DO_REMOTE_DECODE, "pdstack_transfer_id": transfer}
    )
    decoding.join(timeout=120)
    assert prefilled["kv_transfer_params"]["remote_request_id"] == transfer
    assert token_ids(answers["decode"]) == colocated
    assert loaded(pair, transfer), pair.decode.log_tail()


def test_early_dispatch_for_a_transfer_that_never_comes_is_recomputed(pair: Pair) -> None:
    """Prefill never gets the request (it failed, or the gateway's call to it did): decode's pull waits
    open_wait_seconds, ends not_found, and vLLM's recompute policy still gives the colocated output."""
    prompt = prompt_of(2 * BLOCK_SIZE, seed=43)
    colocated = token_ids(pair.prefill.complete(prompt, MAX_TOKENS))
    fingerprint = pair.prefill_params(prompt_of(5, seed=44))["kv_fingerprint"]
    not_found = pair.decode.metric("pdserve_kv_transfer_failures_total", 'cause="not_found"')
    params = early_dispatch_params(pair, secrets.token_hex(16), fingerprint)
    answer = pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params)
    assert token_ids(answer) == colocated
    assert "not_found" in failure_line(pair, answer)
    pair.decode.wait_metric("pdserve_kv_transfer_failures_total", lambda v: v > not_found, 'cause="not_found"')


def test_both_workers_describe_their_instance_for_the_agent(pair: Pair) -> None:
    """<run_dir>/<engine>-<port>/instance.json, which `pdserve agent --connector-run-dir` registers."""
    run_dir = Path(pair.prefill.extra["run_dir"])
    instances = {
        body["role"]: body for body in (json.loads(path.read_text()) for path in run_dir.glob("*/instance.json"))
    }
    producer, consumer = instances["kv_producer"], instances["kv_consumer"]
    assert (producer["kv_host"], producer["kv_port"]) == ("127.0.0.1", pair.kv_port)
    assert (consumer["kv_host"], consumer["kv_port"]) == (None, None)
    assert producer["fingerprint"] == consumer["fingerprint"] == pair.prefill_params([7, 8, 9])["kv_fingerprint"]
    assert producer["fingerprint_fields"]["block_size"] == BLOCK_SIZE
    assert producer["kv_streaming"] is consumer["kv_streaming"] is True
    assert producer["connector_version"] == consumer["connector_version"] == "3"


def test_a_manifest_larger_than_the_prompt_is_refused_before_allocating(pair: Pair) -> None:
    """A lease holding the KV of a longer prompt, named by params a key holder signed for a shorter one (as a
    compromised prefill could): decode refuses the manifest that announces more KV than its own prompt can hold
    (pdserve.kv pull's max_bytes) before it allocates for it, and computes the prompt itself. Unsigned, the token
    count alone refuses it (kv_transfer_params.num_tokens) before any connection."""
    short = prompt_of(BLOCK_SIZE + 3, seed=42)
    colocated = token_ids(pair.prefill.complete(short, MAX_TOKENS))
    long_params = pair.resign(pair.prefill_params(prompt_of(5 * BLOCK_SIZE, seed=43)), num_tokens=len(short))
    answer = pair.decode.complete(short, MAX_TOKENS, kv_transfer_params=long_params)
    assert token_ids(answer) == colocated
    assert "more than this request's" in failure_line(pair, answer)
