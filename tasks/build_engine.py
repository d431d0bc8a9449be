"""build_engine: the TensorRT-LLM engine from the quantized checkpoint (GPU profiles only).

The engine is cached by what determines its bytes: the checkpoint's digest, the trtllm-build
arguments, the TensorRT-LLM version and the GPU architecture (an engine built for sm90 does not run
on sm86). After the build, the engine answers the eval split; the drop from the merged model's score
on `evaluate.metric` (scored as evaluate scores it; ROUGE-L for answer_loss, which answers do not carry)
is the quantization accuracy drop the gate checks. The engine's build config and the
command go to MLflow.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from tasks.data.splits import eval_conversations
from tasks.evaluate import EvaluationMetrics
from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import RunContext, StageMetrics, StageResult, logger, run_cached
from tasks.quality.chat import Conversation
from tasks.quality.contract import CONTRACT_FILE
from tasks.quality.scoring import answer_metric, answer_score, scored_metric
from tasks.serving import tensorrt_llm


@dataclass
class EngineMetrics(StageMetrics):
    """The build, and the engine's accuracy against the merged model on `metric` (a text metric)."""

    STAGES = ("build_engine",)

    build_s: float
    engine_bytes: int
    metric: str
    merged_score: float  # evaluate's candidate (base + adapter), which the merged model matches within merge.tolerance
    engine_score: float
    accuracy_drop: float

    def as_mlflow(self) -> dict[str, float | str]:
        return {
            "build_s": self.build_s,
            "engine_bytes": self.engine_bytes,
            f"merged_{self.metric}": self.merged_score,
            f"engine_{self.metric}": self.engine_score,
            "accuracy_drop": self.accuracy_drop,
        }

    @classmethod
    def from_mlflow(cls, values: dict) -> EngineMetrics:
        metric = scored_metric(values, "engine")
        if metric is None:
            raise ValueError(f"build_engine metrics: no engine_<metric> score in {sorted(values)}")
        return cls(
            values["build_s"],
            values["engine_bytes"],
            metric,
            values[f"merged_{metric}"],
            values[f"engine_{metric}"],
            values["accuracy_drop"],
        )

    @classmethod
    def measured(
        cls,
        build_s: float,
        engine_bytes: int,
        evaluation: EvaluationMetrics,
        answers: list[str],
        conversations: list[Conversation],
        evaluate_metric: str,
    ) -> EngineMetrics:
        """The engine's answers scored on `evaluate.metric` the way evaluate scored the merged model's
        (ROUGE-L where evaluate decides on answer_loss), and the drop from the merged model's score."""
        metric = answer_metric(evaluate_metric)
        merged, engine = evaluation.candidate[metric], answer_score(answers, conversations, metric)
        return cls(build_s, engine_bytes, metric, merged, engine, merged - engine)  # text metrics: higher is better

    def headline(self) -> str:
        return f"{self.engine_bytes:,} bytes, {self.metric} {self.engine_score:.3f}"


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


def engine_answers(
    ctx: RunContext, conversations: list[Conversation], engine_dir: Path, tokenizer_dir: Path, scratch: Path
) -> list[str]:
    """The engine's greedy answers to the eval questions (tasks/runners/tensorrt_llm_eval.py)."""
    from tasks.quality.chat import prompt_ids
    from tasks.quality.models import load_tokenizer

    cfg = ctx.profile.evaluate
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
    return [json.loads(line)["answer"] for line in answers.read_text().splitlines()]


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
        conversations = eval_conversations(ctx, data, ctx.profile.evaluate.max_samples)
        answers = engine_answers(ctx, conversations, out_dir / "engine", out_dir / "tokenizer", scratch)
        metrics = EngineMetrics.measured(
            build_s,
            sum(p.stat().st_size for p in (out_dir / "engine").rglob("*.engine")),
            EvaluationMetrics.of(evaluation),
            answers,
            conversations,
            ctx.profile.evaluate.metric,
        )
        shutil.rmtree(scratch, ignore_errors=True)
        if metrics.accuracy_drop > ctx.profile.quantize.max_accuracy_drop:
            raise CheckFailed(
                f"build_engine: {metrics.metric} drops by {metrics.accuracy_drop:.3f} in the "
                f"{ctx.profile.quantize.tensorrt_llm.qformat} engine > quantize.max_accuracy_drop "
                f"{ctx.profile.quantize.max_accuracy_drop}"
            )
        return metrics.as_mlflow()

    return run_cached(ctx, "build_engine", key, produce, headline=lambda m: EngineMetrics.from_mlflow(m).headline())
