"""Serving pieces that need no server: strict templates, the gate's decision, genai-perf parsing, CLI gate."""

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.benchmark import BenchmarkResult, Comparison, RoleBenchmark, ServingSummary
from tasks.gate import Quality, decide
from tasks.load.genai_perf import LoadLevel, parse_profile_export, prompts_key
from tasks.platform.config import BenchSection, GateSection, load_profile
from tasks.platform.errors import REJECTED_EXIT_CODE, BadInput, CheckFailed
from tasks.quality.stats import Difference, ratio_interval
from tasks.serving.repository import TEMPLATES, config_parameters, render_config, render_model
from tasks.serving.server import find_binary

LLM_VALUES = dict(
    max_batch_size=8,
    max_queue_delay_us=100,
    max_queue_size=32,
    instance_count=2,
    model_dir="/m",
    apply_chat_template="true",
    default_max_tokens=8,
    torch_threads=1,
    device="cpu",
    dtype="float32",
    artifact_sha256="a" * 64,
)


def parsed(folder: Path):
    """A rendered model folder's config.pbtxt, as Triton reads it."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse((folder / "config.pbtxt").read_text(encoding="utf-8"), model_config_pb2.ModelConfig())


def test_a_template_refuses_unknown_and_missing_values_and_fields_of_the_wrong_type():
    template = 'name: "" max_batch_size: 0 parameters { key: "a" value { string_value: "" } }'
    with pytest.raises(BadInput, match=r"no value for parameter\(s\) a"):
        render_config(template, "m", {"max_batch_size": 1}, "t")
    with pytest.raises(BadInput, match=r"unknown value\(s\) typo \(no such field or declared parameter\)"):
        render_config(template, "m", {"a": 1, "typo": 2}, "t")
    for wrong in (True, "8", -1, 1.5):
        with pytest.raises(BadInput, match="max_batch_size must be a whole number"):
            render_config(template, "m", {"a": 1, "max_batch_size": wrong}, "t")
    with pytest.raises(BadInput, match="not a Triton model config"):
        render_config("name: ${model_name}", "m", {}, "t")


def test_rendered_llm_config_has_profile_values_and_no_placeholder(tmp_path):
    folder = render_model("llm", tmp_path, "svc-v3", LLM_VALUES)
    config = parsed(folder)
    assert (config.name, config.max_batch_size, config.instance_group[0].count) == ("svc-v3", 8, 2)
    assert config.model_transaction_policy.decoupled and "exclude_input_in_output" in [i.name for i in config.input]
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 32
    assert {k: v.string_value for k, v in config.parameters.items()}["dtype"] == "float32"
    assert "${" not in (folder / "config.pbtxt").read_text() and (folder / "1" / "model.py").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["svc-v3"]  # no staging folder left behind


def test_the_llm_model_computes_in_the_profiles_dtype_on_cuda_and_fp32_on_the_cpu():
    """bf16 on a CUDA profile (Qwen2's fp16 activations overflow; the model once hardcoded fp16), fp32 on the CPU."""
    from tasks.serving.model_config import serving_model

    cuda = load_profile("cpu-tiny", ["hardware.accelerator=cuda", "hardware.gpus=1", "hardware.compute_dtype=bfloat16"])
    values = serving_model(cuda, Path("/m"), "a" * 64)[1]
    assert (values["device"], values["dtype"]) == ("cuda", "bfloat16")
    assert serving_model(load_profile("cpu-tiny"), Path("/m"), "a" * 64)[1]["dtype"] == "float32"


def test_every_template_renders_with_exactly_its_variables(tmp_path):
    """The served models only: no model in Triton forwards requests to another (no router, no BLS call)."""
    assert sorted(p.name for p in TEMPLATES.iterdir()) == ["llm", "llmapi", "lora", "vllm"]
    forwarding = [
        str(path.relative_to(TEMPLATES.parent.parent))
        for folder in (TEMPLATES, TEMPLATES.parent.parent.parent / "tasks")
        for path in folder.rglob("*.py")
        if "InferenceRequest(" in path.read_text()
    ]
    assert forwarding == []
    lora = {"base_model": "svc-base", "adapter_dir": "/a", "artifact_sha256": "b@c"}
    render_model("lora", tmp_path, "svc-v2", lora)
    with pytest.raises(BadInput, match="no value"):
        render_model("lora", tmp_path, "svc-v2", {"base_model": "svc-base"})
    with pytest.raises(BadInput, match="model name"):
        render_model("lora", tmp_path, "bad name", lora)


def test_vllm_model_renders_the_profiles_engine_settings_and_the_llm_inputs(tmp_path):
    """serve.backend vllm: the same inputs as the llm model (gateway, genai-perf and /generate unchanged), one
    engine per model, the KV cache from the profile, and nothing of the static batcher's settings."""
    from tasks.serving.model_config import serving_model

    profile = load_profile("cpu-tiny", ["serve.backend=vllm", "serve.vllm.kv_cache_gb=0.5", "serve.max_batch_size=32"])
    template, values = serving_model(profile, Path("/m"), "a" * 64)
    assert template == "vllm"
    config = parsed(render_model(template, tmp_path, "svc-v2", values))
    assert config.parameters["kv_cache_memory_bytes"].string_value == str(1 << 29)
    assert config.parameters["max_num_seqs"].string_value == "32" and config.instance_group[0].count == 1
    assert not config.HasField("dynamic_batching") and config.model_transaction_policy.decoupled
    llm = parsed(render_model("llm", tmp_path, "svc-v1", LLM_VALUES))

    def inputs(model) -> list[str]:
        return [tensor.name for tensor in model.input]

    # the llm model's inputs, vLLM's structured outputs (response_format), the adapter's name, which only the
    # gateway sets (its clients cannot): never a path; and the tools the chat template renders
    assert inputs(config) == [*inputs(llm), "structured_output", "lora_name", "tools"]
    assert serving_model(load_profile("cpu-tiny"), Path("/m"), "a" * 64)[0] == "llm"


def test_llmapi_model_has_the_llm_interface_and_passes_the_llm_args_as_json(tmp_path):
    """serve.backend llmapi: the llm model's inputs (gateway, genai-perf, served scoring unchanged), no dynamic
    batcher, and LLM() arguments that survive the config's string literal as the JSON llm_args renders."""
    from tasks.serving.llm_api import llm_args
    from tasks.serving.model_config import serving_model

    profile = load_profile("qwen2-14b-int4-tp2")
    template, values = serving_model(profile, Path("/ckpt/v3"), "e" * 64, 40960)
    config = parsed(render_model(template, tmp_path, "svc-v3", values))
    llm = parsed(render_model("llm", tmp_path, "svc-v1", LLM_VALUES))
    inputs = lambda model: [tensor.name for tensor in model.input]  # noqa: E731
    # the llm model's inputs but the logprobs ones, which the gateway does not pass to the LLM API yet (openai_fields.py)
    scoring = ("logprobs", "prompt_logprobs")
    assert template == "llmapi" and inputs(config) == [name for name in inputs(llm) if name not in scoring]
    assert not config.HasField("dynamic_batching") and config.model_transaction_policy.decoupled
    assert config.instance_group[0].count == 1
    rendered = json.loads(config.parameters["llm_args"].string_value)  # as the model reads it
    assert rendered == {
        **llm_args(profile),
        "kv_cache_config": {"enable_block_reuse": True, "free_gpu_memory_fraction": 0.9, "max_tokens": 40960},
    }
    assert rendered["tensor_parallel_size"] == 2 and config.parameters["gpu_device_ids"].string_value == "0,1"


def test_vllm_backend_without_its_environment_fails_with_what_to_run(tmp_path):
    from tasks.serving.champion import triton_launch

    profile = load_profile("cpu-tiny", ["serve.backend=vllm"])
    profile.serve.vllm.environment = str(tmp_path / "none")  # a profile file's setting (no --set may set it)
    with pytest.raises(BadInput, match=r"no vLLM environment at .*none.*make setup-vllm"):
        triton_launch(profile, tmp_path)


def test_a_second_vllm_engine_that_does_not_fit_in_memory_is_refused_before_loading(monkeypatch):
    import psutil

    from tasks.serving import vllm as vllm_serving

    profile = load_profile("cpu-tiny", ["serve.backend=vllm", "serve.vllm.kv_cache_gb=2"])
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": 3 << 30})())
    with pytest.raises(CheckFailed, match=r"svc-v2 needs about 3.50 GiB .* but 3.00 GiB is free"):
        vllm_serving.require_room(profile, "svc-v2")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": 4 << 30})())
    vllm_serving.require_room(profile, "svc-v2")


def test_missing_triton_binary_is_bad_input(monkeypatch):
    monkeypatch.setenv("LLMOPS_TRITONSERVER", "/nonexistent/tritonserver")
    with pytest.raises(BadInput, match="tritonserver binary /nonexistent/tritonserver: not found"):
        find_binary(None)


CANDIDATE = ServingSummary(
    latency_p99_ms=50.0, ttft_p99_ms=10.0, output_tokens_per_s=900.0, requests_per_s=20.0, error_rate=0.0
)


def rounds_of(*throughput_ratios: float) -> Comparison:
    """A comparison whose rounds measured these candidate/champion request-rate ratios (latency equal)."""
    champion = LoadLevel(5, 5, 5, 1, 1, 40, 40, 45, 900, 100, 128)
    pairs = [(champion, replace(champion, requests_per_s=100 * ratio)) for ratio in throughput_ratios]
    return Comparison.of(pairs, 4, BenchSection(rounds=2))


COMPARISON = rounds_of(0.9, 0.92, 0.88, 0.9)
GATE = GateSection(
    p99_request_latency_ms=100,
    p99_time_to_first_token_ms=20,
    min_throughput_ratio=0.8,
    max_task_metric_drop=0.02,
    max_serving_parity_drop=0.05,
)
QUALITY = Quality(
    "rouge_l",
    parity=Difference(0.0, -0.01, 0.02, 0.9, 40),
    drop_vs_champion=Difference(0.01, -0.02, 0.015, 0.9, 40),
    probe_tokens=3,
    max_tokens=16,
    served_artifact="a" * 64,
    measured_artifact="a" * 64,
)


def test_gate_passes_a_good_candidate_and_reports_every_check(tmp_path):
    report = decide(GATE, "svc", "2", "1", CANDIDATE, COMPARISON, QUALITY, quantization_accuracy_drop=0.0)
    assert report.passed and report.decision == "promote"
    assert [c.name for c in report.checks] == [
        "p99 request latency (ms)",
        "p99 time to first token (ms)",
        "error rate",
        "quantization accuracy drop",
        "served artifact is the measured artifact",
        "serving parity: rouge_l drop served vs offline",
        "served stop probe: answer tokens",
        "throughput ratio vs champion",
        "task metric drop vs champion (rouge_l, served)",
    ]
    json_path, md_path = report.write(tmp_path)
    written = json.loads(json_path.read_text())
    assert written["decision"] == "promote" and written["metric"] == "rouge_l"
    drop = next(c for c in written["checks"] if c["name"].startswith("task metric drop"))
    assert drop["interval"] == [-0.02, 0.015] and drop["samples"] == 40 and drop["passed"]
    ratio = next(c for c in written["checks"] if c["name"] == "throughput ratio vs champion")
    assert ratio["samples"] == 4 and 0.85 < ratio["interval"][0] < 0.9 < ratio["interval"][1] < 0.95
    assert "| throughput ratio vs champion | 0.8999 | 0.8" in md_path.read_text()
    assert "Gate: promote against v1" in report.description()


@pytest.mark.parametrize(
    "change,quality,failed",
    [
        ({"latency_p99_ms": 150.0}, {}, "p99 request latency (ms)"),
        ({"error_rate": 0.01}, {}, "error rate"),
        ({"quantization_accuracy_drop": 0.2}, {}, "quantization accuracy drop"),
        # the point drop passes (0.01 <= 0.02), the interval's upper bound does not
        (
            {},
            {"drop_vs_champion": Difference(0.01, -0.01, 0.04, 0.9, 40)},
            "task metric drop vs champion (rouge_l, served)",
        ),
        ({}, {"parity": Difference(0.3, 0.25, 0.35, 0.9, 40)}, "serving parity: rouge_l drop served vs offline"),
        ({}, {"probe_tokens": 16}, "served stop probe: answer tokens"),
        ({}, {"measured_artifact": "b" * 64}, "served artifact is the measured artifact"),
    ],
)
def test_gate_rejects_on_each_threshold(change, quality, failed):
    drop = change.get("quantization_accuracy_drop", 0.0)
    serving = {name: value for name, value in change.items() if name != "quantization_accuracy_drop"}
    report = decide(GATE, "svc", "2", "1", replace(CANDIDATE, **serving), COMPARISON, replace(QUALITY, **quality), drop)
    assert not report.passed and [c.name for c in report.checks if not c.passed] == [failed]
    assert failed in report.summary()


@pytest.mark.parametrize(
    "ratios,verdict",
    [
        ((0.5, 0.52, 0.48, 0.5), "FAIL"),  # half the champion's throughput, the whole interval below 0.8
        ((0.95, 1.05, 0.99, 1.02), "pass"),  # equal: the interval holds 1.0 and clears 0.8
        ((0.6, 1.1, 0.7, 1.0), "INCONCLUSIVE"),  # too noisy to tell: the interval straddles 0.8
    ],
)
def test_the_throughput_ratio_is_decided_on_its_interval_over_the_rounds(ratios, verdict):
    report = decide(GATE, "svc", "2", "1", CANDIDATE, rounds_of(*ratios), QUALITY)
    check = next(c for c in report.checks if c.name == "throughput ratio vs champion")
    assert check.verdict == verdict and report.passed == (verdict == "pass")
    if verdict == "INCONCLUSIVE":
        assert "inconclusive on 4 samples" in report.summary()
        assert "| INCONCLUSIVE |" in report.markdown()


def test_the_latency_ratio_is_checked_on_its_upper_bound():
    champion = LoadLevel(5, 5, 5, 1, 1, 40, 40, 45, 900, 100, 128)
    slower = [(champion, replace(champion, latency_p99_ms=45 * r)) for r in (1.3, 1.25, 1.35)]
    gate = GATE.model_copy(update={"max_latency_ratio": 1.2})
    report = decide(gate, "svc", "2", "1", CANDIDATE, Comparison.of(slower, 4, BenchSection(rounds=2)), QUALITY)
    assert [c.name for c in report.checks if not c.passed] == ["p99 latency ratio vs champion"]


def shadow_records(agreeing: int, disagreeing: int, failed: int = 0, sampled: int = 0) -> list[dict]:
    """Records as the gateway writes them: the champion answers "cold" in 20 ms, the candidate in 21 ms."""

    def record(candidate: str | None, temperature: float | None = None) -> dict:
        inputs = {"text_input": "hot", "max_tokens": 4} | ({"temperature": temperature} if temperature else {})
        error = None if candidate is not None else "HTTP 500: engine died"
        latencies = {"champion_s": 0.020, "candidate_s": 0.021}
        return {"inputs": inputs, "champion": "cold", "candidate": candidate, "error": error, **latencies}

    return (
        [record("cold")] * agreeing
        + [record("warm")] * disagreeing
        + [record(None)] * failed
        + [record("icy", temperature=0.8)] * sampled
    )


@pytest.mark.parametrize(
    "records,failed,inconclusive",
    [
        (shadow_records(60, 0, sampled=5), [], False),  # answers as the champion does; sampled ones not compared
        (shadow_records(3, 57), ["shadow: answers vs the champion's (exact_match)"], False),
        (shadow_records(50, 10), ["shadow: answers vs the champion's (exact_match)"], True),
        (shadow_records(54, 0, failed=6), ["shadow: candidate error rate"], False),
        (shadow_records(5, 0), ["shadow: copies answered (too little traffic to judge)"], True),
    ],
)
def test_the_shadow_window_is_checked_on_agreement_errors_and_traffic(records, failed, inconclusive):
    """Agreement is decided on its interval: 60 of 60 passes 0.8, 3 of 60 fails it, 50 of 60 (0.83; Wilson's
    interval about 0.74..0.90 at 90%) cannot tell."""
    from tasks.shadow import score

    decided = ["evaluate.metric=exact_match"]  # as the release decides it for the antonyms (tasks/evaluate.py)
    profile = load_profile("cpu-tiny", [*decided, "canary.shadow_min_requests=20", "bench.confidence=0.9"])
    shadowed = score(records, profile, seconds=5)
    gate = GATE.model_copy(update={"min_shadow_agreement": 0.8, "max_latency_ratio": 1.5})
    report = decide(gate, "svc", "2", "1", CANDIDATE, COMPARISON, QUALITY, shadowed=shadowed)
    assert [c.name for c in report.checks if not c.passed] == failed
    shadow_checks = [c for c in report.checks if c.name.startswith("shadow")]
    assert any(c.verdict == "INCONCLUSIVE" for c in shadow_checks) == inconclusive
    if len(records) == 65:
        assert (shadowed.requests, shadowed.compared, shadowed.agreement) == (65, 60, 1.0)
        agreement = next(c for c in shadow_checks if c.name.startswith("shadow: answers"))
        low, high = agreement.interval
        assert agreement.samples == 60 and 0.95 < low < high == 1.0
        latency = next(c for c in shadow_checks if c.name == "shadow: mean latency ratio vs champion")
        assert latency.value == pytest.approx(1.05)


def test_shadow_agreement_is_scored_with_the_profiles_metric():
    """rouge_l gives partial credit where exact match gives none; its interval is the bootstrap's."""
    from tasks.shadow import score

    records = shadow_records(0, 0)
    for answer in ("the cold one", "cold", "very cold indeed", "cold"):
        records.append(
            {"inputs": {"text_input": "hot"}, "champion": "cold", "candidate": answer, "error": None}
            | {"champion_s": 0.02, "candidate_s": 0.02}
        )
    records.append({"at": 0, "dropped": True})
    rouge = score(records, load_profile("cpu-tiny", ["evaluate.metric=rouge_l"]), 1)
    exact = score(records, load_profile("cpu-tiny", ["evaluate.metric=exact_match"]), 1)
    assert (exact.metric, exact.agreement) == ("exact_match", 0.5)
    assert rouge.metric == "rouge_l" and 0.5 < rouge.agreement < 1 and rouge.dropped == 1 and rouge.requests == 4
    low, high = rouge.agreement_interval
    assert low <= rouge.agreement <= high


def test_ratio_intervals_are_t_intervals_on_the_log_scale():
    equal = ratio_interval([1.0, 1.0, 1.0], 0.9)
    assert (equal.value, equal.low, equal.high) == (1.0, 1.0, 1.0)
    spread = ratio_interval([0.5, 2.0], 0.9)  # symmetric on the log scale: the geometric mean is 1
    assert spread.value == pytest.approx(1.0) and spread.low == pytest.approx(1 / spread.high)
    # t(0.95, 3) = 2.353: sd of log(1.1), log(1/1.1), ... over 4 rounds
    four = ratio_interval([1.1, 1 / 1.1, 1.1, 1 / 1.1], 0.9)
    half = 2.3534 * math.log(1.1) * math.sqrt(4 / 3) / 2
    assert four.high == pytest.approx(math.exp(half), rel=1e-3)
    one = ratio_interval([0.9], 0.9)  # one round measures no spread
    assert one.interval() is None and one.verdict(0.5, ">=") == "inconclusive"
    with pytest.raises(ValueError, match="ratios must be positive"):
        ratio_interval([1.0, 0.0], 0.9)


def test_bench_rounds_must_fit_the_budget():
    with pytest.raises(BadInput, match=r"max_rounds \(3\) must be at least rounds \(4\)"):
        load_profile("cpu-tiny", ["bench.max_rounds=3"])


def test_without_a_confidence_level_the_point_value_decides():
    point = replace(QUALITY, drop_vs_champion=Difference(0.01, None, None, None, 40))
    assert decide(GATE, "svc", "2", "1", CANDIDATE, COMPARISON, point).passed


def test_a_quantized_artifact_that_does_not_serve_is_not_gated_on():
    report = decide(GATE, "svc", "2", "1", CANDIDATE, COMPARISON, QUALITY, quantization_accuracy_drop=None)
    assert report.passed and "quantization accuracy drop" not in [c.name for c in report.checks]


def test_first_release_has_only_absolute_checks():
    report = decide(GATE, "svc", "1", None, CANDIDATE, None)
    assert report.passed and not any("champion" in c.name for c in report.checks)


def test_invalid_gate_thresholds_are_rejected_by_the_profile():
    with pytest.raises(BadInput, match=r"gate\.max_error_rate: Input should be less than or equal to 1"):
        load_profile("cpu-tiny", ["gate.max_error_rate=1.5"])
    with pytest.raises(BadInput, match=r"gate\.p99_request_latency_ms: Input should be greater than 0"):
        load_profile("cpu-tiny", ["gate.p99_request_latency_ms=-5"])
    with pytest.raises(BadInput, match="steps must be rising percentages"):
        load_profile("cpu-tiny", ["canary.steps=[50, 10]"])


def export(**overrides):
    def stats(v):
        return {"unit": "ms", "avg": v, "p50": v, "p90": v, "p99": v * 2, "min": v, "max": v * 2}

    data = {
        "time_to_first_token": stats(5),
        "inter_token_latency": stats(1),
        "request_latency": stats(20),
        "output_token_throughput": {"unit": "tokens/sec", "avg": 800.0},
        "request_throughput": {"unit": "requests/sec", "avg": 50.0},
        "request_count": {"unit": "count", "avg": 32},
    }
    data.update(overrides)
    return data


def test_genai_perf_export_is_parsed(tmp_path):
    path = tmp_path / "profile_export_genai_perf.json"
    path.write_text(json.dumps(export()))
    level = parse_profile_export(path)
    assert level.latency_p99_ms == 40 and level.ttft_p99_ms == 10 and level.output_tokens_per_s == 800
    summary = ServingSummary.of({1: [level], 4: [replace(level, latency_p99_ms=60.0, requests_per_s=70.0)]}, 0.0, 8)
    assert summary.latency_p99_ms == 60.0 and summary.requests_per_s == 70.0  # worst p99, rate at the top level
    assert summary.output_tokens_per_s == 560.0  # generated tokens: 8 a request, not genai-perf's re-tokenized 800


def test_the_top_level_is_the_median_of_the_rounds(tmp_path):
    path = tmp_path / "profile_export_genai_perf.json"
    path.write_text(json.dumps(export()))
    level = parse_profile_export(path)
    rounds = [replace(level, requests_per_s=r, latency_p99_ms=p) for r, p in ((40, 30), (90, 10), (50, 20))]
    assert LoadLevel.median(rounds) == replace(level, requests_per_s=50, latency_p99_ms=20)


def test_benchmark_result_keeps_its_mlflow_keys_and_json(tmp_path):
    path = tmp_path / "profile_export_genai_perf.json"
    path.write_text(json.dumps(export()))
    level = parse_profile_export(path)
    candidate = RoleBenchmark({1: level, 4: level}, ServingSummary.of({1: [level], 4: [level]}, 0.25, 8), [level])
    flat = candidate.as_mlflow("candidate")
    per_level = {
        "ttft_p50_ms",
        "ttft_p90_ms",
        "ttft_p99_ms",
        "itl_avg_ms",
        "itl_p99_ms",
        "latency_p50_ms",
        "latency_p90_ms",
        "latency_p99_ms",
        "output_tokens_per_s",
        "requests_per_s",
        "request_count",
        "goodput_per_s",
    }
    summary = {"latency_p99_ms", "ttft_p99_ms", "output_tokens_per_s", "requests_per_s", "error_rate", "goodput_per_s"}
    assert set(flat) == {f"candidate_c{c}_{name}" for c in (1, 4) for name in per_level} | {
        f"candidate_{name}" for name in summary
    }
    assert flat["candidate_c4_request_count"] == 32 and flat["candidate_error_rate"] == 0.25
    written = BenchmarkResult(candidate).as_json()
    assert set(written["levels"]["candidate"]) == {"1", "4"} and "champion" not in written["summary"]
    assert len(written["rounds"]["candidate"]) == 1 and written["comparison"] is None
    compared = BenchmarkResult(candidate, candidate, COMPARISON)
    assert compared.as_json()["comparison"]["throughput"]["rounds"] == 4
    assert set(COMPARISON.as_mlflow()) == {"ratio_rounds"} | {
        f"ratio_{name}{bound}" for name in ("throughput", "latency_p99", "ttft_p99") for bound in ("", "_low", "_high")
    }
    assert written["summary"]["candidate"] == {name: flat[f"candidate_{name}"] for name in summary} | {"intervals": {}}


def test_synthesized_prompts_are_reused_only_for_the_same_tokenizer_and_prompt_settings(tmp_path):
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"model": "a"}')
    (tokenizer / "config.json").write_text("{}")
    bench = load_profile("cpu-tiny").bench
    key = prompts_key(tokenizer, bench)
    (tokenizer / "config.json").write_text('{"weights": "other"}')  # not a tokenizer file: same prompts
    assert prompts_key(tokenizer, bench) == key
    assert prompts_key(tokenizer, bench.model_copy(update={"concurrency": [7]})) == key
    assert prompts_key(tokenizer, bench.model_copy(update={"input_tokens": bench.input_tokens + 1})) != key
    assert prompts_key(tokenizer, bench.model_copy(update={"request_count": bench.request_count + 1})) != key
    (tokenizer / "tokenizer.json").write_text('{"model": "b"}')
    assert prompts_key(tokenizer, bench) != key


def test_genai_perf_export_missing_or_malformed(tmp_path):
    path = tmp_path / "profile_export_genai_perf.json"
    with pytest.raises(CheckFailed, match="genai-perf wrote no profile_export_genai_perf.json"):
        parse_profile_export(path)
    path.write_text("{not json")
    with pytest.raises(CheckFailed, match="malformed genai-perf export"):
        parse_profile_export(path)
    data = export()
    del data["time_to_first_token"]
    path.write_text(json.dumps(data))
    with pytest.raises(CheckFailed, match="malformed genai-perf export .*time_to_first_token"):
        parse_profile_export(path)


def test_llmops_gate_exit_codes(tmp_path):
    llmops = Path(sys.executable).parent / "llmops"
    good = decide(GATE, "svc", "2", "1", CANDIDATE, COMPARISON, QUALITY).write(tmp_path / "good")[0]
    bad = decide(
        GATE,
        "svc",
        "3",
        "1",
        CANDIDATE,
        COMPARISON,
        replace(QUALITY, drop_vs_champion=Difference(0.5, 0.4, 0.6, 0.9, 40)),
    ).write(tmp_path / "bad")[0]
    assert subprocess.run([llmops, "gate", str(good)], capture_output=True).returncode == 0
    rejected = subprocess.run([llmops, "gate", str(bad)], capture_output=True, text=True)
    assert rejected.returncode == REJECTED_EXIT_CODE
    assert rejected.stderr.strip().splitlines()[-1].startswith("llmops: rejected: gate rejected svc v3")
    (tmp_path / "junk.json").write_text("[]")
    assert subprocess.run([llmops, "gate", str(tmp_path / "junk.json")], capture_output=True).returncode == 2


def test_the_champion_serves_with_the_settings_it_was_released_with():
    from types import SimpleNamespace

    from tasks.serving.champion import released_profile

    released = load_profile("cpu-tiny", ["serve.max_queue_delay_us=20000", "serve.torch_threads=2"])
    version = SimpleNamespace(settings=json.loads(json.dumps(released.serve.model_settings())))  # as recorded
    candidate_run = load_profile("cpu-tiny", ["serve.max_batch_size=4", "serve.load_timeout_s=60"])
    served = released_profile(candidate_run, version).serve  # type: ignore[arg-type]
    assert (served.max_queue_delay_us, served.torch_threads, served.max_batch_size) == (20000, 2, 8)
    assert served.load_timeout_s == 60  # not a setting of the model: this run's
    assert released_profile(candidate_run, SimpleNamespace(settings=None)) is candidate_run  # type: ignore[arg-type]


def test_a_shadow_window_without_the_gateway_of_llmops_serve_is_refused_before_training(tmp_path):
    from tasks.serving.client import TritonTarget
    from tasks.shadow import refuse_shadow_without_gateway

    shadowed = load_profile("cpu-tiny", ["canary.shadow_s=30"])
    refuse_shadow_without_gateway(load_profile("cpu-tiny"), None, tmp_path)  # no window: nothing to refuse
    with pytest.raises(BadInput, match=r"^canary.shadow_s: .* none runs for LLMOPS_HOME .*start `llmops serve` first"):
        refuse_shadow_without_gateway(shadowed, None, tmp_path)
    attached = TritonTarget("http://127.0.0.1:8000", None, None, None)
    with pytest.raises(BadInput, match=r"^canary.shadow_s: .*a release attached to http://127.0.0.1:8000"):
        refuse_shadow_without_gateway(shadowed, attached, tmp_path)
    (tmp_path / "triton").mkdir()  # a server.json whose process is gone: no gateway either
    (tmp_path / "triton" / "server.json").write_text(json.dumps({"gateway_url": "https://127.0.0.1:1", "pid": 999999}))
    with pytest.raises(BadInput, match="none runs for LLMOPS_HOME"):
        refuse_shadow_without_gateway(shadowed, None, tmp_path)


def test_a_release_reads_the_control_key_again_when_a_restarted_triton_refuses_it(tmp_path):
    """`llmops serve` restarts its Triton with a new control key (control.key): the client of a release of another
    service loading there, refused with the old one, reads the file again and loads with the new key; a key that
    did not change is not retried. A release of the serve's own service holds no Triton key at all."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tasks.serving.client import CONTROL_HEADER, CONTROL_KEY_FILE, Triton, control_key
    from tasks.serving.publication import published_replicas

    current = {"key": "old-key"}
    seen: list[str] = []

    class Restricted(BaseHTTPRequestHandler):  # Triton's restricted model-control API: 403 without the key
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            seen.append(self.headers.get(CONTROL_HEADER, ""))
            ok = self.headers.get(CONTROL_HEADER) == current["key"]
            body = b"{}" if ok else b'{"error": "This API is restricted"}'
            self.send_response(200 if ok else 403)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Restricted)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    keys = tmp_path / "triton" / CONTROL_KEY_FILE
    keys.parent.mkdir()
    keys.write_text("old-key")
    try:
        [published] = published_replicas({"replicas": [{"url": url}]})
        assert published.control_key is None and not published.control_headers()
        triton = Triton(url, None, None, None, control_key(tmp_path), lambda: control_key(tmp_path))  # as `published`
        triton.load("svc-v2")
        current["key"] = "new-key"  # the Triton restarted
        keys.write_text("new-key")
        triton.load("svc-v3")
        assert seen == ["old-key", "old-key", "new-key"]
        current["key"] = "rotated-elsewhere"  # a key nobody wrote down: refused once, not retried
        with pytest.raises(CheckFailed, match="svc-v4 failed to load: This API is restricted"):
            triton.load("svc-v4")
        assert seen[3:] == ["new-key"]
    finally:
        server.shutdown()


# Every value a profile, a `--set` or a run parameter may bring to a rendered config, by template: the parameters each
# template declares (and the serving settings behind them) and its typed fields.
TEMPLATE_PARAMETERS = {
    kind: sorted(config_parameters((TEMPLATES / kind / "config.pbtxt").read_text()))
    for kind in ("llm", "vllm", "llmapi", "lora")
}
TEMPLATE_FIELDS = {"llm": ["max_batch_size", "max_queue_delay_us", "max_queue_size", "instance_count"],
                   "vllm": ["max_batch_size"], "llmapi": ["max_batch_size", "instance_count"], "lora": []}  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(sorted(TEMPLATE_PARAMETERS)),
    text=st.text(
        alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]) | st.sampled_from('"\\{}[]:\n\r\t #$'),
        max_size=80,
    ),
    number=st.integers(min_value=0, max_value=2**31 - 1),
    data=st.data(),
)
def test_any_text_a_run_may_set_lands_in_exactly_its_own_parameter(tmp_path, kind, text, number, data):
    """Issue 61, finding 1: a quote and braces in a value once added parameters (a second model_dir) to the rendered
    config. Quotes, braces, backslashes, newlines and non-ASCII now round-trip into exactly the parameter they were
    given for, every other parameter and field as given, nothing added."""
    target = data.draw(st.sampled_from(TEMPLATE_PARAMETERS[kind]))
    values: dict[str, object] = {key: f"v-{key}" for key in TEMPLATE_PARAMETERS[kind]}
    values |= {field: number for field in TEMPLATE_FIELDS[kind]}
    values[target] = text
    config = parsed(render_model(kind, tmp_path / kind, "svc-v9", values))
    assert {key: value.string_value for key, value in config.parameters.items()} == {
        key: value for key, value in values.items() if key in TEMPLATE_PARAMETERS[kind]
    }
    assert config.name == "svc-v9" and len(config.parameters) == len(TEMPLATE_PARAMETERS[kind])
    if TEMPLATE_FIELDS[kind]:
        assert config.max_batch_size == number


def test_a_serving_setting_that_is_not_one_of_the_engines_values_is_refused_naming_its_key():
    injected = 'float32" } } parameters { key: "model_dir", value: { string_value: "/elsewhere'
    with pytest.raises(BadInput, match=r"serve.vllm.dtype: Input should be 'auto', 'half', 'float16'"):
        load_profile("cpu-tiny", [f"serve.vllm.dtype={injected}"])


def test_a_model_refuses_a_model_dir_outside_its_folder_and_the_store(tmp_path, monkeypatch):
    """Issue 61, finding 1: a config naming another folder (a value planted through a run parameter, a link out of
    the store) is refused by the served model itself where its Triton's starter named the store's folders."""
    from tasks.serving.model_roots import ROOTS_ENV, served_folder

    store, model, elsewhere = tmp_path / "store", tmp_path / "repository" / "svc-v2", tmp_path / "secrets"
    for folder in (store / "objects" / "abc", model / "1" / "model", elsewhere):
        folder.mkdir(parents=True)
    (store / "objects" / "planted").symlink_to(elsewhere)
    args = {"model_repository": str(model), "model_version": "1"}
    monkeypatch.delenv(ROOTS_ENV, raising=False)
    assert served_folder(args, str(elsewhere)) == str(elsewhere)  # a Triton someone else started: their layout
    monkeypatch.setenv(ROOTS_ENV, str(store))
    assert served_folder(args, str(store / "objects" / "abc")) == str(store / "objects" / "abc")
    assert served_folder(args, "model") == str(model / "1" / "model")  # sent with the load request
    for planted in (str(elsewhere), str(store / "objects" / "planted"), "../../../secrets", "/etc"):
        with pytest.raises(ValueError, match=r"^model_dir .*: outside this model's folder and the artifact store"):
            served_folder(args, planted)


def test_a_release_waits_for_a_serve_that_died_without_stopping_instead_of_starting_a_service_of_its_own(tmp_path):
    """Issue 73, seen in the chaos soak (benchmarks/chaos.py): a release that opened its service while the serve lay
    SIGKILLed (its server.json left behind, naming a dead pid) started a gateway of its own on the serve's record and
    promoted there, while the serve, back, kept routing the old champion. Now it waits for that serve to publish again
    and rolls out on it; past the wait it is a TransientError naming the pid, never a service of its own."""
    import json
    import subprocess
    import sys
    import threading
    import time

    from tasks.platform.errors import TransientError
    from tasks.serving.publication import awaited_service, died_without_stopping

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    server_json = tmp_path / "triton" / "server.json"
    server_json.parent.mkdir()
    (tmp_path / "serving").mkdir()
    (tmp_path / "serving" / "control.key").write_text("serve-key")
    state = {"service": "demo", "url": "http://127.0.0.1:1", "control_url": "http://127.0.0.1:2", "pid": dead.pid}
    server_json.write_text(json.dumps(state))
    said: list[str] = []
    assert died_without_stopping(tmp_path, "demo") == dead.pid and died_without_stopping(tmp_path, "other") is None
    assert awaited_service(tmp_path, "other", 5, said.append) is None  # another service's serve: not this one's
    with pytest.raises(TransientError, match=rf"pid {dead.pid}\) died without stopping and is not back after 1s"):
        awaited_service(tmp_path, "demo", 1, said.append)
    standin = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "llmops-serve"])  # the serve back
    try:
        threading.Timer(1.0, lambda: server_json.write_text(json.dumps({**state, "pid": standin.pid}))).start()
        started = time.monotonic()
        found = awaited_service(tmp_path, "demo", 20, said.append)
        assert found is not None and found.control.url == "http://127.0.0.1:2" and time.monotonic() - started >= 1
    finally:
        standin.kill()
    assert (
        said[0] == f"serving: the llmops serve of demo (pid {dead.pid}) died without stopping; waiting up to 1s for it"
    )


def registry_of_two_versions(tmp_path):
    """A real MLflow registry (sqlite) with versions 1 and 2 of `svc`, v1 its champion; the run context that reads it."""
    from types import SimpleNamespace

    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model("svc")
    for _ in range(2):
        client.create_model_version("svc", source=str(tmp_path))
    client.set_registered_model_alias("svc", "champion", "1")
    ctx = SimpleNamespace(
        profile=SimpleNamespace(registry=SimpleNamespace(model_name="svc")), tracker=SimpleNamespace(client=client)
    )
    return ctx, client


def test_a_serve_starting_moves_the_registrys_champion_to_the_records_and_says_so(tmp_path):
    """Issue 73: the record says what clients get, and a promotion writes it first; a registry left behind (its alias
    write failed, a release promoted apart from the serve) follows it when the serve starts, in one direction, said.
    Never while a release owns the service. A real MLflow registry (sqlite)."""
    import time
    from dataclasses import replace

    from tasks.control.contract import Owner, RouteTable, Version
    from tasks.serving.champion import registry_follows_record

    ctx, client = registry_of_two_versions(tmp_path)
    recorded = RouteTable("svc", Version("svc-v2", "svc-v2", None, {"version": "2"}), None, {"svc-v2": 100.0})
    owned = replace(recorded, owner=Owner("run-9", time.time(), time.time() + 60, None, 3))
    assert registry_follows_record(ctx, owned) is None  # a release owns it: its promotion may be under way
    assert str(client.get_model_version_by_alias("svc", "champion").version) == "1"
    assert registry_follows_record(ctx, recorded) == (
        "llmops serve: the registry's champion was v1, the deployment record's v2: alias champion -> v2 "
        "(the record says what clients get)"
    )
    assert str(client.get_model_version_by_alias("svc", "champion").version) == "2"
    assert registry_follows_record(ctx, recorded) is None  # nothing differs now


def test_a_serve_moves_the_registrys_champion_once_its_controller_promoted_though_the_release_still_owns_it(
    tmp_path, capsys
):
    """Issue 73, found by the 12-minute chaos soak (seed 5): a release SIGSTOPped in its last window; the service's
    controller promoted its candidate in the record; the release woke past its lease, ended with exit 6 and wrote no
    alias: the registry said v1 while clients got v2, until the serve's next start. The running serve now follows a
    promotion its controller made, though the release's ownership has not lapsed; a rollout still ramping is not
    followed. A real MLflow registry (sqlite), the loop of `llmops serve` (flows/serve.py registry_follows)."""
    import threading
    import time
    from types import SimpleNamespace

    from flows.serve import registry_follows
    from tasks.control.contract import Owner, RouteTable, Version
    from tasks.control.rollout import Rollout

    ctx, client = registry_of_two_versions(tmp_path)
    champion, candidate = (Version(f"svc-v{n}", f"svc-v{n}", None, {"version": str(n)}) for n in (1, 2))
    owner = Owner("run-9", time.time(), time.time() + 600, None, 3)
    plan = Rollout("run-9", "svc-v2", (50.0, 100.0), 6.0, 0.05, 500.0, step=1, step_started_at=time.time())
    ramping = RouteTable("svc", champion, candidate, {"svc-v1": 50.0, "svc-v2": 50.0}, owner=owner, rollout=plan)
    done = RouteTable("svc", candidate, None, {"svc-v2": 100.0}, owner=owner, rollout=plan.ended("promoted", None, 1))
    tables = iter([ramping, ramping, done])
    fleet = SimpleNamespace(table=lambda: next(tables, done))
    stopped = threading.Event()
    loop = threading.Thread(target=registry_follows, args=(ctx, ramping, fleet, stopped, 0.05))
    loop.start()
    deadline = time.time() + 20
    while str(client.get_model_version_by_alias("svc", "champion").version) != "2" and time.time() < deadline:
        time.sleep(0.05)
    stopped.set()
    loop.join(5)
    assert str(client.get_model_version_by_alias("svc", "champion").version) == "2"
    assert capsys.readouterr().out.strip().splitlines() == [
        "llmops serve: the registry's champion was v1, the deployment record's v2: alias champion -> v2 "
        "(the record says what clients get)"
    ]
