"""Layer-wise streaming overlapped with prefill: under early dispatch, prefill's connector opens the lease entry
on the request's first prefill step, adds each layer's completed blocks as vLLM computes them (chunked prefill:
max_num_batched_tokens 128, four blocks a step), and seals it once the prompt is complete; decode's pull, already
waiting, gets the blocks while prefill computes.

Order is read from prefill's own log, whose lines come from one thread in step order: one line per step naming the
blocks it added, then the seal's line with the bytes the KV server had already sent from the open entry. The
colocated reference runs on prefill with its own cache_salt, so it does not seed the prefix cache of the runs
under test (which would leave prefill nothing to compute).
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.vllm.conftest import (
    BLOCK_SIZE,
    DO_REMOTE_DECODE,
    MAX_TOKENS,
    Pair,
    failure_line,
    loaded,
    prompt_of,
    token_ids,
)
from tests.vllm.kvhelpers import early_dispatch_params
from tests.vllm.pair.conftest import BATCHED_TOKENS

LONG = 1900  # 60 blocks, the last one partial; 15 prefill steps
STEP_LINE = re.compile(
    r"lease (\S+) step (\d+): blocks \[(\d+), (\d+)\) of (\d+) added, (\d+) prompt tokens computed, (\d+) bytes served"
)
SEAL_LINE = re.compile(r"lease (\S+) sealed after (\d+) steps: (\d+) of (\d+) bytes were already served")


def colocated(pair: Pair, prompt: list[int]) -> list[int]:
    return token_ids(pair.prefill.complete(prompt, MAX_TOKENS, cache_salt=secrets.token_hex(8)))


def fingerprint_of(pair: Pair) -> str:
    """Prefill's registered fingerprint, as the gateway has it (from the instance file, holding no lease)."""
    for path in Path(pair.prefill.extra["run_dir"]).glob("*/instance.json"):
        body = json.loads(path.read_text())
        if body["role"] == "kv_producer":
            return str(body["fingerprint"])
    raise AssertionError("prefill wrote no instance.json")


def start_decode(pair: Pair, prompt: list[int], transfer: str, answers: dict[str, Any]) -> threading.Thread:
    """Decode asked first, as the gateway's early dispatch may: its pull waits for prefill to open `transfer`."""
    params = early_dispatch_params(pair, transfer, fingerprint_of(pair))
    thread = threading.Thread(
        target=lambda: answers.update(decode=pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params))
    )
    thread.start()
    time.sleep(1.0)  # lets decode's pull reach prefill first (order only; nothing asserts on time)
    return thread


def stream_lines(pair: Pair, transfer: str) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(step lines, seal lines) of prefill's log for `transfer`, in log order, as integers."""
    steps, seals = [], []
    for line in pair.prefill.log().splitlines():
        if (step := STEP_LINE.search(line)) and step[1] == transfer:
            steps.append(tuple(int(value) for value in step.groups()[1:]))
        if (seal := SEAL_LINE.search(line)) and seal[1] == transfer:
            seals.append(tuple(int(value) for value in seal.groups()[1:]))
    return steps, seals


def test_early_dispatch_streams_blocks_while_prefill_computes(pair: Pair) -> None:
    prompt = prompt_of(LONG, seed=81)
    reference = colocated(pair, prompt)
    transfer = secrets.token_hex(16)
    answers: dict[str, Any] = {}
    decoding = start_decode(pair, prompt, transfer, answers)
    prefilled = pair.prefill.complete(
        prompt, 1, kv_transfer_params={**DO_REMOTE_DECODE, "pdstack_transfer_id": transfer}
    )
    decoding.join(timeout=120)
    assert prefilled["kv_transfer_params"]["remote_request_id"] == transfer
    assert prefilled["kv_transfer_params"]["kv_checksum"]  # the sequential flow's params are still complete
    assert token_ids(answers["decode"]) == reference
    assert loaded(pair, transfer), pair.decode.log_tail()

    steps, seals = stream_lines(pair, transfer)
    total = -(-LONG // BLOCK_SIZE)
    assert len(steps) == -(-LONG // BATCHED_TOKENS), steps  # one line per chunk, in step order
    expected_first = 0
    for number, (step, first, end, blocks, computed, _served) in enumerate(steps, start=1):
        assert (step, first, blocks) == (number, expected_first, total), steps
        # Only complete blocks: a chunk's half-filled last block waits; the prompt's partial last block ends it.
        assert end == (total if computed == LONG else computed // BLOCK_SIZE), steps
        expected_first = end
    assert expected_first == total
    assert len(seals) == 1, seals
    sealed_steps, served_before_seal, entry_bytes = seals[0]
    assert sealed_steps == len(steps)
    # Before prefill computed its last chunk, the KV server had already sent KV of this prompt from the open
    # entry to decode's waiting pull (the count rises from step to step): the transfer overlapped the prefill.
    served = [line[-1] for line in steps]
    assert served == sorted(served) and 0 < served[-2] <= served_before_seal <= entry_bytes, steps


def test_sequential_flow_still_equals_colocated(pair: Pair) -> None:
    """vLLM's proxy flow on the same streamed path: prefill answers with the sealed entry's checksum."""
    prompt = prompt_of(5 * BATCHED_TOKENS + 7, seed=82)
    reference = colocated(pair, prompt)
    params = pair.prefill_params(prompt)
    assert params["num_tokens"] == len(prompt) and params["kv_checksum"]
    answer = pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params)
    assert token_ids(answer) == reference
    assert loaded(pair, str(params["remote_request_id"])), pair.decode.log_tail()
    steps, seals = stream_lines(pair, str(params["remote_request_id"]))
    assert len(steps) == 6 and len(seals) == 1, (steps, seals)


def busy_prefill(pair: Pair, count: int) -> list[threading.Thread]:
    """Other long prompts prefilled at once, so they share each step's token budget with the request under test
    and its prefill takes many more steps."""
    threads = [threading.Thread(target=colocated, args=(pair, prompt_of(LONG, seed=200 + n))) for n in range(count)]
    for thread in threads:
        thread.start()
    return threads


def test_prefill_aborted_mid_stream_frees_everything_and_decode_recomputes(pair: Pair) -> None:
    prompt = prompt_of(LONG, seed=83)
    reference = colocated(pair, prompt)
    pair.prefill.wait_leases_gone()
    usage = pair.prefill.metric("vllm:kv_cache_usage_perc")
    transfer = secrets.token_hex(16)
    answers: dict[str, Any] = {}
    decoding = start_decode(pair, prompt, transfer, answers)
    others = busy_prefill(pair, 3)
    body = {
        "model": str(pair.prefill.model),
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "kv_transfer_params": {**DO_REMOTE_DECODE, "pdstack_transfer_id": transfer},
    }
    with httpx.stream("POST", pair.prefill.url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        while not stream_lines(pair, transfer)[0]:  # its first chunk is streamed: the client leaves now
            time.sleep(0.01)
    decoding.join(timeout=120)
    for thread in others:
        thread.join(timeout=120)

    assert token_ids(answers["decode"]) == reference  # recomputed by decode
    assert "not_found" in failure_line(pair, answers["decode"]), pair.decode.log_tail()
    steps, seals = stream_lines(pair, transfer)
    assert steps and not seals, (steps, seals)
    assert "ended mid-prefill; its KV entry is aborted" in pair.prefill.log()
    pair.prefill.wait_metric("pdserve_kv_lease_bytes", lambda value: value == 0)
    pair.prefill.wait_metric("vllm:kv_cache_usage_perc", lambda value: value == usage)
