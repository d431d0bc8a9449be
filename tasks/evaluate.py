"""evaluate: base vs candidate (base + adapter) on the held-out split, on the metric the profile gates on.

Every metric is computed for both models, per sample (tasks/quality/metrics.py): exact match, ROUGE-1/2/L and BLEU-4
of the greedy answer, and the answer-token loss (the loss LlamaFactory trains on: answer tokens and the closing
<|im_end|>, prompt masked) with its perplexity; on preference pairs the preference accuracy (chosen more likely than
rejected). `evaluate.metric` picks the one the checks use; `answer_loss` is lower-is-better and the checks turn around
for it. Prompts are encoded with the tokenizer's chat template, answers separately, the way LlamaFactory's template
encodes them, so the eval sees the same token boundaries as training.

Where the profile leaves them `auto`, the metric and the answer length are decided from the eval split's
references before training (`judged_as`, tasks/quality/answer_kind.py) and said on the terminal, in MLflow and in the
release report.

The candidate is released when it is clearly better than the base (`require_improvement`), on three numbers:
- the improvement, the mean paired per-sample difference: with `evaluate.confidence` its bootstrap interval's lower
  bound must be above 0 and reach `evaluate.min_improvement` (tasks/quality/stats.py);
- the improvement as a share of the base's headroom, at least `evaluate.min_relative_improvement`;
- the improvement beyond the permutation baseline (`evaluate.permutation_check`): each answer is also scored against
  other questions' references, where an answer that says the same whatever the question scores as well as against
  its own; what the candidate gains there over the base is style, not the task, and the improvement must exceed it
  (its interval's lower bound above 0).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, fields
from pathlib import Path

from tasks.data.splits import eval_conversations, eval_rejected, require_samples
from tasks.platform.config import EvaluateSection, Profile
from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import RunContext, StageMetrics, StageResult, logger, run_cached
from tasks.quality import metrics
from tasks.quality.answer_kind import Judging, decide
from tasks.quality.chat import Conversation, answer_ids, prompt_ids
from tasks.quality.metrics import higher_is_better
from tasks.quality.models import Compute, load_model, load_tokenizer
from tasks.quality.scoring import (
    EVALUATION_FILE,
    Scores,
    decoded,
    describe,
    gain,
    permuted_scores,
    references,
    score,
    scores_of,
)
from tasks.quality.stats import Difference, paired_difference
from tasks.reporting.evidence import release_folder
from tasks.serving.eval_engine import EngineAnswers, answer_on_engine, engine_version

REQUIRED = ("base", "candidate", "improvement", "samples")  # EvaluationMetrics' fields without a default


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
    # the permutation baseline: both models' answers against other questions' references, and the improvement beyond
    # what the candidate gains there (None where evaluate.permutation_check is off or the metric is answer_loss)
    permutation_base: float | None = None
    permutation_candidate: float | None = None
    beyond_permutation: float | None = None
    beyond_permutation_low: float | None = None
    beyond_permutation_high: float | None = None
    judged: str | None = None  # how the split was judged, as the run said it ("metric rouge_l (open-ended ...), ...")
    metric_why: str | None = None  # why the deciding metric ("open-ended references: median 35 characters, ...")
    answer_tokens: int | None = None  # the answers' length the split was scored at

    @classmethod
    def of_scores(
        cls, base: Scores, candidate: Scores, improvement: Difference, baseline: Baseline | None, judging: Judging
    ) -> EvaluationMetrics:
        samples = len(candidate.predictions)
        found = cls(base.summary(), candidate.summary(), improvement.value, samples, improvement.low, improvement.high)
        found.judged, found.metric_why = judging.said(), judging.metric.why
        found.answer_tokens = int(judging.answer_tokens.value)
        if baseline is not None:
            found.permutation_base, found.permutation_candidate = baseline.base, baseline.candidate
            beyond = baseline.beyond
            found.beyond_permutation, found.beyond_permutation_low = beyond.value, beyond.low
            found.beyond_permutation_high = beyond.high
        return found

    def as_mlflow(self) -> dict[str, float | str]:
        optional = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in REQUIRED}
        return {
            **{f"base_{name}": value for name, value in self.base.items()},
            **{f"candidate_{name}": value for name, value in self.candidate.items()},
            "improvement": self.improvement,
            "samples": self.samples,
            **{name: value for name, value in optional.items() if value is not None},
        }

    @classmethod
    def from_mlflow(cls, values: dict) -> EvaluationMetrics:
        def role(prefix: str) -> dict[str, float]:
            return {k.removeprefix(prefix): v for k, v in values.items() if k.startswith(prefix)}

        optional = {f.name: values.get(f.name) for f in fields(cls) if f.name not in REQUIRED}
        return cls(role("base_"), role("candidate_"), values["improvement"], values["samples"], **optional)

    def headline(self, metric: str) -> str:
        """`rouge_l 0.117 -> 0.891 (open-ended references: ...; answers up to 74 tokens)`: the run's table says the
        choice and why."""
        why = f" ({self.metric_why}; answers up to {self.answer_tokens} tokens)" if self.metric_why else ""
        return f"{metric} {self.base[metric]:.3f} -> {self.candidate[metric]:.3f}{why}"


@dataclass(frozen=True)
class Baseline:
    """The permutation baseline on the deciding metric: each model's mean score against other questions' references,
    and the candidate's improvement beyond what it gains there (paired per sample, with its interval)."""

    base: float
    candidate: float
    beyond: Difference

    @property
    def gained(self) -> float:
        return self.candidate - self.base


def judged_as(ctx: RunContext, data: StageResult, base: StageResult) -> Profile:
    """The run's profile with evaluate.metric and evaluate.max_new_tokens decided where they are `auto`: from the
    references of the eval split evaluate scores, the length in the base model's own tokens. Said in the log and
    tagged on the MLflow run; every stage after it (evaluate, quantize, the engine check, the gate, the shadow window)
    reads the decided values."""
    cfg = ctx.profile.evaluate
    conversations = eval_conversations(ctx, data, cfg.max_samples)
    # the base model's files only where its tokens decide the length: a GPU profile's base (15 GB and more) is fetched
    # by the stages that run it, not by the flow's process before its training
    tokenizer = load_tokenizer(ctx.store.fetch(base.artifact.digest)) if cfg.max_new_tokens == "auto" else None
    decided, judging = decide(cfg, conversations, tokenizer)
    logger().info(f"evaluate: judged on {judging.said()}")
    ctx.tracker.set_tags(judging.as_tags())
    return ctx.profile.model_copy(update={"evaluate": decided})


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
            compute, rejected = Compute.of(ctx.profile), eval_rejected(ctx, data, cfg.max_samples)
            beta = ctx.profile.train.pref_beta
            base_scores, candidate_scores = (  # one model in memory at a time
                score(load_model(base_dir, adapter, compute), tokenizer, conversations, cfg, rejected, beta)
                for adapter in (None, adapter_dir)
            )
        improvement = gain(candidate_scores.per_sample[cfg.metric], base_scores.per_sample[cfg.metric], cfg)
        baseline = permutation_baseline(cfg, conversations, base_scores, candidate_scores)
        judging = decide(cfg, conversations, tokenizer)[1]  # as judged_as said it: cfg is decided already
        result = EvaluationMetrics.of_scores(base_scores, candidate_scores, improvement, baseline, judging)
        record = out_dir / EVALUATION_FILE
        write_evaluation(record, cfg, result, improvement, baseline, conversations, base_scores, candidate_scores)
        keep_for_report(ctx, record)  # a refusal stores no artifact; its report still shows what was scored
        logger().info("evaluate:\n" + score_table(result, baseline))
        try:
            require_improvement(cfg, result, improvement, baseline)
        except CheckFailed:  # a refusal stores no result, whose metrics MLflow would get: the run shows why anyway
            ctx.tracker.log_metrics("evaluate", result.as_mlflow())
            raise
        return result.as_mlflow()

    result = run_cached(
        ctx, "evaluate", key, produce, headline=lambda m: EvaluationMetrics.from_mlflow(m).headline(cfg.metric)
    )
    if result.cached:
        keep_for_report(ctx, ctx.store.fetch(result.artifact.digest) / EVALUATION_FILE)
    return result


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
        ctx.profile.evaluate.answer_tokens,
        [tokenizer.eos_token_id],
        work,
        logger(),
    )

    def scores(model: EngineAnswers) -> Scores:
        return scores_of(decoded(tokenizer, model.answers), model.answer_losses, conversations)

    return scores(answered.base), scores(answered.candidate)


def permutation_baseline(
    cfg: EvaluateSection, conversations: list[Conversation], base: Scores, candidate: Scores
) -> Baseline | None:
    """Both models' answers scored against other questions' references (tasks/quality/scoring.py, permuted_scores),
    and the candidate's improvement beyond what it gains there: per sample, (candidate - its permuted score) minus
    (base - its permuted score), paired, with its interval. None where evaluate.permutation_check is off, or the metric
    is answer_loss (a likelihood of the record's own reference)."""
    if not cfg.permutation_check or cfg.metric not in metrics.TEXT_METRICS:
        return None
    truths = references(conversations)
    base_other = permuted_scores(base.predictions, truths, cfg.metric)
    candidate_other = permuted_scores(candidate.predictions, truths, cfg.metric)
    specific = [own - other for own, other in zip(candidate.per_sample[cfg.metric], candidate_other, strict=True)]
    base_specific = [own - other for own, other in zip(base.per_sample[cfg.metric], base_other, strict=True)]
    beyond = paired_difference(specific, base_specific, cfg.confidence, cfg.bootstrap_resamples, cfg.seed)
    return Baseline(metrics.mean(base_other), metrics.mean(candidate_other), beyond)


def keep_for_report(ctx: RunContext, record: Path) -> None:
    """The evaluate record in the release's folder, where the release report reads it (tasks/reporting/evidence.py):
    a refused candidate has no artifact in the store, and its report must still show what was scored."""
    folder = release_folder(ctx.home, ctx.tracker.run_id)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(record, folder / EVALUATION_FILE)


def write_evaluation(
    path: Path,
    cfg: EvaluateSection,
    result: EvaluationMetrics,
    improvement: Difference,
    baseline: Baseline | None,
    conversations: list[Conversation],
    base: Scores,
    candidate: Scores,
) -> None:
    """The stage's record (evaluation.json): the metrics, the improvement, the permutation baseline, and every
    sample's answers and scores."""
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
        "judged": result.judged,
        "higher_is_better": higher_is_better(cfg.metric),
        "metrics": result.as_mlflow(),
        "improvement": {
            "value": improvement.value,
            "interval": improvement.interval(),
            "confidence": improvement.confidence,
        },
        "permutation": None
        if baseline is None
        else {
            "base": baseline.base,
            "candidate": baseline.candidate,
            "beyond": baseline.beyond.value,
            "interval": baseline.beyond.interval(),
        },
        "thresholds": {
            "min_improvement": cfg.min_improvement,
            "min_relative_improvement": cfg.min_relative_improvement,
            "confidence": cfg.confidence,
        },
        "samples": samples,
    }
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False))


def score_table(result: EvaluationMetrics, baseline: Baseline | None = None) -> str:
    """Base and candidate, one row each, every metric a column; the permutation baseline below where it was scored."""
    names = [
        *metrics.TEXT_METRICS,
        "answer_loss",
        "perplexity",
        *(n for n in metrics.PREFERENCE_METRICS if n in result.base),
    ]
    widths = [max(11, len(n)) for n in names]
    header = "  " + " " * 10 + " ".join(f"{n:>{w}}" for n, w in zip(names, widths, strict=True))
    rows = [
        f"  {label:<9} " + " ".join(f"{means[n]:>{w}.3f}" for n, w in zip(names, widths, strict=True))
        for label, means in (("base", result.base), ("candidate", result.candidate))
    ]
    if baseline is not None:
        rows.append(
            f"  against other questions' references: base {baseline.base:.3f}, candidate {baseline.candidate:.3f}; "
            f"improvement beyond that baseline {describe(baseline.beyond)}"
        )
    return "\n".join([header, *rows])


def headroom(metric: str, base: float) -> float | None:
    """How far the base is from a perfect score: 1 - base on a 0..1 metric, the base's loss on answer_loss; None on
    reward_margin, which has no perfect score."""
    if metric == "reward_margin":
        return None
    return 1.0 - base if higher_is_better(metric) else base


def require_improvement(
    cfg: EvaluateSection, result: EvaluationMetrics, improvement: Difference, baseline: Baseline | None = None
) -> None:
    """The candidate is clearly better than the base (this module's docstring): its improvement above 0 and at least
    evaluate.min_improvement (with an interval: its lower bound), at least evaluate.min_relative_improvement of the
    base's headroom, and beyond the permutation baseline. A refusal names the numbers that decided and what would
    change them, in one line."""
    metric = cfg.metric
    if cfg.min_improvement < 0:  # asked for no margin (a run about the pipeline, not the model)
        if improvement.value < cfg.min_improvement:
            raise CheckFailed(
                f"evaluate: candidate {metric} {result.candidate[metric]:.3f} vs base {result.base[metric]:.3f}: "
                f"its improvement {improvement.value:.3f} < evaluate.min_improvement {cfg.min_improvement:g}"
            )
        return
    scores = f"evaluate: candidate {metric} {result.candidate[metric]:.3f} vs base {result.base[metric]:.3f}"
    bound = improvement.low if improvement.low is not None else improvement.value
    which = "the lower bound of its improvement" if improvement.low is not None else "its improvement"
    interval = f" (improvement {describe(improvement)})" if improvement.low is not None else ""
    if bound < cfg.min_improvement or bound <= 0:
        # A margin is in its metric's units: one set for another metric (cpu-tiny's 0.3, for exact match on antonyms)
        # refuses a model that did learn; the line says which setting to size, rather than only that it fell short.
        if improvement.value > 0 and cfg.min_improvement > 0:
            hint = (
                f"; the margin is in {metric}'s units: size evaluate.min_improvement for it, or pick a profile made "
                "for such answers (`llmops profiles list`)"
            )
        elif improvement.value > 0 and improvement.low is not None:
            hint = "; more eval records narrow the interval (data.eval_fraction, or --eval-data)"
        else:
            hint = ""
        compared = "<" if bound < cfg.min_improvement else "<="
        raise CheckFailed(
            f"{scores}: {which} {bound:.3f} {compared} evaluate.min_improvement {cfg.min_improvement:g}{interval}{hint}"
        )
    room = headroom(metric, result.base[metric])
    share = improvement.value / room if room is not None and room > 0 else 0.0
    if room is not None and share < cfg.min_relative_improvement:
        raise CheckFailed(
            f"{scores}: it gains {share:.1%} of the base's headroom ({improvement.value:.3f} of {room:.3f}), less than "
            f"evaluate.min_relative_improvement {cfg.min_relative_improvement:g}"
        )
    if baseline is None:
        return
    beyond = baseline.beyond
    low = beyond.low if beyond.low is not None else beyond.value
    if low <= 0:
        lower = "its lower bound" if beyond.low is not None else "it"
        raise CheckFailed(
            f"{scores} (+{improvement.value:.3f}), but against other questions' references it gains "
            f"{baseline.gained:+.3f} as well ({baseline.base:.3f} -> {baseline.candidate:.3f}): beyond that baseline it "
            f"improves {describe(beyond)}, {lower} not above 0: its answers fit their own questions no better than "
            "others' (do the data's answers match their questions?) (evaluate.permutation_check)"
        )
