"""Reading Pulumi stack files (`stacks/Pulumi.<env>-<dc>.yaml`) into typed stack configs, with precise problems."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from pdstack.model import StackConfig

NAMESPACE = "pdstack"
PULUMI_STACK_KEYS = {"config", "secretsprovider", "encryptedkey", "encryptionsalt", "environment"}


@dataclass(frozen=True, order=True)
class Problem:
    """One thing wrong, located as precisely as we can: the file, the field path inside it, and why."""

    file: str
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.path}: {self.reason}" if self.path else f"{self.file}: {self.reason}"


@dataclass(frozen=True)
class StackFile:
    path: Path
    stack_name: str
    config: StackConfig
    pulumi_config: dict[str, Any]  # every key of the file's `config:` block, other namespaces included


class StackFileError(Exception):
    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(map(str, problems)))
        self.problems = problems


def stack_name_of(path: Path) -> str | None:
    """`Pulumi.prod-use1.yaml` -> `prod-use1`; None when the name is not a stack file name."""
    name = path.name
    if name.startswith("Pulumi.") and name.endswith(".yaml") and name.count(".") == 2:
        return name[len("Pulumi.") : -len(".yaml")]
    return None


def load_stack_file(path: Path) -> StackFile:
    """Parse and type-check one stack file; raise StackFileError listing every problem found."""
    where = str(path)
    stack_name = stack_name_of(path)
    if stack_name is None:
        raise StackFileError([Problem(where, "", "file name must be Pulumi.<env>-<datacenter>.yaml")])
    raw = _read_yaml(path)
    pulumi_config = _pulumi_config_block(raw, where)
    ours = {key.split(":", 1)[1]: value for key, value in pulumi_config.items() if key.startswith(f"{NAMESPACE}:")}
    try:
        # Through JSON so strict mode accepts enum values as strings but still refuses "8000" for a number.
        config = StackConfig.model_validate_json(json.dumps(ours, default=str))
    except ValidationError as exc:
        raise StackFileError([_problem_of(where, err) for err in exc.errors()]) from None
    expected = f"{config.environment}-{config.datacenter.name}"
    if stack_name != expected:
        raise StackFileError(
            [Problem(where, "", f"stack name {stack_name!r} does not match environment-datacenter {expected!r}")]
        )
    return StackFile(path=path, stack_name=stack_name, config=config, pulumi_config=pulumi_config)


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise StackFileError([Problem(str(path), "", f"malformed YAML: {at}{problem}")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise StackFileError([Problem(str(path), "", f"cannot read: {exc}")]) from None


def _pulumi_config_block(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise StackFileError([Problem(where, "", "a stack file must be a mapping with a `config:` block")])
    problems = [
        Problem(where, str(key), "unknown top-level key of a Pulumi stack file")
        for key in raw
        if key not in PULUMI_STACK_KEYS
    ]
    config = raw.get("config")
    if not isinstance(config, dict):
        problems.append(Problem(where, "config", "missing, or not a mapping of `namespace:key: value`"))
    else:
        problems += [
            Problem(where, f"config.{key}", "config keys must be namespaced, like pdstack:environment")
            for key in config
            if not isinstance(key, str) or ":" not in key
        ]
    if problems:
        raise StackFileError(problems)
    assert isinstance(config, dict)
    return config


def _problem_of(where: str, err: ErrorDetails) -> Problem:
    loc = err["loc"]
    path = f"{NAMESPACE}:" + _dotted(loc) if loc else ""
    reason = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        reason = f"unknown key{_did_you_mean(loc)}"
    elif err["type"] == "missing":
        reason = "required key is missing"
    elif "input" in err and err["type"].endswith("_type"):
        reason = f"{reason}, got {type(err['input']).__name__} {err['input']!r}"
    return Problem(where, path, reason)


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _did_you_mean(loc: tuple[int | str, ...]) -> str:
    """Suggest the closest field name for a misspelled key, by walking the model along the error location."""
    model: type[BaseModel] | None = StackConfig
    for part in loc[:-1]:
        if model is None:
            return ""
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        model = _model_in(field.annotation) if field is not None else None
    if model is None:
        return ""
    match = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
