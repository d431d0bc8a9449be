"""How a user's own data is judged on the defaults (issue 72): the metric and the answer length follow from the eval
split's references (tasks/quality/answer_kind.py), the margin means "clearly better" on any metric, the permutation
baseline tells a model that learned the task from one that learned its answers' phrasing, and cpu-tiny's antonym
numbers hold only on its own exam (evaluate.for_exam)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.evaluate import Baseline, EvaluationMetrics, require_improvement
from tasks.platform.config import load_profile
from tasks.platform.errors import BadInput, CheckFailed
from tasks.quality.answer_kind import choose_answer_length, choose_metric, decide
from tasks.quality.scoring import other_records, permuted_scores
from tasks.quality.stats import Difference

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "profiles" / "data"


def references(path: Path) -> list[str]:
    found = []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        turns = record.get("conversations") or record.get("messages")
        found.append(turns[-1].get("value", turns[-1].get("content")) if turns else record["output"])
    return found


def conversation(question: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def test_the_metric_follows_the_references_of_the_shipped_sets_and_a_label_set():
    antonyms = choose_metric(references(DATA / "antonyms-eval.jsonl"))
    assert antonyms.value == "exact_match" and antonyms.why == "closed references: 100% of 39 at most 3 words"
    finance = choose_metric(references(DATA / "finance_qa_zh.jsonl"))
    assert finance.value == "rouge_l" and finance.why.startswith("open-ended references: median ")
    labels = choose_metric(["the answer is positive", "the answer is negative"] * 15)  # long, but a label set
    assert labels.value == "exact_match" and labels.why == "closed references: 2 distinct answers over 30"
    sentences = choose_metric([f"It is the {n}th answer, worded one way of many." for n in range(30)])
    assert sentences.value == "rouge_l"


def test_the_answer_length_has_room_for_the_references_and_is_capped():
    assert choose_answer_length([3] * 20, 256).value == 8  # at least eight, as cpu-tiny had
    chosen = choose_answer_length([*range(1, 100)], 256)  # 95th percentile 95 tokens
    assert chosen.value == 121 and chosen.why == "references: 95th percentile 95 tokens, median 50"
    capped = choose_answer_length([*range(1, 100)], 64)
    assert capped.value == 64 and capped.why.endswith("cut to evaluate.max_new_tokens_cap 64")


class Words:
    """A tokenizer stand-in: a token per word, and the closing EOS (answer_ids adds it)."""

    eos_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [1] * len(text.split())}


def test_deciding_again_on_a_decided_section_says_the_same_and_a_fixed_metric_that_does_not_fit_is_said():
    split = [conversation(f"q{n}", f"a long answer of many words number {n}") for n in range(30)]
    cfg = load_profile("cpu-tiny", [], str(DATA / "finance_qa_zh.jsonl")).evaluate
    decided, judging = decide(cfg, split, Words())
    assert (decided.metric, decided.max_new_tokens) == ("rouge_l", 14)  # 8 words + EOS: ceil(9 * 1.25) + 2
    assert decide(decided, split, Words())[1] == judging  # evaluate records what judged_as said
    fixed = decide(cfg.model_copy(update={"metric": "exact_match"}), split, Words())[1]
    assert fixed.metric.why.startswith("set by the profile; the references would choose rouge_l: open-ended")
    assert "metric exact_match (set by the profile" in fixed.said()


def test_cpu_tinys_antonym_margin_holds_on_its_exam_only_and_an_override_still_wins(tmp_path):
    exam = load_profile("cpu-tiny").evaluate
    assert (exam.min_improvement, exam.confidence) == (0.3, None)
    own = load_profile("cpu-tiny", [], str(DATA / "finance_qa_zh.jsonl")).evaluate
    assert (own.metric, own.max_new_tokens, own.min_improvement, own.confidence) == ("auto", "auto", 0.0, 0.9)
    assert load_profile("cpu-tiny", ["evaluate.min_improvement=0.1"]).evaluate.min_improvement == 0.1
    named = load_profile("cpu-tiny", [], str(DATA / "finance_qa_zh.jsonl"), "profile").evaluate  # its exam named
    assert named.min_improvement == 0.3
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nevaluate:\n  for_exam:\n    min_improvment: 0.3\n")
    with pytest.raises(BadInput, match=r"evaluate.for_exam.min_improvment: unknown key"):
        load_profile(str(bad))


def test_the_permutation_baseline_pairs_each_answer_with_other_references_only():
    shifts = other_records(47)
    assert len(shifts) == 8 and 0 not in shifts and shifts == other_records(47)
    assert other_records(1) == []
    truths = ["alpha beta", "gamma delta", "epsilon zeta"]
    assert permuted_scores(truths, truths, "exact_match") == [0.0, 0.0, 0.0]  # never its own reference
    assert permuted_scores(["same"] * 3, ["same"] * 3, "exact_match") == [1.0, 1.0, 1.0]


def scores(base: float, candidate: float) -> EvaluationMetrics:
    return EvaluationMetrics({"rouge_l": base}, {"rouge_l": candidate}, candidate - base, 47)


def own_data(*overrides: str):
    decided = ["evaluate.metric=rouge_l", "evaluate.max_new_tokens=74", *overrides]
    return load_profile("cpu-tiny", decided, str(DATA / "finance_qa_zh.jsonl")).evaluate


def test_the_default_margin_refuses_an_interval_that_reaches_zero_naming_its_numbers():
    with pytest.raises(CheckFailed) as refused:
        require_improvement(own_data(), scores(0.137, 0.160), Difference(0.023, -0.004, 0.05, 0.9, 47))
    line = str(refused.value)
    assert line.startswith("evaluate: candidate rouge_l 0.160 vs base 0.137: the lower bound of its improvement -0.004")
    assert "< evaluate.min_improvement 0 (improvement 0.023 (90% interval -0.004..0.050, 47 samples))" in line
    assert "more eval records narrow the interval" in line and "\n" not in line


def test_a_gain_too_small_for_the_bases_headroom_is_refused():
    with pytest.raises(CheckFailed, match=r"it gains 2.3% of the base's headroom \(0.020 of 0.860\), less than "):
        require_improvement(own_data(), scores(0.140, 0.160), Difference(0.020, 0.010, 0.030, 0.9, 47))


def test_a_candidate_that_gains_as_much_against_other_questions_references_is_refused():
    """The shuffled finance set's numbers (this machine, `llmops run --data` a copy with its answers shuffled):
    ROUGE-L 0.063 -> 0.258, against other questions' references 0.059 -> 0.245."""
    baseline = Baseline(0.059, 0.245, Difference(0.010, -0.021, 0.046, 0.9, 45))
    with pytest.raises(CheckFailed) as refused:
        require_improvement(own_data(), scores(0.063, 0.258), Difference(0.195, 0.17, 0.22, 0.9, 45), baseline)
    line = str(refused.value)
    assert "but against other questions' references it gains +0.186 as well (0.059 -> 0.245)" in line
    assert (
        "beyond that baseline it improves 0.010 (90% interval -0.021..0.046, 45 samples), its lower bound not " in line
    )
    assert line.endswith("(evaluate.permutation_check)")
    learned = Baseline(0.111, 0.237, Difference(0.648, 0.616, 0.679, 0.9, 47))  # the finance set's own numbers
    require_improvement(own_data(), scores(0.117, 0.891), Difference(0.774, 0.74, 0.80, 0.9, 47), learned)


def test_the_runs_table_says_the_metric_chosen_and_why():
    from tasks.quality.answer_kind import Choice, Judging

    judging = Judging(Choice("rouge_l", "open-ended references: median 35 characters"), Choice(74, "references: ..."))
    found = EvaluationMetrics.of_scores(*two_scores(), Difference(0.77, 0.74, 0.8, 0.9, 2), None, judging)
    assert EvaluationMetrics.from_mlflow(found.as_mlflow()).headline("rouge_l") == (
        "rouge_l 0.100 -> 0.900 (open-ended references: median 35 characters; answers up to 74 tokens)"
    )


def two_scores():
    from tasks.quality.scoring import Scores

    def scores(value: float) -> Scores:
        return Scores({"rouge_l": [value, value], "answer_loss": [1.0, 1.0]}, ["a", "b"])

    return scores(0.1), scores(0.9)


def test_the_permutation_check_is_off_where_the_profile_says_so_or_the_metric_is_answer_loss():
    """The documented fix `--set evaluate.permutation_check=false` (and answer_loss, which has no such baseline)."""
    from tasks.evaluate import permutation_baseline

    split = [conversation(f"q{n}", f"answer number {n}") for n in range(2)]
    base, candidate = two_scores()
    on = own_data()
    assert permutation_baseline(on, split, base, candidate) is not None
    off = own_data("evaluate.permutation_check=false")
    assert permutation_baseline(off, split, base, candidate) is None
    loss = on.model_copy(update={"metric": "answer_loss"})
    assert permutation_baseline(loss, split, base, candidate) is None
