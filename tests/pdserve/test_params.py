"""The generation parameters the gateway and the servers check alike (pdserve.common.params)."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.common.params import MAX_STOP_CHARS, MAX_STOP_SEQUENCES, ParamError, check_generation_params


@pytest.mark.parametrize(
    ("body", "max_tokens", "field"),
    [
        ({"stop": ["a"] * (MAX_STOP_SEQUENCES + 1)}, 4, "stop"),
        ({"stop": "x" * (MAX_STOP_CHARS + 1)}, 4, "stop"),
        ({"stop": ["ok", "x" * 250_000]}, 4, "stop"),
        ({"stop": [""]}, 4, "stop"),
        ({"stop": [1]}, 4, "stop"),
        ({"stop": {"a": 1}}, 4, "stop"),
        ({"min_tokens": "x"}, 4, "min_tokens"),
        ({"min_tokens": -1}, 4, "min_tokens"),
        ({"min_tokens": True}, 4, "min_tokens"),
        ({"min_tokens": 1000}, 4, "min_tokens"),
        ({"stream_options": {"include_usage": "x"}}, 4, "stream_options.include_usage"),
        ({"stream_options": []}, 4, "stream_options"),
        ({"stop_token_ids": ["a"]}, 4, "stop_token_ids"),
        ({"top_k": -2}, 4, "top_k"),
        ({"top_k": "5"}, 4, "top_k"),
        ({"ignore_eos": "yes"}, 4, "ignore_eos"),
        ({"return_token_ids": 1}, 4, "return_token_ids"),
        ({"echo": "no"}, 4, "echo"),
    ],
)
def test_what_every_engine_refuses_is_named(body: dict[str, Any], max_tokens: int, field: str) -> None:
    with pytest.raises(ParamError) as refused:
        check_generation_params(body, max_tokens)
    assert refused.value.field == field


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"stop": "x" * MAX_STOP_CHARS},
        {"stop": ["a", "b", "c", "d"]},
        {"min_tokens": 4, "stream_options": {"include_usage": True}},
        {"top_k": -1, "stop_token_ids": [1, 2], "ignore_eos": False, "stop": None},
    ],
)
def test_what_engines_accept_passes(body: dict[str, Any]) -> None:
    check_generation_params(body, 4)


def test_min_tokens_unchecked_against_an_unknown_cap() -> None:
    check_generation_params({"min_tokens": 1000}, None)
