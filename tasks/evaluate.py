"""evaluate: base vs candidate (base + adapter) on the held-out split, on the metric the profile gates on.

Every metric is computed for both models, per sample (tasks/metrics.py): exact match, ROUGE-1/2/L
and BLEU-4 of the greedy answer, and the answer-token loss (the loss LlamaFactory trains on: answer
tokens and the closing <|im_end|>, prompt masked) with its perplexity. `evaluate.metric` picks the
one the checks use; `answer_loss` is lower-is-better and the checks turn around for it. Prompts are
encoded with the tokenizer's chat template, answers separately, the way LlamaFactory's template
encodes them, so the eval sees the same token boundaries as training.

The improvement over the base is the mean paired per-sample difference; with `evaluate.confidence`
its bootstrap interval's lower bound must reach `evaluate.min_improvement` (tasks/stats.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tasks import metrics
from tasks.chat import Conversation, answer_ids, prompt_ids
from tasks.config import EvaluateSection
from tasks.data import eval_conversations
from tasks.errors import CheckFailed
from tasks.metrics import higher_is_better, mean, text_scores
from tasks.models import Compute, load_model, load_tokenizer
from tasks.stage import RunContext, StageResult, logger, run_cached
from tasks.stats import Difference, paired_difference

BATCH = 32
EVALUATION_FILE = "evaluation.json"


@dataclass
class Scores:
    """One model's answers on the eval split and every metric per sample ({metric: [score per sample]})."""

    per_sample: dict[str, list[float]]
    predictions: list[str]

    def summary(self) -> dict[str, float]:
        """Each metric's mean over the samples, and the perplexity of the mean answer loss."""
        means = {name: mean(values) for name, values in self.per_sample.items()}
        return {**means, "perplexity": math.exp(min(means["answer_loss"], 50.0))}

    def as_metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}_{name}": value for name, value in self.summary().items()}


def batches(items: list, size: int = BATCH):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def answer_losses(model, tokenizer, conversations: list[Conversation]) -> list[float]:
    """Per sample, the mean cross-entropy of the answer's tokens (and the closing <|im_end|>) given the prompt."""
    import torch

    losses = []
    for group in batches(conversations):
        rows = [(prompt_ids(tokenizer, c), answer_ids(tokenizer, c)) for c in group]
        width = max(len(p) + len(a) for p, a in rows)
        input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (p, a) in enumerate(rows):
            seq = p + a
            input_ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(p) : len(seq)] = torch.tensor(a)
            mask[i, : len(seq)] = 1
        with torch.no_grad():
            logits = model(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device)).logits
        logits = logits[:, :-1].float().cpu()
        target = labels[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100, reduction="none")
        counts = (target != -100).sum(dim=1).clamp(min=1)
        losses += (nll.sum(dim=1) / counts).tolist()
    return losses


def generate_answers(model, tokenizer, conversations: list[Conversation], max_new_tokens: int) -> list[str]:
    import torch

    answers = []
    for group in batches(conversations):
        prompts = [prompt_ids(tokenizer, c) for c in group]
        batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(model.device)
        with torch.no_grad():
            out = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        new_tokens = out[:, batch["input_ids"].shape[1] :]
        answers += [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new_tokens]
    return answers


def exact_match(predictions: list[str], conversations: list[Conversation]) -> float:
    """Share of answers equal to the reference (the quantize and engine stages' accuracy measure)."""
    return mean([metrics.exact_match(p, c[-1]["content"]) for p, c in zip(predictions, conversations, strict=True)])


def references(conversations: list[Conversation]) -> list[str]:
    return [c[-1]["content"] for c in conversations]


def score(model, tokenizer, conversations: list[Conversation], cfg: EvaluateSection) -> Scores:
    predictions = generate_answers(model, tokenizer, conversations, cfg.max_new_tokens)
    per_sample = {
        **text_scores(predictions, references(conversations)),
        "answer_loss": answer_losses(model, tokenizer, conversations),
    }
    return Scores(per_sample, predictions)


def require_samples(count: int, cfg: EvaluateSection, where: str) -> None:
    """A decision on a handful of samples is noise: refuse it, saying what to do."""
    if count < cfg.min_samples:
        raise CheckFailed(
            f"{where}: the eval split has {count} samples, fewer than evaluate.min_samples {cfg.min_samples}: too few "
            "to decide on; add data, raise data.eval_fraction, or name a held-out set with data.eval_source"
        )


def gain(candidate: list[float], reference: list[float], cfg: EvaluateSection) -> Difference:
    """How much better the candidate scores than the reference on the gate metric, paired per sample
    (positive = better, whichever way the metric points), with its interval when evaluate.confidence is set."""
    difference = paired_difference(candidate, reference, cfg.confidence, cfg.bootstrap_resamples, cfg.seed)
    return difference if higher_is_better(cfg.metric) else difference.flipped()


def describe(difference: Difference) -> str:
    if difference.low is None:
        return f"{difference.value:.3f}"
    return (
        f"{difference.value:.3f} ({difference.confidence:.0%} interval {difference.low:.3f}..{difference.high:.3f}, "
        f"{difference.samples} samples)"
    )


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


def offline_scores(ctx: RunContext, evaluation: StageResult) -> dict:
    """The evaluate stage's record of the candidate: answers and per-sample scores (evaluation.json)."""
    return json.loads((ctx.store.fetch(evaluation.artifact.digest) / EVALUATION_FILE).read_text())
