"""Finding the project's stacks and loading one environment's stacks: one way, one strictness, for every caller.

Every part of pdstack that needs "the stacks of environment E" (plan, synth, canary, `pdstack local`, the Pulumi
program's view of its siblings) goes through `load_environment`: the files `Pulumi.<E>-*.yaml` of one folder, each
checked on its own and then together exactly as `pdstack validate` checks them. An environment with any problem does
not load, and the error lists every problem; the other environments of the folder do not matter to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdstack.model import DatacenterRole, StackConfig
from pdstack.plan.catalog import Catalog
from pdstack.stacks.files import Problem, StackFile, stack_name_of
from pdstack.stacks.validate import validate

PROJECT_FILE = "Pulumi.yaml"
STACKS_FOLDER = "stacks"


def find_project(start: Path | None = None) -> Path | None:
    """The nearest folder holding `Pulumi.yaml`, walking up from `start` (default: the working directory)."""
    here = (start or Path.cwd()).resolve()
    return next((folder for folder in (here, *here.parents) if (folder / PROJECT_FILE).is_file()), None)


def default_stacks_dir(start: Path | None = None) -> Path:
    """The project's `stacks/` (the project found by walking up to `Pulumi.yaml`); `./stacks` outside any project."""
    project = find_project(start)
    return (project if project is not None else (start or Path.cwd()).resolve()) / STACKS_FOLDER


def stack_files(stacks_dir: Path, env: str | None = None) -> list[Path]:
    """The stack files of one environment (all of them when `env` is None), by name, sorted."""
    pattern = f"Pulumi.{env}-*.yaml" if env else "Pulumi.*.yaml"
    return sorted(p for p in stacks_dir.glob(pattern) if stack_name_of(p) is not None)


def environment_names(stacks_dir: Path) -> list[str]:
    """The environments the folder's file names name (`Pulumi.<env>-<dc>.yaml`)."""
    return sorted({(stack_name_of(p) or "").split("-", 1)[0] for p in stack_files(stacks_dir)})


class EnvironmentLoadError(ValueError):
    """The environment cannot be loaded: no such folder or files, or problems in its stacks (all listed)."""

    def __init__(self, message: str, problems: list[Problem] | None = None) -> None:
        self.problems = sorted(problems or [])
        super().__init__("\n".join([message, *map(str, self.problems)]))


@dataclass(frozen=True)
class EnvironmentStacks:
    """One environment's stacks, valid on their own and together."""

    name: str
    stacks_dir: Path
    stacks: tuple[StackFile, ...]  # sorted by stack name

    @property
    def configs(self) -> dict[str, StackConfig]:
        """Stack config by datacenter name."""
        return {s.config.datacenter.name: s.config for s in self.stacks}

    @property
    def control(self) -> StackFile:
        """The control-plane stack (validation guarantees exactly one)."""
        return next(s for s in self.stacks if s.config.datacenter.role is DatacenterRole.CONTROL)

    def stack(self, name: str) -> StackFile:
        """The stack named `name` (`prod-control`); EnvironmentLoadError naming the known ones otherwise."""
        for stack in self.stacks:
            if stack.stack_name == name:
                return stack
        known = ", ".join(s.stack_name for s in self.stacks)
        raise EnvironmentLoadError(f"no stack {name!r} in environment {self.name} (known: {known})")


def load_environment(stacks_dir: Path, env: str, catalog: Catalog | None = None) -> EnvironmentStacks:
    """The stacks of environment `env` in `stacks_dir`, validated as `pdstack validate` validates them."""
    if not stacks_dir.is_dir():
        raise EnvironmentLoadError(f"no stacks folder {stacks_dir}")
    paths = stack_files(stacks_dir, env)
    if not paths:
        known = ", ".join(environment_names(stacks_dir)) or "none"
        raise EnvironmentLoadError(f"no stack files Pulumi.{env}-*.yaml in {stacks_dir} (environments: {known})")
    report = validate(paths, catalog)
    if not report.valid:
        raise EnvironmentLoadError(
            f"environment {env} in {stacks_dir} is not valid (see `pdstack validate`):", report.problems
        )
    return EnvironmentStacks(env, stacks_dir, tuple(sorted(report.stacks, key=lambda s: s.stack_name)))
