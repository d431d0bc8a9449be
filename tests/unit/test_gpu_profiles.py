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
    assert config["fp16"] is True and config["include_num_input_tokens_seen"] == "non_padding"
    env = launch_env(profile.hardware)
    assert env["FORCE_TORCHRUN"] == "1" and env["NPROC_PER_NODE"] == "2"


def test_gpu_profiles_name_models_that_exist_with_the_modules_they_target():
    sources = {name: load_profile(name) for name in ("qwen-7b-qlora-2xa10", "qwen2-14b-int4-tp2")}
    assert sources["qwen-7b-qlora-2xa10"].base_model.source == "Qwen/Qwen2.5-7B-Instruct"
    assert sources["qwen2-14b-int4-tp2"].base_model.source == "Qwen/Qwen2.5-14B-Instruct"
    for profile in sources.values():  # Qwen2 architecture: separate projections, no remote code
        assert set(profile.train.lora_target.split(",")) <= {"q_proj", "k_proj", "v_proj", "o_proj", "all"}
