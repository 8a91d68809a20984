"""Hypothesis strategies for hostile HTTP input, and the checks every answer to it must pass."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from pdserve.scheduler.protocol import ENGINE_OPTIONAL_PARAMS

# Bounded in count and time: a standing suite, not an exploration. derandomize keeps CI runs identical.
FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

NASTY_STRINGS = [
    "\ud800",
    "a\udfffb",
    "\x00",
    "\u202e\u0000",
    "' OR 1=1 --",
    "../../../etc/passwd",
    "{{7*7}}",
    "%s%s%n",
    "NaN",
    "Infinity",
    "-0",
    "1e309",
    "\U0001f600" * 50,
    "a" * 5000,
]
SPECIAL_NUMBERS = [
    float("nan"),
    float("inf"),
    float("-inf"),
    -1,
    -(2**63),
    2**63,
    2**64,
    10**30,
    1e308,
    -0.0,
    0.5,
    2**31,
]
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(NASTY_STRINGS),
    st.sampled_from(SPECIAL_NUMBERS),
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)

COMPLETION_FIELDS = [
    "model",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "echo",
    "user",
    "return_token_ids",
    "kv_transfer_params",
    "messages",
    "suffix",
    "presence_penalty",
    *ENGINE_OPTIONAL_PARAMS,
]
KV_FIELDS = [
    "do_remote_decode",
    "do_remote_prefill",
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "pdstack_signature",
]

DEEP = [b"[" * 20000 + b"]" * 20000, b'{"a":' * 5000 + b"1" + b"}" * 5000, b"[" * 100000]
RAW_BODIES = st.one_of(
    st.binary(max_size=120),
    st.sampled_from([*DEEP, b"", b"{", b"null", b"[]", b'"x"', b'{"prompt": "\xff\xfe"}', b"NaN", b"1e99999"]),
)


def encode(document: Any) -> bytes:
    """JSON as a careless client writes it: NaN/Infinity literals, lone surrogates as \\u escapes."""
    return json.dumps(document, allow_nan=True).encode()


@st.composite
def kv_params(draw: st.DrawFn) -> dict[str, Any]:
    """kv_transfer_params a client might forge: the real field names, hostile values (loopback or garbage hosts)."""
    fields = draw(st.dictionaries(st.sampled_from(KV_FIELDS), VALUES, max_size=5))
    if draw(st.booleans()):
        fields.update(
            do_remote_prefill=True,
            remote_host=draw(st.sampled_from(["127.0.0.1", "localhost", "::1"])),
            remote_port=draw(st.sampled_from([1, 22, 6379, 65535])),
        )
    return fields


@st.composite
def completion_bodies(draw: st.DrawFn, base: dict[str, Any]) -> bytes:
    """A valid request with some fields replaced by hostile values, or a raw body that is not one."""
    if draw(st.integers(0, 4)) == 0:
        return draw(RAW_BODIES)
    document = dict(base)
    document.update(draw(st.dictionaries(st.sampled_from(COMPLETION_FIELDS), VALUES, max_size=3)))
    if draw(st.integers(0, 3)) == 0:
        document["kv_transfer_params"] = draw(kv_params())
    if isinstance(document.get("max_tokens"), int) and document["max_tokens"] > 64:
        document["max_tokens"] = 64  # keeps the generation each example may start short; validity is unchanged
    return encode(document)


HEADER_VALUES = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(str.strip)
CONTENT_TYPES = st.sampled_from(
    [
        "application/json",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json; charset=utf-16",
        "",
    ]
)
PATHS = st.one_of(
    st.sampled_from(
        [
            "/v1/completions/",
            "/v1//completions",
            "/V1/completions",
            "/v1/models/x",
            "/v1/embeddings",
            "/%2e%2e/etc/passwd",
            "/v1/completions?x=%00",
        ]
    ),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="?#%"), max_size=20).map(
        lambda s: "/" + s
    ),
)


def check_answer(response: httpx.Response, what: str) -> None:
    """No 5xx, and nothing of the server's insides in the body."""
    text = response.text
    assert response.status_code < 500, f"{what}: {response.status_code} {text[:300]}"
    for leak in ("Traceback", 'File "/', "Exception in ASGI", "site-packages"):
        assert leak not in text, f"{what}: answer shows {leak!r}: {text[:300]}"
