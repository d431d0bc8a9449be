"""How an eval split is judged where the profile leaves it to the data (`evaluate.metric: auto`,
`evaluate.max_new_tokens: auto`): decided from the split's references, and said with the numbers that decided it.

- The metric: the references are closed answers (90% of them at most CLOSED_WORDS words, or at most LABELS distinct
  ones: a label set) -> exact_match, which scores them as their users do, all or nothing; else they are open-ended
  (sentences, worded one way of many) -> rouge_l, which credits the words an answer shares with its reference.
  Peers decide the same way from the task (MLflow evaluate's model_type "question-answering" against "text",
  lm-eval's task configs: exact_match for closed QA, ROUGE for generation).
- The answer length: the references' 95th percentile in the base model's own tokens, with room (x1.25 + 2) for an
  answer worded longer than its reference, at least MIN_TOKENS (a closed answer's eight, as cpu-tiny had) and at
  most the profile's cap. An answer cut short is scored as a worse one, so the length must fit the references.

Words are the metrics' words (jieba for unsegmented scripts, tasks/quality/metrics.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from tasks.platform.config import EvaluateSection
from tasks.quality.chat import Conversation, answer_ids
from tasks.quality.metrics import words

CLOSED_WORDS = 3  # a closed answer: a word, a name, a number, a short phrase
CLOSED_SHARE = 0.9  # ... for 90% of the references (a few longer ones do not make a set open-ended)
LABELS = 10  # at most this many distinct references: a label set, judged all or nothing
LENGTH_QUANTILE = 0.95
LENGTH_ROOM, LENGTH_EXTRA, MIN_TOKENS = 1.25, 2, 8


@dataclass(frozen=True)
class Choice:
    """A setting the data decided, and why, in the words the run prints."""

    value: str | int
    why: str

    def said(self, setting: str) -> str:
        return f"{setting} {self.value} ({self.why})"


def quantile(values: list[int], q: float) -> int:
    """The q-quantile of `values`, the nearest rank at or above it."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def choose_metric(references: list[str]) -> Choice:
    """exact_match for closed references, rouge_l for open-ended ones (the rule in this module's docstring)."""
    if not references:
        raise ValueError("choose_metric: no references")
    lengths = [len(words(r)) for r in references]
    short = sum(n <= CLOSED_WORDS for n in lengths) / len(lengths)
    distinct = len({r.strip() for r in references})
    median_chars = int(statistics.median(len(r.strip()) for r in references))
    if distinct <= LABELS and distinct < len(references):
        return Choice("exact_match", f"closed references: {distinct} distinct answers over {len(references)}")
    if short >= CLOSED_SHARE:
        return Choice(
            "exact_match", f"closed references: {short:.0%} of {len(references)} at most {CLOSED_WORDS} words"
        )
    return Choice(
        "rouge_l",
        f"open-ended references: median {median_chars} characters, {1 - short:.0%} over {CLOSED_WORDS} words",
    )


def choose_answer_length(reference_tokens: list[int], cap: int) -> Choice:
    """Room for the references' 95th percentile in tokens (the rule in this module's docstring)."""
    if not reference_tokens:
        raise ValueError("choose_answer_length: no references")
    top = quantile(reference_tokens, LENGTH_QUANTILE)
    wanted = max(MIN_TOKENS, math.ceil(top * LENGTH_ROOM) + LENGTH_EXTRA)
    chosen = min(cap, wanted)
    capped = f", cut to evaluate.max_new_tokens_cap {cap}" if chosen < wanted else ""
    return Choice(
        chosen,
        f"references: 95th percentile {top} tokens, median {int(statistics.median(reference_tokens))}{capped}",
    )


@dataclass(frozen=True)
class Judging:
    """How the eval split is judged: the metric and the answer length, each chosen by the data or set by the
    profile."""

    metric: Choice
    answer_tokens: Choice

    def said(self) -> str:
        length = self.answer_tokens
        return f"{self.metric.said('metric')}, answers of up to {length.value} tokens ({length.why})"

    def as_tags(self) -> dict[str, str]:
        """The MLflow tags of the run (and the evaluate record's `judging`)."""
        return {
            "evaluate.metric": str(self.metric.value),
            "evaluate.metric_why": self.metric.why,
            "evaluate.max_new_tokens": str(self.answer_tokens.value),
            "evaluate.max_new_tokens_why": self.answer_tokens.why,
        }


def decide(cfg: EvaluateSection, conversations: list[Conversation], tokenizer=None) -> tuple[EvaluateSection, Judging]:
    """`cfg` with its auto settings decided from the eval split's `conversations` (the answer length in `tokenizer`'s
    tokens), and how the split is judged. A setting the profile fixed is said as such, with what the references would
    have chosen where that differs: so deciding again on an already decided `cfg` says the same (evaluate does, to
    record it), and a fixed metric that does not fit the data is pointed out. Without a tokenizer the answer length
    is not measured (`llmops data validate` on a base model it does not have)."""
    references = [c[-1]["content"] for c in conversations]
    metric = fixed_or_chosen(cfg.metric, choose_metric(references))
    if tokenizer is None:
        if cfg.max_new_tokens == "auto":
            raise ValueError("decide: evaluate.max_new_tokens auto needs the base model's tokenizer")
        length = Choice(cfg.max_new_tokens, "set by the profile")
    else:
        lengths = [len(answer_ids(tokenizer, c)) for c in conversations]
        length = fixed_or_chosen(cfg.max_new_tokens, choose_answer_length(lengths, cfg.max_new_tokens_cap))
    decided = cfg.model_copy(update={"metric": metric.value, "max_new_tokens": length.value})
    return decided, Judging(metric, length)


def fixed_or_chosen(setting: str | int, chosen: Choice) -> Choice:
    """The data's choice where the setting is auto (or equals it), else the setting, saying what the data would
    choose."""
    if setting in ("auto", chosen.value):
        return chosen
    return Choice(setting, f"set by the profile; the references would choose {chosen.value}: {chosen.why}")
