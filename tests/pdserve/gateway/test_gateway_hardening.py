"""The gateway against hostile input (issue 13), in front of a real prefill and decode that require their API token.

Every refusal is a 400 naming the field; nothing a client sends gets a 500, steers decode's KV pulls, or is
silently ignored; and every request, refused or not, is counted, logged with its request id, and leaves the
in-flight gauge at zero.
"""

from __future__ import annotations

import json
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.cluster import HTTP, KEYS, Cluster, counting_tokens, metric

PROMPT = "The quick brown fox jumps over the lazy dog near the river bank at dawn"
AUTH = {"Authorization": f"Bearer {KEYS['bulk']}"}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, kv_key_file: Path, model_v1: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("gateway-hardening"), kv_key_file)
    try:
        servers = [("p1", "prefill", model_v1, "v1"), ("d1", "decode", model_v1, "v1")]
        cluster.start_pd(servers, *counting_tokens(model_v1, 16))
        yield cluster
    finally:
        cluster.stop()


def post(url: str, body: Any, path: str = "/v1/completions", **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return HTTP.post(url + path, content=content, headers={**AUTH, "Content-Type": "application/json", **headers})


def counted(url: str) -> tuple[float, float]:
    """Requests counted so far, and requests in flight, by the gateway's /metrics."""
    text = httpx.get(f"{url}/metrics").text
    return metric(text, "pdserve_gateway_requests_total"), metric(text, "pdserve_gateway_inflight_requests")


def context_length(cluster: Cluster) -> int:
    lengths = {entry["info"]["max_model_len"] for entry in cluster.instances()}
    assert len(lengths) == 1 and None not in lengths, f"servers must report max_model_len: {lengths}"
    return int(lengths.pop())


def test_client_kv_transfer_params_are_refused_and_cause_no_connection(gateway_url: str) -> None:
    """Finding 2: a short prompt's client-written kv_transfer_params reached decode, which connected where they said."""
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(8)
        trap.settimeout(2.0)
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "x",
            "remote_request_id": "y",
            "remote_host": "127.0.0.1",
            "remote_port": trap.getsockname()[1],
            "remote_block_ids": [],
        }
        for prompt in ("Hi", PROMPT):  # offloaded to decode, and through remote prefill
            response = post(
                gateway_url, {"model": "dense", "prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}
            )
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "kv_transfer_params"
            assert "not by clients" in response.json()["error"]["message"]
        with pytest.raises(TimeoutError):
            trap.accept()


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"best_of": 2}, "best_of"),
        ({"best_of": True}, "best_of"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"repetition_penalty": 1.3}, "repetition_penalty"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ],
)
def test_parameters_the_engine_does_not_honour_are_refused(gateway_url: str, extra: dict[str, Any], field: str) -> None:
    for path, base in (
        (PATHS["completions"], {"prompt": PROMPT}),
        (PATHS["chat"], {"messages": [{"role": "user", "content": PROMPT}]}),
    ):
        response = post(gateway_url, {"model": "dense", "max_tokens": 2, **base, **extra}, path)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field
        assert response.json()["error"]["message"].startswith(field)


def test_parameters_at_their_defaults_pass(gateway_url: str) -> None:
    body = {
        "model": "dense",
        "prompt": PROMPT,
        "max_tokens": 2,
        "best_of": 1,
        "tools": None,
        "logit_bias": {},
        "repetition_penalty": 1.0,
        "response_format": {"type": "text"},
        "seed": 0,
    }
    response = post(gateway_url, body)
    assert response.status_code == 200, response.text


def test_prompts_past_the_context_are_refused_before_any_prefill(gateway_url: str, cluster: Cluster) -> None:
    context = context_length(cluster)
    prefilled_before = cluster.served("p1")
    cases = [([1] * context, 1, "prompt"), ([1] * (context - 2), 4, "max_tokens")]
    for prompt, max_tokens, field in cases:
        response = post(gateway_url, {"model": "dense", "prompt": prompt, "max_tokens": max_tokens})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field
    chat = post(
        gateway_url,
        {"model": "dense", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": context},
        PATHS["chat"],
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens", chat.text
    assert cluster.served("p1") == prefilled_before, "a refused prompt must not reach prefill"
    fits = post(gateway_url, {"model": "dense", "prompt": [1] * (context - 4), "max_tokens": 4})
    assert fits.status_code == 200, fits.text


NAN_BODIES = [
    (b'{"model": "dense", "prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"model": "dense", "prompt": "hi", "top_p": Infinity}', "top_p"),
    (b'{"model": "dense", "prompt": "hi", "presence_penalty": -Infinity}', "presence_penalty"),
    (b'{"model": "dense", "prompt": "hi", "frequency_penalty": 1e999}', "frequency_penalty"),
    (b'{"model": "dense", "prompt": "hi", "logprobs": NaN}', "logprobs"),
    (b'{"model": "dense", "prompt": "hi", "user": {"a": [1, NaN]}}', "user.a[1]"),
    (b'{"model": "dense", "prompt": "\\ud800"}', "prompt"),
    (b'{"model": "dense", "prompt": ["ok \\udfff"]}', "prompt[0]"),
    (b'{"model": "dense", "prompt": "hi", "stop": ["\\ud83d"]}', "stop[0]"),
    (b'{"model": "dense", "prompt": "hi", "\\ud800": 1}', "\\ud800"),
    (b'{"model": "dense", "prompt": "hi", "seed": -1}', "seed"),
    (b'{"model": "dense", "prompt": "hi", "seed": 9223372036854775808}', "seed"),
    (b'{"model": "dense", "prompt": "hi", "seed": 1.5}', "seed"),
    (b'{"model": "dense", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "body"),
    (b'{"model": "dense", "prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body"),
    (b'{"model": "dense", "prompt": "hi", "x": ' + b"[" * 40 + b"]" * 40 + b"}", "x" + "[0]" * 31),
    (b'{"model": "dense", "prompt": "hi", "x": ' + b'{"a": ' * 40 + b"1" + b"}" * 40 + b"}", "x" + ".a" * 31),
    (b'{"model": "dense", "messages": [{"role": ["user"], "content": "hi"}]}', "messages[0].role"),
    (b'{"model": "dense", "messages": [{"role": "user", "content": "\\udc00"}]}', "messages[0].content"),
    (b"\xff\xfe{", "body"),
]


@pytest.mark.parametrize(("body", "field"), NAN_BODIES, ids=[field for _, field in NAN_BODIES])
def test_malformed_input_is_400_naming_the_field_and_counted(
    gateway_url: str, cluster: Cluster, body: bytes, field: str
) -> None:
    """Finding 5: these gave 500s, uncounted and unlogged, and left the in-flight gauge above zero."""
    path = PATHS["chat"] if b'"messages"' in body else PATHS["completions"]
    before, _ = counted(gateway_url)
    request_id = f"malformed-{uuid.uuid4().hex}"
    response = post(gateway_url, body, path, **{"X-Request-Id": request_id})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.text
    assert response.headers["x-request-id"] == request_id
    after, inflight = counted(gateway_url)
    assert after == before + 1 and inflight == 0
    assert request_id in cluster.gateways[0].logs()


def test_refused_and_unauthenticated_requests_are_counted_and_logged(gateway_url: str, cluster: Cluster) -> None:
    before, _ = counted(gateway_url)
    ids = [f"refused-{n}-{uuid.uuid4().hex}" for n in range(4)]
    assert post(gateway_url, {"model": "dense"}, **{"X-Request-Id": ids[0]}).status_code == 400
    assert (
        post(
            gateway_url, {"model": "dense", "prompt": "hi"}, **{"X-Request-Id": ids[1], "Authorization": "Bearer nope"}
        ).status_code
        == 401
    )
    missing = HTTP.get(f"{gateway_url}/v1/nowhere", headers={"X-Request-Id": ids[2]})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "path"
    wrong_method = HTTP.post(f"{gateway_url}/v1/models", headers={"X-Request-Id": ids[3]})
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["param"] == "method"
    after, inflight = counted(gateway_url)
    assert after == before + 4 and inflight == 0
    logs = cluster.gateways[0].logs()
    assert all(request_id in logs for request_id in ids)


def test_a_client_gone_mid_stream_leaves_nothing_in_flight(gateway_url: str, cluster: Cluster) -> None:
    long = min(context_length(cluster) - 8, 4096)
    body = {"model": "dense", "prompt": [1] * 4, "max_tokens": long, "stream": True, "ignore_eos": True}
    before, _ = counted(gateway_url)
    with httpx.stream("POST", f"{gateway_url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200, response.read()
        next(response.iter_bytes())
    deadline = threading.Event()
    for _ in range(200):  # bounded: the gateway notices the close within one decode event
        after, inflight = counted(gateway_url)
        if after == before + 1 and inflight == 0:
            break
        deadline.wait(0.05)
    assert (after, inflight) == (before + 1, 0)


FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "kv_transfer_params",
    "best_of",
    "tools",
    "logit_bias",
    "logprobs",
    "echo",
    "user",
    "min_tokens",
    "ignore_eos",
    "role",
    "content",
    "frequency_penalty",
]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["dense", "", "\ud800", "\udfff x", "user"]),
    st.text(max_size=20),
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)
BODIES = st.one_of(
    st.fixed_dictionaries(
        {"model": st.sampled_from(["dense", 3, None])},
        optional={name: JSON_VALUES for name in FIELDS if name != "model"},
    ).map(lambda d: json.dumps(d, allow_nan=True).encode()),
    JSON_VALUES.map(lambda v: json.dumps(v, allow_nan=True).encode()),
    st.binary(max_size=64),
    st.integers(min_value=1, max_value=5000).map(lambda n: b'{"model": "dense", "prompt": ' + b"[" * n),
)


def test_generated_garbage_never_gets_a_5xx_and_is_all_counted(gateway_url: str, cluster: Cluster) -> None:
    before, _ = counted(gateway_url)
    sent: list[str] = []

    @settings(
        max_examples=150,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(body=BODIES, endpoint=st.sampled_from(sorted(PATHS)), key=st.sampled_from([KEYS["bulk"], None]))
    def throw(body: bytes, endpoint: str, key: str | None) -> None:
        request_id = f"fuzz-{len(sent)}-{uuid.uuid4().hex[:8]}"
        headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        sent.append(request_id)
        response = HTTP.post(gateway_url + PATHS[endpoint], content=body, headers=headers)
        assert response.status_code < 500, (body, response.status_code, response.text)
        assert "Traceback" not in response.text and 'File "' not in response.text, response.text
        if response.status_code == 400:
            assert response.json()["error"]["param"], response.text

    throw()
    after, inflight = counted(gateway_url)
    assert after == before + len(sent), "every request, refused or not, is counted exactly once"
    assert inflight == 0
    logs = cluster.gateways[0].logs()
    assert all(request_id in logs for request_id in sent)
