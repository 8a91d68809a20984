"""vLLM stack settings: the examples run vLLM and pass; each bad setting is refused naming its full field path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdstack.model import Engine
from pdstack.stacks.files import load_stack_file
from pdstack.stacks.validate import validate
from tests.support import STACKS
from tests.support.stackedit import edit, problems_of

DIGEST = "sha256:" + "0123456789abcdef" * 4


def vllm(change: dict[str, Any]) -> Any:
    """An edit of the control stack's serving.vllm block."""
    return lambda c: c["pdstack:serving"]["vllm"].update(change)


def role(side: str, change: dict[str, Any]) -> Any:
    return lambda c: c["pdstack:serving"]["vllm"][side].update(change)


def test_examples_run_vllm_in_the_cloud_and_pdserve_locally() -> None:
    report = validate([STACKS])
    assert report.problems == []
    engines = {s.stack_name: s.config.serving.engine for s in report.stacks if s.config.serving is not None}
    assert engines == {
        "dev-control": Engine.VLLM,
        "staging-control": Engine.VLLM,
        "prod-control": Engine.VLLM,
        "local-control": Engine.PDSERVE,
    }
    prod = load_stack_file(STACKS / "Pulumi.prod-control.yaml").config.serving
    assert prod is not None and prod.vllm is not None
    assert prod.vllm.prefill.tensor_parallel_size == 8 and prod.vllm.decode.tensor_parallel_size == 8


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            vllm({"image": "vllm/vllm-openai:v0.32.0"}),
            "pdstack:serving.vllm.image: 'vllm/vllm-openai:v0.32.0' is not pinned: add @sha256:<digest> "
            "(a tag alone can move)",
        ),
        (
            vllm({"image": f"vllm/vllm-openai:v0.32.0@sha256:{'0' * 63}"}),
            "pdstack:serving.vllm.image: 'vllm/vllm-openai:v0.32.0@sha256:" + "0" * 63 + "' is not an image reference "
            "of the form name[:tag]@sha256:<64 lower-case hex>",
        ),
        (
            vllm({"image": f"vllm/vllm-openai:v0.31.1@{DIGEST}"}),
            "pdstack:serving.vllm: serving.vllm.image is tagged 'v0.31.1' but serving.vllm.version is '0.32.0': the "
            "release records the version, so they must agree",
        ),
        (vllm({"version": "latest"}), "pdstack:serving.vllm.version: String should match pattern"),
        (vllm({"dtype": "auto"}), "pdstack:serving.vllm.dtype: Input should be 'bfloat16', 'float16' or 'float32'"),
        (
            vllm({"gpu_memory_utilization": 1.5}),
            "pdstack:serving.vllm.gpu_memory_utilization: Input should be less than or equal to 1",
        ),
        (vllm({"kv_connector": "mooncake"}), "pdstack:serving.vllm.kv_connector: Input should be 'pdstack' or 'nixl'"),
        (
            vllm({"extra_args": {"speculative-config": "{}"}}),
            "pdstack:serving.vllm.extra_args: serving.vllm.extra_args.speculative-config: --speculative-config is not "
            "an allowed extra vLLM flag (allowed: enable-prefix-caching,",
        ),
        (
            vllm({"extra_args": {"tensor-parallel-size": 4}}),
            "pdstack:serving.vllm.extra_args: serving.vllm.extra_args.tensor-parallel-size: pdstack sets "
            "--tensor-parallel-size itself, from serving.vllm.<prefill|decode>.tensor_parallel_size",
        ),
        (
            vllm({"extra_args": {"max-num-seqs": "256"}}),
            "pdstack:serving.vllm.extra_args: serving.vllm.extra_args.max-num-seqs: --max-num-seqs takes a int value, "
            "got str '256'",
        ),
        (
            role("decode", {"tensor_parallel_size": 0}),
            "pdstack:serving.vllm.decode.tensor_parallel_size: Input should be greater than or equal to 1",
        ),
        (
            role("decode", {"pipeline_parallel_size": 2}),
            "pdstack:serving.vllm.decode.pipeline_parallel_size: unknown key",
        ),
        (
            lambda c: c["pdstack:serving"].update(engine="sglang"),
            "pdstack:serving.engine: Input should be 'pdserve' or 'vllm'",
        ),
        (
            lambda c: c["pdstack:serving"].pop("vllm"),
            "pdstack:serving: serving.vllm is required when serving.engine is vllm (image, version, max_model_len)",
        ),
        (
            lambda c: c["pdstack:serving"].update(engine="pdserve"),
            "pdstack:serving: serving.vllm is set but serving.engine is pdserve: set engine: vllm, or remove it",
        ),
    ],
)
def test_a_malformed_setting_is_refused_naming_its_field(stacks_dir: Path, change: Any, expected: str) -> None:
    edit(stacks_dir / "Pulumi.staging-control.yaml", change)
    found = problems_of(stacks_dir)
    assert len(found) == 1, found
    assert found[0].startswith(f"{stacks_dir}/Pulumi.staging-control.yaml: {expected}"), found[0]


def _only(stacks_dir: Path, env: str, change: Any) -> list[str]:
    edit(stacks_dir / f"Pulumi.{env}-control.yaml", change)
    prefix = f"{stacks_dir}/Pulumi.{env}-control.yaml: "
    return [p.removeprefix(prefix) for p in problems_of(stacks_dir)]


def test_tensor_parallelism_beyond_one_node_is_refused(stacks_dir: Path) -> None:
    assert _only(stacks_dir, "staging", role("prefill", {"tensor_parallel_size": 8, "data_parallel_size": 1})) == [
        "pdstack:serving.vllm.prefill.tensor_parallel_size: 8 exceeds the 4 GPUs of pool 'prefill' (g6e.12xlarge) "
        "of Pulumi.staging-prefill-us-east-1.yaml: tensor parallelism stays inside one node",
        "pdstack:serving.vllm.decode.tensor_parallel_size: 1 differs from prefill's tensor_parallel_size 8: "
        "PdstackConnector moves each TP rank's KV heads to the decode rank of the same index, so decode would refuse "
        "every KV prefill sends (use equal TP on both sides, with data_parallel_size to fill the nodes)",
    ]


def test_an_engine_that_leaves_gpus_idle_is_refused_with_the_data_parallel_size_that_fills_the_node(
    stacks_dir: Path,
) -> None:
    prefill_tp2 = role("prefill", {"tensor_parallel_size": 2, "data_parallel_size": 2})  # equal TP, fills its node
    edit(stacks_dir / "Pulumi.staging-control.yaml", prefill_tp2)
    assert _only(stacks_dir, "staging", role("decode", {"tensor_parallel_size": 2, "data_parallel_size": 1})) == [
        "pdstack:serving.vllm.decode.data_parallel_size: TP 2 x DP 1 uses 2 of the 4 GPUs of pool 'decode' "
        "(g6e.24xlarge) of Pulumi.staging-decode-us-west-2.yaml: pdstack runs one engine per node, so 2 would sit "
        "idle; data_parallel_size 2 fills it"
    ]


def test_data_parallelism_across_nodes_needs_pools_of_whole_engines(stacks_dir: Path) -> None:
    # TP 8 x DP 2 on 8-GPU p5e/p5en nodes: one engine spans 2 nodes; the pools' sizes (2/4/8 and 0/2/8) hold
    # whole engines, so this is valid.
    assert _only(stacks_dir, "prod", role("decode", {"data_parallel_size": 2})) == []
    edit(stacks_dir / "Pulumi.prod-control.yaml", role("decode", {"data_parallel_size": 3}))  # 3 nodes
    decode = f"{stacks_dir}/Pulumi.prod-decode-us-west-2.yaml"
    why = "is not a multiple of 3: one engine of serving.vllm.decode spans 3 {} nodes, so a pool holds whole engines"
    assert problems_of(stacks_dir) == [
        f"{decode}: pdstack:datacenter.pools[0].min_size: 2 {why.format('p5e.48xlarge')}",
        f"{decode}: pdstack:datacenter.pools[0].desired_size: 4 {why.format('p5e.48xlarge')}",
        f"{decode}: pdstack:datacenter.pools[0].max_size: 8 {why.format('p5e.48xlarge')}",
        f"{decode}: pdstack:datacenter.pools[1].desired_size: 2 {why.format('p5en.48xlarge')}",
        f"{decode}: pdstack:datacenter.pools[1].max_size: 8 {why.format('p5en.48xlarge')}",
    ]


def test_prefill_and_decode_must_agree_on_dtype_and_block_size(stacks_dir: Path) -> None:
    found = _only(stacks_dir, "dev", role("decode", {"dtype": "float16", "block_size": 32}))
    assert found == [
        "pdstack:serving.vllm.decode.dtype: prefill runs serving.vllm.dtype 'bfloat16' but decode "
        "serving.vllm.decode.dtype 'float16': the KV fingerprint covers dtype and block size, so decode would "
        "refuse every KV prefill sends",
        "pdstack:serving.vllm.decode.block_size: prefill runs serving.vllm.block_size 16 but decode "
        "serving.vllm.decode.block_size 32: the KV fingerprint covers dtype and block size, so decode would refuse "
        "every KV prefill sends",
    ]


def _hybrid_with_nixl_in_one_region(stacks_dir: Path) -> None:
    """Prod serving Qwen3-Next (3 in 4 layers Gated DeltaNet, MoE) through nixl, its decode moved beside prefill:
    the only way vLLM serves a hybrid model disaggregated (nixl supports the hybrid KV cache manager)."""

    def beside_prefill(c: dict[str, Any]) -> None:
        c["aws:region"] = "us-east-1"
        c["pdstack:datacenter"]["region"] = "us-east-1"

    edit(stacks_dir / "Pulumi.prod-decode-us-west-2.yaml", beside_prefill)
    edit(stacks_dir / "Pulumi.prod-control.yaml", lambda c: c["pdstack:serving"]["model"].update(name=QWEN3_NEXT))
    edit(stacks_dir / "Pulumi.prod-control.yaml", vllm({"kv_connector": "nixl"}))


QWEN3_NEXT = "qwen3-next-80b-a3b-instruct"


def test_the_pdstack_connector_refuses_a_model_that_needs_the_hybrid_kv_cache_manager(stacks_dir: Path) -> None:
    # vLLM 0.32 turns its hybrid KV cache manager off for a connector without SupportsHMA; Qwen3-Next's Gated
    # DeltaNet state and its attention KV then cannot share a KV cache group, and the engine fails at start-up.
    # Sliding-window layers only cost memory without that manager (promoted to full attention): not refused.
    assert _only(stacks_dir, "dev", lambda c: c["pdstack:serving"]["model"].update(name="mistral-7b-v0.1")) == []
    qwen = lambda c: c["pdstack:serving"]["model"].update(name=QWEN3_NEXT)  # noqa: E731
    assert _only(stacks_dir, "prod", qwen) == [
        "pdstack:serving.vllm.kv_connector: pdstack cannot serve Qwen3-Next-80B-A3B: 36 of its 48 layers are linear "
        "attention, whose per-request state only vLLM's hybrid KV cache manager holds beside the attention KV. "
        "PdstackConnector moves one full-attention KV cache group and does not subclass SupportsHMA, so vLLM "
        "disables that manager and the engine fails at start-up. nixl supports it, but only between EFA pools in one "
        "region; across regions serve a model without linear attention"
    ]


def test_a_hybrid_model_through_nixl_in_one_region_is_accepted(stacks_dir: Path) -> None:
    _hybrid_with_nixl_in_one_region(stacks_dir)
    assert problems_of(stacks_dir) == []


def test_a_hybrid_models_block_size_must_resolve_the_same_at_both_tensor_parallel_sizes(stacks_dir: Path) -> None:
    # Qwen3-Next, per GPU and layer, bf16. Attention page per token: 2 x max(1, 2 kv heads // TP) x 256 x 2 B =
    # 1024 B at TP 8, 2048 B at TP 1. Gated DeltaNet state: (3 x 8192 conv + 32 x 128 x 128) x 2 B / TP = 137,216 B
    # at TP 8, 1,097,728 B at TP 1. vLLM raises block 16 to 16 x ceil(state / (16 x page)): 16 x 9 = 144 at TP 8,
    # 16 x 34 = 544 at TP 1.
    _hybrid_with_nixl_in_one_region(stacks_dir)  # decode at TP 1 needs nixl (PdstackConnector needs equal TP)
    edit(stacks_dir / "Pulumi.prod-control.yaml", role("decode", {"tensor_parallel_size": 1, "data_parallel_size": 8}))
    assert _only(stacks_dir, "prod", vllm({"block_size": 16})) == [
        "pdstack:serving.vllm.block_size: 16 becomes 144 tokens on prefill (TP 8) but 544 on decode (TP 1): vLLM "
        "raises Qwen3-Next-80B-A3B's block size until an attention page holds a linear-attention state, and the KV "
        "fingerprint covers block size; set block_size to at least 544 on both"
    ]
    assert _only(stacks_dir, "prod", vllm({"block_size": 544})) == []


def test_the_pdstack_connector_needs_equal_tensor_parallelism(stacks_dir: Path) -> None:
    # Prefill TP 8 (each rank holds one of Llama-3.1-70B's 8 KV heads) to decode TP 4 x DP 2 (two heads a rank,
    # 35 GB of weights a GPU: it fits): the connector moves rank r's shard to decode rank r, so decode would refuse
    # every KV.
    assert _only(stacks_dir, "prod", role("decode", {"tensor_parallel_size": 4, "data_parallel_size": 2})) == [
        "pdstack:serving.vllm.decode.tensor_parallel_size: 4 differs from prefill's tensor_parallel_size 8: "
        "PdstackConnector moves each TP rank's KV heads to the decode rank of the same index, so decode would refuse "
        "every KV prefill sends (use equal TP on both sides, with data_parallel_size to fill the nodes)"
    ]


def test_the_pdstack_connectors_kv_ports_stay_clear_of_the_other_ports(stacks_dir: Path) -> None:
    # Staging prefill TP 1 x DP 4 serves KV on 8400..8403 (serving.ports.kv + DP index x TP + rank).
    assert _only(stacks_dir, "staging", lambda c: c["pdstack:serving"].update(ports={"kv": 8298})) == [
        "pdstack:serving.ports.kv: 8298: a prefill of TP 1 x DP 4 serves KV on one port per worker, 8298..8301, "
        "which overlaps serving.ports.decode 8300"
    ]
    assert _only(stacks_dir, "staging", lambda c: c["pdstack:serving"].update(ports={"kv": 65534})) == [
        "pdstack:serving.ports.kv: 65534: a prefill of TP 1 x DP 4 serves KV on one port per worker, 65534..65537, "
        "which ends above 65535"
    ]


def test_block_size_must_suit_the_attention_kernels(stacks_dir: Path) -> None:
    assert _only(stacks_dir, "dev", vllm({"block_size": 24})) == [
        "pdstack:serving.vllm.block_size: 24 is not a multiple of 16, which vLLM's CUDA attention kernels need "
        f"(pool '{pool}' (g6e.{size}) of Pulumi.dev-{pool}-{region}.yaml)"
        for pool, size, region in (("decode", "2xlarge", "us-east-2"), ("prefill", "xlarge", "us-east-1"))
    ]


def test_nixl_needs_efa_at_both_ends_and_one_region(stacks_dir: Path) -> None:
    found = _only(stacks_dir, "staging", vllm({"kv_connector": "nixl"}))
    assert found == [
        "pdstack:serving.vllm.kv_connector: nixl needs both ends in one region, but pool 'prefill' (g6e.12xlarge) of "
        "Pulumi.staging-prefill-us-east-1.yaml is in us-east-1 and pool 'decode' (g6e.24xlarge) of "
        "Pulumi.staging-decode-us-west-2.yaml in us-west-2: use kv_connector pdstack across regions"
    ]


def test_nixl_needs_efa(stacks_dir: Path) -> None:
    no_efa = _only(stacks_dir, "dev", vllm({"kv_connector": "nixl"}))
    assert (
        "pdstack:serving.vllm.kv_connector: nixl moves KV over RDMA, and pool 'prefill' (g6e.xlarge) of "
        "Pulumi.dev-prefill-us-east-1.yaml has no EFA: use kv_connector pdstack" in no_efa
    )


def test_nixl_within_one_region_with_efa_is_accepted(stacks_dir: Path) -> None:
    def same_region(c: dict[str, Any]) -> None:
        c["aws:region"] = "us-east-1"
        c["pdstack:datacenter"]["region"] = "us-east-1"

    edit(stacks_dir / "Pulumi.staging-decode-us-west-2.yaml", same_region)
    edit(stacks_dir / "Pulumi.staging-control.yaml", vllm({"kv_connector": "nixl"}))
    assert problems_of(stacks_dir) == []


def test_the_context_holds_what_the_gateway_admits(stacks_dir: Path) -> None:
    assert _only(stacks_dir, "dev", vllm({"max_model_len": 16384})) == [
        "pdstack:serving.vllm.max_model_len: 16384 is shorter than serving.limits.max_prompt_tokens 16384 + "
        "max_output_tokens 2048 = 18432: vLLM would refuse requests the gateway admits"
    ]


def test_the_context_fits_the_checkpoint(stacks_dir: Path) -> None:
    # 163840 x 131,072 B = 21.5 GB of KV still fits an L40S beside the weights: only the checkpoint refuses it.
    assert _only(stacks_dir, "staging", vllm({"max_model_len": 163840})) == [
        "pdstack:serving.vllm.max_model_len: 163840 exceeds Llama-3.1-8B's max_position_embeddings 131072"
    ]


def test_expert_settings_follow_vllms_rules(stacks_dir: Path) -> None:
    assert _only(stacks_dir, "prod", role("decode", {"enable_eplb": True, "enable_expert_parallel": False})) == [
        "pdstack:serving.vllm.decode.enable_eplb: needs enable_expert_parallel: true (EPLB moves whole experts)"
    ]


def test_redundant_experts_need_eplb(stacks_dir: Path) -> None:
    assert _only(stacks_dir, "dev", role("prefill", {"num_redundant_experts": 4})) == [
        "pdstack:serving.vllm.prefill.num_redundant_experts: 4 redundant experts need enable_eplb: true (EPLB places "
        "them)"
    ]


def test_expert_parallelism_on_a_dense_model_is_refused(stacks_dir: Path) -> None:
    assert _only(stacks_dir, "staging", role("decode", {"enable_expert_parallel": True})) == [
        "pdstack:serving.vllm.decode.enable_expert_parallel: Llama-3.1-8B has no routed experts to place (decode)"
    ]


def test_weights_that_do_not_fit_name_the_setting(stacks_dir: Path) -> None:
    # Llama-3.1-8B: 8.03 B params x 2 B = 16.06 GB on one L40S; 0.3 x 48 GB = 14.4 GB.
    found = _only(stacks_dir, "staging", vllm({"gpu_memory_utilization": 0.3}))
    assert found == [
        f"pdstack:serving.vllm.{side}.tensor_parallel_size: weights need 16.1 GB per L40S at TP 1 x DP 4, more than "
        "gpu_memory_utilization 0.3 x 48 GB = 14.4 GB: split the weights over more GPUs "
        f"({side}, pool '{side}' (g6e.{size}) of Pulumi.staging-{side}-{region}.yaml)"
        for side, size, region in (("prefill", "12xlarge", "us-east-1"), ("decode", "24xlarge", "us-west-2"))
    ]


def test_a_context_whose_kv_does_not_fit_names_max_model_len(stacks_dir: Path) -> None:
    # 0.38 x 48 GB = 18.24 GB less 16.06 GB of weights leaves 2.18 GB; one 20480-token sequence needs
    # 20480 x 131,072 B = 2.68 GB.
    found = _only(stacks_dir, "staging", vllm({"gpu_memory_utilization": 0.38}))
    assert len(found) == 2
    assert found[0].startswith(
        "pdstack:serving.vllm.max_model_len: one sequence of 20480 tokens needs 2.68 GB of KV per GPU, but "
        "gpu_memory_utilization 0.38 x 48 GB = 18.2 GB less 16.1 GB of weights leaves 2.18 GB (prefill,"
    )


def test_a_moe_model_too_big_for_its_engine_and_an_mla_block_size(stacks_dir: Path) -> None:
    # DeepSeek-V3 (FP8 weights) at prefill TP 8 x EP on one p5: (17.12 - 1.03) / 8 + 1.03 = 3.04 GB of shared
    # weights + 653.9 GB of routed experts / 8 = 81.7 GB: 84.8 GB per H100 against 0.92 x 80 = 73.6 GB.
    # Decode (TP 8 x EP 8 with 32 redundant experts: 36 per H200) fits. Its MLA kernels need blocks of 64, which 16
    # is not.
    edit(stacks_dir / "Pulumi.prod-control.yaml", role("prefill", {"enable_expert_parallel": True}))
    decode_ep = {"enable_expert_parallel": True, "enable_eplb": True, "num_redundant_experts": 32}
    edit(stacks_dir / "Pulumi.prod-control.yaml", role("decode", decode_ep))
    found = _only(stacks_dir, "prod", lambda c: c["pdstack:serving"]["model"].update(name="deepseek-v3"))
    assert (
        "pdstack:serving.vllm.prefill.data_parallel_size: weights need 84.8 GB per H100 at TP 8 x DP 1 with EP, "
        "more than gpu_memory_utilization 0.92 x 80 GB = 73.6 GB: spread the experts over more GPUs (prefill, "
        "pool 'prefill-h100' (p5.48xlarge) of Pulumi.prod-prefill-us-east-1.yaml)"
    ) in found
    assert (
        "pdstack:serving.vllm.block_size: 16 is not a multiple of 64, which vLLM's MLA kernels (FlashMLA) need "
        "(pool 'prefill-h100' (p5.48xlarge) of Pulumi.prod-prefill-us-east-1.yaml)"
    ) in found
    assert not any("decode" in p and "weights need" in p for p in found)
