"""Decode's events as the gateway reads them: which carry a token, and which give the request up.

vLLM ends a choice it did not complete with finish_reason `abort` (the request aborted, e.g. by an engine shutting
down under a drain that raced a stale routing table) or `error` (e.g. a KV load failed under the `fail` policy),
then [DONE]. Relayed as they are, a client gets an empty or cut-short text that looks whole (seen in
tests/local/test_local_vllm's canaries as 'stream carried no generated text'); the gateway raises instead, so a
stream not yet relayed is retried on another decode and one already relayed ends with an error event.
"""

from __future__ import annotations

import json

import pytest

from pdserve.gateway.proxy import UpstreamError, given_up
from pdserve.gateway.streaming import DONE, carries_token, unfinished


def completion_chunk(text: str, finish_reason: str | None) -> str:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason}
    return json.dumps({"object": "text_completion", "choices": [choice]})


def chat_chunk(content: str, finish_reason: str | None) -> str:
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": finish_reason}
    return json.dumps({"object": "chat.completion.chunk", "choices": [choice]})


@pytest.mark.parametrize("reason", ["abort", "error"])
@pytest.mark.parametrize("chunk", [completion_chunk, chat_chunk])
def test_a_choice_the_engine_gave_up_is_a_retriable_decode_failure(chunk: object, reason: str) -> None:
    event = chunk("", reason)  # type: ignore[operator]
    assert unfinished(event) == reason
    with pytest.raises(UpstreamError) as raised:
        given_up(event)
    assert raised.value.role == "decode" and raised.value.cause == f"engine_{reason}" and raised.value.retriable
    assert reason in str(raised.value)


@pytest.mark.parametrize("reason", [None, "stop", "length"])
def test_tokens_and_whole_answers_pass(reason: str | None) -> None:
    for event in (completion_chunk(" text", reason), chat_chunk(" text", reason)):
        given_up(event)
        assert unfinished(event) is None and carries_token(event)


def test_a_non_streamed_answer_that_gave_up_is_refused_too() -> None:
    answer = json.dumps(
        {
            "object": "text_completion",
            "usage": {"completion_tokens": 0},
            "choices": [{"index": 0, "text": "", "finish_reason": "abort"}],
        }
    )
    with pytest.raises(UpstreamError):
        given_up(answer)


@pytest.mark.parametrize("event", [DONE, "not json", "[]", json.dumps({"usage": {"completion_tokens": 3}})])
def test_events_without_choices_give_nothing_up(event: str) -> None:
    assert unfinished(event) is None
    given_up(event)
