"""Typed stage metrics: flattened to the MLflow keys the stages have always logged, read back unchanged from
the stage cache's record and from a remote stage's result, and the engine's accuracy drop on evaluate.metric."""

import json

import pytest

from tasks.base_model import BaseModelMetrics
from tasks.build_engine import EngineMetrics
from tasks.evaluate import EvaluationMetrics
from tasks.merge import MergeMetrics
from tasks.platform.config import load_profile
from tasks.platform.stage_cache import RunContext, StageResult, run_cached
from tasks.platform.store import LocalStore
from tasks.platform.tracking import start_run
from tasks.prepare_data import DatasetMetrics
from tasks.quality.metrics import answer_metric, rouge
from tasks.quality.scoring import answer_score
from tasks.quantize import QuantizeMetrics
from tasks.train import TrainMetrics

MEANS = {
    "exact_match": 0.9,
    "rouge_1": 0.95,
    "rouge_2": 0.9,
    "rouge_l": 0.95,
    "bleu_4": 0.8,
    "answer_loss": 0.2,
    "perplexity": 1.22,
}
EVALUATION = EvaluationMetrics({**MEANS, "exact_match": 0.1}, MEANS, 0.8, 40, improvement_low=0.7, improvement_high=0.9)
DATASET = DatasetMetrics(
    records_read=12,
    duplicates_dropped=1,
    empty_answers_dropped=1,
    records=10,
    train_records=8,
    eval_records=2,
    fingerprint="f" * 64,
)
ONNX = QuantizeMetrics(
    merged_bytes=1000,
    onnx_fp32_bytes=1100,
    quantized_bytes=300,
    metric="exact_match",
    scores={"merged": 0.9, "onnx_fp32": 0.9, "quantized": 0.85},
    top1_agreement=0.97,
    onnx_fp32_ms_per_token=2.0,
    quantized_ms_per_token=1.0,
    accuracy_drop=0.05,
)
ENGINE = EngineMetrics(12.5, 4096, "exact_match", 0.9, 0.88, 0.02)

# The keys of each stage's metrics (what MLflow gets and the StageResult carries) before they were typed.
# quantization.json's fields, in the order written before (its bytes are part of the artifact's digest)
ONNX_KEYS = [
    "merged_bytes",
    "onnx_fp32_bytes",
    "quantized_bytes",
    "merged_exact_match",
    "onnx_fp32_exact_match",
    "quantized_exact_match",
    "top1_agreement",
    "onnx_fp32_ms_per_token",
    "quantized_ms_per_token",
    "accuracy_drop",
]
KEYS_BEFORE = [
    (
        DATASET,
        {
            "records_read",
            "duplicates_dropped",
            "empty_answers_dropped",
            "records",
            "train_records",
            "eval_records",
            "fingerprint",
        },
    ),
    (BaseModelMetrics(1234, 300, 5.0, 3.0), {"parameters", "vocab_size", "pretrain_loss_first", "pretrain_loss_last"}),
    (BaseModelMetrics(), set()),
    (
        TrainMetrics(1.5, 30, 4.0, 900.0, 10.0, 12.0, 0, 2, 16, 128),
        {
            "final_loss",
            "steps",
            "samples_per_second",
            "tokens_per_second",
            "runtime_s",
            "wall_s",
            "resumed_from_step",
            "nodes",
            "world_size",
            "global_batch_size",
        },
    ),
    (
        EVALUATION,
        {f"{role}_{name}" for role in ("base", "candidate") for name in MEANS}
        | {"improvement", "samples", "improvement_low", "improvement_high"},
    ),
    (MergeMetrics(1e-6, 8), {"max_abs_logit_diff", "probe_samples"}),
    (ONNX, set(ONNX_KEYS)),
    (
        QuantizeMetrics(merged_bytes=5, quantized_bytes=5, accuracy_drop=0.0),
        {"merged_bytes", "quantized_bytes", "accuracy_drop"},
    ),
    (QuantizeMetrics(merged_bytes=5, quantized_bytes=2), {"merged_bytes", "quantized_bytes"}),
    (ENGINE, {"load_s", "checkpoint_bytes", "merged_exact_match", "engine_exact_match", "accuracy_drop"}),
]


@pytest.mark.parametrize("metrics,keys", KEYS_BEFORE, ids=lambda v: type(v).__name__ if not isinstance(v, set) else "")
def test_flattening_keeps_the_keys_logged_before_and_reads_back_the_same(metrics, keys):
    flat = metrics.as_mlflow()
    assert set(flat) == keys
    assert type(metrics).from_mlflow(json.loads(json.dumps(flat))) == metrics


def test_an_onnx_artifact_keeps_the_field_order_of_its_quantization_json():
    """quantization.json is written from these metrics and its bytes are part of the artifact's digest."""
    assert list(ONNX.as_mlflow()) == ONNX_KEYS


def test_scores_on_another_metric_are_named_by_it():
    rouge_l = QuantizeMetrics(
        merged_bytes=5, quantized_bytes=2, metric="rouge_l", scores={"merged": 0.6, "quantized": 0.5}, accuracy_drop=0.1
    )
    assert {"merged_rouge_l", "quantized_rouge_l"} <= set(rouge_l.as_mlflow())
    assert QuantizeMetrics.from_mlflow(rouge_l.as_mlflow()) == rouge_l
    engine = EngineMetrics(1.0, 10, "bleu_4", 0.5, 0.4, 0.1)
    assert set(engine.as_mlflow()) == {"load_s", "checkpoint_bytes", "merged_bleu_4", "engine_bleu_4", "accuracy_drop"}
    assert EngineMetrics.from_mlflow(engine.as_mlflow()) == engine


def test_a_dataset_with_a_held_out_set_carries_its_fingerprint():
    held_out = DatasetMetrics(**{**DATASET.__dict__, "eval_records_read": 3, "eval_fingerprint": "e" * 64})
    assert held_out.as_mlflow()["eval_fingerprint"] == "e" * 64
    assert DatasetMetrics.from_mlflow(held_out.as_mlflow()).eval_fingerprint == "e" * 64
    assert DatasetMetrics.from_mlflow(DATASET.as_mlflow()).eval_fingerprint is None


@pytest.fixture
def ctx(tmp_path):
    tracker = start_run(f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "mlartifacts", "unit", {})
    return RunContext(load_profile("cpu-tiny"), LocalStore(tmp_path / "store"), tracker, tmp_path)


def test_metrics_survive_the_cache_record_and_a_remote_stage_result(ctx):
    def produce(out_dir):
        (out_dir / "engine.bin").write_bytes(b"e" * 8)
        return ENGINE.as_mlflow()

    def headline(values: dict) -> str:
        return EngineMetrics.from_mlflow(values).headline()

    ran = run_cached(ctx, "build_engine", {"input": 1}, produce, headline)
    hit = run_cached(ctx, "build_engine", {"input": 1}, produce, headline)
    assert (ran.cached, hit.cached) == (False, True)
    assert EngineMetrics.of(ran) == EngineMetrics.of(hit) == ENGINE
    assert hit.headline == "4,096 bytes, exact_match 0.880"
    record = ctx.store.get_record("stages/build_engine", hit.key)
    assert record["metrics"] == ENGINE.as_mlflow()  # the record stays the flat dict MLflow gets
    remote = StageResult.from_dict(json.loads(json.dumps(hit.as_dict())))  # flows/remote_stage.py's return value
    assert EngineMetrics.of(remote) == ENGINE


def test_metrics_of_another_stage_are_refused():
    with pytest.raises(ValueError, match="QuantizeMetrics: describes a result of quantize, not of build_engine"):
        QuantizeMetrics.of(StageResult("build_engine", None, ENGINE.as_mlflow()))  # type: ignore[arg-type]


CONVERSATIONS = [
    [{"role": "user", "content": "When does the cold front arrive?"}, {"role": "assistant", "content": reference}]
    for reference in ("the cold front arrives tonight after dark", "rain spreads east by the morning")
]
# Near misses: no answer is exact, each shares most of its words with the reference.
ENGINE_ANSWERS = ["the cold front arrives tonight", "rain spreads east by morning"]


def test_the_engine_accuracy_drop_is_on_the_profiles_metric_not_exact_match():
    engine = EngineMetrics.measured(1.0, 10, EVALUATION, ENGINE_ANSWERS, CONVERSATIONS, "rouge_l")
    rouge_l = sum(rouge(a, c[-1]["content"])["rouge_l"] for a, c in zip(ENGINE_ANSWERS, CONVERSATIONS, strict=True)) / 2
    assert engine.metric == "rouge_l" and engine.merged_score == MEANS["rouge_l"]
    assert engine.engine_score == pytest.approx(rouge_l)
    assert engine.accuracy_drop == pytest.approx(MEANS["rouge_l"] - rouge_l)
    # On exact match these answers would score 0: a drop of 0.9, far above any max_accuracy_drop.
    assert engine.accuracy_drop < 0.3
    exact = EngineMetrics.measured(1.0, 10, EVALUATION, ENGINE_ANSWERS, CONVERSATIONS, "exact_match")
    assert (exact.engine_score, exact.accuracy_drop) == (0.0, pytest.approx(0.9))


def test_answer_loss_profiles_measure_answers_on_rouge_l():
    assert answer_metric("answer_loss") == "rouge_l" and answer_metric("bleu_4") == "bleu_4"
    engine = EngineMetrics.measured(1.0, 10, EVALUATION, ENGINE_ANSWERS, CONVERSATIONS, "answer_loss")
    assert engine.metric == "rouge_l" and engine.merged_score == EVALUATION.candidate["rouge_l"]
    assert answer_score(ENGINE_ANSWERS, CONVERSATIONS, "rouge_l") == engine.engine_score


def test_a_model_that_learned_but_fell_short_of_the_margin_is_told_which_setting_is_in_whose_units():
    """The default profile's margin (0.3, exact match on antonyms) met by a finance run scored on ROUGE-L: the refusal
    names the setting to size for that metric; a model that did not learn at all gets no such hint."""
    import pytest

    from tasks.evaluate import EvaluationMetrics, require_improvement
    from tasks.platform.config import load_profile
    from tasks.platform.errors import CheckFailed
    from tasks.quality.stats import Difference

    cfg = load_profile("cpu-tiny", ["evaluate.metric=rouge_l"]).evaluate
    learned = EvaluationMetrics({"rouge_l": 0.137}, {"rouge_l": 0.239}, 0.102, 47)
    with pytest.raises(
        CheckFailed, match=r"its improvement 0.102 < evaluate.min_improvement 0.3; the margin is in rouge_l's units"
    ):
        require_improvement(cfg, learned, Difference(0.102, None, None, None, 47))
    with pytest.raises(CheckFailed) as refused:
        require_improvement(cfg, learned, Difference(-0.01, None, None, None, 47))
    assert "units" not in str(refused.value)
