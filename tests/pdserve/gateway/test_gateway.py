"""The gateway in front of real prefill and decode servers: OpenAI clients, auth, limits, validation, routing, drain.

One cluster for the module: a scheduler, prefill p1 p2 and decode d1 d2 (all v1), and a gateway that counts prompt
tokens with the model's tokenizer and sends prompts of 16 tokens or more to remote prefill.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.cluster import FOUR_SERVERS, HTTP, KEYS, Cluster, counting_tokens, metric

LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank at dawn"
SHORT_PROMPT = "Hi"
AUTH = {"Authorization": f"Bearer {KEYS['acme']}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, kv_key_file: Path, model_v1: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("gateway-main"), kv_key_file)
    try:
        cluster.start_pd([(name, role, model_v1, "v1") for name, role in FOUR_SERVERS], *counting_tokens(model_v1, 16))
        yield cluster
    finally:
        cluster.stop()


def complete(url: str, key: str = KEYS["acme"], **body: Any) -> httpx.Response:
    payload = {"model": "dense", "prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0} | body
    return HTTP.post(f"{url}/v1/completions", json=payload, headers={"Authorization": f"Bearer {key}"})


def test_requests_without_a_valid_key_get_401(gateway_url: str, cluster: Cluster) -> None:
    body = {"model": "dense", "prompt": LONG_PROMPT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer sk-not-a-key"}, {"Authorization": f"Basic {KEYS['acme']}"}):
        response = httpx.post(f"{gateway_url}/v1/completions", json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{gateway_url}/v1/models").status_code == 401
    models = httpx.get(f"{gateway_url}/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["dense"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="sk-wrong").completions.create(
            model="dense", prompt=LONG_PROMPT, max_tokens=2
        )
    log = cluster.gateways[0].logs()
    assert "sk-not-a-key" not in log and "sk-wrong" not in log and KEYS["acme"] not in log


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": LONG_PROMPT, "max_tokens": -1}, "max_tokens"),
        ({"prompt": LONG_PROMPT, "max_tokens": 100_000}, "max_tokens"),
        ({"prompt": LONG_PROMPT, "temperature": 7}, "temperature"),
        ({"prompt": LONG_PROMPT, "top_p": 0}, "top_p"),
        ({"prompt": LONG_PROMPT, "n": 3}, "n"),
        ({"prompt": LONG_PROMPT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": LONG_PROMPT, "stream": "yes"}, "stream"),
        ({"model": 5, "prompt": LONG_PROMPT}, "model"),
        ({"prompt": "word " * 40_000}, "prompt"),
    ],
)
def test_bad_parameters_get_400_naming_the_field(gateway_url: str, body: dict[str, Any], field: str) -> None:
    response = httpx.post(f"{gateway_url}/v1/completions", json={"model": "dense"} | body, headers=AUTH)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert error["message"].startswith(field)


def test_bad_chat_messages_and_bodies_are_refused(gateway_url: str) -> None:
    bad_role = {"model": "dense", "messages": [{"role": "wizard", "content": "hi"}]}
    response = httpx.post(f"{gateway_url}/v1/chat/completions", json=bad_role, headers=AUTH)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0].role"
    not_json = httpx.post(f"{gateway_url}/v1/completions", content=b"{nope", headers=AUTH)
    assert not_json.status_code == 400
    assert not_json.json()["error"]["param"] == "body"
    huge = httpx.post(f"{gateway_url}/v1/completions", content=b" " * 2_000_000, headers=AUTH)
    assert huge.status_code == 413


def test_official_openai_client_sync_and_streaming(gateway_url: str, cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=KEYS["acme"], max_retries=0)
    sync = client.completions.create(model="dense", prompt=LONG_PROMPT, max_tokens=12, temperature=0)
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(
            model="dense", prompt=LONG_PROMPT, max_tokens=12, temperature=0, stream=True
        )
        if chunk.choices
    )
    # The same request sent straight to a decode server, which then prefills locally: the PD result must match.
    direct = httpx.post(
        f"{cluster.servers['d1'].url}/v1/completions",
        timeout=60,
        headers=cluster.server_auth(),
        json={"model": "dense", "prompt": LONG_PROMPT, "max_tokens": 12, "temperature": 0},
    ).json()
    assert sync.choices[0].text == streamed == direct["choices"][0]["text"]
    assert sync.usage is not None and sync.usage.completion_tokens == 12

    messages: list[Any] = [{"role": "user", "content": LONG_PROMPT}]
    chat = client.chat.completions.create(model="dense", messages=messages, max_tokens=8, temperature=0)
    chat_stream = client.chat.completions.create(
        model="dense", messages=messages, max_tokens=8, temperature=0, stream=True
    )
    streamed_chat = "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices)
    assert chat.choices[0].message.content == streamed_chat
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_a_prefill_whose_one_token_ends_the_request_hands_over_to_decode(gateway_url: str, cluster: Cluster) -> None:
    """The prompt's greedy first token is a stop string: prefill finishes with "stop" and, as vLLM, exports no KV.
    That is no prefill failure: decode computes the prompt itself and answers what a single server would."""
    body = {"model": "dense", "prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0}
    first = httpx.post(
        f"{cluster.servers['d1'].url}/v1/completions",
        json=body | {"max_tokens": 1},
        headers=cluster.server_auth(),
        timeout=60,
    ).json()["choices"][0]["text"]
    assert first, "premise: the first token has text to stop on"
    direct = httpx.post(
        f"{cluster.servers['d1'].url}/v1/completions",
        json=body | {"stop": [first]},
        headers=cluster.server_auth(),
        timeout=60,
    )
    errors_before = metric(httpx.get(f"{gateway_url}/metrics").text, "pdserve_gateway_upstream_errors_total")
    response = complete(gateway_url, stop=[first])
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (direct.json()["choices"][0]["text"], "stop")
    assert metric(httpx.get(f"{gateway_url}/metrics").text, "pdserve_gateway_upstream_errors_total") == errors_before
    line = next(line for line in reversed(cluster.gateways[0].logs().splitlines()) if '"message": "request"' in line)
    assert '"route": "prefill_finished"' in line and '"retries": 0' in line


def test_request_id_is_carried_end_to_end(gateway_url: str, cluster: Cluster) -> None:
    before = {name: cluster.served(name) for name in cluster.servers}
    response = httpx.post(
        f"{gateway_url}/v1/completions",
        headers=AUTH | {"X-Request-Id": "rid-e2e-4242"},
        json={"model": "dense", "prompt": LONG_PROMPT, "max_tokens": 2},
        timeout=60,
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "rid-e2e-4242"
    used = [name for name in cluster.servers if cluster.served(name) > before[name]]
    assert sorted(n[0] for n in used) == ["d", "p"]  # one prefill and one decode served it ...
    for name in used:  # ... and both logged it under the client's id
        assert "rid-e2e-4242" in cluster.servers[name].logs()
    assert '"request_id": "rid-e2e-4242"' in cluster.gateways[0].logs()
    generated = httpx.post(
        f"{gateway_url}/v1/completions",
        headers=AUTH,
        json={"model": "dense", "prompt": LONG_PROMPT, "max_tokens": 2},
        timeout=60,
    )
    assert len(generated.headers["x-request-id"]) == 32


def test_short_prompts_skip_remote_prefill(gateway_url: str, cluster: Cluster) -> None:
    def prefill_count() -> float:
        return cluster.served("p1") + cluster.served("p2")

    before = prefill_count()
    assert complete(gateway_url, prompt=SHORT_PROMPT).status_code == 200
    assert prefill_count() == before, "a short prompt must be prefilled on decode"
    assert complete(gateway_url, prompt=LONG_PROMPT).status_code == 200
    assert prefill_count() == before + 1, "a long prompt must go through remote prefill"


def test_kv_transfer_figures_relayed_from_decode(gateway_url: str) -> None:
    def kv_metrics() -> dict[str, float]:
        text = httpx.get(f"{gateway_url}/metrics", timeout=10).text
        wanted = (
            "pdserve_gateway_kv_transfer_bytes_sum",
            "pdserve_gateway_kv_transfer_bytes_count",
            'pdserve_gateway_kv_sources_total{source="remote"}',
            'pdserve_gateway_kv_sources_total{source="local"}',
        )
        found = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(wanted)
        }
        return {name: found.get(name, 0.0) for name in wanted}

    before = kv_metrics()
    assert complete(gateway_url, prompt=LONG_PROMPT, max_tokens=2).status_code == 200  # remote prefill
    assert complete(gateway_url, prompt=SHORT_PROMPT, max_tokens=2).status_code == 200  # prefilled on decode
    after = kv_metrics()
    assert after["pdserve_gateway_kv_transfer_bytes_sum"] > before["pdserve_gateway_kv_transfer_bytes_sum"]
    assert after['pdserve_gateway_kv_sources_total{source="remote"}'] == (
        before['pdserve_gateway_kv_sources_total{source="remote"}'] + 1
    )
    assert after['pdserve_gateway_kv_sources_total{source="local"}'] == (
        before['pdserve_gateway_kv_sources_total{source="local"}'] + 1
    )


def test_instances_share_the_load(gateway_url: str, cluster: Cluster) -> None:
    before = {name: cluster.served(name) for name in cluster.servers}
    with ThreadPoolExecutor(4) as pool:
        statuses = list(
            pool.map(lambda _: complete(gateway_url, key=KEYS["bulk"], max_tokens=8).status_code, range(24))
        )
    assert statuses == [200] * 24
    shares = {name: cluster.served(name) - before[name] for name in cluster.servers}
    assert shares["p1"] + shares["p2"] == 24 and shares["d1"] + shares["d2"] == 24
    assert all(share >= 3 for share in shares.values()), shares


def test_rate_limits_answer_429_and_recover(gateway_url: str) -> None:
    # Three at once, so all three meet the limiter within its 1 s refill however slow the machine is.
    start = threading.Barrier(3)

    def one(_: int) -> httpx.Response:
        start.wait()
        return complete(gateway_url, key=KEYS["slow"], max_tokens=1)

    with ThreadPoolExecutor(3) as pool:
        statuses = list(pool.map(one, range(3)))
    assert sorted(r.status_code for r in statuses) == [200, 200, 429]  # the burst of 2, then refused
    refused = next(r for r in statuses if r.status_code == 429)
    assert refused.json()["error"]["type"] == "rate_limit_error"
    retry_after = int(refused.headers["retry-after"])
    assert retry_after >= 1
    assert complete(gateway_url, max_tokens=1).status_code == 200, "other tenants are not limited"
    threading.Event().wait(retry_after)
    assert complete(gateway_url, key=KEYS["slow"], max_tokens=1).status_code == 200


def test_token_budget_per_tenant(gateway_url: str) -> None:
    too_big = complete(gateway_url, key=KEYS["budget"], max_tokens=400)
    assert too_big.status_code == 400
    assert too_big.json()["error"]["param"] == "max_tokens"
    assert complete(gateway_url, key=KEYS["budget"], max_tokens=180).status_code == 200
    spent = complete(gateway_url, key=KEYS["budget"], max_tokens=180)
    assert spent.status_code == 429
    assert "tokens" in spent.json()["error"]["message"]


def test_metrics_follow_prometheus_conventions(gateway_url: str) -> None:
    text = httpx.get(f"{gateway_url}/metrics").text
    assert metric(text, "pdserve_gateway_requests_total", status="200", tenant="acme", version="v1") > 0
    assert metric(text, "pdserve_gateway_rate_limited_total", tenant="slow", limit="requests") >= 1
    assert metric(text, "pdserve_gateway_time_to_first_token_seconds_count") > 0
    assert metric(text, "pdserve_gateway_routing_decisions_total", role="prefill", reason="remote_prefill") > 0
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: apt-get install prometheus"
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False, timeout=30
    )
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr
