"""A model's answers and scores on the eval split, in batches: what evaluate, quantize and the gate share.

Prompts are encoded with the tokenizer's chat template, answers separately, the way LlamaFactory's
template encodes them, so scoring sees the same token boundaries as training. The improvement over a
reference is the mean paired per-sample difference, with its bootstrap interval (tasks/quality/stats.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from tasks.platform.config import EvaluateSection, Profile
from tasks.platform.stage_cache import RunContext, StageResult
from tasks.quality import metrics
from tasks.quality.chat import Conversation, answer_ids, prompt_ids
from tasks.quality.metrics import higher_is_better, mean, text_scores
from tasks.quality.stats import Difference, paired_difference

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
    return [total / tokens for total, tokens in answer_nll(model, tokenizer, conversations)]


def preferred(
    model, tokenizer, chosen: list[Conversation], rejected: list[Conversation], beta: float
) -> dict[str, list[float]]:
    """Per preference pair, from the log-probabilities of its two answers given the prompt (summed over the answer's
    tokens, as DPO's loss reads a policy): preference_accuracy 1.0 where the chosen one is the more likely, else 0.0;
    reward_margin, beta times the chosen's log-probability minus the rejected's. The candidate's reward_margin minus
    the base's is DPO's reward margin with the base as its reference model (TRL's and LlamaFactory's rewards/margins,
    beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r)))), the quantity DPO's loss widens."""
    chosen_nll, rejected_nll = (answer_nll(model, tokenizer, side) for side in (chosen, rejected))
    pairs = list(zip(chosen_nll, rejected_nll, strict=True))
    return {
        "preference_accuracy": [float(c < r) for (c, _), (r, _) in pairs],
        "reward_margin": [beta * (r - c) for (c, _), (r, _) in pairs],
    }


def answer_nll(model, tokenizer, conversations: list[Conversation]) -> list[tuple[float, int]]:
    """Per sample, the summed cross-entropy of the answer's tokens (and the closing <|im_end|>) given the prompt, and
    how many tokens that is."""
    import torch

    losses: list[tuple[float, int]] = []
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
        losses += zip(nll.sum(dim=1).tolist(), counts.tolist(), strict=True)
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
        answers += decoded(tokenizer, out[:, batch["input_ids"].shape[1] :])
    return answers


def references(conversations: list[Conversation]) -> list[str]:
    return [c[-1]["content"] for c in conversations]


def answer_score(predictions: list[str], conversations: list[Conversation], metric: str) -> float:
    """Mean `metric` (a text metric) of the answers against the references: the quantize and engine stages'
    accuracy measure, scored as evaluate scores."""
    return mean(text_scores(predictions, references(conversations))[metric])


OTHER_REFERENCES = 8  # references of other records each answer is scored against (the permutation baseline)


def other_records(samples: int, count: int = OTHER_REFERENCES) -> list[int]:
    """Cyclic shifts spread over the split: sample i is paired with the references of i + shift for each; no shift is
    0, so no answer meets its own reference. Deterministic: a rerun scores the same pairs."""
    if samples < 2:
        return []
    return sorted({max(1, round(j * samples / (count + 1))) % samples for j in range(1, count + 1)} - {0})


def permuted_scores(predictions: list[str], references: list[str], metric: str) -> list[float]:
    """Each answer's mean `metric` (a text metric) against other records' references: what it scores for what it says
    whatever the question (the answers' shared phrasing, their length), where its own reference scores what it says
    about its own question."""
    shifts, count = other_records(len(references)), len(references)
    return [
        mean([metrics.metric_score(metric, answer, references[(i + shift) % count]) for shift in shifts])
        for i, answer in enumerate(predictions)
    ]


def scored_metric(values: dict, model: str) -> str | None:
    """The text metric a stage's flat metrics score `model` on (the key `<model>_<metric>`), if any."""
    return next((name for name in metrics.TEXT_METRICS if f"{model}_{name}" in values), None)


def score(
    model,
    tokenizer,
    conversations: list[Conversation],
    cfg: EvaluateSection,
    rejected: list[Conversation] | None = None,
    beta: float = 0.1,
) -> Scores:
    """Every metric per sample; with `rejected` (the eval split's pairs with the rejected answers, tasks/data/splits.py
    load_rejected), preference_accuracy and reward_margin (at DPO's `beta`) too."""
    predictions = generate_answers(model, tokenizer, conversations, cfg.answer_tokens)
    scores = scores_of(predictions, answer_losses(model, tokenizer, conversations), conversations)
    if rejected is not None:
        scores.per_sample |= preferred(model, tokenizer, conversations, rejected, beta)
    return scores


def scores_of(predictions: list[str], losses: list[float], conversations: list[Conversation]) -> Scores:
    """Every metric per sample, from a model's answers and its answer losses (however they were computed)."""
    return Scores({**text_scores(predictions, references(conversations)), "answer_loss": losses}, predictions)


def decoded(tokenizer, answers: list[list[int]]) -> list[str]:
    """Generated token ids as answers, decoded as `generate_answers` decodes them."""
    return [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in answers]


def gain(candidate: list[float], reference: list[float], cfg: EvaluateSection) -> Difference:
    """How much better the candidate scores than the reference on the gate metric, paired per sample
    (positive = better, whichever way the metric points), with its interval when evaluate.confidence is set."""
    difference = paired_difference(candidate, reference, cfg.confidence, cfg.bootstrap_resamples, cfg.seed)
    return difference if higher_is_better(cfg.metric) else difference.flipped()


def gate_comparison(profile: Profile, metric: str) -> EvaluateSection:
    """The evaluate section a gate check compares two served versions with on `metric` (a higher-is-better score):
    on their interval only where gate.quality_on_interval asks, else on the point value (the interval is then not
    computed, so it cannot decide)."""
    cfg = profile.evaluate
    confidence = cfg.confidence if profile.gate.quality_on_interval else None
    return cfg.model_copy(update={"metric": metric, "confidence": confidence})


def describe(difference: Difference) -> str:
    if difference.low is None:
        return f"{difference.value:.3f}"
    return (
        f"{difference.value:.3f} ({difference.confidence:.0%} interval {difference.low:.3f}..{difference.high:.3f}, "
        f"{difference.samples} samples)"
    )


def offline_scores(ctx: RunContext, evaluation: StageResult) -> dict:
    """The evaluate stage's record of the candidate: answers and per-sample scores (evaluation.json)."""
    return json.loads((ctx.store.fetch(evaluation.artifact.digest) / EVALUATION_FILE).read_text())
