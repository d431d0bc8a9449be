"""serve.lora adapter without a server: what the profile allows, the adapter's rank read from its PEFT config, and
the base engine and adapter models as rendered (their loads: tests/integration/test_adapters.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.platform.config import load_profile
from tasks.platform.errors import BadInput, CheckFailed
from tasks.serving.adapters import adapter_rank, served_artifact
from tasks.serving.model_config import serving_model
from tasks.serving.repository import config_parameters, render_model

ADAPTER = ["serve.backend=vllm", "serve.lora=adapter"]


def test_adapters_need_vllm_fit_the_rank_and_are_not_tuned():
    assert load_profile("cpu-tiny", ADAPTER).serve.lora == "adapter"
    assert load_profile("cpu-tiny").serve.lora == "merged"  # the default
    with pytest.raises(BadInput, match="lora adapter needs serve.backend vllm"):
        load_profile("cpu-tiny", ["serve.lora=adapter"])
    with pytest.raises(BadInput, match="train.lora_rank 32 exceeds serve.vllm.max_lora_rank 16"):
        load_profile("cpu-tiny", [*ADAPTER, "train.lora_rank=32"])
    with pytest.raises(BadInput, match="tune.enabled with serve.lora adapter"):
        load_profile("cpu-tiny", [*ADAPTER, "tune.enabled=true"])
    with pytest.raises(BadInput, match="max_lora_rank"):
        load_profile("cpu-tiny", [*ADAPTER, "serve.vllm.max_lora_rank=12"])  # vLLM's ranks only


def test_an_adapter_over_a_quantized_checkpoint_is_refused_naming_both_settings():
    """Issue 76: adapter mode serves the full-precision base with the adapter, so the FP8 checkpoint the quantize stage
    built and checked would never serve; the profile that asks for both is refused when it loads."""
    no_tune = ["serve.lora=adapter", "tune.enabled=false"]
    with pytest.raises(BadInput, match=r"serve.lora adapter with quantize.backend modelopt: .* never serve; set serve"):
        load_profile("qwen-7b-vllm-h100", no_tune)
    assert load_profile("qwen-7b-vllm-h100", [*no_tune, "quantize.backend=none"]).serve.lora == "adapter"


def test_the_rank_is_the_largest_in_the_adapter_config(tmp_path: Path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "rank_pattern": {"q_proj": 32}}))
    assert adapter_rank(tmp_path) == 32
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "rank_pattern": {}}))
    assert adapter_rank(tmp_path) == 8
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(CheckFailed, match=r"adapter_config.json: not a PEFT LoRA adapter config \('r'\)"):
        adapter_rank(tmp_path)


def test_the_base_engine_enables_lora_and_a_versions_model_registers_its_adapter_with_that_base(tmp_path: Path):
    profile = load_profile("cpu-tiny", [*ADAPTER, "serve.vllm.max_loras=3"])
    template, values = serving_model(profile, Path("/store/base"), "b" * 64)
    base = (render_model(template, tmp_path, "svc-base", values) / "config.pbtxt").read_text()
    for key, value in (("enable_lora", "true"), ("max_lora_rank", "16"), ("max_loras", "3")):
        assert config_parameters(base)[key] == value
    merged = serving_model(load_profile("cpu-tiny", ["serve.backend=vllm"]), Path("/m"), "a" * 64)[1]
    assert merged["enable_lora"] == "false"
    assert 'name: "lora_name"' in base and "lora_path" not in base  # a request names an adapter, never its files
    adapter = render_model(
        "lora",
        tmp_path,
        "svc-v2",
        {
            "base_model": "svc-base",
            "adapter_dir": "/store/adapter",
            "artifact_sha256": served_artifact("a" * 64, "b" * 64),
        },
    )
    config = (adapter / "config.pbtxt").read_text()
    assert config_parameters(config)["base_model"] == "svc-base"
    assert config_parameters(config)["artifact_sha256"] == f"{'a' * 64}@{'b' * 64}"
    assert 'name: "lora_' not in config  # a client cannot name another adapter: only the base model takes it


def test_one_engine_may_take_more_of_the_gpu_than_two_side_by_side():
    merged = ["serve.vllm.gpu_memory_utilization=0.6"]
    with pytest.raises(BadInput, match="a merged canary runs two engines side by side, so below 0.5"):
        load_profile("qwen-7b-vllm-h100", merged)
    adapter = ["serve.lora=adapter", "tune.enabled=false", "quantize.backend=none"]  # an adapter serves unquantized
    utilization = "serve.vllm.gpu_memory_utilization"
    assert (
        load_profile("qwen-7b-vllm-h100", [*adapter, f"{utilization}=0.85"]).serve.vllm.gpu_memory_utilization == 0.85
    )
    with pytest.raises(BadInput, match="at most 0.9"):
        load_profile("qwen-7b-vllm-h100", [*adapter, f"{utilization}=0.95"])
