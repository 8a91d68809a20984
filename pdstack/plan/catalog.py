"""The hardware catalog: GPUs and instance types, loaded from data with the source of every figure."""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Gpu(_Entry):
    memory_gb: float = Field(gt=0)
    memory_bandwidth_tbps: float = Field(gt=0, description="HBM/GDDR bandwidth, TB/s")
    bf16_dense_tflops: float = Field(gt=0)
    nvlink_domain: int = Field(ge=1, description="GPUs joined by one NVLink/NVSwitch fabric")
    source: str


class InstanceType(_Entry):
    provider: Literal["aws", "local"]
    gpu: str | None
    gpu_count: int = Field(ge=0)
    vcpu: int = Field(gt=0)
    memory_gib: float = Field(gt=0)
    network_gbps: float = Field(gt=0)
    efa: bool
    source: str

    @property
    def has_gpu(self) -> bool:
        return self.gpu_count > 0


class Catalog(_Entry):
    sources: dict[str, str]
    gpus: dict[str, Gpu]
    instances: dict[str, InstanceType]

    @model_validator(mode="after")
    def _references_resolve(self) -> Catalog:
        for name, gpu in self.gpus.items():
            if gpu.source not in self.sources:
                raise ValueError(f"gpu {name}: unknown source {gpu.source!r}")
        for name, inst in self.instances.items():
            if inst.source not in self.sources:
                raise ValueError(f"instance {name}: unknown source {inst.source!r}")
            if (inst.gpu is None) != (inst.gpu_count == 0):
                raise ValueError(f"instance {name}: gpu and gpu_count disagree")
            if inst.gpu is not None and inst.gpu not in self.gpus:
                raise ValueError(f"instance {name}: unknown gpu {inst.gpu!r}")
        return self

    def instance(self, name: str) -> InstanceType | None:
        return self.instances.get(name)

    def gpu_of(self, instance_name: str) -> Gpu | None:
        inst = self.instances.get(instance_name)
        return self.gpus[inst.gpu] if inst is not None and inst.gpu is not None else None


@cache
def load_catalog() -> Catalog:
    text = files("pdstack").joinpath("data/catalog.yaml").read_text(encoding="utf-8")
    return Catalog.model_validate(yaml.safe_load(text))
