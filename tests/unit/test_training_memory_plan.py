"""The memory plans of a profile before anything runs (tasks/training/memory_plan.py): the 72B profile's per-GPU
training memory, term by term, against published references, and its canary's serving memory; a layout that
cannot fit is refused naming the term that overflows."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.platform.config import load_profile
from tasks.platform.errors import BadInput
from tasks.serving.memory_plan import GIB, footprint
from tasks.training.memory_plan import Shape, memory_plan, served_footprint, training_plan

PROFILE = "qwen2.5-72b-lora-2x8xh100"
LLMOPS = Path(sys.executable).parent / "llmops"


def terms(plan) -> dict[str, float]:
    return {t.name: t.bytes for t in plan.terms}


def test_the_72b_shape_counts_what_its_model_card_says():
    shape = Shape(load_profile(PROFILE).base_model.architecture)
    assert shape.total == 72_705_384_448  # Qwen2.5-72B-Instruct's card: 72.7B parameters, 70.0B non-embedding
    assert shape.embeddings == 2 * 152064 * 8192  # untied input and output embeddings
    assert shape.lora(16, "all") == 80 * 16 * (2 * 16384 + 2 * 9216 + 3 * 37760)  # r x (in + out), 7 modules
    with pytest.raises(BadInput, match="train.lora_target q_proj,c_attn: c_attn is not a linear module"):
        shape.lora(8, "q_proj,c_attn")


def test_the_72b_profile_trains_within_an_h100_per_gpu():
    plan = training_plan(load_profile(PROFILE))
    got = terms(plan)
    assert got["weights"] == pytest.approx(72_705_384_448 * 2 / 16)  # bf16 weights, 1/16 each under ZeRO-3
    assert got["lora states"] == pytest.approx(210_534_400 * 18 / 16)  # all partitioned under ZeRO-3
    assert got["gathered"] == pytest.approx((152064 * 8192 + 0.9 * 8192**2) * 2)  # the embedding is the largest
    assert got["activations"] == pytest.approx(80 * 8192 * 8192 * 2 + 2 * 8192 * (6 * 8192 + 2 * 1024 + 4 * 29568) * 2)
    assert got["logits"] == pytest.approx(8192 * 152064 * 10)
    assert plan.gpu_gib == 79.65 and plan.total_gib == pytest.approx(39.5, abs=0.05)
    assert plan.total_gib < plan.usable_gib


def test_one_node_fits_too_the_partitioned_states_are_what_it_adds():
    two, one = (training_plan(load_profile(PROFILE, o)) for o in ([], ["hardware.nodes=1"]))
    added = {name: terms(one)[name] - terms(two)[name] for name in terms(one)}
    assert {name for name, more in added.items() if more} == {"weights", "lora states"}
    assert added["weights"] == pytest.approx(terms(two)["weights"])  # 1/8 instead of 1/16
    assert one.total_gib - two.total_gib == pytest.approx(sum(added.values()) / GIB)
    assert one.total_gib == pytest.approx(48.2, abs=0.05)
    assert one.total_gib < one.usable_gib


def test_the_references_agree_with_the_plan():
    """LlamaFactory's hardware table (README.md:484-492 at v0.9.5): LoRA in 16 bits needs `2x` GB for x billion
    parameters. DeepSpeed 0.19.8's `estimate_zero3_model_states_mem_needs_all_cold(total_params=210534400,
    largest_layer_params=1245708288, num_gpus_per_node=8, num_nodes=2)` (deepspeed/runtime/zero/stage3.py), run on
    the LoRA parameters here on CPU: 4.86 GiB per GPU without offload, 4.64 of them 4 B x the largest layer (a
    16-bit weight and gradient; the plan counts 2 B plus the prefetch bucket, the frozen embedding having no
    gradient: `gathered`) and 0.22 = 18 B x 210.5M / 16 GPUs, the plan's `lora states`."""
    profile = load_profile(PROFILE)
    shape, plan = Shape(profile.base_model.architecture), training_plan(profile)
    world = profile.hardware.world_size
    assert terms(plan)["weights"] * world / 1e9 == pytest.approx(2 * shape.total / 1e9)  # 2x GB, whole model
    assert terms(plan)["lora states"] / GIB == pytest.approx(4.86 - 4.64, abs=0.005)
    assert 4 * shape.largest_module / GIB == pytest.approx(4.64, abs=0.005)


def test_the_canary_plan_is_the_serving_plans_arithmetic_on_the_planned_checkpoint(tmp_path):
    profile = load_profile(PROFILE)
    planned = served_footprint(profile)
    # The serving plan reads a checkpoint's files; one with the planned config.json and weight bytes must read the same.
    arch = profile.base_model.architecture.model_dump() | {"torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(arch))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"kv_cache_quant_algo": "FP8"}}))
    with open(tmp_path / "model.safetensors", "wb") as weights:
        weights.truncate(planned.weights_bytes * 8)  # sparse: a size, no data
    read = footprint(tmp_path, 8, 1, profile.engine.max_num_tokens, profile.engine.max_batch_size)
    assert read == planned
    assert planned.weights_bytes / 1e9 == pytest.approx(9.39, abs=0.01)  # 75.1 GB of FP8 checkpoint over 8 GPUs
    canary = next(p for p in memory_plan(profile) if p.what.startswith("canary"))
    assert canary.total_gib == pytest.approx(canary.usable_gib, abs=0.01)  # the KV caches take what is left


@pytest.mark.parametrize(
    "overrides,term",
    [
        (["hardware.nodes=1", "hardware.gpus=2", "engine.tensor_parallel_size=2"], "weights overflow (67.7 GiB"),
        (["train.cutoff_len=32768"], "activations overflow (60.7 GiB"),
    ],
)
def test_a_layout_that_cannot_fit_is_refused_naming_the_term(overrides, term):
    with pytest.raises(BadInput) as refused:
        memory_plan(load_profile(PROFILE, overrides))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"profile {PROFILE}: training needs ") and term in message


def test_profiles_show_prints_the_plan_and_validate_refuses_what_cannot_fit():
    shown = subprocess.run([str(LLMOPS), "profiles", "show", PROFILE], capture_output=True, text=True, check=True)
    assert "# train on 2 x 8 H100: 39.5 GiB per GPU of 75.7 usable" in shown.stdout
    assert "#   weights         8.46 GiB  72.7B parameters, 2 B each, / 16 (ZeRO-3)" in shown.stdout
    assert "# canary on tensor parallel 8 x pipeline parallel 1 H100" in shown.stdout
    refused = subprocess.run(
        [str(LLMOPS), "profiles", "validate", PROFILE, "--set", "train.cutoff_len=32768"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith("llmops: error: profile ")
    assert "activations overflow" in refused.stderr


def test_profiles_without_a_shape_or_a_gpu_have_no_plan():
    assert memory_plan(load_profile("cpu-tiny")) == []
    assert memory_plan(load_profile("qwen-7b-qlora-2xa10")) == []  # a GPU profile that states no architecture


def test_the_seven_b_profile_fits_an_h100_at_its_batch_and_not_at_twice_it():
    """8 samples of 4096 tokens over Qwen's 152k vocabulary: 46 GiB of logits alone; the profile trains 4 x 8."""
    profile = load_profile("qwen-7b-vllm-h100")
    assert profile.train.per_device_train_batch_size * profile.train.gradient_accumulation_steps == 32
    assert all(plan.total_gib <= plan.usable_gib for plan in memory_plan(profile))
    doubled = load_profile("qwen-7b-vllm-h100", ["train.per_device_train_batch_size=8"])
    with pytest.raises(BadInput, match=r"80.4 GiB per GPU .* logits overflow \(46.4 GiB: 8 x 4096 tokens x 152064"):
        memory_plan(doubled)


DPO = ["train.stage=dpo", "data.eval_source=null"]


@pytest.mark.parametrize(
    ("overrides", "sequences", "reference"),
    [
        ([], 4, 0),
        (DPO, 8, 8),  # chosen and rejected in one batch; the reference model reads both without gradients
        ([*DPO, "train.pref_loss=simpo"], 8, 0),  # no reference model
        (["train.stage=kto", "data.eval_source=null"], 4, 8),  # the targets hold the graph; KL and reference do not
    ],
)
def test_a_preference_stage_plans_the_sequences_its_trainer_puts_through_the_model(overrides, sequences, reference):
    """Issue 78: qwen-7b-vllm-h100 (4 x 4096 tokens per device) planned as LlamaFactory 0.9.5's DPO and KTO trainers
    batch (tasks/training/memory_plan.py, sequences_per_step, with the lines it read)."""
    got = terms(training_plan(load_profile("qwen-7b-vllm-h100", overrides)))
    assert got["logits"] == pytest.approx(sequences * 4096 * 152064 * 10)
    assert got.get("reference logits", 0) == pytest.approx(reference * 4096 * 152064 * 10)


def test_the_h100_profiles_dpo_variant_is_refused_at_its_sft_batch_and_fits_at_half_of_it():
    """DPO on qwen-7b-vllm-h100 as shipped (4 x 8) would put 8 sequences of 4096 tokens through the model with
    gradients and 8 more through the reference: refused before anything runs, naming the logits; 2 x 16 (the same
    global batch) fits. docs/user-guide.md gives that variant."""
    with pytest.raises(
        BadInput, match=r"training needs 126\.8 GiB per GPU .* logits overflow .*dpo: chosen and rejected"
    ):
        memory_plan(load_profile("qwen-7b-vllm-h100", DPO))
    half = ["train.per_device_train_batch_size=2", "train.gradient_accumulation_steps=16"]
    plan = training_plan(load_profile("qwen-7b-vllm-h100", [*DPO, *half]))
    assert plan.total_gib == pytest.approx(71.3, abs=0.05) and plan.total_gib < plan.usable_gib
