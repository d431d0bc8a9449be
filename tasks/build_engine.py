"""build_engine: the TensorRT-LLM engine from the quantized checkpoint (GPU profiles only).

The engine is cached by what determines its bytes: the checkpoint's digest, the trtllm-build
arguments, the TensorRT-LLM version and the GPU architecture (an engine built for sm90 does not run
on sm86). After the build, the engine answers the eval split; the drop in exact match from the
merged model is the quantization accuracy drop the gate checks. The engine's build config and the
command go to MLflow.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from tasks.data.splits import eval_conversations
from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import RunContext, StageResult, logger, run_cached
from tasks.quality.contract import CONTRACT_FILE
from tasks.serving import tensorrt_llm


def engine_cache_key(
    checkpoint_digest: str, build_args: list[str], trtllm_version: str, gpu_arch: str, data_digest: str, evaluate: dict
) -> dict:
    """The engine, and the accuracy measured on it: the eval data and settings it is measured with count too."""
    return {
        "checkpoint": checkpoint_digest,
        "build_args": build_args,
        "tensorrt_llm": trtllm_version,
        "gpu_arch": gpu_arch,
        "data": data_digest,
        "evaluate": evaluate,
    }


def engine_exact_match(
    ctx: RunContext, data: StageResult, engine_dir: Path, tokenizer_dir: Path, scratch: Path
) -> float:
    from tasks.quality.chat import prompt_ids
    from tasks.quality.models import load_tokenizer
    from tasks.quality.scoring import exact_match

    cfg = ctx.profile.evaluate
    conversations = eval_conversations(ctx, data, cfg.max_samples)
    tokenizer = load_tokenizer(tokenizer_dir)
    questions, answers = scratch / "questions.jsonl", scratch / "answers.jsonl"
    questions.write_text("".join(json.dumps({"input_ids": prompt_ids(tokenizer, c)}) + "\n" for c in conversations))
    world = ctx.profile.quantize.tensorrt_llm.tp_size * ctx.profile.quantize.tensorrt_llm.pp_size
    tensorrt_llm.run_logged(
        tensorrt_llm.eval_command(engine_dir, tokenizer_dir, questions, answers, cfg.max_new_tokens, world),
        scratch / "eval.log",
        "build_engine: eval",
        logger(),
    )
    predictions = [json.loads(line)["answer"] for line in answers.read_text().splitlines()]
    return exact_match(predictions, conversations)


def build_engine(ctx: RunContext, data: StageResult, evaluation: StageResult, checkpoint: StageResult) -> StageResult:
    cfg = ctx.profile.engine
    args = tensorrt_llm.build_args(cfg)
    key = engine_cache_key(
        checkpoint.artifact.digest,
        args,
        tensorrt_llm.installed_version(),
        tensorrt_llm.gpu_arch(),
        data.artifact.digest,
        ctx.profile.evaluate.model_dump(),
    )

    def produce(out_dir: Path) -> dict:
        log = logger()
        source = ctx.store.fetch(checkpoint.artifact.digest)
        scratch = out_dir.parent / "scratch"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        command = tensorrt_llm.build_command(cfg, source / "checkpoint", out_dir / "engine")
        started = time.monotonic()
        tensorrt_llm.run_logged(command, scratch / "trtllm-build.log", "build_engine", log)
        build_s = time.monotonic() - started
        shutil.copytree(source / "tokenizer", out_dir / "tokenizer")
        shutil.copy2(source / CONTRACT_FILE, out_dir / CONTRACT_FILE)  # checked against the tokenizer at quantize
        engine_config = json.loads((out_dir / "engine" / "config.json").read_text())
        (out_dir / "build.json").write_text(
            json.dumps(
                {"trtllm_build_args": args, "tensorrt_llm": key["tensorrt_llm"], "gpu_arch": key["gpu_arch"]}, indent=2
            )
        )
        ctx.tracker.log_params(
            "engine", {"build_args": " ".join(args), "tensorrt_llm": key["tensorrt_llm"], "gpu_arch": key["gpu_arch"]}
        )
        ctx.tracker.log_json("engine_config.json", engine_config)
        engine_em = engine_exact_match(ctx, data, out_dir / "engine", out_dir / "tokenizer", scratch)
        merged_em = evaluation.metrics["candidate_exact_match"]  # the merged model's, within merge.tolerance
        metrics = {
            "build_s": build_s,
            "engine_bytes": sum(p.stat().st_size for p in (out_dir / "engine").rglob("*.engine")),
            "merged_exact_match": merged_em,
            "engine_exact_match": engine_em,
            "accuracy_drop": merged_em - engine_em,
        }
        shutil.rmtree(scratch, ignore_errors=True)
        if metrics["accuracy_drop"] > ctx.profile.quantize.max_accuracy_drop:
            raise CheckFailed(
                f"build_engine: exact match drops by {metrics['accuracy_drop']:.3f} in the "
                f"{ctx.profile.quantize.tensorrt_llm.qformat} engine > quantize.max_accuracy_drop "
                f"{ctx.profile.quantize.max_accuracy_drop}"
            )
        return metrics

    return run_cached(
        ctx,
        "build_engine",
        key,
        produce,
        headline=lambda m: f"{m['engine_bytes']:,} bytes, exact match {m['engine_exact_match']:.3f}",
    )
