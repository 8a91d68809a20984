"""`pdstack bench` refuses bad settings before sending any load, naming the setting."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdstack.cli import app

runner = CliRunner()
URL = "http://127.0.0.1:9"  # nothing listens there; settings are checked before any connection


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "rate/peak-shares: give --rate or --peak-shares"),
        (["--rate", "1", "--peak-shares", "50"], "not both"),
        (["--rate", "0"], "rate: must be positive"),
        (["--peak-shares", "50,120"], "peak-shares: 120 is not within (0, 100]"),
        (["--rate", "1", "--api", "embeddings"], "api: expected one of chat, completions"),
        (["--rate", "1", "--requests", "0"], "requests: must be at least 1"),
        (["--rate", "1", "--slo-ttft-ms", "-5"], "slo-ttft-ms: must be positive"),
        (["--rate", "1", "--timeout", "0"], "timeout: must be positive"),
    ],
)
def test_bad_settings_are_named(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["bench", "--url", URL, *args])
    assert result.exit_code == 2
    assert message in result.output


def test_rates_must_be_numbers() -> None:
    result = runner.invoke(app, ["bench", "--url", URL, "--rate", "fast"])
    assert result.exit_code == 2
    assert "--rate" in result.output and "comma-separated numbers" in result.output


def test_a_bad_url_and_an_unreachable_endpoint_are_named() -> None:
    result = runner.invoke(app, ["bench", "--url", "127.0.0.1:8000", "--rate", "1"])
    assert result.exit_code == 2 and "url: expected http(s)://host:port" in result.output
    result = runner.invoke(app, ["bench", "--url", URL, "--rate", "1"])
    assert result.exit_code == 2 and "url: cannot reach http://127.0.0.1:9/v1/models" in result.output


def test_api_key_file_problems_are_named_without_showing_the_key(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    result = runner.invoke(app, ["bench", "--url", URL, "--rate", "1", "--api-key-file", str(missing)])
    assert result.exit_code == 2 and f"api-key-file: cannot read {missing}" in result.output
    empty = tmp_path / "empty"
    empty.write_text("\n\n")
    result = runner.invoke(app, ["bench", "--url", URL, "--rate", "1", "--api-key-file", str(empty)])
    assert result.exit_code == 2 and "is empty" in result.output


def test_plot_without_matplotlib_fails_before_any_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    result = runner.invoke(app, ["bench", "--url", URL, "--rate", "1", "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 2
    assert "matplotlib is not installed" in result.output and "pdstack[plot]" in result.output
    assert "cannot reach" not in result.output
