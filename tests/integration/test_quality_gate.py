"""Releasing a model of open-ended answers: Chinese finance Q&A gated on ROUGE-L with bootstrap bounds,
scored on the served endpoint, with the train/serve contract recorded; exact match refuses the same data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_serving import FAST
from tests.servers import llmops, registry

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200), pytest.mark.usefixtures("shared_prefect")]

PROFILE = "cpu-tiny-qa-zh"
MODEL = "tiny-qwen2-qa-zh"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("quality-home")


@pytest.fixture(scope="module")
def release(home):
    result = llmops(home, "run", "--profile", PROFILE, *FAST)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_open_ended_chinese_answers_are_released_on_rouge_l_with_a_confidence_bound(home, release):
    report_path = Path(release.stdout.split("gate report: ")[1].split()[0])
    report = json.loads(report_path.read_text())
    assert report["decision"] == "promote" and report["metric"] == "rouge_l"
    parity = next(c for c in report["checks"] if c["name"] == "serving parity: rouge_l drop served vs offline")
    assert parity["passed"] and parity["interval"] is not None and parity["samples"] >= 20
    assert parity["interval"][1] <= 0.05  # the upper bound decided it

    client = registry(home)
    version = client.get_model_version_by_alias(MODEL, "champion")
    run = client.get_run(version.tags["mlflow.run_id"])
    metrics = run.data.metrics
    assert metrics["evaluate/improvement_low"] >= 0.2  # evaluate.min_improvement, on the lower bound
    assert metrics["evaluate/candidate_rouge_l"] > metrics["evaluate/base_rouge_l"] + 0.2
    for name in ("rouge_1", "rouge_2", "bleu_4", "exact_match", "answer_loss", "perplexity"):
        assert f"evaluate/candidate_{name}" in metrics, name
    assert metrics["gate/served_candidate_rouge_l"] == pytest.approx(metrics["evaluate/candidate_rouge_l"], abs=0.05)
    assert float(version.tags["metric.rouge_l"]) == pytest.approx(metrics["evaluate/candidate_rouge_l"])
    assert version.tags["contract.prompt_ids_sha256"] and version.tags["contract.eos_token_id"] != "None"
    assert version.description.startswith("Gate: promote against no champion (first release).")

    evaluation = Path(version.tags["artifact.evaluate.uri"].removeprefix("file://")) / "files" / "evaluation.json"
    samples = json.loads(evaluation.read_text())["samples"]
    assert all(set(s["scores"]["candidate"]) >= {"rouge_l", "bleu_4", "answer_loss"} for s in samples)
    served = json.loads((report_path.parent / "served_answers.json").read_text())
    assert len(served) == len(samples) and all("，" in s["expected"] for s in served)  # answers are sentences


def test_exact_match_on_the_same_data_is_refused_with_the_reason(home, release):
    result = llmops(home, "run", "--profile", PROFILE, "--set", "evaluate.metric=exact_match", *FAST)
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("llmops: error: evaluate: candidate exact_match ")
    assert "the lower bound of its improvement" in last and "< evaluate.min_improvement 0.2" in last
    assert "90% interval" in last


def test_an_eval_split_too_small_to_decide_says_so_before_training(home, release):
    result = llmops(
        home, "run", "--profile", PROFILE, "--set", "evaluate.max_samples=5", "--set", "train.learning_rate=3e-4"
    )
    assert result.returncode == 3
    # refused by prepare_data: the training a new learning rate asks for never started
    assert "Task run 'train" not in result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "llmops: error: prepare_data: the eval split (hash split of finance_qa_zh.jsonl) cut to evaluate.max_samples "
        "has 5 samples, fewer than evaluate.min_samples 20: too few to decide on; raise evaluate.max_samples (the "
        "split holds 47)"
    )
