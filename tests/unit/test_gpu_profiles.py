"""The GPU profiles' settings on a CPU machine: each validates, the rules that pair hardware, quantize and serve
backends give one-line errors, and what the profiles train is what their comments say."""

import shlex
from pathlib import Path

import pytest

from tasks.platform.config import PROFILES_DIR, available_profiles, load_profile
from tasks.platform.errors import BadInput
from tasks.serving import tensorrt_llm

GPU_PROFILES = [p for p in available_profiles() if load_profile(p).hardware.accelerator == "cuda"]


def test_the_three_gpu_profiles_exist_and_validate():
    assert {"qwen-7b-qlora-2xa10", "llama3-8b-h100-fp8", "qwen2-14b-int4-tp2"} <= set(GPU_PROFILES)


@pytest.mark.parametrize("profile_name", GPU_PROFILES)
def test_gpu_profile_header_shows_the_command_to_run_it(profile_name):
    header = [line for line in (PROFILES_DIR / f"{profile_name}.yaml").read_text().splitlines() if line.startswith("#")]
    assert any(f"llmops run --profile {profile_name}" in line for line in header)


def test_profile_rules_for_the_gpu_backends():
    with pytest.raises(BadInput, match="quantize.backend modelopt needs hardware.accelerator cuda"):
        load_profile("cpu-tiny", ["quantize.backend=modelopt"])
    with pytest.raises(BadInput, match="serve.backend llmapi needs hardware.accelerator cuda"):
        load_profile("cpu-tiny", ["serve.backend=llmapi", "quantize.backend=none"])
    with pytest.raises(BadInput, match="llmapi loads a Hugging Face checkpoint: quantize.backend modelopt or none, "):
        load_profile("qwen-7b-qlora-2xa10", ["quantize.backend=onnx-int8"])
    load_profile("qwen-7b-qlora-2xa10", ["quantize.backend=none"])  # the bf16 merged model: LLM loads it too
    with pytest.raises(BadInput, match="tensor_parallel_size x pipeline_parallel_size = 4 exceeds hardware.gpus 2"):
        load_profile("qwen2-14b-int4-tp2", ["engine.pipeline_parallel_size=2"])
    with pytest.raises(BadInput, match="engine.max_num_tokens 2048 is below train.cutoff_len 4096"):
        load_profile("llama3-8b-h100-fp8", ["engine.max_num_tokens=2048", "engine.enable_chunked_prefill=false"])
    load_profile("llama3-8b-h100-fp8", ["engine.max_num_tokens=2048", "engine.enable_chunked_prefill=true"])
    with pytest.raises(BadInput, match="quantize.modelopt.qformat"):
        load_profile("llama3-8b-h100-fp8", ["quantize.modelopt.qformat=int8_wo"])


def test_the_removed_engine_backends_are_refused_with_what_to_use_instead():
    with pytest.raises(BadInput, match="tensorrt-llm .* was removed.*use quantize.backend modelopt"):
        load_profile("llama3-8b-h100-fp8", ["quantize.backend=tensorrt-llm"])
    with pytest.raises(BadInput, match="tensorrtllm .* was removed: use serve.backend llmapi"):
        load_profile("llama3-8b-h100-fp8", ["serve.backend=tensorrtllm"])
    with pytest.raises(BadInput, match="serve.tensorrtllm was removed: .* from the engine section"):
        load_profile("llama3-8b-h100-fp8", ["serve.tensorrtllm.decoupled=true"])


def test_nvfp4_is_a_config_error_unless_the_gpu_is_blackwell():
    with pytest.raises(BadInput, match="nvfp4 needs a Blackwell GPU .* not H100: use fp8 or int4_awq"):
        load_profile("llama3-8b-h100-fp8", ["quantize.modelopt.qformat=nvfp4"])
    with pytest.raises(BadInput, match="nvfp4 needs a Blackwell GPU .* not None"):
        load_profile("llama3-8b-h100-fp8", ["quantize.modelopt.qformat=nvfp4", "hardware.gpu_type=null"])
    blackwell = load_profile("llama3-8b-h100-fp8", ["quantize.modelopt.qformat=nvfp4", "hardware.gpu_type=B200"])
    assert "--qformat nvfp4" in shlex.join(
        tensorrt_llm.quantize_command(blackwell.quantize.modelopt, Path("/m"), Path("/c"), Path("/o"))
    )


def test_qlora_config_for_two_gpus_launches_torchrun_with_4bit_base():
    from tasks.train import llamafactory_config
    from tasks.training.launch import launch_env

    profile = load_profile("qwen-7b-qlora-2xa10")
    config = llamafactory_config(profile.train, Path("/m"), Path("/d"), Path("/o"), None)
    assert config["quantization_bit"] == 4 and config["quantization_method"] == "bnb"
    assert config["lora_target"] == "q_proj,v_proj" and config["lora_rank"] == 8 and config["lora_alpha"] == 32
    assert (
        config["bf16"] is True and not config.get("fp16") and config["include_num_input_tokens_seen"] == "non_padding"
    )
    env = launch_env(profile.hardware)
    assert env["FORCE_TORCHRUN"] == "1" and env["NPROC_PER_NODE"] == "2"


def test_gpu_profiles_name_models_that_exist_with_the_modules_they_target():
    sources = {name: load_profile(name) for name in ("qwen-7b-qlora-2xa10", "qwen2-14b-int4-tp2")}
    assert sources["qwen-7b-qlora-2xa10"].base_model.source == "Qwen/Qwen2.5-7B-Instruct"
    assert sources["qwen2-14b-int4-tp2"].base_model.source == "Qwen/Qwen2.5-14B-Instruct"
    for profile in sources.values():  # Qwen2 architecture: separate projections, no remote code
        assert set(profile.train.lora_target.split(",")) <= {"q_proj", "k_proj", "v_proj", "o_proj", "all"}


def test_int4_awq_takes_only_the_group_sizes_tensorrt_llm_runs_and_that_divide_every_layer(tmp_path):
    """TensorRT-LLM's INT4-AWQ kernels run group size 64 or 128 only, and each layer's input width must be a multiple
    of it: a profile that asks for another one is refused when it loads, not at build_engine's first GEMM."""
    import json

    from tasks.quantize import require_awq_groups

    gpu_tiny = ["hardware.accelerator=cuda", "hardware.gpus=1", "quantize.backend=modelopt"]
    awq = [*gpu_tiny, "quantize.modelopt.qformat=int4_awq"]
    with pytest.raises(BadInput, match=r"^profile cpu-tiny: quantize\.modelopt\.awq_block_size: 16: .*64 or 128 only"):
        load_profile("cpu-tiny", [*awq, "quantize.modelopt.awq_block_size=16"])
    # the tiny base is 64 wide with an MLP of 128: 128 does not divide 64
    with pytest.raises(BadInput, match=r"awq_block_size 128 does not divide hidden_size 64 of base_model\.tiny"):
        load_profile("cpu-tiny", awq)
    load_profile("cpu-tiny", [*awq, "quantize.modelopt.awq_block_size=64"])
    load_profile("cpu-tiny", gpu_tiny)  # fp8: no groups to divide

    # A hub model's widths are known once it is merged: the quantize stage checks them before calibrating.
    qwen14b = load_profile("qwen2-14b-int4-tp2")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 5120, "intermediate_size": 13824}))
    require_awq_groups(qwen14b, tmp_path)  # 2560 and 6912 per GPU: multiples of 128
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 5120, "intermediate_size": 13760}))
    with pytest.raises(BadInput, match=r"does not divide intermediate_size 13760, intermediate_size / 2 GPUs 6880 of"):
        require_awq_groups(qwen14b, tmp_path)


@pytest.mark.parametrize("profile_name", GPU_PROFILES)
def test_gpu_profiles_compute_in_bf16_end_to_end(profile_name):
    """Every shipped GPU is Ampere or newer and has bf16, the dtype Qwen2.5 and Llama 3 were trained in; fp16
    overflows on Qwen2 (QwenLM/Qwen3#761, #868). Training, evaluate/merge, calibration and the served checkpoint
    all compute in it."""
    profile = load_profile(profile_name)
    assert profile.train.bf16 and not profile.train.fp16
    assert profile.hardware.compute_dtype == "bfloat16"
    if profile.quantize.backend == "modelopt":
        assert profile.quantize.modelopt.dtype == "bfloat16"
    if profile.serve.backend == "vllm":
        assert profile.serve.vllm.dtype == "bfloat16"


@pytest.mark.parametrize("profile_name", GPU_PROFILES)
def test_gpu_profiles_benchmark_with_aiperf_while_genai_perf_stays_the_cpu_default(profile_name):
    """NVIDIA's NIM and Dynamo benchmarking guides use AIPerf and genai-perf is frozen: the GPU profiles measure with it
    (Triton's HTTP stream, goodput under the TTFT/ITL objectives); genai-perf stays available and cpu-tiny's default."""
    profile = load_profile(profile_name)
    assert profile.bench.tool == "aiperf" and profile.bench.profile_runs >= 3
    assert "time_to_first_token" in profile.goodput_objectives()
    assert load_profile("cpu-tiny").bench.tool == "genai-perf"
    assert load_profile(profile_name, ["bench.tool=genai-perf"]).bench.tool == "genai-perf"


def test_an_attention_the_pinned_transformers_breaks_is_refused_before_anything_runs(tmp_path):
    """Issue 64: FlashAttention-2 under transformers 5.6.0 crashes at the first forward pass on Llama and Qwen2
    (huggingface/transformers#45588); three GPU profiles asked for it. The training stack's transformers is the train
    extra's pin, and a profile asking for an attention it is known to break is refused naming why."""
    import tomllib

    import yaml

    from tasks.platform.config.training import BROKEN_ATTENTION, TRAIN_TRANSFORMERS

    extras = tomllib.loads((PROFILES_DIR.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"transformers=={TRAIN_TRANSFORMERS}" in extras["train"]
    assert (TRAIN_TRANSFORMERS, "fa2") in BROKEN_ATTENTION
    values = yaml.safe_load((PROFILES_DIR / "qwen-7b-vllm-h100.yaml").read_text())
    assert values["train"]["extra_args"]["flash_attn"] == "sdpa"
    values["train"]["extra_args"]["flash_attn"] = "fa2"
    path = tmp_path / "fa2.yaml"
    path.write_text(yaml.safe_dump(values))
    with pytest.raises(BadInput, match=r"train: extra_args.flash_attn fa2: transformers 5.6.0 .*/transformers#45588"):
        load_profile(str(path))
