"""What every section of the stack model is built on: the strict base model and the constrained scalar types."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

NAME_PATTERN = r"^[a-z][a-z0-9-]{0,30}[a-z0-9]$"

Name = Annotated[str, Field(pattern=NAME_PATTERN, description="lower-case DNS label, 2-32 characters")]
Port = Annotated[int, Field(ge=1024, le=65535)]
Seconds = Annotated[float, Field(gt=0, le=3600)]
Percent = Annotated[float, Field(ge=0, le=100)]


class Strict(BaseModel):
    """Base for every config section: unknown keys are errors, values are not coerced across types."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
