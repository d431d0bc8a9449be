"""evaluate: base vs candidate (base + adapter) on the held-out split, on the metric the profile gates on.

Every metric is computed for both models, per sample (tasks/quality/metrics.py): exact match, ROUGE-1/2/L
and BLEU-4 of the greedy answer, and the answer-token loss (the loss LlamaFactory trains on: answer
tokens and the closing <|im_end|>, prompt masked) with its perplexity. `evaluate.metric` picks the
one the checks use; `answer_loss` is lower-is-better and the checks turn around for it. Prompts are
encoded with the tokenizer's chat template, answers separately, the way LlamaFactory's template
encodes them, so the eval sees the same token boundaries as training.

The improvement over the base is the mean paired per-sample difference; with `evaluate.confidence`
its bootstrap interval's lower bound must reach `evaluate.min_improvement` (tasks/quality/stats.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tasks.data.splits import eval_conversations, require_samples
from tasks.platform.config import EvaluateSection
from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import RunContext, StageMetrics, StageResult, logger, run_cached
from tasks.quality import metrics
from tasks.quality.chat import Conversation, answer_ids, prompt_ids
from tasks.quality.metrics import higher_is_better
from tasks.quality.models import Compute, load_model, load_tokenizer
from tasks.quality.scoring import EVALUATION_FILE, Scores, decoded, describe, gain, score, scores_of
from tasks.quality.stats import Difference
from tasks.serving.eval_engine import EngineAnswers, answer_on_engine, engine_version


@dataclass
class EvaluationMetrics(StageMetrics):
    """Each metric's mean over the eval split for the base and the candidate ({metric: mean}, with the
    perplexity), and the candidate's improvement on `evaluate.metric` with its interval's bounds."""

    STAGES = ("evaluate",)

    base: dict[str, float]
    candidate: dict[str, float]
    improvement: float
    samples: int
    improvement_low: float | None = None
    improvement_high: float | None = None

    @classmethod
    def of_scores(cls, base: Scores, candidate: Scores, improvement: Difference) -> EvaluationMetrics:
        samples = len(candidate.predictions)
        return cls(base.summary(), candidate.summary(), improvement.value, samples, improvement.low, improvement.high)

    def as_mlflow(self) -> dict[str, float | str]:
        bounds = {"improvement_low": self.improvement_low, "improvement_high": self.improvement_high}
        return {
            **{f"base_{name}": value for name, value in self.base.items()},
            **{f"candidate_{name}": value for name, value in self.candidate.items()},
            "improvement": self.improvement,
            "samples": self.samples,
            **{name: value for name, value in bounds.items() if value is not None},
        }

    @classmethod
    def from_mlflow(cls, values: dict) -> EvaluationMetrics:
        def role(prefix: str) -> dict[str, float]:
            return {k.removeprefix(prefix): v for k, v in values.items() if k.startswith(prefix)}

        return cls(
            role("base_"),
            role("candidate_"),
            values["improvement"],
            values["samples"],
            values.get("improvement_low"),
            values.get("improvement_high"),
        )

    def headline(self, metric: str) -> str:
        return f"{metric} {self.base[metric]:.3f} -> {self.candidate[metric]:.3f}"


def evaluate(ctx: RunContext, data: StageResult, base: StageResult, adapter: StageResult) -> StageResult:
    cfg = ctx.profile.evaluate
    key = {
        "data": data.artifact.digest,
        "base": base.artifact.digest,
        "adapter": adapter.artifact.digest,
        # transformers' answers keep the keys they had; the judge grades at the gate, never here
        "evaluate": cfg.model_dump(exclude={"engine", "judge"}),
    }
    if cfg.engine == "vllm":  # the engine, and its release: another vLLM may answer otherwise
        key["engine"] = f"vllm {engine_version(ctx.profile)}"

    def produce(out_dir: Path) -> dict:
        conversations = eval_conversations(ctx, data, cfg.max_samples)
        require_samples(len(conversations), cfg, "evaluate")
        base_dir, adapter_dir = ctx.store.fetch(base.artifact.digest), ctx.store.fetch(adapter.artifact.digest)
        tokenizer = load_tokenizer(base_dir)
        if cfg.engine == "vllm":
            base_scores, candidate_scores = engine_scores(ctx, base_dir, adapter_dir, tokenizer, conversations)
        else:
            compute = Compute.of(ctx.profile)
            base_scores = score(load_model(base_dir, compute=compute), tokenizer, conversations, cfg)
            candidate_scores = score(load_model(base_dir, adapter_dir, compute), tokenizer, conversations, cfg)
        improvement = gain(candidate_scores.per_sample[cfg.metric], base_scores.per_sample[cfg.metric], cfg)
        result = EvaluationMetrics.of_scores(base_scores, candidate_scores, improvement)
        write_evaluation(
            out_dir / EVALUATION_FILE, cfg, result, improvement, conversations, base_scores, candidate_scores
        )
        logger().info("evaluate:\n" + score_table(result))
        require_improvement(cfg, result, improvement)
        return result.as_mlflow()

    return run_cached(
        ctx, "evaluate", key, produce, headline=lambda m: EvaluationMetrics.from_mlflow(m).headline(cfg.metric)
    )


def engine_scores(
    ctx: RunContext, base_dir: Path, adapter_dir: Path, tokenizer, conversations: list[Conversation]
) -> tuple[Scores, Scores]:
    """The base's and the candidate's scores from the serving engine (evaluate.engine vllm): the same prompt and
    answer ids as transformers gets, the answers decoded as generate's are."""
    sequences = [(prompt_ids(tokenizer, c), answer_ids(tokenizer, c)) for c in conversations]
    work = ctx.home / "work" / "evaluate" / ctx.tracker.run_id
    answered = answer_on_engine(
        ctx.profile,
        ctx.home,
        base_dir,
        adapter_dir,
        sequences,
        ctx.profile.evaluate.max_new_tokens,
        [tokenizer.eos_token_id],
        work,
        logger(),
    )

    def scores(model: EngineAnswers) -> Scores:
        return scores_of(decoded(tokenizer, model.answers), model.answer_losses, conversations)

    return scores(answered.base), scores(answered.candidate)


def write_evaluation(
    path: Path,
    cfg: EvaluateSection,
    result: EvaluationMetrics,
    improvement: Difference,
    conversations: list[Conversation],
    base: Scores,
    candidate: Scores,
) -> None:
    """The stage's record (evaluation.json): the metrics, the improvement, and every sample's answers and scores."""
    samples = [
        {
            "prompt": c[:-1],
            "expected": c[-1]["content"],
            "base": b,
            "candidate": p,
            "scores": {
                "base": {m: v[i] for m, v in base.per_sample.items()},
                "candidate": {m: v[i] for m, v in candidate.per_sample.items()},
            },
        }
        for i, (c, b, p) in enumerate(zip(conversations, base.predictions, candidate.predictions, strict=True))
    ]
    record = {
        "metric": cfg.metric,
        "higher_is_better": higher_is_better(cfg.metric),
        "metrics": result.as_mlflow(),
        "improvement": {
            "value": improvement.value,
            "interval": improvement.interval(),
            "confidence": improvement.confidence,
        },
        "samples": samples,
    }
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False))


def score_table(result: EvaluationMetrics) -> str:
    """Base and candidate, one row each, every metric a column."""
    names = [*metrics.TEXT_METRICS, "answer_loss", "perplexity"]
    header = "  " + " " * 10 + " ".join(f"{n:>11}" for n in names)
    rows = [
        f"  {label:<9} " + " ".join(f"{means[n]:>11.3f}" for n in names)
        for label, means in (("base", result.base), ("candidate", result.candidate))
    ]
    return "\n".join([header, *rows])


def require_improvement(cfg: EvaluateSection, result: EvaluationMetrics, improvement: Difference) -> None:
    """The candidate must beat the base by evaluate.min_improvement (with an interval: its lower bound must)."""
    bound = improvement.low if improvement.low is not None else improvement.value
    if bound < cfg.min_improvement:
        which = "the lower bound of its improvement" if improvement.low is not None else "its improvement"
        # A margin is in its metric's units: one set for another metric (cpu-tiny's 0.3, for exact match on antonyms)
        # refuses a model that did learn; the line says which setting to size, rather than only that it fell short.
        hint = (
            f"; the margin is in {cfg.metric}'s units: size evaluate.min_improvement for it, or pick a profile made "
            "for such answers (`llmops profiles list`)"
            if improvement.value > 0
            else ""
        )
        raise CheckFailed(
            f"evaluate: candidate {cfg.metric} {result.candidate[cfg.metric]:.3f} vs base "
            f"{result.base[cfg.metric]:.3f}: {which} {bound:.3f} < evaluate.min_improvement "
            f"{cfg.min_improvement}{f' (improvement {describe(improvement)})' if improvement.low is not None else ''}"
            f"{hint}"
        )
