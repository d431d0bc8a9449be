"""serve.backend vllm on cuda (profiles/qwen-7b-vllm-h100.yaml): the profile's rules, the engine arguments the
rendered Triton model carries for vLLM 0.27.1 (NGC tritonserver:26.08-vllm-python-py3) serving the ModelOpt FP8
checkpoint, checked against a reviewed golden file, and the CPU vLLM path left as it was.

Regenerate after a change:  LLMOPS_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_vllm_cuda.py (the run
that rewrites fails; review the diff, then run again)
"""

import ast
from pathlib import Path

import pytest

from tasks.platform.config import load_profile
from tasks.platform.errors import BadInput
from tasks.serving import vllm as vllm_serving
from tasks.serving.model_config import serving_model
from tasks.serving.repository import render_model
from tests.goldens import matches_golden

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
PROFILE = "qwen-7b-vllm-h100"
TEMPLATE = ROOT / "infra" / "triton" / "vllm"


def rendered_config(profile_name: str, tmp_path: Path, overrides: list[str] | None = None) -> tuple[str, str]:
    profile = load_profile(profile_name, overrides or [])
    name = f"{profile.registry.model_name}-v3"
    template, values = serving_model(profile, Path("/checkpoints/v3"), "e" * 64)
    return name, (render_model(template, tmp_path, name, values) / "config.pbtxt").read_text()


def parameter(config: str, key: str) -> str:
    """A parameter of a rendered config.pbtxt, as Triton parses it."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    parsed = text_format.Parse(config, model_config_pb2.ModelConfig())
    assert key in parsed.parameters, f"no parameter {key}"
    return parsed.parameters[key].string_value


def test_the_vllm_model_of_the_h100_profile_matches_golden(tmp_path):
    name, config = rendered_config(PROFILE, tmp_path)
    assert "${" not in config
    matches_golden(GOLDEN / PROFILE / "triton" / name / "config.pbtxt", config)
    assert sorted(p.name for p in (GOLDEN / PROFILE / "triton").iterdir()) == [name]  # none stale


def test_golden_engine_arguments_are_what_the_profile_asks_for():
    """The reviewed facts behind the golden file: bf16 with CUDA graphs, one GPU, each engine within 45% of the
    H100 (two fit during a canary), the KV cache sized by vLLM inside that share, 256 sequences at once."""
    config = (GOLDEN / PROFILE / "triton" / "qwen-7b-vllm-sft-v3" / "config.pbtxt").read_text()
    expected = {
        "dtype": "bfloat16",
        "enforce_eager": "false",
        "gpu_memory_utilization": "0.45",
        "tensor_parallel_size": "1",
        "kv_cache_memory_bytes": "",
        "max_num_seqs": "256",
        "model_dir": "/checkpoints/v3",  # the quantize stage's FP8 checkpoint (tests/unit/test_gpu_path.py)
    }
    assert {key: parameter(config, key) for key in expected} == expected
    assert 'backend: "python"' in config and "decoupled: true" in config and "dynamic_batching" not in config


def test_the_cpu_vllm_engine_gets_the_arguments_it_got_before(tmp_path):
    """cpu-tiny with serve.backend vllm: the KV cache in bytes, eager, the checkpoint's dtype; the GPU settings
    rendered empty, so the model passes them to no engine (vLLM's defaults, as before they existed)."""
    profile = load_profile("cpu-tiny", ["serve.backend=vllm"])
    assert vllm_serving.model_values(profile) == {
        "dtype": "auto",
        "kv_cache_memory_bytes": 1 << 28,
        "enforce_eager": "true",
        "gpu_memory_utilization": "",
        "tensor_parallel_size": "",
        "enable_lora": "false",  # a merged model's engine (serve.lora merged): no adapters
        "max_lora_rank": 16,
        "max_loras": 2,
    }
    _, config = rendered_config("cpu-tiny", tmp_path, ["serve.backend=vllm"])
    assert parameter(config, "gpu_memory_utilization") == parameter(config, "tensor_parallel_size") == ""


def test_a_cpu_engine_runs_its_model_in_its_core_and_cuda_keeps_vllms_choice(tmp_path, monkeypatch):
    """On CPU Triton's environment holds VLLM_ENABLE_V1_MULTIPROCESSING=0: the model in the engine core's process,
    no worker polling a queue beside it (benchmarks/vllm_engine_idle.py); on cuda vLLM's own executor."""
    monkeypatch.setattr(vllm_serving, "environment", lambda profile: None)
    cpu = vllm_serving.triton_env(load_profile("cpu-tiny", ["serve.backend=vllm"]), tmp_path)
    assert cpu["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vllm_serving.triton_env(load_profile(PROFILE), tmp_path)


def test_the_model_passes_exactly_the_arguments_that_may_be_rendered_empty():
    """infra/triton/vllm/1/model.py gives AsyncEngineArgs an optional argument only when its parameter is not
    empty; every value model_values may leave empty must be one of those, or the engine would get int('')."""
    tree = ast.parse((TEMPLATE / "1" / "model.py").read_text())
    optional = next(
        ast.literal_eval(ast.unparse(node.value).replace("int", "'int'").replace("float", "'float'"))
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "OPTIONAL_ENGINE_ARGS"
    )
    empty_somewhere = {
        key
        for name, overrides in ((PROFILE, []), ("cpu-tiny", ["serve.backend=vllm"]))
        for key, value in vllm_serving.model_values(load_profile(name, overrides)).items()
        if value == ""
    }
    assert (
        empty_somewhere == set(optional) == {"kv_cache_memory_bytes", "gpu_memory_utilization", "tensor_parallel_size"}
    )
    template = (TEMPLATE / "config.pbtxt").read_text()
    assert all(f'key: "{key}"' in template for key in optional)


@pytest.mark.parametrize(
    ("profile_name", "overrides", "message"),
    [
        ("cpu-tiny", ["serve.backend=vllm", "serve.vllm.kv_cache_gb=null"], "vLLM on CPU needs its KV cache size"),
        ("cpu-tiny", ["serve.backend=vllm", "serve.vllm.tensor_parallel_size=2"], "needs hardware.accelerator cuda"),
        (PROFILE, ["serve.vllm.tensor_parallel_size=2"], "tensor_parallel_size 2 exceeds hardware.gpus 1"),
        (PROFILE, ["serve.vllm.gpu_memory_utilization=0.5"], "gpu_memory_utilization"),
    ],
)
def test_vllm_settings_that_cannot_serve_are_refused_when_the_profile_loads(profile_name, overrides, message):
    with pytest.raises(BadInput, match=message):
        load_profile(profile_name, overrides)


def test_a_gpu_profile_may_serve_with_vllm_without_naming_a_venv():
    """On cuda vLLM comes with the serving image (NGC tritonserver:26.08-vllm-python-py3), not from a venv."""
    profile = load_profile("llama3-8b-h100-fp8", ["serve.backend=vllm", "quantize.backend=none"])
    assert profile.serve.vllm.environment is None and profile.serve.vllm.tensor_parallel_size == 1
    assert (
        load_profile(
            "qwen2-14b-int4-tp2", ["serve.backend=vllm", "quantize.backend=none", "serve.vllm.tensor_parallel_size=2"]
        ).serve.vllm.tensor_parallel_size
        == 2
    )


def test_a_triton_started_here_for_cuda_vllm_needs_vllm_in_this_python(tmp_path, monkeypatch):
    import importlib.util

    from tasks.serving.champion import triton_launch

    profile = load_profile(PROFILE)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(BadInput, match=r"vLLM is not importable by this Python; attach .*--triton-url"):
        triton_launch(profile, tmp_path)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    launcher, env = triton_launch(profile, tmp_path)
    assert launcher == [] and "PATH" not in env and env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm-cache")


def test_host_memory_is_not_what_bounds_a_gpu_engine(monkeypatch):
    """On cuda vLLM refuses an engine whose GPU share is not free (vllm/v1/worker/utils.py:request_memory at
    0.27.1); the host-RAM check of the CPU path would refuse a canary for the wrong reason."""
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": 0})())
    vllm_serving.require_room(load_profile(PROFILE), "qwen-7b-vllm-sft-v4")
    with pytest.raises(Exception, match="GiB is free"):
        vllm_serving.require_room(load_profile("cpu-tiny", ["serve.backend=vllm"]), "svc-v2")


def test_vllm_serves_the_modelopt_checkpoints_it_has_kernels_for_and_no_others():
    """vLLM 0.27.1 reads ModelOpt's FP8 (and NVFP4, MXFP8) checkpoints, not INT4-AWQ (quantization/modelopt.py)."""
    profile = load_profile(PROFILE)
    assert (profile.quantize.backend, profile.quantize.modelopt.qformat) == (
        "modelopt",
        "fp8",
    ) and profile.serves_quantized
    assert not load_profile(PROFILE, ["quantize.backend=none"]).serves_quantized  # the merged model, as before
    assert not load_profile("cpu-tiny", ["serve.backend=vllm"]).serves_quantized  # an ONNX int8 file serves on nothing
    with pytest.raises(BadInput, match="vllm cannot serve quantize.modelopt.qformat int4_awq"):
        load_profile(PROFILE, ["quantize.modelopt.qformat=int4_awq"])
