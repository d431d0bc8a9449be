"""The TensorRT-LLM GPU path (quantize modelopt -> build_engine check -> serve llmapi) on a CPU machine: what it
renders (the ModelOpt and check commands, the LLM API arguments, the llmapi Triton model) matches the reviewed
golden files, the check's cache key and preconditions, and that what is registered and served is the checkpoint.

Regenerate after a change:  LLMOPS_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_gpu_path.py (the run that
rewrites fails; review the diff, then run again)
"""

import json
import os
import shlex
from pathlib import Path

import pytest

from tasks.build_engine import check_cache_key, require_gpu_for, require_servable
from tasks.platform.config import available_profiles, load_profile
from tasks.platform.errors import BadInput
from tasks.serving import tensorrt_llm
from tasks.serving.llm_api import llm_args
from tasks.serving.model_config import serving_model
from tasks.serving.repository import config_parameters, render_model
from tests.goldens import matches_golden

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
LLMAPI_PROFILES = [p for p in available_profiles() if load_profile(p).serve.backend == "llmapi"]  # vLLM: test_vllm_cuda


def rendered_commands(profile_name: str) -> str:
    profile = load_profile(profile_name)
    quantize = tensorrt_llm.quantize_command(
        profile.quantize.modelopt,
        Path("/work/merged"),
        Path("/work/calibration.jsonl"),
        Path("/work/checkpoint"),
        python="python",
    )
    check = tensorrt_llm.check_command(
        Path("/work/checkpoint"),
        Path("/work/llm_args.json"),
        Path("/work/q.jsonl"),
        Path("/work/report.json"),
        profile.evaluate.max_new_tokens,
        python="python",
    )
    return "".join(
        f"# {stage}\n{shlex.join(command)}\n" for stage, command in (("quantize", quantize), ("build_engine", check))
    )


@pytest.mark.parametrize("profile_name", LLMAPI_PROFILES)
def test_gpu_stage_commands_match_golden(profile_name):
    matches_golden(GOLDEN / profile_name / "commands.sh", rendered_commands(profile_name))


@pytest.mark.parametrize("profile_name", LLMAPI_PROFILES)
def test_llm_api_arguments_match_golden(profile_name):
    """What build_engine checks the checkpoint under, and Triton's llmapi model.yaml serves it with."""
    rendered = json.dumps(llm_args(load_profile(profile_name)), indent=2, sort_keys=True) + "\n"
    matches_golden(GOLDEN / profile_name / "llm_args.json", rendered)


@pytest.mark.parametrize("profile_name", LLMAPI_PROFILES)
def test_triton_llmapi_model_matches_golden(profile_name, tmp_path):
    profile = load_profile(profile_name)
    name = f"{profile.registry.model_name}-v3"
    template, values = serving_model(profile, Path("/checkpoints/v3"), "e" * 64, 40960)
    assert template == "llmapi"
    config = (render_model(template, tmp_path, name, values) / "config.pbtxt").read_text()
    assert "${" not in config
    matches_golden(GOLDEN / profile_name / "triton" / name / "config.pbtxt", config)
    assert [p.name for p in (GOLDEN / profile_name / "triton").iterdir()] == [name]  # none stale


def served_llm_args(profile_name: str) -> dict:
    """The LLM() arguments in the golden llmapi model's config.pbtxt (its `llm_args` parameter)."""
    name = f"{load_profile(profile_name).registry.model_name}-v3"
    config = (GOLDEN / profile_name / "triton" / name / "config.pbtxt").read_text()
    return json.loads(config_parameters(config)["llm_args"])


@pytest.mark.parametrize("profile_name", LLMAPI_PROFILES)
def test_triton_serves_under_the_arguments_build_engine_checked(profile_name):
    """One set of LLM() arguments: the served model's are the checked ones plus the canary's KV budget only."""
    checked = json.loads((GOLDEN / profile_name / "llm_args.json").read_text())
    served = served_llm_args(profile_name)
    assert served.pop("kv_cache_config") == {**checked.pop("kv_cache_config"), "max_tokens": 40960}
    assert served == checked


def test_golden_values_are_what_the_profiles_ask_for():
    """The reviewed facts behind the golden files, stated once in words."""
    qwen7b = (GOLDEN / "qwen-7b-qlora-2xa10" / "commands.sh").read_text()
    assert "--qformat int4_awq --dtype bfloat16 --awq_block_size 128" in qwen7b and "--kv_cache_fp8" not in qwen7b
    qwen7b_args = json.loads((GOLDEN / "qwen-7b-qlora-2xa10" / "llm_args.json").read_text())
    assert qwen7b_args["max_input_len"] == 2048 and qwen7b_args["max_seq_len"] == 2048 + 512  # train.cutoff_len
    assert qwen7b_args["tensor_parallel_size"] == 1 and qwen7b_args["backend"] == "pytorch"
    assert qwen7b_args["kv_cache_config"]["free_gpu_memory_fraction"] == 0.85
    served7b = (GOLDEN / "qwen-7b-qlora-2xa10" / "triton" / "qwen-7b-sft-v3" / "config.pbtxt").read_text()
    parameters7b = config_parameters(served7b)
    assert parameters7b["gpu_device_ids"] == "0;1" and "count: 2" in served7b  # two instances, one A10 each
    assert parameters7b["model_dir"] == "/checkpoints/v3" and "decoupled: true" in served7b

    llama = (GOLDEN / "llama3-8b-h100-fp8" / "commands.sh").read_text()
    assert "--qformat fp8 --dtype bfloat16 --kv_cache_fp8" in llama and "--awq_block_size" not in llama
    assert "python -m tasks.runners.tensorrt_llm_check --model_dir /work/checkpoint" in llama
    llama_args = json.loads((GOLDEN / "llama3-8b-h100-fp8" / "llm_args.json").read_text())
    limits = (llama_args["max_input_len"], llama_args["max_num_tokens"], llama_args["max_batch_size"])
    assert limits == (4096, 16384, 256) and llama_args["enable_chunked_prefill"] is True

    qwen14b = (GOLDEN / "qwen2-14b-int4-tp2" / "commands.sh").read_text()
    assert "--qformat int4_awq --dtype bfloat16 --awq_block_size 128" in qwen14b and "mpirun" not in qwen14b
    assert json.loads((GOLDEN / "qwen2-14b-int4-tp2" / "llm_args.json").read_text())["tensor_parallel_size"] == 2
    served14b = (GOLDEN / "qwen2-14b-int4-tp2" / "triton" / "qwen2-14b-sft-v3" / "config.pbtxt").read_text()
    assert config_parameters(served14b)["gpu_device_ids"] == "0,1" and "count: 1" in served14b  # one over both GPUs


def test_check_cache_key_changes_with_each_of_its_inputs():
    base = ("a" * 64, {"max_batch_size": 64}, "1.2.1", "sm90 NVIDIA H100", "d" * 64, {"max_new_tokens": 8})
    variants = [
        ("b" * 64, *base[1:]),
        (base[0], {"max_batch_size": 128}, *base[2:]),
        (*base[:2], "1.3.0", *base[3:]),
        (*base[:3], "sm86 NVIDIA A10", *base[4:]),
        (*base[:4], "e" * 64, base[5]),
        (*base[:5], {"max_new_tokens": 16}),
    ]
    keys = {str(check_cache_key(*v)) for v in [base, *variants]}
    assert len(keys) == 7


def test_an_nvfp4_checkpoint_is_refused_on_a_gpu_before_blackwell(tmp_path):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    require_gpu_for(tmp_path, "sm100 NVIDIA B200")
    with pytest.raises(BadInput, match=r"NVFP4 checkpoint needs a Blackwell GPU \(sm100\+\), this is sm90 NVIDIA H100"):
        require_gpu_for(tmp_path, "sm90 NVIDIA H100")
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    require_gpu_for(tmp_path, "sm89 NVIDIA L40S")


def test_llm_args_take_prompt_lengths_from_training_not_from_the_eval_split():
    profile = load_profile("qwen-7b-qlora-2xa10", ["train.cutoff_len=3000", "engine.max_output_len=100"])
    args = llm_args(profile)
    assert (args["max_input_len"], args["max_seq_len"]) == (3000, 3100)
    profile.engine.extra_args = {"enable_attention_dp": True}  # a profile file's setting (no --set may set it)
    assert llm_args(profile)["enable_attention_dp"] is True


def test_tensorrt_llm_stages_refuse_clearly_without_tensorrt_llm(tmp_path):
    try:
        import tensorrt_llm as _  # noqa: F401

        pytest.skip("tensorrt_llm is installed here")
    except ImportError:
        pass
    with pytest.raises(BadInput, match=r"tensorrt_llm is not installed here: .*infra/images/trtllm.Dockerfile"):
        tensorrt_llm.installed_version()


def test_an_ngc_tritonserver_runs_with_its_own_environment(monkeypatch):
    """Only the nvidia-pytriton binary gets this venv's libraries and Python; an image without the wheel
    must not need it (importing pytriton there would fail)."""
    import sys

    from tasks.serving.server import server_env

    monkeypatch.setitem(sys.modules, "pytriton", None)  # as in an NGC image: not installed
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/tritonserver/lib")
    env = server_env(bundled=False)
    assert env["LD_LIBRARY_PATH"] == "/opt/tritonserver/lib" and env["PATH"] == os.environ["PATH"]


@pytest.mark.parametrize(
    ("profile_name", "serves"),
    [("llama3-8b-h100-fp8", "quantize"), ("qwen-7b-vllm-h100", "quantize"), ("cpu-tiny", "merge")],
)
def test_a_registered_version_serves_the_modelopt_checkpoint_else_the_merged_model(profile_name, serves, tmp_path):
    """What is registered is what serves: on llmapi the quantize stage's checkpoint (build_engine only checks
    it), on vLLM the ModelOpt FP8 checkpoint the quantize stage made, elsewhere the merged model."""
    import types

    from tasks.serving.champion import served_version

    tags = {
        "artifact.merge.sha256": "m" * 64,
        "artifact.quantize.sha256": "q" * 64,
        "artifact.build_engine.sha256": "c",
    }
    store = types.SimpleNamespace(fetch=lambda digest: tmp_path / digest, uri=str(tmp_path))
    ctx = types.SimpleNamespace(profile=load_profile(profile_name), store=store)
    served = served_version(ctx, "svc", types.SimpleNamespace(version=3, tags=tags))  # type: ignore[arg-type]
    digest = tags[f"artifact.{serves}.sha256"]
    assert (served.name, served.artifact_sha256, served.serves) == ("svc-v3", digest, tmp_path / digest)
    assert served.model_dir == tmp_path / ("m" * 64)  # tokenizer and champion scores: the merged model


def test_an_eval_prompt_the_serving_arguments_cannot_take_is_refused_before_tensorrt_llm_loads():
    """One LLM.generate answers every eval prompt: one prompt over max_num_tokens without chunked prefill would raise
    in TensorRT-LLM's argument check and abort the whole check after the model loaded; it is refused first, named."""
    profile = load_profile("qwen-7b-qlora-2xa10")  # cutoff 2048, max_seq_len 2560, max_num_tokens 4096, no chunking
    args = llm_args(profile)
    require_servable([[1] * 2048, [1] * 10], args, 64)
    with pytest.raises(
        BadInput, match=r"1 eval sample\(s\) do not fit .* the first \(#1\) a 2049-token prompt: at most 2048"
    ):
        require_servable([[1] * 10, [1] * 2049], args, 64)
    with pytest.raises(BadInput, match=r"at most 2560 \(max_seq_len"):
        require_servable([[1] * 2048], args, 600)
    short_steps = {**args, "max_num_tokens": 1024}  # engine.extra_args or a tuned max_num_tokens below the cutoff
    with pytest.raises(BadInput, match=r"at most 1024 tokens \(engine.max_num_tokens \(no chunked prefill\)\)"):
        require_servable([[1] * 1500], short_steps, 64)
    require_servable([[1] * 1500], {**short_steps, "enable_chunked_prefill": True}, 64)
