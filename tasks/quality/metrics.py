"""Task metrics of an answer against its reference, per sample, for the evaluate and gate stages.

- exact_match: 1 when the answer equals the reference (surrounding whitespace ignored), else 0.
- rouge_1, rouge_2, rouge_l: ROUGE F-measures (rouge-chinese) over words.
- bleu_4: sentence BLEU up to 4-grams over words (nltk, smoothing method 3).
- answer_loss: mean cross-entropy of the reference answer's tokens given the prompt (computed by
  the model, tasks/evaluate.py); lower is better.
- preference_accuracy: on preference pairs, 1 when the model gives the chosen answer a higher summed log-probability
  than the rejected one given the prompt, else 0 (tasks/quality/scoring.py, preferred).
- reward_margin: on preference pairs, train.pref_beta times the chosen answer's summed log-probability minus the
  rejected one's; the candidate's minus the base's is DPO's reward margin, the base being DPO's reference model.
  Unbounded, so it has no headroom (evaluate.min_relative_improvement does not apply).

Words: jieba segments Chinese (and other unsegmented text) into words and leaves space-separated
words whole; whitespace is dropped. These are the segmenter and scorers LlamaFactory's own SFT
prediction metrics use (src/llamafactory/train/sft/metric.py, ComputeSimilarity), so numbers are
comparable with `llamafactory-cli train --predict_with_generate` on the 0..1 scale instead of 0..100;
one difference: LlamaFactory computes BLEU over characters, here it is over words like ROUGE.
"""

from __future__ import annotations

import logging
from functools import lru_cache

# The metrics the gate can decide on; True where higher is better.
GATE_METRICS: dict[str, bool] = {
    "exact_match": True,
    "rouge_l": True,
    "bleu_4": True,
    "answer_loss": False,
    "preference_accuracy": True,
    "reward_margin": True,
}
PREFERENCE_METRICS = ("preference_accuracy", "reward_margin")  # scored on held-out pairs (train.stage dpo)
TEXT_METRICS = ("exact_match", "rouge_1", "rouge_2", "rouge_l", "bleu_4")


def answer_metric(metric: str) -> str:
    """The metric answers alone are scored on (quantize, build_engine, the gate's served scores, shadow agreement):
    `evaluate.metric`, or ROUGE-L for answer_loss (a likelihood of the reference answer, which generated answers do
    not carry). The one place this is decided; evaluate.metric auto must have been decided from the eval split first
    (tasks/evaluate.py, judged_as)."""
    if metric not in GATE_METRICS:
        raise ValueError(f"evaluate.metric {metric}: not decided (auto is decided from the eval split's references)")
    return metric if metric in TEXT_METRICS else "rouge_l"


def higher_is_better(metric: str) -> bool:
    return GATE_METRICS[metric]


@lru_cache(maxsize=1)
def _jieba():
    import jieba

    jieba.setLogLevel(logging.WARNING)  # its dictionary-loading banner is not worth a log line per run
    return jieba


def words(text: str) -> list[str]:
    """Words of a text: jieba for unsegmented scripts, whitespace tokens dropped."""
    return [w for w in _jieba().lcut(text.strip()) if w.strip()]


def exact_match(prediction: str, reference: str) -> float:
    return float(prediction.strip() == reference.strip())


def rouge(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1, ROUGE-2 and ROUGE-L F-measures over words; 0 when either side has no words."""
    from rouge_chinese import Rouge

    hypothesis, gold = words(prediction), words(reference)
    if not hypothesis or not gold:
        return {"rouge_1": 0.0, "rouge_2": 0.0, "rouge_l": 0.0}
    scores = Rouge().get_scores(" ".join(hypothesis), " ".join(gold))[0]
    return {"rouge_1": scores["rouge-1"]["f"], "rouge_2": scores["rouge-2"]["f"], "rouge_l": scores["rouge-l"]["f"]}


def bleu_4(prediction: str, reference: str) -> float:
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    hypothesis, gold = words(prediction), words(reference)
    if not hypothesis or not gold:
        return 0.0
    return float(sentence_bleu([gold], hypothesis, smoothing_function=SmoothingFunction().method3))


def text_scores(predictions: list[str], references: list[str]) -> dict[str, list[float]]:
    """Every text metric, one score per sample, in sample order."""
    scores: dict[str, list[float]] = {name: [] for name in TEXT_METRICS}
    for prediction, reference in zip(predictions, references, strict=True):
        scores["exact_match"].append(exact_match(prediction, reference))
        for name, value in rouge(prediction, reference).items():
            scores[name].append(value)
        scores["bleu_4"].append(bleu_4(prediction, reference))
    return scores


def metric_score(metric: str, prediction: str, reference: str) -> float:
    """One text metric of one answer, where text_scores computes every one (the shadow window needs one)."""
    if metric == "exact_match":
        return exact_match(prediction, reference)
    if metric == "bleu_4":
        return bleu_4(prediction, reference)
    return rouge(prediction, reference)[metric]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
