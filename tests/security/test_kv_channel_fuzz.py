"""Hypothesis-driven fuzzing of a real prefill server's KV port before authentication, and a flood of it.

Whatever an unauthenticated peer sends — junk, a frame header claiming a large payload, a frame of the wrong type,
a HELLO followed by a junk proof — the server closes the connection (an ERROR frame first is fine) long before its
30 s I/O timeout, never waits for a large pre-auth payload, and goes on serving: afterwards a completion through the
gateway, whose KV travels over that port, succeeds. However many silent sockets a peer without the key keeps open
there, completions whose KV crosses it go on succeeding.
"""

from __future__ import annotations

import secrets
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from pdserve.kv.protocol import HEADER, MAGIC, NONCE_BYTES, VERSION, FrameType
from tests.pdserve.kv.flood import Flood
from tests.support.cluster import Cluster, metric

from .fuzzing import FUZZ
from .serving_stack import normal_completion, pd_stack

FUZZ_NO_SHRINK = settings(FUZZ, phases=[Phase.explicit, Phase.generate])
GIVE_UP = 10.0  # far below the server's 30 s I/O timeout: a close must come from refusing the input
SMALL = 64 * 1024  # no pre-auth frame needs more; a header claiming more must be refused before any payload


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, kv_key_file: Path, dense_checkpoint: Path) -> Iterator[Cluster]:
    with pd_stack(tmp_path_factory.mktemp("kv-fuzz"), kv_key_file, dense_checkpoint) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def kv_port(cluster: Cluster) -> int:
    ports = [entry["info"]["kv_port"] for entry in cluster.instances() if entry["info"]["role"] == "prefill"]
    assert ports and ports[0], cluster.instances()
    return int(ports[0])


def header(frame_type: int, length: int, payload: bytes = b"", flags: int = 0) -> bytes:
    crc = zlib.crc32(payload, zlib.crc32(HEADER.pack(MAGIC, VERSION, frame_type, flags, length, 0)[:16]))
    return HEADER.pack(MAGIC, VERSION, frame_type, flags, length, crc)


def frame(frame_type: int, payload: bytes) -> bytes:
    return header(frame_type, len(payload), payload) + payload


FRAME_TYPES = st.sampled_from([int(t) for t in FrameType] + [0, 11, 255])
OPENINGS = st.one_of(
    st.binary(min_size=HEADER.size, max_size=200).filter(lambda b: not b.startswith(MAGIC)),
    st.builds(header, FRAME_TYPES, st.integers(SMALL + 1, 2**64 - 1)),  # a huge payload announced, none sent
    st.builds(frame, FRAME_TYPES.filter(lambda t: t != FrameType.HELLO), st.binary(max_size=64)),
    st.builds(frame, st.just(int(FrameType.HELLO)), st.binary(max_size=64).filter(lambda b: len(b) != NONCE_BYTES)),
    st.builds(
        lambda proof, kind: frame(FrameType.HELLO, secrets.token_bytes(NONCE_BYTES)) + frame(kind, proof),
        st.binary(max_size=64),
        FRAME_TYPES,
    ),
    st.builds(
        lambda version: struct.pack("!4sB", MAGIC, version) + bytes(15),
        st.integers(0, 255).filter(lambda v: v != VERSION),
    ),
)


def closed_by_server(port: int, opening: bytes) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=GIVE_UP) as sock:
        try:
            sock.sendall(opening)
            while sock.recv(65536):  # an ERROR frame may come first
                pass
        except TimeoutError:
            return False
        except ConnectionError:  # a reset is a close too
            pass
    return True


def test_unauthenticated_frames_are_refused_promptly(cluster: Cluster, kv_port: int) -> None:
    @FUZZ_NO_SHRINK  # a held connection costs GIVE_UP seconds per example: report the first, do not shrink it
    @given(opening=OPENINGS)
    def attack(opening: bytes) -> None:
        assert closed_by_server(kv_port, opening), f"KV port held a connection that opened with {opening[:40]!r}"

    attack()
    assert normal_completion(cluster.gateways[0].url).status_code == 200


FLOOD_SOCKETS = 260  # issue #33's
COMPLETIONS, AT_ONCE = 24, 8  # at once: more KV streams than decode's pool keeps idle, so new handshakes too
DROP_LOG_SECONDS = 10.0  # the server's kv_drop_log_seconds (default)


def test_a_flood_of_silent_sockets_on_the_kv_port_fails_no_completion(cluster: Cluster, kv_port: int) -> None:
    """Issue #33: 260 silent sockets on prefill's KV port, each replaced when dropped, made every new KV handshake
    fail `capacity`, and 72/72 completions 502 under decode's kv_load_failure_policy `fail` (this stack's). Now
    every completion succeeds, decode opening new KV connections during the flood, and prefill logs about the flood
    at most once per kv_drop_log_seconds while counting each connection it dropped."""
    decode, prefill = cluster.servers["d"], cluster.servers["p"]

    def new_kv_connections() -> float:
        return metric(
            httpx.get(f"{decode.url}/metrics").text, "pdserve_kv_connections_total", role="receiver", outcome="new"
        )

    opened_before, started = new_kv_connections(), time.monotonic()
    with Flood(kv_port, FLOOD_SOCKETS) as flood, ThreadPoolExecutor(AT_ONCE) as requests:
        flood.wait_until_open()
        statuses = [
            response.status_code
            for response in requests.map(lambda _: normal_completion(cluster.gateways[0].url), range(COMPLETIONS))
        ]
    flooded_s = time.monotonic() - started
    assert statuses == [200] * COMPLETIONS
    assert new_kv_connections() > opened_before
    dropped = metric(httpx.get(f"{prefill.url}/metrics").text, "pdserve_kv_connections_dropped_total")
    assert dropped >= flood.dropped > 0
    lines = [line for line in (cluster.tmp / "p.log").read_text().splitlines() if "kv: dropped" in line]
    assert 1 <= len(lines) <= flooded_s / DROP_LOG_SECONDS + 2
