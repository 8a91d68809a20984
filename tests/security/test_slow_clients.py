"""A bounded slowloris against every kind of pdserve listener (gateway, model server, scheduler).

200 connections per listener, in six kinds: connected and silent, half a request line and headers, headers trickled
a byte at a time, full headers and half a body, the same refused at once (401) with its body still owed, and idle
after one complete request (keep-alive). The stack runs with
short limits (LIMITS); each connection must be closed by the server (EOF or reset) — a connection still open after
GIVE_UP seconds, many times the limits, fails the test. A normal completion through the gateway succeeds while all 200
are held and after they are gone, and the gateway counted the requests whose headers it received.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdserve.listener import ListenerLimits
from tests.support.cluster import Cluster, metric

from .serving_stack import KEY, normal_completion, pd_stack

LIMITS = {
    "PDSERVE_HTTP_HEADER_TIMEOUT_SECONDS": "2",
    "PDSERVE_HTTP_BODY_TIMEOUT_SECONDS": "2",
    "PDSERVE_HTTP_IDLE_TIMEOUT_SECONDS": "1",
    "PDSERVE_HTTP_MAX_HEADER_BYTES": "8192",
}
CONNECTIONS = 200
KINDS = ("idle", "half-header", "trickle", "half-body", "early-answer", "keep-alive")
GIVE_UP = 45.0
TRICKLE_GAP = 0.25
TRICKLE_MAX_BYTES = int(GIVE_UP / TRICKLE_GAP)


@dataclass
class Outcome:
    kind: str
    closed: bool
    response: bytes

    @property
    def status(self) -> int | None:
        """The status of the last response the server wrote before closing, if any."""
        if b"HTTP/1.1 " not in self.response:
            return None
        return int(self.response.rsplit(b"HTTP/1.1 ", 1)[1][:3])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, kv_key_file: Path, dense_checkpoint: Path) -> Iterator[Cluster]:
    with pd_stack(tmp_path_factory.mktemp("slow-clients"), kv_key_file, dense_checkpoint, LIMITS) as cluster:
        yield cluster


def opening(kind: str, path: str, authorization: str) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {authorization}\r\n"
    if kind == "half-header":
        return head.encode() + b"Content-Type: applic"
    if kind == "early-answer":  # refused at once (no valid key), the announced body never completes
        head = head.replace(authorization, "Bearer wrong")
    if kind in ("half-body", "early-answer"):
        return (head + "Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n").encode() + b'{"prompt": "'
    if kind == "keep-alive":
        return b"GET /health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    return b""


async def hold(port: int, kind: str, path: str, authorization: str, held: asyncio.Barrier) -> Outcome:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    trickler: asyncio.Task[None] | None = None
    try:
        writer.write(opening(kind, path, authorization))
        await writer.drain()
        if kind == "trickle":
            trickler = asyncio.create_task(trickle(writer))
        await held.wait()
        response = await asyncio.wait_for(read_to_eof(reader), GIVE_UP)
        return Outcome(kind, True, response)
    except TimeoutError:
        return Outcome(kind, False, b"")
    finally:
        if trickler is not None:
            trickler.cancel()
            await asyncio.gather(trickler, return_exceptions=True)
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def trickle(writer: asyncio.StreamWriter) -> None:
    """One byte of an endless header value at a time: every byte arrives well within any idle bound."""
    with contextlib.suppress(OSError):
        writer.write(b"GET /health/live HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        for _ in range(TRICKLE_MAX_BYTES):
            writer.write(b"a")
            await writer.drain()
            await asyncio.sleep(TRICKLE_GAP)


async def read_to_eof(reader: asyncio.StreamReader) -> bytes:
    data = b""
    try:
        while chunk := await reader.read(65536):
            data += chunk
    except ConnectionError:  # a reset is a close too
        pass
    return data


async def slowloris(port: int, path: str, authorization: str, gateway_url: str) -> tuple[list[Outcome], int]:
    """Open all connections; while they are held, one normal completion; then wait for each to be closed."""
    held = asyncio.Barrier(CONNECTIONS + 1)
    tasks = [
        asyncio.create_task(hold(port, KINDS[i % len(KINDS)], path, authorization, held)) for i in range(CONNECTIONS)
    ]
    await held.wait()
    during = (await asyncio.to_thread(normal_completion, gateway_url)).status_code
    return list(await asyncio.gather(*tasks)), during


def listeners(cluster: Cluster) -> dict[str, tuple[int, str, str]]:
    """Port, the path the slow requests name, and their Authorization header, by listener."""
    assert cluster.scheduler is not None
    return {
        "gateway": (cluster.gateways[0].port, "/v1/completions", f"Bearer {KEY}"),
        "prefill": (cluster.servers["p"].port, "/v1/completions", cluster.server_auth()["Authorization"]),
        "scheduler": (cluster.scheduler.port, "/v1/instances", f"Bearer {cluster.admin_token}"),
    }


def own_5xx(cluster: Cluster) -> dict[str, float]:
    """The 5xx answers each service counted itself (gateway and servers; the scheduler counts none by status)."""
    found = {}
    for name, url, family, headers in [
        ("gateway", cluster.gateways[0].url, "pdserve_gateway_requests_total", {}),
        *((n, s.url, "pdserve_requests_total", cluster.server_auth()) for n, s in cluster.servers.items()),
    ]:
        text = httpx.get(f"{url}/metrics", headers=headers).text
        found[name] = sum(metric(text, family, status=str(code)) for code in range(500, 600))
    return found


@pytest.mark.parametrize("listener", ["gateway", "prefill", "scheduler"])
def test_slow_connections_are_all_closed_and_service_goes_on(cluster: Cluster, listener: str) -> None:
    gateway = cluster.gateways[0]
    port, path, authorization = listeners(cluster)[listener]
    counted_before = metric(httpx.get(f"{gateway.url}/metrics").text, "pdserve_gateway_requests_total")
    errors_before = own_5xx(cluster)

    outcomes, during = asyncio.run(slowloris(port, path, authorization, gateway.url))

    still_open = Counter(o.kind for o in outcomes if not o.closed)
    assert not still_open, f"{listener}: connections the server never closed, by kind: {dict(still_open)}"
    statuses = Counter((o.kind, o.status) for o in outcomes)
    assert all(status is None or status < 500 for _, status in statuses), statuses
    # refused before its body (401), or, where the body names the principal (scheduler register), cut off by 408
    assert {o.status for o in outcomes if o.kind == "early-answer"} <= {401, 408}, statuses
    assert during == 200
    # a client that stops sending is the client's failure: no listener counts or logs it as a server error
    assert own_5xx(cluster) == errors_before
    for service in [cluster.gateways[0], *cluster.servers.values(), cluster.scheduler]:
        assert service is not None and "Traceback" not in service.logs(), service.log_path
    assert normal_completion(gateway.url).status_code == 200
    if listener == "gateway":
        # each half-body request reached the application, and with the normal ones it is counted (401, 408/499)
        half_bodies = sum(1 for o in outcomes if o.kind in ("half-body", "early-answer"))
        text = httpx.get(f"{gateway.url}/metrics").text
        assert metric(text, "pdserve_gateway_requests_total") - counted_before == half_bodies + 2
        assert metric(text, "pdserve_gateway_inflight_requests") == 0


def test_headers_over_the_cap_are_refused_in_one_read(cluster: Cluster) -> None:
    """h11's own cap holds only while a header block is incomplete; one sent whole must be refused too."""
    padding = {"X-Pad": "a" * 9000}
    for url in (cluster.gateways[0].url, cluster.servers["p"].url):
        assert httpx.get(f"{url}/health/live", headers=padding).status_code == 400
        assert httpx.get(f"{url}/health/live", headers={"X-Pad": "a" * 4000}).status_code == 200


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan"])
def test_a_bad_limit_is_refused_by_name(value: str) -> None:
    with pytest.raises(SystemExit, match="PDSERVE_HTTP_BODY_TIMEOUT_SECONDS"):
        ListenerLimits.from_env({"PDSERVE_HTTP_BODY_TIMEOUT_SECONDS": value})
    assert ListenerLimits.from_env({}) == ListenerLimits(10.0, 30.0, 5.0, 65536)
