"""Every command the manual shows is one its tools take: the README's and docs/' shell blocks and inline commands,
checked against the real command lines (pdstack's click tree, pdserve's and the WAN link's parsers, the Makefile's
targets, the repository's files) without running them, since most need a running environment or a cloud.

A command in a `sh` block must parse as written. A synopsis (`[--json]`, `a | b`, `URL`) and a command named in a
sentence are checked for their subcommands and the options they name.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import typer
from typer._click.core import Command, Context  # typer 0.29 carries its own click: its commands are of these
from typer._click.exceptions import UsageError
from typer.core import TyperGroup

from pdstack.cli import app
from pdstack.local.wan.__main__ import _parser as wan_parser
from tests.support import REPO

PAGES = [REPO / "README.md", REPO / "serving" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# What a command needs at run time and the manual shows only as an example of that run: the local environment's
# state (.cache/local), a scratch file, or a running scheduler.
NEEDS_A_RUN = ("curl", "cat")
PLACEHOLDER = re.compile(r"\[|\||\.\.\.|<|\b[A-Z][A-Z_]{1,}\b(?!=)")


@dataclass(frozen=True)
class Shown:
    """One command as a page shows it."""

    page: str
    text: str
    synopsis: bool

    def __str__(self) -> str:
        return f"{self.page}: {self.text}"


def commands_in_block(block: str) -> Iterator[str]:
    """The commands of a shell block: continuation lines joined, comments and here-documents dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    heredoc_end = None
    for line in joined.splitlines():
        if heredoc_end is not None:
            heredoc_end = None if line.strip() == heredoc_end else heredoc_end
            continue
        if marker := re.search(r"<<'?(\w+)'?", line):
            heredoc_end = marker.group(1)
        if command := line.split(" #", 1)[0].strip():
            yield command


def shown_commands() -> list[Shown]:
    shown = []
    for page in PAGES:
        name = str(page.relative_to(REPO))
        text = page.read_text()
        for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, flags=re.S):
            shown += [Shown(name, c, synopsis=bool(PLACEHOLDER.search(c))) for c in commands_in_block(block)]
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for span in re.findall(r"`((?:\.venv/bin/)?(?:pdstack|pdserve|make) [^`]+)`", prose):
            shown.append(Shown(name, " ".join(span.split()), synopsis=True))  # named in a sentence, not run
    return shown


SHOWN = shown_commands()


@cache
def make_targets() -> frozenset[str]:
    database = subprocess.run(["make", "-pRrq", "-C", str(REPO)], capture_output=True, text=True, check=False).stdout
    return frozenset(m.group(1) for m in re.finditer(r"^([a-z][\w-]*):", database, flags=re.M))


@cache
def pdserve_options(role: str) -> frozenset[str]:
    shown = subprocess.run(
        [str(REPO / ".venv" / "bin" / "pdserve"), role, "--help"], capture_output=True, text=True, check=False
    )
    assert shown.returncode == 0, f"pdserve {role} --help: {shown.stderr[-500:]}"
    return frozenset(re.findall(r"--[a-z][\w-]*", shown.stdout))


def named_options(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][\w-]*", text)) - {"--help"}


def options_of(command: Command) -> frozenset[str]:
    return frozenset(opt for param in command.params for opt in param.opts + param.secondary_opts)


def check_pdstack(words: list[str], shown: Shown) -> None:
    """Descend pdstack's click tree by the subcommands shown; a command as written must parse, a synopsis must
    name only options the command has."""
    command: Command = typer.main.get_command(app)
    path = ["pdstack"]
    while isinstance(command, TyperGroup) and words and re.fullmatch(r"[a-z][\w-]*", words[0]):
        if len(words) > 1 and words[1] == "|":  # `local up | down | status [--json]`: each subcommand in turn
            for alternative in " ".join(words).split(" | "):
                check_pdstack([*path[1:], *alternative.split()], shown)
            return
        sub = command.get_command(Context(command), words[0])
        assert sub is not None, f"{shown}: `{' '.join(path)}` has no subcommand {words[0]!r}"
        command, path = sub, [*path, words.pop(0)]
    if shown.synopsis:
        unknown = named_options(" ".join(words)) - options_of(command)
        assert not unknown, f"{shown}: `{' '.join(path)}` has no option {sorted(unknown)}"
        return
    try:
        command.make_context(" ".join(path), list(words), resilient_parsing=False)
    except UsageError as error:
        pytest.fail(f"{shown}: `{' '.join(path)}` refuses it: {error.format_message()}")


def check_pdserve(words: list[str], shown: Shown) -> None:
    role = words[0]
    if role in {"ROLE", "--version"} or "|" in words:
        return
    unknown = named_options(" ".join(words[1:])) - pdserve_options(role)
    assert not unknown, f"{shown}: `pdserve {role}` has no option {sorted(unknown)}"


def check_make(words: list[str], shown: Shown) -> None:
    targets = [w for w in words if "=" not in w]
    missing = set(targets) - make_targets()
    assert not missing, f"{shown}: the Makefile has no target {sorted(missing)}"
    makefile = (REPO / "Makefile").read_text()
    for variable in (w.split("=")[0] for w in words if "=" in w):
        assert re.search(rf"\b{variable}\b", makefile), f"{shown}: the Makefile reads no {variable}"


def check_repo_paths(words: list[str], shown: Shown) -> None:
    """The repository's files a command names exist (what a run makes, under .cache/ or /tmp, is not checked)."""
    for word in words:
        path = word.lstrip("@")
        if re.match(r"^(inventories|playbooks|roles|stacks|bench|serving|docs)/", path):
            assert (REPO / path).exists() or path.startswith("bench/results/"), f"{shown}: no {path} in the repo"


def check(shown: Shown) -> None:
    words = shlex.split(shown.text) if not shown.synopsis else shown.text.split()
    # The command's own environment, as in `SSL_CERT_FILE=... pdstack bench`, is not the program.
    while len(words) > 1 and re.match(r"[A-Z_][A-Z0-9_]*=", words[0]):
        words.pop(0)
    program, rest = Path(words[0]).name, words[1:]
    check_repo_paths(rest, shown)
    if program == "pdstack":
        check_pdstack(rest, shown)
    elif program == "pdserve":
        check_pdserve(rest, shown)
    elif program == "make":
        check_make(rest, shown)
    elif words[:3] == ["python", "-m", "pdstack.local.wan"]:
        try:
            wan_parser().parse_args(words[3:])
        except SystemExit:
            pytest.fail(f"{shown}: `python -m pdstack.local.wan` refuses it")
    elif program == "ansible-playbook":
        assert (REPO / words[words.index("-i") + 1]).exists(), f"{shown}: no such inventory"
    else:
        assert program in NEEDS_A_RUN, f"{shown}: {program!r} is neither a pdstack tool nor a known one"


def test_the_manual_shows_commands() -> None:
    programs = {Path(s.text.split()[0]).name for s in SHOWN}
    assert {"pdstack", "pdserve", "make"} <= programs, programs


@pytest.mark.parametrize("shown", SHOWN, ids=str)
def test_each_command_the_manual_shows_is_taken_by_its_tool(shown: Shown) -> None:
    check(shown)


def test_a_misspelled_option_is_caught() -> None:
    with pytest.raises(pytest.fail.Exception, match="refuses it"):
        check(Shown("docs/x.md", "pdstack validate --jsn", synopsis=False))
    with pytest.raises(AssertionError, match=r"has no option \['--jsn'\]"):
        check(Shown("docs/x.md", "pdstack validate [--jsn]", synopsis=True))
    with pytest.raises(AssertionError, match="no target"):
        check(Shown("docs/x.md", "make upp", synopsis=False))
