"""quantize: make the artifact that serving loads, and measure what quantization cost.

CPU backend `onnx-int8`: torch.onnx (dynamo) export of the merged model's forward pass, then
onnxruntime dynamic int8 quantization of the weights. Recorded: size before/after, latency
per generated token (fp32 ONNX vs int8), and the accuracy delta against the merged model
(`evaluate.metric` scored as evaluate scores it, ROUGE-L for answer_loss, and top-1 agreement of
next-token predictions). `none` passes the merged model
through. GPU backend `modelopt`: NVIDIA ModelOpt post-training quantization (fp8, int4_awq, nvfp4; optional
FP8 KV cache), calibrated on the training conversations under the chat template, exported as a Hugging
Face checkpoint; its accuracy is measured on the serving runtime by build_engine.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tasks.data.splits import eval_conversations, load_split
from tasks.platform.config import Profile, awq_indivisible
from tasks.platform.errors import BadInput, CheckFailed
from tasks.platform.stage_cache import RunContext, StageMetrics, StageResult, logger, run_cached
from tasks.quality.chat import Conversation, answer_ids, prompt_ids
from tasks.quality.contract import load_contract, read_contract, require_same, write_contract
from tasks.quality.metrics import answer_metric
from tasks.quality.models import load_model, load_tokenizer, probe_batch
from tasks.quality.scoring import answer_score, generate_answers, scored_metric

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "config.json",
    "generation_config.json",
    "chat_template.jinja",
)

# The models the ONNX path scores on the eval split, as its metrics name them (`<model>_<metric>`).
SCORED_MODELS = ("merged", "onnx_fp32", "quantized")


@dataclass(kw_only=True)
class QuantizeMetrics(StageMetrics):
    """Sizes, and on the ONNX path the cost of quantization: each model's score on `metric` (a text metric:
    evaluate.metric, ROUGE-L for answer_loss), top-1 agreement, ms/token, the accuracy drop merged -> int8.
    On the ModelOpt path only sizes: accuracy is measured on the serving runtime (EngineMetrics).
    Fields in the order quantization.json has always had them (its bytes are part of the artifact's digest)."""

    STAGES = ("quantize",)

    merged_bytes: int
    onnx_fp32_bytes: int | None = None
    quantized_bytes: int
    metric: str | None = None
    scores: dict[str, float] = field(default_factory=dict)  # {model: mean score}, models of SCORED_MODELS
    top1_agreement: float | None = None
    onnx_fp32_ms_per_token: float | None = None
    quantized_ms_per_token: float | None = None
    accuracy_drop: float | None = None

    def as_mlflow(self) -> dict[str, float | str]:
        flat: dict[str, float | str] = {}
        for name, value in super().as_mlflow().items():
            if name == "scores":  # the score keys name the metric
                flat |= {f"{model}_{self.metric}": score for model, score in self.scores.items()}
            elif name != "metric":
                flat[name] = value
        return flat

    @classmethod
    def from_mlflow(cls, values: dict) -> QuantizeMetrics:
        metric = scored_metric(values, "quantized")
        scores = {m: values[f"{m}_{metric}"] for m in SCORED_MODELS if f"{m}_{metric}" in values}
        return replace(super().from_mlflow(values), metric=metric, scores=scores if metric else {})

    def headline(self) -> str:
        sizes = f"{self.onnx_fp32_bytes or self.merged_bytes:,} -> {self.quantized_bytes:,} bytes"
        return sizes if self.accuracy_drop is None else f"{sizes}, accuracy drop {self.accuracy_drop:.3f}"


def folder_bytes(folder: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in folder.glob(pattern) if p.is_file())


def export_onnx(model_dir: Path, path: Path, opset: int) -> None:
    import torch

    model = load_model(model_dir)
    model.config.use_cache = False

    class LogitsOnly(torch.nn.Module):
        """The exported graph: (input_ids, attention_mask) -> logits, no cache outputs."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    example = (torch.ones((2, 8), dtype=torch.long), torch.ones((2, 8), dtype=torch.long))
    batch, seq = torch.export.Dim("batch", max=1024), torch.export.Dim("sequence", max=4096)
    torch.onnx.export(
        LogitsOnly(model).eval(),
        example,
        str(path),
        dynamo=True,
        opset_version=opset,
        input_names=["input_ids", "attention_mask"],
        output_names=["logits"],
        dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
        external_data=False,
        verbose=False,  # its own progress lines ("[torch.onnx] Obtain model graph ... ✅"); the stage logs its steps
    )


def quantize_int8(source: Path, target: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8)


class OnnxCausalLM:
    """Greedy decoding over an ONNX logits graph (full recompute per token: no KV cache here)."""

    def __init__(self, path: Path):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def logits(self, input_ids, attention_mask):
        import numpy as np

        feeds = {
            "input_ids": np.asarray(input_ids, dtype=np.int64),
            "attention_mask": np.asarray(attention_mask, dtype=np.int64),
        }
        return self.session.run(["logits"], feeds)[0]

    def generate(self, tokenizer, conversations, max_new_tokens: int) -> tuple[list[str], float]:
        """Answers, and the mean seconds per generated token."""
        import numpy as np

        answers, tokens, seconds = [], 0, 0.0
        for conversation in conversations:
            ids = prompt_ids(tokenizer, conversation)
            new: list[int] = []
            for _ in range(max_new_tokens):
                started = time.perf_counter()
                step = self.logits([ids + new], [[1] * (len(ids) + len(new))])
                seconds += time.perf_counter() - started
                tokens += 1
                token = int(np.argmax(step[0, -1]))
                if token == tokenizer.eos_token_id:
                    break
                new.append(token)
            answers.append(tokenizer.decode(new, skip_special_tokens=True).strip())
        return answers, seconds / max(tokens, 1)


def top1_agreement(reference, candidate, mask) -> float:
    import numpy as np

    same = (np.asarray(reference).argmax(-1) == np.asarray(candidate).argmax(-1)) & (np.asarray(mask) == 1)
    return float(same.sum() / max(int(np.asarray(mask).sum()), 1))


def onnx_int8(
    merged_dir: Path, out_dir: Path, conversations: list[Conversation], opset: int, max_new_tokens: int, metric: str
) -> QuantizeMetrics:
    """The int8 ONNX model in out_dir, and what it cost against the merged model on `metric` (a text metric)."""
    log = logger()
    tokenizer = load_tokenizer(merged_dir)
    scratch = out_dir.parent / "onnx-fp32"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    log.info("quantize: exporting the merged model to ONNX (torch.onnx, dynamo)")
    export_onnx(merged_dir, scratch / "model.onnx", opset)
    log.info("quantize: onnxruntime dynamic int8 quantization")
    quantize_int8(scratch / "model.onnx", out_dir / "model.onnx")
    for name in TOKENIZER_FILES:
        if (merged_dir / name).is_file():
            shutil.copy2(merged_dir / name, out_dir / name)

    merged = load_model(merged_dir)
    merged_answers = generate_answers(merged, tokenizer, conversations, max_new_tokens)
    fp32, int8 = OnnxCausalLM(scratch / "model.onnx"), OnnxCausalLM(out_dir / "model.onnx")
    fp32_answers, fp32_s_per_token = fp32.generate(tokenizer, conversations, max_new_tokens)
    int8_answers, int8_s_per_token = int8.generate(tokenizer, conversations, max_new_tokens)
    input_ids, mask = probe_batch(tokenizer, conversations)
    import torch

    with torch.no_grad():
        reference = merged(input_ids=input_ids, attention_mask=mask).logits.numpy()
    scores = {
        model: answer_score(answers, conversations, metric)
        for model, answers in zip(SCORED_MODELS, (merged_answers, fp32_answers, int8_answers), strict=True)
    }
    metrics = QuantizeMetrics(
        merged_bytes=folder_bytes(merged_dir, "*.safetensors"),
        quantized_bytes=folder_bytes(out_dir, "model.onnx*"),
        accuracy_drop=scores["merged"] - scores["quantized"],  # text metrics: higher is better
        onnx_fp32_bytes=folder_bytes(scratch, "model.onnx*"),
        metric=metric,
        scores=scores,
        top1_agreement=top1_agreement(reference, int8.logits(input_ids.numpy(), mask.numpy()), mask.numpy()),
        onnx_fp32_ms_per_token=fp32_s_per_token * 1000,
        quantized_ms_per_token=int8_s_per_token * 1000,
    )
    shutil.rmtree(scratch, ignore_errors=True)
    return metrics


def passthrough(merged_dir: Path, out_dir: Path) -> QuantizeMetrics:
    shutil.copytree(merged_dir, out_dir, dirs_exist_ok=True)
    size = folder_bytes(merged_dir, "*.safetensors")
    return QuantizeMetrics(merged_bytes=size, quantized_bytes=size, accuracy_drop=0.0)


def quantize(ctx: RunContext, data: StageResult, merged: StageResult) -> StageResult:
    cfg = ctx.profile.quantize
    if cfg.backend == "modelopt":
        return modelopt_checkpoint(ctx, data, merged)
    key = {
        "merged": merged.artifact.digest,
        "data": data.artifact.digest,
        "quantize": cfg.model_dump(exclude={"modelopt"}),  # the GPU backend's settings change nothing here
        "max_new_tokens": ctx.profile.evaluate.answer_tokens,
        "eval_samples": ctx.profile.evaluate.max_samples,
    }

    def produce(out_dir: Path) -> dict:
        merged_dir = ctx.store.fetch(merged.artifact.digest)
        if cfg.backend == "none":
            metrics = passthrough(merged_dir, out_dir)
        else:
            evaluate = ctx.profile.evaluate
            conversations = eval_conversations(ctx, data, evaluate.max_samples)
            metric = answer_metric(evaluate.metric)
            metrics = onnx_int8(merged_dir, out_dir, conversations, cfg.opset, evaluate.answer_tokens, metric)
        trained = load_contract(merged_dir)
        require_same(trained, read_contract(out_dir, merged_dir), f"the {cfg.backend} artifact's tokenizer")
        write_contract(trained, out_dir)
        flat = metrics.as_mlflow()
        # Timings stay out of the artifact (they go to the record and MLflow): equal weights, equal digest.
        stable = {k: v for k, v in flat.items() if not k.endswith("_per_token")}
        (out_dir / "quantization.json").write_text(json.dumps({"backend": cfg.backend, **stable}, indent=2))
        logger().info("quantize: " + ", ".join(f"{k} {v:.4g}" for k, v in flat.items()))
        if metrics.accuracy_drop is not None and metrics.accuracy_drop > cfg.max_accuracy_drop:
            raise CheckFailed(
                f"quantize: {metrics.metric} drops by {metrics.accuracy_drop:.3f} after {cfg.backend} "
                f"> quantize.max_accuracy_drop {cfg.max_accuracy_drop}"
            )
        return flat

    return run_cached(ctx, "quantize", key, produce, headline=lambda m: QuantizeMetrics.from_mlflow(m).headline())


def calibration_ids(tokenizer, conversations: list[Conversation], max_length: int) -> list[list[int]]:
    """Whole conversations as training encoded them (chat-templated prompt, answer, EOS), cut to max_length."""
    return [(prompt_ids(tokenizer, c) + answer_ids(tokenizer, c))[:max_length] for c in conversations]


def require_awq_groups(profile: Profile, merged_dir: Path) -> None:
    """int4_awq: the merged model's layer widths must be multiples of the group size TensorRT-LLM runs it with,
    refused here rather than after calibration, at the first GEMM of build_engine."""
    cfg = profile.quantize.modelopt
    if cfg.qformat != "int4_awq":
        return
    try:
        config = json.loads((merged_dir / "config.json").read_text())
        hidden, intermediate = int(config["hidden_size"]), int(config["intermediate_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckFailed(f"quantize: the merged model's config.json has no layer widths ({exc!r})") from None
    bad = awq_indivisible(cfg.awq_block_size, hidden, intermediate, profile.engine.tensor_parallel_size)
    if bad:
        raise BadInput(
            f"quantize.modelopt.awq_block_size {cfg.awq_block_size} does not divide {', '.join(bad)} of "
            f"{profile.base_model.source}: TensorRT-LLM needs every INT4-AWQ layer's input width to be a multiple of "
            "it (use 64 or 128, whichever divides them)"
        )


def modelopt_checkpoint(ctx: RunContext, data: StageResult, merged: StageResult) -> StageResult:
    """The GPU backend: an NVIDIA ModelOpt Hugging Face checkpoint (weights, hf_quant_config.json, tokenizer)
    that TensorRT-LLM loads as is (vLLM: FP8 and NVFP4 only). Its accuracy is measured on the serving runtime: by
    build_engine on TensorRT-LLM, by the gate's serving parity on vLLM."""
    from tasks.serving import tensorrt_llm

    cfg = ctx.profile.quantize.modelopt
    key = {
        "merged": merged.artifact.digest,
        "data": data.artifact.digest,
        "modelopt": cfg.model_dump(),
        "tensorrt_llm": tensorrt_llm.installed_version(),  # the image, and with it the ModelOpt it pins
    }

    def produce(out_dir: Path) -> dict:
        merged_dir = ctx.store.fetch(merged.artifact.digest)
        require_awq_groups(ctx.profile, merged_dir)
        # The train split only: AWQ fits scales to its calibration data, and the eval split measures the drop.
        conversations = load_split(ctx.store.fetch(data.artifact.digest), "train")[: cfg.calib_size]
        calibration = out_dir.parent / "calibration.jsonl"
        samples = calibration_ids(load_tokenizer(merged_dir), conversations, cfg.calib_max_seq_length)
        calibration.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in samples))
        command = tensorrt_llm.quantize_command(cfg, merged_dir, calibration, out_dir)
        tensorrt_llm.run_logged(command, out_dir.parent / "quantize.log", "quantize", logger())
        calibration.unlink()
        for name in TOKENIZER_FILES:  # config.json is the export's own: it carries quantization_config
            if name != "config.json" and (merged_dir / name).is_file():
                shutil.copy2(merged_dir / name, out_dir / name)
        trained = load_contract(merged_dir)
        require_same(trained, read_contract(out_dir, merged_dir), "the ModelOpt checkpoint's tokenizer")
        write_contract(trained, out_dir)
        (out_dir / "quantization.json").write_text(json.dumps({"backend": "modelopt", **cfg.model_dump()}, indent=2))
        return QuantizeMetrics(
            merged_bytes=folder_bytes(merged_dir, "*.safetensors"),
            quantized_bytes=folder_bytes(out_dir, "*.safetensors"),
        ).as_mlflow()

    return run_cached(
        ctx, "quantize", key, produce, headline=lambda m: f"{QuantizeMetrics.from_mlflow(m).headline()} ({cfg.qformat})"
    )
