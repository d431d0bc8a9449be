"""Task metrics and the paired bootstrap, against values worked out by hand."""

import numpy as np
import pytest

from tasks.quality.metrics import bleu_4, exact_match, rouge, text_scores, words
from tasks.quality.stats import paired_difference

# "the cat sat on mat" vs "the cat lay on mat": 5 words each, 4 shared unigrams, bigrams shared:
# (the cat), (on mat) of 4; longest common subsequence: the cat on mat (4).
# BLEU-4: p1 = 4/5, p2 = 2/4, p3 = 0/3 and p4 = 0/2 smoothed by method 3 to 1/(2*3) and 1/(4*2);
# equal lengths, no brevity penalty: (4/5 * 1/2 * 1/6 * 1/8) ** (1/4) = 0.30214.
ENGLISH = ("the cat sat on mat", "the cat lay on mat", 0.8, 0.5, 0.8, 0.30214)
# jieba: 市盈率/是/股价/除以/每股/收益 vs 市盈率/等于/股价/除以/每股/收益: 5 of 6 words shared,
# 3 of 5 bigrams, LCS 5; BLEU-4 (5/6 * 3/5 * 2/4 * 1/3) ** (1/4) = 0.53728.
CHINESE = ("市盈率是股价除以每股收益", "市盈率等于股价除以每股收益", 5 / 6, 3 / 5, 5 / 6, 0.53728)


def test_chinese_is_segmented_into_words_and_spaces_dropped():
    assert words("市盈率是股价除以每股收益") == ["市盈率", "是", "股价", "除以", "每股", "收益"]
    assert words("  the cat\tsat ") == ["the", "cat", "sat"]


@pytest.mark.parametrize("prediction, reference, rouge_1, rouge_2, rouge_l, bleu", [ENGLISH, CHINESE])
def test_rouge_and_bleu_match_hand_computed_values(prediction, reference, rouge_1, rouge_2, rouge_l, bleu):
    scores = rouge(prediction, reference)
    assert scores["rouge_1"] == pytest.approx(rouge_1, abs=1e-6)
    assert scores["rouge_2"] == pytest.approx(rouge_2, abs=1e-6)
    assert scores["rouge_l"] == pytest.approx(rouge_l, abs=1e-6)
    assert bleu_4(prediction, reference) == pytest.approx(bleu, abs=1e-4)


def test_identical_answers_score_one_and_empty_answers_zero():
    assert rouge("股价除以每股收益", "股价除以每股收益")["rouge_l"] == pytest.approx(1.0, abs=1e-6)
    assert bleu_4("股价除以每股收益", "股价除以每股收益") == pytest.approx(1.0)
    assert rouge("", "股价") == {"rouge_1": 0.0, "rouge_2": 0.0, "rouge_l": 0.0}
    assert bleu_4("   ", "股价") == 0.0


def test_exact_match_ignores_surrounding_whitespace_only():
    assert exact_match(" cold\n", "cold") == 1.0
    assert exact_match("Cold", "cold") == 0.0
    assert text_scores(["cold", "hot"], ["cold", "warm"])["exact_match"] == [1.0, 0.0]


def test_bootstrap_of_a_constant_difference_is_that_constant():
    difference = paired_difference([0.9, 0.5, 0.7], [0.4, 0.0, 0.2], confidence=0.9)
    assert (difference.value, difference.low, difference.high) == pytest.approx((0.5, 0.5, 0.5))


def test_bootstrap_interval_matches_the_normal_approximation_and_is_seeded():
    rng = np.random.default_rng(1)
    candidate = rng.normal(0.5, 1.0, 400)
    reference = candidate - rng.normal(0.2, 0.5, 400)
    difference = paired_difference(list(candidate), list(reference), confidence=0.95, seed=3)
    diffs = candidate - reference
    half_width = 1.96 * diffs.std(ddof=1) / np.sqrt(len(diffs))
    assert difference.value == pytest.approx(diffs.mean())
    assert difference.low == pytest.approx(diffs.mean() - half_width, abs=0.01)
    assert difference.high == pytest.approx(diffs.mean() + half_width, abs=0.01)
    assert paired_difference(list(candidate), list(reference), confidence=0.95, seed=3) == difference
    flipped = difference.flipped()
    assert (flipped.value, flipped.low, flipped.high) == (-difference.value, -difference.high, -difference.low)


def test_no_confidence_gives_the_point_difference_only():
    difference = paired_difference([1.0, 0.0], [0.0, 0.0])
    assert (difference.value, difference.low, difference.high, difference.samples) == (0.5, None, None, 2)
