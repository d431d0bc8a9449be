"""build_engine: the check on the runtime that will serve (GPU profiles that serve with TensorRT-LLM).

TensorRT-LLM builds no engines any more: its PyTorch backend loads the Hugging Face checkpoint from
quantize directly. So this stage loads that checkpoint with the LLM API under exactly the arguments
Triton's llmapi model will use (tasks/serving/llm_api.py), has it answer the eval split, and scores the
answers on `evaluate.metric` (as evaluate scores it; ROUGE-L for answer_loss, which answers do not carry).
The drop from the merged model's score is the quantization accuracy drop the gate checks, measured on
what users get. The stage keeps its name (flows and caches know it by it).

Cached by what determines the answers: the checkpoint's digest, the LLM arguments, the TensorRT-LLM version
(the one the runner really imported must match) and the GPU architecture, plus the eval data and settings.
Its artifact, check.json (and the contract), is a record, not something served: release registers and serves
the quantize stage's checkpoint, and the gate takes this stage's accuracy drop (flows/release.py).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from tasks.data.splits import eval_conversations
from tasks.evaluate import EvaluationMetrics
from tasks.platform.errors import BadInput, CheckFailed
from tasks.platform.stage_cache import RunContext, StageMetrics, StageResult, logger, run_cached
from tasks.quality.chat import Conversation, prompt_ids
from tasks.quality.contract import CONTRACT_FILE
from tasks.quality.metrics import answer_metric
from tasks.quality.models import load_tokenizer
from tasks.quality.scoring import answer_score, scored_metric
from tasks.serving import llm_api, tensorrt_llm

CHECK_FILE = "check.json"


@dataclass
class EngineMetrics(StageMetrics):
    """The load, and the serving runtime's accuracy against the merged model on `metric` (a text metric)."""

    STAGES = ("build_engine",)

    load_s: float
    checkpoint_bytes: int
    metric: str
    merged_score: float  # evaluate's candidate (base + adapter), which the merged model matches within merge.tolerance
    engine_score: float
    accuracy_drop: float

    def as_mlflow(self) -> dict[str, float | str]:
        return {
            "load_s": self.load_s,
            "checkpoint_bytes": self.checkpoint_bytes,
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
            values["load_s"],
            values["checkpoint_bytes"],
            metric,
            values[f"merged_{metric}"],
            values[f"engine_{metric}"],
            values["accuracy_drop"],
        )

    @classmethod
    def measured(
        cls,
        load_s: float,
        checkpoint_bytes: int,
        evaluation: EvaluationMetrics,
        answers: list[str],
        conversations: list[Conversation],
        evaluate_metric: str,
    ) -> EngineMetrics:
        """The runtime's answers scored on `evaluate.metric` the way evaluate scored the merged model's
        (ROUGE-L where evaluate decides on answer_loss), and the drop from the merged model's score."""
        metric = answer_metric(evaluate_metric)
        merged, engine = evaluation.candidate[metric], answer_score(answers, conversations, metric)
        return cls(load_s, checkpoint_bytes, metric, merged, engine, merged - engine)  # text metrics: higher is better

    def headline(self) -> str:
        return f"{self.checkpoint_bytes:,} bytes, {self.metric} {self.engine_score:.3f}"


def check_cache_key(
    checkpoint_digest: str, llm_args: dict, trtllm_version: str, gpu_arch: str, data_digest: str, evaluate: dict
) -> dict:
    """The answers, and the accuracy measured on them: the eval data and settings they are measured with count too."""
    return {
        "checkpoint": checkpoint_digest,
        "llm_args": llm_args,
        "tensorrt_llm": trtllm_version,
        "gpu_arch": gpu_arch,
        "data": data_digest,
        "evaluate": evaluate,
    }


def require_gpu_for(checkpoint_dir: Path, gpu_arch: str) -> None:
    """NVFP4 weights need Blackwell tensor cores (compute capability 10 or newer)."""
    quant_file = checkpoint_dir / "hf_quant_config.json"
    algo = json.loads(quant_file.read_text())["quantization"].get("quant_algo") if quant_file.is_file() else None
    major = int(gpu_arch.split()[0].removeprefix("sm")) // 10
    if algo == "NVFP4" and major < 10:
        raise BadInput(f"build_engine: an NVFP4 checkpoint needs a Blackwell GPU (sm100+), this is {gpu_arch}")


def require_servable(prompts: list[list[int]], args: dict, max_new_tokens: int) -> None:
    """Every eval prompt must fit the arguments the LLM is loaded under, as a served request must. The check runs one
    `LLM.generate` over all of them, and on the PyTorch backend a prompt longer than max_num_tokens without chunked
    prefill raises in its argument check (BaseLLM._check_arguments, 1.x llmapi/llm.py), which aborts the whole check
    after minutes of loading; a prompt beyond max_input_len, or with its answer beyond max_seq_len, cannot be served."""
    limit, names = args["max_input_len"], "max_input_len (train.cutoff_len)"
    if not args.get("enable_chunked_prefill") and args["max_num_tokens"] < limit:
        limit, names = args["max_num_tokens"], "engine.max_num_tokens (no chunked prefill)"
    too_long = [
        i for i, ids in enumerate(prompts) if len(ids) > limit or len(ids) + max_new_tokens > args["max_seq_len"]
    ]
    if too_long:
        first = prompts[too_long[0]]
        raise BadInput(
            f"build_engine: {len(too_long)} eval sample(s) do not fit the serving arguments, the first (#{too_long[0]}) "
            f"a {len(first)}-token prompt: at most {limit} tokens ({names}), and with evaluate.max_new_tokens "
            f"{max_new_tokens} at most {args['max_seq_len']} (max_seq_len: train.cutoff_len + engine.max_output_len); "
            "raise those, or leave such records out of the eval data"
        )


def build_engine(ctx: RunContext, data: StageResult, evaluation: StageResult, checkpoint: StageResult) -> StageResult:
    args = llm_api.llm_args(ctx.profile)
    key = check_cache_key(
        checkpoint.artifact.digest,
        args,
        tensorrt_llm.installed_version(),
        tensorrt_llm.gpu_arch(),
        data.artifact.digest,
        ctx.profile.evaluate.model_dump(exclude={"judge"}),
    )

    def produce(out_dir: Path) -> dict:
        source = ctx.store.fetch(checkpoint.artifact.digest)
        require_gpu_for(source, key["gpu_arch"])
        scratch = out_dir.parent / "scratch"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        conversations = eval_conversations(ctx, data, ctx.profile.evaluate.max_samples)
        tokenizer = load_tokenizer(source)
        prompts = [prompt_ids(tokenizer, c) for c in conversations]
        require_servable(prompts, args, ctx.profile.evaluate.answer_tokens)
        questions = scratch / "questions.jsonl"
        questions.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in prompts))
        (scratch / "llm_args.json").write_text(json.dumps(args))
        command = tensorrt_llm.check_command(
            source, scratch / "llm_args.json", questions, scratch / "report.json", ctx.profile.evaluate.answer_tokens
        )
        tensorrt_llm.run_logged(command, scratch / "check.log", "build_engine", logger())
        report = json.loads((scratch / "report.json").read_text())
        if report["tensorrt_llm"] != key["tensorrt_llm"]:
            raise CheckFailed(
                f"build_engine: the runner imported TensorRT-LLM {report['tensorrt_llm']}, but the installed "
                f"package says {key['tensorrt_llm']}: the image's Python path holds another tensorrt_llm"
            )
        metrics = EngineMetrics.measured(
            report["load_s"],
            sum(p.stat().st_size for p in source.glob("*.safetensors")),
            EvaluationMetrics.of(evaluation),
            report["answers"],
            conversations,
            ctx.profile.evaluate.metric,
        )
        shutil.rmtree(scratch, ignore_errors=True)
        checked = {"checkpoint": checkpoint.artifact.digest, "llm_args": args} | {
            name: report[name] for name in ("tensorrt_llm", "gpu_arch")
        }
        (out_dir / CHECK_FILE).write_text(json.dumps(checked, indent=2))
        shutil.copy2(source / CONTRACT_FILE, out_dir / CONTRACT_FILE)  # checked against the tokenizer at quantize
        ctx.tracker.log_params("engine", {"tensorrt_llm": checked["tensorrt_llm"], "gpu_arch": checked["gpu_arch"]})
        ctx.tracker.log_json("llm_args.json", args)
        if metrics.accuracy_drop > ctx.profile.quantize.max_accuracy_drop:
            raise CheckFailed(
                f"build_engine: {metrics.metric} drops by {metrics.accuracy_drop:.3f} on TensorRT-LLM "
                f"({ctx.profile.quantize.backend} checkpoint) > quantize.max_accuracy_drop "
                f"{ctx.profile.quantize.max_accuracy_drop}"
            )
        return metrics.as_mlflow()

    return run_cached(ctx, "build_engine", key, produce, headline=lambda m: EngineMetrics.from_mlflow(m).headline())
