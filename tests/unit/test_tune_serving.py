"""tune_serving's parts that need no Triton: the goodput objectives, the cache key, the baseline trial and the plot.
The search itself runs on a real Triton in tests/integration/test_serving.py (a release with tuning on, under
client load) and in benchmarks/tune_serving.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.load.genai_perf import genai_perf_command
from tasks.platform.config import load_profile
from tasks.tune_serving import (
    Trial,
    Tuned,
    cache_key,
    defaults,
    measured_capacity,
    plot_trials,
    space,
    with_settings,
)


def test_goodput_objectives_are_the_gates_ttft_and_the_tune_sections_inter_token_latency():
    profile = load_profile("cpu-tiny", ["tune.inter_token_latency_ms=50"])
    assert profile.goodput_objectives() == {"time_to_first_token": 1000, "inter_token_latency": 50}
    assert load_profile("cpu-tiny", ["gate.p99_time_to_first_token_ms=null"]).goodput_objectives() == {}


def test_genai_perf_gets_the_objectives_as_key_value_pairs():
    bench = load_profile("cpu-tiny").bench
    assert "--goodput" not in genai_perf_command("m", "localhost:8001", Path("tok"), bench, 8, Path("out"))
    command = genai_perf_command(
        "m", "localhost:8001", Path("tok"), bench, 8, Path("out"), None, {"time_to_first_token": 1000.0}
    )
    assert command[-2:] == ["--goodput", "time_to_first_token:1000"]


def test_a_cached_search_is_found_again_only_for_the_same_model_space_load_and_objectives():
    profile = load_profile("cpu-tiny")
    key = cache_key(profile, "a" * 64)
    assert key == cache_key(load_profile("cpu-tiny"), "a" * 64)
    assert key != cache_key(profile, "b" * 64)
    for change in ("tune.max_batch_size=[1,4]", "bench.concurrency=[16]", "gate.p99_time_to_first_token_ms=500"):
        assert key != cache_key(load_profile("cpu-tiny", [change]), "a" * 64), change


def test_the_first_trial_is_the_profiles_own_settings_and_a_trial_applies_only_its_own():
    profile = load_profile("cpu-tiny", ["serve.max_batch_size=4", "serve.max_queue_delay_us=500"])
    assert defaults(profile) == {"max_batch_size": 4, "max_queue_delay_us": 500, "instance_count": 2}
    tried = with_settings(profile, {"max_batch_size": 16, "max_queue_delay_us": 0, "instance_count": 1})
    assert (tried.serve.max_batch_size, tried.serve.max_queue_delay_us, tried.serve.instance_count) == (16, 0, 1)
    assert tried.serve.default_max_tokens == profile.serve.default_max_tokens


def test_the_plot_marks_the_profiles_settings_and_the_chosen_ones(tmp_path):
    default = Trial(0, {"max_batch_size": 8}, 10.0, 10.0, 120.0)
    best = Trial(1, {"max_batch_size": 16}, 14.0, 14.0, 90.0)
    tuned = Tuned(best.settings, default, best, [default, best])
    path = plot_trials(tuned, tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert "(1.40x)" in tuned.headline()


def test_each_engine_searches_the_settings_that_shape_its_batching():
    vllm = load_profile("qwen-7b-vllm-h100")
    assert space(vllm) == {"max_batch_size": [16, 32, 64, 128, 256]} and defaults(vllm) == {"max_batch_size": 256}
    llmapi = load_profile("qwen-7b-qlora-2xa10")
    assert set(space(llmapi)) == {"engine.max_batch_size", "engine.max_num_tokens"}
    assert defaults(llmapi) == {"engine.max_batch_size": 64, "engine.max_num_tokens": 4096}
    assert all(load_profile(name).tune.enabled for name in ("llama3-8b-h100-fp8", "qwen2-14b-int4-tp2"))


def test_the_space_holds_the_profiles_own_settings_which_are_the_first_trial():
    cpu_tiny = load_profile("cpu-tiny")  # two instances, where tune.instance_count lists only 1
    assert cpu_tiny.tune.instance_count == [1] and space(cpu_tiny)["instance_count"] == [1, 2]
    own = load_profile("cpu-tiny", ["serve.max_batch_size=3"])
    assert 3 in space(own)["max_batch_size"] and all(defaults(own)[k] in v for k, v in space(own).items())


def test_a_trial_renders_its_settings_into_the_engines_model(tmp_path):
    """What each trial loads: vLLM's max_num_seqs, and the LLM API's batch and token budgets in its llm_args."""
    from tasks.serving.model_config import serving_model
    from tasks.serving.repository import config_parameters, render_model

    vllm = with_settings(load_profile("qwen-7b-vllm-h100"), {"max_batch_size": 32})
    template, values = serving_model(vllm, Path("/m"), "a" * 64)
    config = (render_model(template, tmp_path, "svc-v2", values) / "config.pbtxt").read_text()
    assert config_parameters(config)["max_num_seqs"] == "32"
    llmapi = with_settings(
        load_profile("qwen-7b-qlora-2xa10"), {"engine.max_batch_size": 16, "engine.max_num_tokens": 8192}
    )
    template, values = serving_model(llmapi, Path("/ckpt"), "b" * 64, 4096)
    config = (render_model(template, tmp_path, "svc-v3", values) / "config.pbtxt").read_text()
    rendered = json.loads(config_parameters(config)["llm_args"])
    assert (rendered["max_batch_size"], rendered["max_num_tokens"]) == (16, 8192)


def test_a_trial_the_profiles_rules_refuse_is_an_error_not_a_load():
    """engine.max_num_tokens below train.cutoff_len (2048) without chunked prefill: the LLM could not take a prompt
    as long as training allowed."""
    with pytest.raises(ValueError, match="max_num_tokens 1024 is below train.cutoff_len"):
        with_settings(load_profile("qwen-7b-qlora-2xa10"), {"engine.max_num_tokens": 1024})


def test_the_champion_serves_at_its_own_tuned_settings():
    """The registered version's serve.model_settings, tuned settings included, is what released_profile serves."""
    from types import SimpleNamespace

    from tasks.serving.champion import released_profile

    profile = load_profile("qwen-7b-qlora-2xa10")
    tuned = with_settings(profile, {"engine.max_batch_size": 32, "engine.max_num_tokens": 8192})
    version = SimpleNamespace(settings=json.loads(json.dumps(tuned.served_settings())))  # as the tag records it
    champion = released_profile(profile, version)  # type: ignore[arg-type]
    assert (champion.engine.max_batch_size, champion.engine.max_num_tokens) == (32, 8192)
    assert released_profile(profile, SimpleNamespace(settings=None)) == profile  # type: ignore[arg-type]


def test_a_replica_holds_the_benchmarks_highest_concurrency_only_where_its_ttft_met_the_objective():
    """serve.autoscale's default in_flight target comes from here (flows/serve.py): the closed loop's concurrency
    where the chosen settings' TTFT p99 met gate.p99_time_to_first_token_ms, else nothing is known."""
    from tasks.platform.config.autoscale import AutoscaleSection

    profile = load_profile("cpu-tiny", ["bench.concurrency=[1,6]", "gate.p99_time_to_first_token_ms=200"])
    held = measured_capacity(profile, Trial(3, {}, goodput_per_s=9.0, ttft_p99_ms=150.04))
    assert held == {"in_flight": 6.0, "ttft_p99_ms": 150.0}
    assert measured_capacity(profile, Trial(3, {}, goodput_per_s=9.0, ttft_p99_ms=250.0)) is None
    assert measured_capacity(profile, Trial(3, {}, error="did not load")) is None
    assert AutoscaleSection().with_target(200.0, held["in_flight"]).target == 6.0
    assert AutoscaleSection(target=2).with_target(200.0, 6.0).target == 2.0  # the profile's own wins
    assert AutoscaleSection().with_target(200.0, None).target == 4.0
