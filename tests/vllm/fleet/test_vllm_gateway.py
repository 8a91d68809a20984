"""pdstack's gateway in front of a real vLLM prefill and decode, registered with pdstack's scheduler by two
`pdserve agent` processes: the official openai client through the gateway gets vLLM's colocated greedy output,
token for token, and the KV really crossed (decode's connector logged the load for each request), both with vLLM's
sequential proxy flow and with early dispatch (prefill and decode sent at once).
"""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.gateway.proxy import prefill_kv_transfer_params
from pdserve.kv.auth import SecretKey
from pdserve.kv.params import derive_params_key
from pdserve.kv.release import RELEASE_PATH
from tests.support.cluster import metric, wait_for
from tests.support.services import Service
from tests.vllm.agenthelpers import API_KEY, BLOCK_SIZE, MODEL_NAME, Fleet, prompt_of
from tests.vllm.conftest import SilentServer

MAX_TOKENS = 16
LENGTHS = {"under_one_block": BLOCK_SIZE - 7, "three_blocks": 3 * BLOCK_SIZE, "not_aligned": 2 * BLOCK_SIZE + 13}
CHAT = [{"role": "user", "content": "Tell me about the weather in the mountains in spring, please."}]


@pytest.fixture(scope="module")
def gateway(fleet: Fleet) -> Iterator[Service]:
    """A gateway without the params key: the sequential proxy flow (prefill answers, then decode gets its params)."""
    with fleet.routed_gateway() as service:
        yield service


@pytest.fixture(scope="module")
def client(gateway: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def complete(client: openai.OpenAI, prompt: list[int]) -> list[int]:
    answer = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ids = answer.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert len(ids) == MAX_TOKENS, answer
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)
    return list(ids)


def complete_streamed(client: openai.OpenAI, prompt: list[int]) -> list[int]:
    ids: list[int] = []
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            ids.extend((choice.model_extra or {}).get("token_ids") or [])
    return ids


@pytest.mark.parametrize("length", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
def test_completions_equal_colocated(fleet: Fleet, client: openai.OpenAI, length: int, streamed: bool) -> None:
    prompt = prompt_of(length, seed=length)
    expected = fleet.colocated(prompt, MAX_TOKENS)
    loads = fleet.loads()
    got = complete_streamed(client, prompt) if streamed else complete(client, prompt)
    assert got == expected
    assert fleet.loads() == loads + 1, "decode did not load the KV from prefill"


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
def test_chat_equals_colocated(fleet: Fleet, client: openai.OpenAI, streamed: bool) -> None:
    expected = fleet.colocated_chat(CHAT, MAX_TOKENS)
    loads = fleet.loads()
    kwargs = {
        "model": MODEL_NAME,
        "messages": CHAT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    if streamed:
        parts = [
            choice.delta.content or ""
            for chunk in client.chat.completions.create(**kwargs, stream=True)
            for choice in chunk.choices
        ]
        got = "".join(parts)
    else:
        got = client.chat.completions.create(**kwargs).choices[0].message.content or ""
    assert got == expected
    assert fleet.loads() == loads + 1


def test_models_lists_what_vllm_serves(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL_NAME]


def test_vllm_errors_reach_the_client_as_vllms(client: openai.OpenAI) -> None:
    """A request vLLM itself refuses (here a token id past the vocabulary) comes back with vLLM's status and
    message, not as a gateway failure."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL_NAME, prompt=[5, 100_000], max_tokens=4)
    assert "100000" in str(refused.value) or "token" in str(refused.value).lower()


def test_mismatched_fingerprints_are_never_paired(fleet: Fleet, gateway: Service, client: openai.OpenAI) -> None:
    """A prefill of another KV layout (registered with another fingerprint) gets no request, though it is ready
    and idle; with the same fingerprint the same registration would draw about half of them."""
    prompt = prompt_of(LENGTHS["not_aligned"], seed=7)
    expected = fleet.colocated(prompt, MAX_TOKENS)
    with SilentServer() as other:
        fleet.register_fake("prefill-other-layout", "prefill", f"http://127.0.0.1:{other.port}", "sha256:other")
        try:
            fleet.wait_routable(gateway, instances=3)
            for _ in range(8):
                fleet.beat_fake("prefill-other-layout")
                assert complete(client, prompt) == expected
            assert other.connections == 0
        finally:
            fleet.remove_fake("prefill-other-layout")
    fleet.wait_routable(gateway, instances=2)


def test_x_request_id_reused_by_clients_names_no_shared_lease(fleet: Fleet, client: openai.OpenAI) -> None:
    """The gateway passes a client's X-Request-Id on to vLLM, which builds its request ids from it: two requests
    sent at once under one id still get a lease each (vLLM appends its own random part; the connector leases under
    that id, or the gateway's transfer id) and each its own colocated answer."""
    prompts = [prompt_of(LENGTHS["three_blocks"], seed=seed) for seed in (31, 32)]
    expected = [fleet.colocated(prompt, MAX_TOKENS) for prompt in prompts]
    loads = fleet.loads()
    same = {"X-Request-Id": "reused-by-two-clients"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda prompt: complete(client.with_options(default_headers=same), prompt), prompts))
    assert got == expected
    assert fleet.loads() == loads + 2


def test_the_gateways_release_frees_a_vllm_prefills_lease_at_once(fleet: Fleet) -> None:
    """What the gateway sends when decode refused a request or its client left before decode started (POST
    /v1/kv/release with the server token, pdserve.kv.release): a vLLM prefill frees that KV at once, through
    PdstackConnector's middleware, not LEASE_SECONDS later; the endpoint takes only the token and a lease id."""
    prefill, auth = fleet.prefill, fleet.engine_auth()
    body = {
        "model": MODEL_NAME,
        "prompt": prompt_of(LENGTHS["three_blocks"], seed=41),
        "max_tokens": 1,
        "kv_transfer_params": prefill_kv_transfer_params(),
    }
    answer = httpx.post(prefill.url + "/v1/completions", json=body, headers=auth, timeout=120)
    assert answer.status_code == 200, answer.text
    lease = answer.json()["kv_transfer_params"]["remote_request_id"]
    acked = prefill.metric("pdserve_kv_leases_released_total", 'reason="ack"')
    release = prefill.url + RELEASE_PATH
    for bad, param in (
        ({}, "remote_request_id"),
        ({"remote_request_id": "x" * 300}, "remote_request_id"),
        ([], "body"),
    ):
        refused = httpx.post(release, json=bad, headers=auth, timeout=30)
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, param), refused.text
    assert httpx.post(release, json={"remote_request_id": lease}, timeout=30).status_code == 401
    freed = httpx.post(release, json={"remote_request_id": lease}, headers=auth, timeout=30)
    assert freed.json() == {"remote_request_id": lease, "released": True}, freed.text
    # vLLM forwards a connector's stats at engine steps only (pdserve.vllm.stats): one request makes the step.
    stepped = httpx.post(
        prefill.url + "/v1/completions", json={**body, "kv_transfer_params": None}, headers=auth, timeout=120
    )
    assert stepped.status_code == 200, stepped.text
    prefill.wait_metric("pdserve_kv_leases_released_total", lambda count: count == acked + 1, 'reason="ack"')
    again = httpx.post(release, json={"remote_request_id": lease}, headers=auth, timeout=30)
    assert again.json() == {"remote_request_id": lease, "released": False}, again.text


@pytest.fixture(scope="module")
def early_gateway(fleet: Fleet, kv_key_file: Path) -> Iterator[Service]:
    """A gateway holding the params key (derived from the KV channel key, never the key itself): early dispatch."""
    path = fleet.tmp / "kv-params.key"
    path.write_text(derive_params_key(SecretKey.from_file(kv_key_file).material).hex())
    with fleet.routed_gateway("--kv-params-key-file", str(path)) as service:
        yield service


@pytest.mark.parametrize("length", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
def test_early_dispatch_equals_colocated(fleet: Fleet, early_gateway: Service, length: int, streamed: bool) -> None:
    """Prefill and decode sent at once (both registered kv_streaming): decode pulls the transfer the gateway named
    while prefill computes it, and the answer is still vLLM's colocated one."""
    assert all(entry["info"]["kv_streaming"] for entry in fleet.instances().values())
    client = openai.OpenAI(base_url=early_gateway.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    prompt = prompt_of(length, seed=100 + length)
    expected = fleet.colocated(prompt, MAX_TOKENS)
    loads, before = fleet.loads(), early_prefills(early_gateway)
    got = complete_streamed(client, prompt) if streamed else complete(client, prompt)
    assert got == expected
    assert fleet.loads() == loads + 1, "decode did not load the KV from prefill"
    last_load = [line for line in fleet.decode.log().splitlines() if "pdstack connector: loaded the KV" in line][-1]
    assert re.search(r"\([0-9a-f]{32}\)$", last_load), f"not a transfer the gateway named: {last_load}"
    wait_for(lambda: early_prefills(early_gateway) == before + 1, what="the early prefill counted as ok")


def early_prefills(gateway: Service) -> float:
    return metric(
        httpx.get(gateway.url + "/metrics").text, "pdserve_gateway_early_dispatch_prefills_total", outcome="ok"
    )
