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
from pathlib import Path

from tasks.data.splits import eval_conversations
from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import RunContext, StageResult, logger, run_cached
from tasks.quality import metrics
from tasks.quality.metrics import higher_is_better
from tasks.quality.models import Compute, load_model, load_tokenizer
from tasks.quality.scoring import EVALUATION_FILE, describe, gain, require_samples, score


def evaluate(ctx: RunContext, data: StageResult, base: StageResult, adapter: StageResult) -> StageResult:
    cfg = ctx.profile.evaluate
    key = {
        "data": data.artifact.digest,
        "base": base.artifact.digest,
        "adapter": adapter.artifact.digest,
        "evaluate": cfg.model_dump(),
    }

    def produce(out_dir: Path) -> dict:
        conversations = eval_conversations(ctx, data, cfg.max_samples)
        require_samples(len(conversations), cfg, "evaluate")
        base_dir = ctx.store.fetch(base.artifact.digest)
        tokenizer = load_tokenizer(base_dir)
        compute = Compute.of(ctx.profile)
        base_scores = score(load_model(base_dir, compute=compute), tokenizer, conversations, cfg)
        candidate_scores = score(
            load_model(base_dir, ctx.store.fetch(adapter.artifact.digest), compute), tokenizer, conversations, cfg
        )
        improvement = gain(candidate_scores.per_sample[cfg.metric], base_scores.per_sample[cfg.metric], cfg)
        result = {
            **base_scores.as_metrics("base"),
            **candidate_scores.as_metrics("candidate"),
            "improvement": improvement.value,
            "samples": len(conversations),
        }
        if improvement.low is not None and improvement.high is not None:
            result |= {"improvement_low": improvement.low, "improvement_high": improvement.high}
        samples = [
            {
                "prompt": c[:-1],
                "expected": c[-1]["content"],
                "base": b,
                "candidate": p,
                "scores": {
                    "base": {m: v[i] for m, v in base_scores.per_sample.items()},
                    "candidate": {m: v[i] for m, v in candidate_scores.per_sample.items()},
                },
            }
            for i, (c, b, p) in enumerate(
                zip(conversations, base_scores.predictions, candidate_scores.predictions, strict=True)
            )
        ]
        (out_dir / EVALUATION_FILE).write_text(
            json.dumps(
                {
                    "metric": cfg.metric,
                    "higher_is_better": higher_is_better(cfg.metric),
                    "metrics": result,
                    "improvement": {
                        "value": improvement.value,
                        "interval": improvement.interval(),
                        "confidence": improvement.confidence,
                    },
                    "samples": samples,
                },
                indent=1,
                ensure_ascii=False,
            )
        )
        names = [*metrics.TEXT_METRICS, "answer_loss", "perplexity"]
        rows = [
            f"  {label:<9} " + " ".join(f"{s[n]:>11.3f}" for n in names)
            for label, s in (("base", base_scores.summary()), ("candidate", candidate_scores.summary()))
        ]
        logger().info("evaluate:\n  " + " " * 10 + " ".join(f"{n:>11}" for n in names) + "\n" + "\n".join(rows))
        bound = improvement.low if improvement.low is not None else improvement.value
        if bound < cfg.min_improvement:
            which = "the lower bound of its improvement" if improvement.low is not None else "its improvement"
            raise CheckFailed(
                f"evaluate: candidate {cfg.metric} {candidate_scores.summary()[cfg.metric]:.3f} vs base "
                f"{base_scores.summary()[cfg.metric]:.3f}: {which} {bound:.3f} < evaluate.min_improvement "
                f"{cfg.min_improvement} (improvement {describe(improvement)})"
            )
        return result

    return run_cached(
        ctx,
        "evaluate",
        key,
        produce,
        headline=lambda m: f"{cfg.metric} {m[f'base_{cfg.metric}']:.3f} -> {m[f'candidate_{cfg.metric}']:.3f}",
    )
