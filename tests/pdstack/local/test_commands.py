"""pdstack.local.commands: the one way pdstack.local runs a command, on real processes."""

from __future__ import annotations

import pytest

from pdstack.local.commands import OUTPUT_TAIL, CommandError, run_captured


def test_a_failed_command_raises_with_the_command_its_exit_and_its_output() -> None:
    script = "echo building; echo 'no space left on device' >&2; exit 3"
    with pytest.raises(CommandError) as raised:
        run_captured(["sh", "-c", script])
    error = raised.value
    assert (error.argv, error.returncode) == (["sh", "-c", script], 3)
    assert str(error).startswith(f"`sh -c {script}` failed with exit 3: building")
    assert str(error).endswith("no space left on device")  # standard error last: the cause ends the message


def test_the_error_carries_the_tail_of_a_long_output() -> None:
    with pytest.raises(CommandError) as raised:
        run_captured(["sh", "-c", f"printf 'x%.0s' $(seq {OUTPUT_TAIL}); echo; echo the-cause >&2; exit 1"])
    message = str(raised.value)
    assert message.endswith("the-cause") and len(message) < OUTPUT_TAIL + 100
    assert len(raised.value.output) > OUTPUT_TAIL  # the whole output stays on the error


def test_a_command_that_prints_nothing_says_so() -> None:
    with pytest.raises(CommandError, match=r"^`false` failed with exit 1: \(no output\)$"):
        run_captured(["false"])


def test_unchecked_runs_return_the_exit_and_the_output_as_text() -> None:
    result = run_captured(["sh", "-c", "cat; printf '\\377'; exit 4"], stdin="from stdin\n", check=False)
    assert result.returncode == 4
    assert result.stdout == "from stdin\n\ufffd"  # undecodable bytes are replaced, not raised
