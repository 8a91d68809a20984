"""The one settings loader of every pdserve component: a pydantic model filled from flags and PDSERVE_* variables.

Every field is a flag (`--state-file`) and an environment variable (`PDSERVE_STATE_FILE`); the flag wins over the
variable, which wins over the field's default. A bad value exits with status 2 naming the field and where its value
came from (`pdserve scheduler: invalid configuration: heartbeat_interval: Input should be a valid number, unable to
parse string as a number (--heartbeat-interval)`).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

ENV_PREFIX = "PDSERVE_"
M = TypeVar("M", bound=BaseModel)


def is_loopback(host: str) -> bool:
    """Only this machine can reach a listener on `host` (plain HTTP there crosses no network)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def env_name(field: str) -> str:
    """The environment variable of a settings field (the deployment contract renders these:
    pdstack/contract/components.py)."""
    return ENV_PREFIX + field.upper()


def as_env(model: type[BaseModel], values: Mapping[str, Any]) -> dict[str, str]:
    """`values`, by field name of `model`, as the PDSERVE_* variables load_settings reads them from (booleans as
    true/false); ValueError naming any name that is not a field of `model`. Deployments render with this
    (pdstack.contract.components), so a renamed field fails there, not in a container that ignores a variable."""
    unknown = sorted(set(values) - set(model.model_fields))
    if unknown:
        raise ValueError(f"{model.__name__} has no field {', '.join(unknown)}")
    return {
        env_name(name): str(value).lower() if isinstance(value, bool) else str(value) for name, value in values.items()
    }


def load_settings(
    model: type[M],
    argv: Sequence[str],
    prog: str,
    env: Mapping[str, str] | None = None,
    *,
    fixed: Mapping[str, Any] | None = None,
) -> M:
    """Build `model` from flags, then PDSERVE_* variables of `env` (default: the process's), then defaults. Fields
    in `fixed` (a server's role, say) take that value and have neither flag nor variable."""
    environ = os.environ if env is None else env
    given = dict(fixed or {})
    names = [name for name in model.model_fields if name not in given]
    parser = _parser(model, names, prog)
    namespace = parser.parse_args(list(argv))
    sources = {name: f"{_flag(name)} or {env_name(name)}" for name in names}
    for name in names:
        flag_value = getattr(namespace, name)
        if flag_value is not None:
            given[name], sources[name] = flag_value, _flag(name)
        elif env_name(name) in environ:
            given[name], sources[name] = environ[env_name(name)], env_name(name)
    try:
        return model.model_validate(given)
    except ValidationError as error:
        problems = "; ".join(_problem(item, sources) for item in error.errors())
        parser.exit(2, f"{prog}: invalid configuration: {problems}\n")
        raise  # unreachable: parser.exit exits


def _parser(model: type[BaseModel], names: list[str], prog: str) -> argparse.ArgumentParser:
    description = f"{(model.__doc__ or '').strip()} Every option can also be set by its PDSERVE_* variable."
    parser = argparse.ArgumentParser(prog=prog, description=description.strip())
    for name in names:
        field = model.model_fields[name]
        parser.add_argument(_flag(name), dest=name, default=None, help=_help(name, field))
    return parser


def _help(name: str, field: FieldInfo) -> str:
    if field.is_required():
        default = "required"
    elif field.default_factory is not None:
        default = "default: made at start"
    else:
        default = f"default {field.default!r}"
    return f"{field.description or ''} (env {env_name(name)}; {default})"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _problem(error: Any, sources: Mapping[str, str]) -> str:
    """One validation error: the field, the message, where the value came from; a check across fields (no location)
    names its fields itself."""
    location = error["loc"]
    if not location:
        return str(error["msg"])
    where = sources.get(str(location[0]), "")
    return f"{'.'.join(str(part) for part in location)}: {error['msg']}" + (f" ({where})" if where else "")
