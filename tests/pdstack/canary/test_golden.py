"""Golden outputs against real colocated pdserve servers on loopback: a twin gives the same tokens, a server with the
output-perturbing switch does not, and a recorded golden file stands in for a baseline when the model changes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdserve.engine.testmodels import make_test_checkpoint
from pdstack.canary.golden import DEFAULT_PROMPTS, GoldenError, compare, generate, load_golden
from pdstack.cli import app
from tests.support.serverproc import ServerProcess, start_all

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    root = tmp_path_factory.mktemp("golden")
    model = make_test_checkpoint("dense", root / "model")
    procs = {
        "baseline": ServerProcess("colocated", model, log_path=root / "baseline.log"),
        "twin": ServerProcess("colocated", model, log_path=root / "twin.log"),
        "perturbed": ServerProcess(
            "colocated", model, env={"PDSERVE_FAULT_PERTURB_OUTPUT": "true"}, log_path=root / "perturbed.log"
        ),
        "failing": ServerProcess(
            "colocated", model, env={"PDSERVE_FAULT_ERROR_RATE": "1"}, log_path=root / "failing.log"
        ),
    }
    start_all(list(procs.values()))
    yield procs
    for proc in procs.values():
        proc.stop()


def golden(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["canary", "golden", *args])
    return result.exit_code, result.output


@pytest.mark.slow  # the servers fixture: pdserve processes
def test_same_release_gives_the_same_greedy_tokens(servers: dict[str, ServerProcess]) -> None:
    prompts = list(DEFAULT_PROMPTS)
    report = compare(
        generate(servers["twin"].url, prompts, MAX_TOKENS), generate(servers["baseline"].url, prompts, MAX_TOKENS)
    )
    assert report.passed
    assert all(c.first_difference is None for c in report.comparisons)


@pytest.mark.slow  # the servers fixture: pdserve processes
def test_perturbed_outputs_fail_and_the_report_says_where(servers: dict[str, ServerProcess]) -> None:
    code, output = golden("--canary", servers["perturbed"].url, "--baseline", servers["baseline"].url)
    assert code == 1
    assert output.startswith("FAIL golden_outputs:")
    assert "threshold 0" in output and "DIFFERENT" in output and "from token" in output


@pytest.mark.slow  # the servers fixture: pdserve processes
def test_cli_passes_for_the_twin(servers: dict[str, ServerProcess]) -> None:
    code, output = golden("--canary", servers["twin"].url, "--baseline", servers["baseline"].url, "--json")
    assert code == 0 and json.loads(output)["outcome"] == "pass"


@pytest.mark.slow  # the servers fixture: pdserve processes
def test_recorded_golden_file_replaces_the_baseline(servers: dict[str, ServerProcess], tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text("max_tokens: 6\nprompts: ['Hello world', 'KV cache']\n")
    recorded = tmp_path / "golden.json"
    assert golden("--canary", servers["baseline"].url, "--golden", str(prompts), "--record", str(recorded))[0] == 0
    assert len(load_golden(recorded).outputs or []) == 2
    assert golden("--canary", servers["twin"].url, "--golden", str(recorded))[0] == 0
    assert golden("--canary", servers["perturbed"].url, "--golden", str(recorded))[0] == 1


@pytest.mark.slow  # the servers fixture: pdserve processes
def test_golden_file_without_outputs_needs_a_baseline(servers: dict[str, ServerProcess], tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text("prompts: ['Hello world']\n")
    code, output = golden("--canary", servers["twin"].url, "--golden", str(prompts))
    assert code == 2 and "--baseline" in output


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_tokens: 0\nprompts: [a]\n", "max_tokens"),
        ("prompts: []\n", "prompts"),
        ("prompts: [a]\noutputs: [{prompt: b, token_ids: [1]}]\n", "no output for prompt 'a'"),
    ],
)
def test_bad_golden_files_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "golden.yaml"
    path.write_text(text)
    with pytest.raises(GoldenError, match=message):
        load_golden(path)


@pytest.mark.slow  # the servers fixture: pdserve processes
def test_a_canary_answering_with_errors_fails_naming_the_status(servers: dict[str, ServerProcess]) -> None:
    code, output = golden("--canary", servers["failing"].url, "--baseline", servers["baseline"].url)
    assert code == 1 and output.startswith("FAIL golden_outputs: the canary failed a golden prompt")
    assert "HTTP 500" in output and "injected fault" in output


@pytest.mark.slow  # the servers fixture: pdserve processes
def test_a_baseline_answering_with_errors_cannot_judge(servers: dict[str, ServerProcess]) -> None:
    code, output = golden("--canary", servers["baseline"].url, "--baseline", servers["failing"].url)
    assert code == 2 and "HTTP 500" in output


def test_unreachable_endpoint_is_a_clear_error() -> None:
    code, output = golden("--canary", "http://127.0.0.1:9", "--baseline", "http://127.0.0.1:9")
    assert code == 2 and "http://127.0.0.1:9" in output
