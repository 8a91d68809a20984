"""The hardware catalog: the GPUs and instance types the issue names, with consistent, sourced figures."""

from __future__ import annotations

import pytest

from pdstack.plan.catalog import Catalog, load_catalog

REQUIRED_GPUS = {"A100-40GB", "A100-80GB", "H100", "H200", "H20", "L40S", "B200", "GB200"}
REQUIRED_TYPES = {
    "p4d.24xlarge",
    "p4de.24xlarge",
    "p5.48xlarge",
    "p5e.48xlarge",
    "p5en.48xlarge",
    "p6-b200.48xlarge",
    *(
        f"g6e.{size}"
        for size in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "12xlarge", "16xlarge", "24xlarge", "48xlarge")
    ),
}


def test_catalog_holds_the_required_entries() -> None:
    catalog = load_catalog()
    assert set(catalog.gpus) >= REQUIRED_GPUS
    assert set(catalog.instances) >= REQUIRED_TYPES
    assert any(not i.has_gpu and i.provider == "aws" for i in catalog.instances.values()), "CPU types for control"


@pytest.mark.parametrize(
    ("instance", "gpu", "count", "total_gb"),
    [
        ("p4d.24xlarge", "A100-40GB", 8, 320),
        ("p4de.24xlarge", "A100-80GB", 8, 640),
        ("p5.48xlarge", "H100", 8, 640),
        ("p5e.48xlarge", "H200", 8, 1128),
        ("p6-b200.48xlarge", "B200", 8, 1440),
        ("g6e.48xlarge", "L40S", 8, 384),
    ],
)
def test_instance_gpu_memory_matches_aws_figures(instance: str, gpu: str, count: int, total_gb: int) -> None:
    catalog = load_catalog()
    inst = catalog.instances[instance]
    assert (inst.gpu, inst.gpu_count) == (gpu, count)
    assert catalog.gpus[gpu].memory_gb * count == total_gb


def test_every_figure_names_a_source() -> None:
    catalog = load_catalog()
    for entry in [*catalog.gpus.values(), *catalog.instances.values()]:
        assert catalog.sources[entry.source]


def test_broken_catalog_reference_is_refused() -> None:
    data = load_catalog().model_dump()
    data["instances"]["p5.48xlarge"]["gpu"] = "H999"
    with pytest.raises(ValueError, match=r"instance p5\.48xlarge: unknown gpu 'H999'"):
        Catalog.model_validate(data)
