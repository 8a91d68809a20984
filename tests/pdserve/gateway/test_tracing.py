"""Traces and the one log schema, through real processes: scheduler, prefill, decode and gateway on loopback export
their spans over OTLP/HTTP to a receiver here that decodes the protobuf with opentelemetry-proto's own classes.

One completion through the gateway (remote prefill, then decode pulling the KV) is one trace: the gateway's server
span, its client calls to prefill and decode, their server spans, and decode's KV pull under its request, parent to
child. Without pdserve's setting nothing is exported, even with the standard OTEL_* endpoint variable set. Prompt
text is in no span. Every log line of every component parses with one schema, and the lines a request causes carry
its request id and its trace id.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.common.logs import FIXED
from tests.support.cluster import HTTP, KEYS, Cluster, wait_for
from tests.support.otlp import Receiver, Span, receiving
from tests.support.services import Service, instance_token_file

RECEIVER_TOKEN = "otlp-test-token-5f1c"  # what the exporters present (OTEL_EXPORTER_OTLP_TRACES_HEADERS)
PROMPT = "The quick brown fox jumps over the lazy dog near the river bank at dawn, twice over"
AUTH = {"Authorization": f"Bearer {KEYS['acme']}"}
ADMIN_TRACE = "ab" * 16  # the trace id of the admin call sent to the scheduler with its own traceparent


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with receiving(token=RECEIVER_TOKEN) as found:
        yield found


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in values.items():
            patch.setenv(name, value)
        yield


def start(cluster: Cluster, model: Path) -> None:
    cluster.start_pd(
        [("p1", "prefill", model, "v1"), ("d1", "decode", model, "v1")],
        "--tokenizer-file",
        str(model / "tokenizer.json"),
        "--offload-threshold-tokens",
        "8",
    )


@pytest.fixture(scope="module")
def traced(
    tmp_path_factory: pytest.TempPathFactory, kv_key_file: Path, model_v1: Path, receiver: Receiver
) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("traced"), kv_key_file)
    try:
        with environment(
            PDSERVE_OTLP_TRACES_ENDPOINT=receiver.url(),
            OTEL_BSP_SCHEDULE_DELAY="100",
            OTEL_EXPORTER_OTLP_TRACES_HEADERS=f"Authorization=Bearer {RECEIVER_TOKEN}",
        ):
            start(cluster, model_v1)  # the processes keep the environment they started with
        yield cluster
    finally:
        cluster.stop()


def completion(gateway: Service, request_id: str) -> httpx.Response:
    response = HTTP.post(
        f"{gateway.url}/v1/completions",
        headers=AUTH | {"X-Request-Id": request_id},
        json={"model": "dense", "prompt": PROMPT, "max_tokens": 3, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    return response


def request_trace(receiver: Receiver, request_id: str) -> list[Span]:
    """The spans of the trace whose gateway span carries `request_id`, once every process has exported its part:
    gateway (server + 2 clients), prefill and decode servers, decode's kv pull and prefill's kv serve per stream."""

    def found() -> list[Span]:
        roots = [s for s in receiver.spans if s.attributes.get("pdserve.request_id") == request_id]
        spans = receiver.trace(roots[0].trace_id) if roots else []
        pulls = [s for s in spans if s.name == "kv pull"]
        served = [s for s in spans if s.name == "kv serve"]
        complete = len(pulls) == 1 and len(served) == pulls[0].attributes["pdserve.kv.streams"]
        return spans if complete and len(spans) >= 6 + len(served) else []

    try:
        wait_for(lambda: bool(found()), timeout=30, what=f"the trace of {request_id}")
    except AssertionError:
        summary = [(s.service, s.name, s.trace_id[:8], s.parent[:8]) for s in receiver.spans]
        raise AssertionError(f"no complete trace of {request_id}; spans received: {summary}") from None
    return found()


def test_a_request_is_one_trace_across_gateway_prefill_kv_pull_and_decode(traced: Cluster, receiver: Receiver) -> None:
    completion(traced.gateways[0], "rid-trace-1")
    spans = request_trace(receiver, "rid-trace-1")
    by_id = {s.span_id: s for s in spans}
    (root,) = [s for s in spans if not s.parent]
    assert (root.service, root.name, root.kind) == ("pdserve-gateway", "POST /v1/completions", 2)  # SERVER
    assert (root.attributes["pdserve.route"], root.attributes["pdserve.retries"]) == ("remote_prefill", 0)
    assert all(s.parent in by_id for s in spans if s is not root), "a span's parent is missing from the trace"

    def server_span(service: str) -> Span:
        (span,) = [s for s in spans if s.service == service and s.name == "POST /v1/completions"]
        return span

    for role in ("prefill", "decode"):
        span = server_span(f"pdserve-{role}")
        client = by_id[span.parent]  # the gateway's call, carrying traceparent
        assert span.attributes["pdserve.request_id"] == "rid-trace-1"
        assert (client.service, client.kind, by_id[client.parent].span_id) == ("pdserve-gateway", 3, root.span_id)
    (pull,) = [s for s in spans if s.name == "kv pull"]
    decode = server_span("pdserve-decode")
    assert (pull.service, pull.parent, pull.kind) == ("pdserve-decode", decode.span_id, 3)  # CLIENT under decode
    assert pull.attributes["pdserve.kv.bytes"] > 0 and pull.attributes["pdserve.kv.goodput_bytes_per_second"] > 0
    assert pull.attributes["pdserve.kv.streams"] >= 1
    # prefill's side of the pull, one span per stream, joined to decode's pull by the PULL frame's traceparent
    served = [s for s in spans if s.name == "kv serve"]
    assert len(served) == pull.attributes["pdserve.kv.streams"]
    assert {(s.service, s.parent, s.kind) for s in served} == {("pdserve-prefill", pull.span_id, 2)}
    assert sum(s.attributes["pdserve.kv.bytes"] for s in served) == pull.attributes["pdserve.kv.bytes"]
    assert PROMPT not in json.dumps([s.attributes for s in receiver.spans], default=str)
    assert "pdserve.prompt" not in root.attributes


def test_prompt_text_is_in_the_gateways_span_only_when_asked(
    traced: Cluster, receiver: Receiver, model_v1: Path
) -> None:
    with environment(
        OTEL_BSP_SCHEDULE_DELAY="100", OTEL_EXPORTER_OTLP_TRACES_HEADERS=f"Authorization=Bearer {RECEIVER_TOKEN}"
    ):
        gateway = traced.start_gateway(
            "--tokenizer-file",
            str(model_v1 / "tokenizer.json"),
            "--offload-threshold-tokens",
            "8",
            "--otlp-traces-endpoint",
            receiver.url(),
            "--trace-prompts",
            "true",
        )
    traced.wait_routable(gateway, 2)
    completion(gateway, "rid-prompt-5")
    spans = request_trace(receiver, "rid-prompt-5")
    (root,) = [s for s in spans if not s.parent]
    assert root.attributes["pdserve.prompt"] == PROMPT
    assert [s for s in spans if PROMPT in json.dumps(s.attributes)] == [root]  # nowhere else, not in the servers'


def test_background_calls_start_no_trace(traced: Cluster, receiver: Receiver) -> None:
    """Routing polls and heartbeats (several a second here) carry an unsampled traceparent: no span of theirs."""
    time.sleep(1.0)
    requested = {s.trace_id for s in receiver.spans if "pdserve.request_id" in s.attributes} | {ADMIN_TRACE}
    assert {s.trace_id for s in receiver.spans} <= requested
    assert not [s for s in receiver.spans if s.service == "pdserve-scheduler" and s.trace_id != ADMIN_TRACE]


def test_every_line_has_one_schema_and_a_requests_lines_carry_its_ids(traced: Cluster, receiver: Receiver) -> None:
    completion(traced.gateways[0], "rid-logs-2")
    trace_id = request_trace(receiver, "rid-logs-2")[0].trace_id
    # the scheduler answering an admin call that comes with its own traceparent and request id
    assert traced.scheduler is not None
    parent = f"00-{ADMIN_TRACE}-{'cd' * 8}-01"
    weights = httpx.put(
        f"{traced.scheduler.url}/v1/admin/weights",
        json={"weights": {"v1": 1.0}},
        headers={"Authorization": f"Bearer {traced.admin_token}", "X-Request-Id": "rid-admin-3", "traceparent": parent},
    )
    assert weights.status_code == 200, weights.text
    services = {
        "gateway": traced.gateways[0],
        "prefill": traced.servers["p1"],
        "decode": traced.servers["d1"],
        "scheduler": traced.scheduler,
    }

    def lines(service: Service) -> list[dict[str, Any]]:
        return [json.loads(line) for line in service.logs().splitlines() if line.strip()]

    wait_for(
        lambda: any(line.get("request_id") == "rid-admin-3" for line in lines(traced.scheduler)),
        what="the scheduler's line of the admin call",
    )
    for component, service in services.items():
        records = lines(service)  # every line is JSON (json.loads raises otherwise)
        assert records, f"{component} logged nothing"
        for record in records:
            assert list(record)[: len(FIXED)] == list(FIXED), record
            assert record["component"] == component, record
        if component != "scheduler":
            mine = [r for r in records if r["request_id"] == "rid-logs-2"]
            assert mine, f"{component} logged no line of the request"
            assert {r["trace_id"] for r in mine} == {trace_id}, mine
    (admin,) = [r for r in lines(traced.scheduler) if r["request_id"] == "rid-admin-3"]
    assert admin["trace_id"] == ADMIN_TRACE and admin["span_id"] not in (None, "cd" * 8)


def test_the_agent_logs_in_the_same_schema(traced: Cluster, tmp_path: Path) -> None:
    """The agent (normally beside vLLM) waiting for an engine that is not there: its lines, outside any request."""
    assert traced.scheduler is not None
    dead = "http://127.0.0.1:9"  # the discard port: nothing answers
    log_path = tmp_path / "agent.log"
    command = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "agent",
        "--engine-url",
        dead,
        "--role",
        "decode",
        "--scheduler-url",
        traced.scheduler.url,
        "--advertise-url",
        dead,
        "--version",
        "v1",
        "--scheduler-token-file",
        str(instance_token_file(tmp_path, "decode-agent")),
        "--connector-run-dir",
        str(tmp_path),
        "--instance-id",
        "decode-agent",
    ]
    with log_path.open("ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=log)
    try:
        wait_for(lambda: '"message": "waiting for vLLM' in log_path.read_text(), what="the agent's first line")
    finally:
        process.terminate()
        process.wait(timeout=10)
    for line in log_path.read_text().splitlines():
        record = json.loads(line)
        assert list(record)[: len(FIXED)] == list(FIXED) and record["component"] == "agent", record


@pytest.fixture(scope="module")
def untraced(
    tmp_path_factory: pytest.TempPathFactory, kv_key_file: Path, model_v1: Path, receiver: Receiver, traced: Cluster
) -> Iterator[Cluster]:
    """pdserve's setting unset; the OTel SDK's own endpoint variable set, which must not turn tracing on."""
    traced.stop()  # its tests are done (this module's last test uses this one): two clusters at once only crawl
    cluster = Cluster(tmp_path_factory.mktemp("untraced"), kv_key_file)
    try:
        with environment(
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=receiver.url("/untraced"),
            OTEL_BSP_SCHEDULE_DELAY="100",
            OTEL_EXPORTER_OTLP_TRACES_HEADERS=f"Authorization=Bearer {RECEIVER_TOKEN}",
        ):
            start(cluster, model_v1)
        yield cluster
    finally:
        cluster.stop()


def test_with_tracing_off_nothing_is_exported(untraced: Cluster, receiver: Receiver) -> None:
    response = completion(untraced.gateways[0], "rid-off-4")
    assert response.headers["x-request-id"] == "rid-off-4"
    time.sleep(1.0)  # ten export periods of a process that would trace
    assert receiver.exports.get("/untraced", 0) == 0
    assert not [s for s in receiver.spans if s.attributes.get("pdserve.request_id") == "rid-off-4"]
    line = next(json.loads(line) for line in untraced.gateways[0].logs().splitlines() if "rid-off-4" in line)
    assert (line["request_id"], line["trace_id"], line["span_id"]) == ("rid-off-4", None, None)
