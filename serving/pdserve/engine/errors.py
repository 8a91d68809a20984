"""Exceptions raised by the engine. Every message names the thing that is wrong."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class CheckpointError(EngineError):
    """The checkpoint directory is unusable (missing or malformed file)."""


class UnsupportedModelError(EngineError):
    """The config asks for a model type or feature this engine does not implement."""


class UnsupportedRopeScalingError(UnsupportedModelError):
    """The config's rope_scaling / rope_parameters type is not implemented."""


class MissingTensorError(CheckpointError):
    """A tensor the architecture needs is not in any *.safetensors file of the checkpoint."""

    def __init__(self, name: str, directory: str) -> None:
        super().__init__(f"tensor {name!r} is missing from the checkpoint in {directory}")
        self.tensor_name = name


class TensorShapeError(CheckpointError):
    """A tensor exists but its shape does not match the config."""


class KVCacheError(EngineError):
    """A KV cache does not fit the engine or request it is used with."""
