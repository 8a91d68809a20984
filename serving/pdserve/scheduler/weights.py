"""Traffic weights per version, persisted to a JSON state file so they survive a scheduler restart."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path


class WeightsError(ValueError):
    """A weights update that cannot be accepted; the message names the version at fault."""


def validate_weights(weights: dict[str, float]) -> dict[str, float]:
    for version, weight in weights.items():
        if not version or len(version) > 64:
            raise WeightsError(f"weights: version name {version!r} must be 1-64 characters")
        if not math.isfinite(weight) or weight < 0:
            raise WeightsError(f"weights.{version}: weight must be a finite number >= 0, got {weight!r}")
    total = sum(weights.values())
    if weights and not math.isfinite(total):
        raise WeightsError(f"weights: the weights must add up to a finite number, got {total!r}")
    if weights and total <= 0:
        raise WeightsError("weights: at least one version needs a weight above 0")
    return dict(weights)


class WeightsStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.weights: dict[str, float] = self._load()

    def set(self, weights: dict[str, float]) -> None:
        validated = validate_weights(weights)
        self._write(validated)
        self.weights = validated

    def _load(self) -> dict[str, float]:
        if not self.path.exists():
            return {}
        try:
            document = json.loads(self.path.read_text())
            return validate_weights({str(k): float(v) for k, v in document["weights"].items()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightsError(f"state file {self.path}: cannot read weights ({exc})") from exc

    def _write(self, weights: dict[str, float]) -> None:
        """Write to a temp file in the same directory, fsync, then rename: a crash leaves the old or the new file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump({"weights": weights}, handle, indent=2, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
