"""The GPU stage runners' own logic, on a CPU machine: what they hand ModelOpt and TensorRT-LLM, how they
read their arguments and what they accept back. The real runs need CUDA (tests/gpu/test_cuda_path.py)."""

import copy
import json
import types
from pathlib import Path

import pytest

from tasks.runners import modelopt_quantize, tensorrt_llm_check

# The presets as NVIDIA/TensorRT-Model-Optimizer 0.37.0 modelopt/torch/quantization/config.py writes them
# (L181 FP8_DEFAULT_CFG, L226 INT4_AWQ_CFG, L336 FP8_KV_CFG, L360 NVFP4_DEFAULT_CFG), cut to the keys used here.
DISABLED = {"*lm_head*": {"enable": False}, "default": {"enable": False}}
PRESETS = {
    "FP8_DEFAULT_CFG": {
        "quant_cfg": {
            "*weight_quantizer": {"num_bits": (4, 3), "axis": None},
            "*input_quantizer": {"num_bits": (4, 3), "axis": None},
            **DISABLED,
        },
        "algorithm": "max",
    },
    "INT4_AWQ_CFG": {
        "quant_cfg": {
            "*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}, "enable": True},
            "*input_quantizer": {"enable": False},
            **DISABLED,
        },
        "algorithm": {"method": "awq_lite", "alpha_step": 0.1},
    },
    "NVFP4_DEFAULT_CFG": {"quant_cfg": {"*weight_quantizer": {"num_bits": (2, 1)}, **DISABLED}, "algorithm": "max"},
    "FP8_KV_CFG": {
        "quant_cfg": {
            "*[kv]_bmm_quantizer": {"num_bits": (4, 3), "axis": None, "enable": True},
            "default": {"enable": False},
        },
        "algorithm": "max",
    },
}


def test_each_format_takes_its_modelopt_preset_and_leaves_the_preset_alone():
    before = copy.deepcopy(PRESETS)
    fp8 = modelopt_quantize.quantize_config(PRESETS, "fp8", kv_cache_fp8=True, awq_block_size=128)
    assert fp8["quant_cfg"]["*weight_quantizer"] == {"num_bits": (4, 3), "axis": None}
    assert fp8["quant_cfg"]["*[kv]_bmm_quantizer"]["enable"] is True and fp8["algorithm"] == "max"
    awq = modelopt_quantize.quantize_config(PRESETS, "int4_awq", kv_cache_fp8=False, awq_block_size=64)
    assert awq["quant_cfg"]["*weight_quantizer"]["block_sizes"][-1] == 64
    assert "*[kv]_bmm_quantizer" not in awq["quant_cfg"] and awq["algorithm"]["method"] == "awq_lite"
    assert modelopt_quantize.quantize_config(PRESETS, "nvfp4", False, 128)["quant_cfg"]["*weight_quantizer"] == {
        "num_bits": (2, 1)
    }
    assert before == PRESETS  # mtq's presets are module globals shared by every later call


def test_the_quantize_runner_reads_its_arguments(tmp_path):
    args = modelopt_quantize.parse_args(
        ["--model_dir", "m", "--calibration", "c.jsonl", "--output_dir", "o", "--qformat", "int4_awq", "--kv_cache_fp8"]
    )
    assert (args.qformat, args.kv_cache_fp8, args.awq_block_size, args.dtype) == ("int4_awq", True, 128, "bfloat16")
    with pytest.raises(SystemExit):
        modelopt_quantize.parse_args(
            ["--model_dir", "m", "--calibration", "c", "--output_dir", "o", "--qformat", "int8_sq"]
        )
    calibration = tmp_path / "c.jsonl"
    calibration.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4]}\n')
    assert modelopt_quantize.calibration_samples(calibration) == [[1, 2, 3], [4]]
    calibration.write_text("")
    with pytest.raises(SystemExit, match="no calibration samples"):
        modelopt_quantize.calibration_samples(calibration)


def exported(folder: Path, quant_algo: str, kv: str | None, method: str = "modelopt") -> Path:
    """The two files export_hf_checkpoint writes about quantization (unified_export_hf.py L518-520, L537)."""
    folder.mkdir()
    quantization = {"quant_algo": quant_algo, "kv_cache_quant_algo": kv, "exclude_modules": ["lm_head"]}
    (folder / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt"}, "quantization": quantization})
    )
    (folder / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": method, "quant_algo": quant_algo}})
    )
    return folder


def test_an_export_is_accepted_only_when_it_holds_what_was_asked(tmp_path):
    good = exported(tmp_path / "fp8", "FP8", "FP8")
    assert modelopt_quantize.check_export(good, "fp8", kv_cache_fp8=True)["quant_algo"] == "FP8"
    with pytest.raises(SystemExit, match=r"exported \{'quant_algo': 'FP8', 'kv_cache_quant_algo': 'FP8'\}"):
        modelopt_quantize.check_export(good, "fp8", kv_cache_fp8=False)
    awq = exported(tmp_path / "awq", "W4A16_AWQ", None)
    assert modelopt_quantize.check_export(awq, "int4_awq", kv_cache_fp8=False)["quant_algo"] == "W4A16_AWQ"
    with pytest.raises(SystemExit, match="quant_method 'fp8'"):
        modelopt_quantize.check_export(exported(tmp_path / "other", "FP8", None, method="fp8"), "fp8", False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="not a ModelOpt Hugging Face checkpoint"):
        modelopt_quantize.check_export(tmp_path / "empty", "fp8", False)


def test_the_check_runner_asks_for_greedy_answers_and_reads_the_text_of_each_output(tmp_path):
    args = tensorrt_llm_check.parse_args(
        ["--model_dir", "m", "--llm_args", "a.json", "--questions", "q", "--report", "r", "--max_new_tokens", "64"]
    )
    assert args.max_new_tokens == 64
    kwargs = tensorrt_llm_check.sampling_kwargs(64)
    assert kwargs == {"max_tokens": 64, "top_k": 1}
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"input_ids": [1, 2]}\n{"input_ids": [3]}\n')
    assert tensorrt_llm_check.prompts(questions) == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    outputs = [
        types.SimpleNamespace(outputs=[types.SimpleNamespace(text=f" answer {i}\n", token_ids=[i])]) for i in (1, 2)
    ]
    assert tensorrt_llm_check.answers(outputs) == ["answer 1", "answer 2"]
    cuda = types.SimpleNamespace(get_device_capability=lambda i: (9, 0), get_device_name=lambda i: "NVIDIA H100")
    assert tensorrt_llm_check.gpu_arch(types.SimpleNamespace(cuda=cuda)) == "sm90 NVIDIA H100"


def test_calibration_samples_are_whole_conversations_under_the_chat_template(tmp_path):
    from tasks.base_model import train_tokenizer
    from tasks.quality.chat import answer_ids, prompt_ids
    from tasks.quality.models import load_tokenizer
    from tasks.quantize import calibration_ids

    train_tokenizer(["what is the opposite of hot", "cold"] * 4, 300).save_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    conversation = [{"role": "user", "content": "opposite of hot?"}, {"role": "assistant", "content": "cold"}]
    whole = prompt_ids(tokenizer, conversation) + answer_ids(tokenizer, conversation)
    assert calibration_ids(tokenizer, [conversation], 1000) == [whole]
    assert calibration_ids(tokenizer, [conversation], 5) == [whole[:5]]
    assert whole[-1] == tokenizer.eos_token_id and "<|im_start|>" in tokenizer.decode(whole)
