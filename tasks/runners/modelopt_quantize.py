"""Quantize the merged model with NVIDIA ModelOpt into a Hugging Face checkpoint (GPU only; started by
tasks/quantize.py inside the TensorRT-LLM image, whose nvidia-modelopt is the one TensorRT-LLM pins).

    python -m tasks.runners.modelopt_quantize --model_dir M --calibration calib.jsonl --output_dir O \
        --qformat fp8 [--kv_cache_fp8] [--awq_block_size 128] [--dtype bfloat16]

calib.jsonl holds {"input_ids": [...]} lines: whole conversations as training encoded them (chat template,
cut to calib_max_seq_length), written by the caller. Follows ModelOpt's examples/llm_ptq/hf_ptq.py:
`mtq.quantize(model, config, forward_loop)` in place, then `export_hf_checkpoint(model, export_dir=...)`,
which writes hf_quant_config.json and config.json's quantization_config (quant_method "modelopt") next to
the safetensors: the layout TensorRT-LLM's PyTorch backend detects as pre-quantized
(llmapi/llm_utils.py ModelLoader._update_from_hf_quant_config) and vLLM's modelopt quantization reads for FP8 and
NVFP4 (vllm 0.27.1 model_executor/layers/quantization/modelopt.py; it has no INT4-AWQ reader).
Upstream names cited below are NVIDIA/TensorRT-Model-Optimizer at tag 0.37.0 (TensorRT-LLM 1.2's
requirements.txt pins nvidia-modelopt[torch]~=0.37.0). This module imports nothing of the orchestrator.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# qformat -> the mtq preset (modelopt/torch/quantization/config.py: FP8_DEFAULT_CFG L181, INT4_AWQ_CFG L226,
# NVFP4_DEFAULT_CFG L360), as examples/llm_ptq/hf_ptq.py QUANT_CFG_CHOICES maps them (L68-81).
PRESETS = {"fp8": "FP8_DEFAULT_CFG", "int4_awq": "INT4_AWQ_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}
KV_CACHE_PRESET = "FP8_KV_CFG"  # config.py L336: "*[kv]_bmm_quantizer" FP8
# The hf_quant_config.json quant_algo each format exports (modelopt/torch/export/quant_utils.py L612, L617, L633).
QUANT_ALGOS = {"fp8": "FP8", "int4_awq": "W4A16_AWQ", "nvfp4": "NVFP4"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("--model_dir", "--calibration", "--output_dir"):
        parser.add_argument(name, required=True)
    parser.add_argument("--qformat", required=True, choices=sorted(PRESETS))
    parser.add_argument("--kv_cache_fp8", action="store_true")
    parser.add_argument("--awq_block_size", type=int, choices=(64, 128), default=128)  # TensorRT-LLM's kernels
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="bfloat16")
    return parser.parse_args(argv)


def quantize_config(presets: Mapping[str, Any], qformat: str, kv_cache_fp8: bool, awq_block_size: int) -> dict:
    """The mtq.quantize config, built as hf_ptq.py builds it, on a copy (the presets are module globals)."""
    config = copy.deepcopy(presets[PRESETS[qformat]])
    if qformat == "int4_awq":  # hf_ptq.py L448-455: the weight quantizer's last-axis block size
        weight = config["quant_cfg"]["*weight_quantizer"]
        (weight[0] if isinstance(weight, list) else weight)["block_sizes"][-1] = awq_block_size
    if kv_cache_fp8:  # examples/llm_ptq/example_utils.py apply_kv_cache_quant L245-256
        config["quant_cfg"].update(copy.deepcopy(presets[KV_CACHE_PRESET]["quant_cfg"]))
        config.setdefault("algorithm", "max")
    return config


def calibration_samples(path: Path) -> list[list[int]]:
    samples = [json.loads(line)["input_ids"] for line in path.read_text().splitlines() if line.strip()]
    if not samples:
        raise SystemExit(f"{path}: no calibration samples")
    return samples


def check_export(out_dir: Path, qformat: str, kv_cache_fp8: bool) -> dict:
    """The exported checkpoint says what it holds: hf_quant_config.json (unified_export_hf.py L518-520) and
    config.json quantization_config (L537) with quant_method "modelopt" (convert_hf_config.py L115)."""
    try:
        quantization = json.loads((out_dir / "hf_quant_config.json").read_text())["quantization"]
        config = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"{out_dir}: not a ModelOpt Hugging Face checkpoint ({exc!r})") from None
    expected = {"quant_algo": QUANT_ALGOS[qformat], "kv_cache_quant_algo": "FP8" if kv_cache_fp8 else None}
    found = {key: quantization.get(key) for key in expected}
    if found != expected or config.get("quant_method") != "modelopt":
        raise SystemExit(
            f"{out_dir}: exported {found} (quant_method {config.get('quant_method')!r}), expected {expected}"
        )
    return quantization


def quantize_model(model, samples: list[list[int]], qformat: str, kv_cache_fp8: bool, awq_block_size: int):
    """mtq.quantize in place, calibrated on `samples` (one forward each, no gradients). The model is left
    fake-quantized: it computes as the exported checkpoint will, so its answers measure the accuracy drop."""
    import modelopt.torch.quantization as mtq
    import torch

    def forward_loop(m) -> None:
        with torch.no_grad():
            for ids in samples:
                m(torch.tensor([ids], device=m.device))

    mtq.quantize(model, quantize_config(vars(mtq), qformat, kv_cache_fp8, awq_block_size), forward_loop)
    return model


def export_checkpoint(model, out_dir: Path) -> None:
    from modelopt.torch.export import export_hf_checkpoint

    export_hf_checkpoint(model, export_dir=str(out_dir))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    samples = calibration_samples(Path(args.calibration))
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, torch_dtype=getattr(torch, args.dtype), device_map="auto"
    ).eval()
    quantize_model(model, samples, args.qformat, args.kv_cache_fp8, args.awq_block_size)
    export_checkpoint(model, Path(args.output_dir))
    quantization = check_export(Path(args.output_dir), args.qformat, args.kv_cache_fp8)
    print(f"modelopt_quantize: {len(samples)} calibration samples; exported {json.dumps(quantization)}")


if __name__ == "__main__":
    main()
