"""bench.tool aiperf without a server: AIPerf's command line and exports, the intervals of a model's runs, and the
gate's pass / fail / inconclusive on them (the runs themselves: tests/integration/test_serving.py)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from tasks.benchmark import Comparison, ServingSummary, compare_in_rounds, require_load_tool
from tasks.gate import decide
from tasks.load.aiperf import PAYLOAD_TEMPLATE, aiperf_command, aiperf_executable, first_error, parse_run_export
from tasks.load.load_level import LoadLevel, tool_failed
from tasks.platform.config import BenchSection, GateSection, load_profile
from tasks.platform.errors import BadInput, CheckFailed, TransientError
from tasks.quality.checks import GateReport
from tasks.quality.stats import mean_interval

LEVEL = LoadLevel(5, 6, 8, 1, 2, 40, 42, 45, 900, 100, 128, goodput_per_s=90)


def run_export(**overrides) -> dict:
    """A profile run's profile_export_aiperf.json, with the keys and statistics AIPerf 0.13.0 writes."""

    def stats(unit: str, avg: float, p50: float, p90: float, p99: float) -> dict:
        return {"unit": unit, "avg": avg, "p50": p50, "p90": p90, "p99": p99, "std": 1.0, "count": 32}

    data = {
        "schema_version": "1.0",
        "request_throughput": {"unit": "requests/sec", "avg": 50.0},
        "request_latency": stats("ms", 30, 29, 35, 40),
        "request_count": {"unit": "requests", "avg": 32.0},
        "time_to_first_token": stats("ms", 6, 5, 8, 10),
        "inter_token_latency": stats("ms", 3, 3, 4, 5),
        "output_token_throughput": {"unit": "tokens/sec", "avg": 400.0},
        "goodput": {"unit": "requests/sec", "avg": 45.0},
    }
    data.update(overrides)
    return data


def test_a_profile_run_export_is_parsed_with_its_goodput(tmp_path):
    path = tmp_path / "profile_export_aiperf.json"
    path.write_text(json.dumps(run_export()))
    level = parse_run_export(path)
    assert (level.requests_per_s, level.latency_p99_ms, level.ttft_p99_ms, level.itl_p99_ms) == (50, 40, 10, 5)
    assert level.goodput_per_s == 45
    path.write_text(json.dumps(run_export(goodput=None)))  # no objectives given: no goodput
    assert parse_run_export(path).goodput_per_s == 0


def test_a_missing_or_malformed_export_is_one_clear_error(tmp_path):
    with pytest.raises(CheckFailed, match="AIPerf wrote no profile_export_aiperf.json"):
        parse_run_export(tmp_path / "profile_export_aiperf.json")
    path = tmp_path / "profile_export_aiperf.json"
    path.write_text(json.dumps(run_export(request_latency={"unit": "ms"})))
    with pytest.raises(CheckFailed, match="malformed AIPerf export .*KeyError"):
        parse_run_export(path)


def test_the_command_streams_triton_generate_with_exact_output_lengths_and_the_objectives(tmp_path):
    cfg = BenchSection(input_tokens=16, output_tokens=8, request_count=32, profile_runs=4, confidence=0.9)
    command = aiperf_command(
        tmp_path / "aiperf", "svc-v2", "http://127.0.0.1:8000", tmp_path / "model", cfg, 4, tmp_path / "out",
        {"time_to_first_token": 1000, "inter_token_latency": 50}, runs=4,
    )  # fmt: skip

    def flag(name: str) -> str:
        return command[command.index(name) + 1]

    assert command[:2] == [str(tmp_path / "aiperf"), "profile"]
    assert flag("--endpoint-type") == "template" and "--streaming" in command
    assert flag("--url") == "http://127.0.0.1:8000" and flag("--endpoint") == "/v2/models/svc-v2/generate_stream"
    assert (flag("--output-tokens-mean"), flag("--output-tokens-stddev")) == ("8", "0")
    assert (flag("--num-profile-runs"), flag("--confidence-level"), flag("--concurrency")) == ("4", "0.9", "4")
    assert flag("--goodput") == "time_to_first_token:1000 inter_token_latency:50"
    extra = json.loads(flag("--extra-inputs"))  # one JSON object: AIPerf splits KEY:VALUE pairs on commas
    assert extra == {"payload_template": PAYLOAD_TEMPLATE, "response_field": "text_output"}
    body = json.loads(PAYLOAD_TEMPLATE.replace("{{ text|tojson }}", '"hi"').replace("{{ max_tokens|tojson }}", "8"))
    assert body == {"text_input": "hi", "max_tokens": 8, "min_length": 8, "stream": True}  # exactly 8 tokens
    # One run (a paired sample of the gate's rounds): no interval of AIPerf's own, which needs two runs
    single = aiperf_command(tmp_path / "aiperf", "svc-v2", "http://h:1", tmp_path / "m", cfg, 4, tmp_path / "o")
    assert single[single.index("--num-profile-runs") + 1] == "1" and "--confidence-level" not in single


def test_without_the_aiperf_environment_the_error_names_the_setup_before_any_training(tmp_path):
    with pytest.raises(BadInput, match=r"no aiperf in .*make setup-aiperf"):
        aiperf_executable(BenchSection(tool="aiperf", aiperf_environment=str(tmp_path)))
    profile = load_profile("cpu-tiny", ["bench.tool=aiperf"])
    profile.bench.aiperf_environment = str(tmp_path)  # a profile file's setting (no --set may set it)
    with pytest.raises(BadInput, match="make setup-aiperf"):
        require_load_tool(profile)  # the release flow's first step, before prepare_data
    require_load_tool(load_profile("cpu-tiny"))  # genai-perf: nothing to check


def test_aiperf_needs_three_runs_and_its_environment_comes_only_from_a_profile_file():
    with pytest.raises(ValueError, match="profile_runs"):
        BenchSection(profile_runs=2)
    with pytest.raises(BadInput, match="bench.aiperf_environment"):
        load_profile("cpu-tiny", ["bench.aiperf_environment=/tmp/elsewhere"])


def test_the_interval_of_a_mean_is_students_t():
    interval = mean_interval([10.0, 12.0, 14.0], 0.9)
    # mean 12, sd 2, t(0.95, 2) = 2.919986: 12 +- 2.919986 * 2 / sqrt(3)
    assert interval.value == 12 and interval.low == pytest.approx(8.6283, abs=1e-4)
    assert interval.high == pytest.approx(15.3717, abs=1e-4) and interval.samples == 3
    assert mean_interval([7.0], 0.9).interval() is None


def test_with_several_runs_the_candidates_own_checks_pass_fail_or_stay_inconclusive():
    def summary(*ttft_p99: float) -> ServingSummary:
        return ServingSummary.of({4: [replace(LEVEL, ttft_p99_ms=v) for v in ttft_p99]}, 0.0, 8, confidence=0.9)

    gate = GateSection(p99_time_to_first_token_ms=20)
    verdicts = {}
    for label, values in {"pass": (10, 11, 12), "fail": (30, 31, 32), "straddles": (10, 20, 30)}.items():
        check = next(
            c for c in decide(gate, "svc", "2", None, summary(*values), None).checks if "first token" in c.name
        )
        verdicts[label] = (check.verdict, check.samples, check.interval is not None)
    assert verdicts == {
        "pass": ("pass", 3, True),
        "fail": ("FAIL", 3, True),
        "straddles": ("INCONCLUSIVE", 3, True),
    }
    one_run = ServingSummary.of({4: [LEVEL]}, 0.0, 8, confidence=0.9)  # no interval: decided on the value
    assert one_run.intervals == {} and decide(gate, "svc", "2", None, one_run, None).passed


def test_the_goodput_ratio_is_decided_on_its_interval_and_needs_a_champion_that_met_the_objectives():
    def comparison(*candidate_goodputs: float, champion_goodput: float = 90) -> Comparison:
        champion = replace(LEVEL, goodput_per_s=champion_goodput)
        pairs = [(champion, replace(champion, goodput_per_s=g)) for g in candidate_goodputs]
        return Comparison.of(pairs, 4, BenchSection())

    gate = GateSection(min_goodput_ratio=0.8)
    candidate = ServingSummary.of({4: [LEVEL]}, 0.0, 8)

    def verdict(compared: Comparison) -> tuple[str, float | None]:
        check = next(c for c in decide(gate, "svc", "2", "1", candidate, compared).checks if "goodput" in c.name)
        return check.verdict, check.value

    assert verdict(comparison(88, 90, 92))[0] == "pass"
    assert verdict(comparison(0, 0, 0))[0] == "FAIL"  # the candidate met no objective in any run
    assert verdict(comparison(40, 90, 140))[0] == "INCONCLUSIVE"
    assert verdict(comparison(88, 90, 92, champion_goodput=0)) == ("INCONCLUSIVE", None)  # nothing to compare with


def test_the_summary_logs_each_interval_beside_its_value():
    runs = [replace(LEVEL, requests_per_s=r) for r in (90, 100, 110)]
    flat = ServingSummary.of({4: runs}, 0.0, 8, confidence=0.9).as_mlflow("candidate")
    assert flat["candidate_requests_per_s"] == 100
    assert flat["candidate_requests_per_s_low"] < 100 < flat["candidate_requests_per_s_high"]
    assert "candidate_intervals" not in flat and all(isinstance(v, float | int) for v in flat.values())


def test_the_gate_report_states_each_checks_sample_size(tmp_path: Path):
    runs = [replace(LEVEL, ttft_p99_ms=v) for v in (10, 11, 12)]
    report = decide(
        GateSection(p99_time_to_first_token_ms=20), "svc", "2", None, ServingSummary.of({4: runs}, 0.0, 8, 0.9), None
    )
    row = next(line for line in report.markdown().splitlines() if "first token" in line)
    assert row.split("|")[4].strip() == "3"


def test_a_written_gate_report_reads_back_as_it_was(tmp_path: Path):
    """A release started again after its approval applies the decision to the report its first process wrote."""
    runs = [replace(LEVEL, ttft_p99_ms=v) for v in (10, 11, 30)]
    report = decide(
        GateSection(p99_time_to_first_token_ms=20), "svc", "2", "1", ServingSummary.of({4: runs}, 0.0, 8, 0.9), None
    )
    json_path, _ = report.write(tmp_path)
    assert GateReport.read(json_path) == report and not report.passed


def test_a_failed_run_is_explained_by_the_first_error_in_aiperfs_logs(tmp_path):
    log = tmp_path / "profile_runs" / "run_0001" / "logs" / "aiperf.log"
    log.parent.mkdir(parents=True)
    log.write_text(
        "2026-11-25 13:04:12.600 - dataset_manager - INFO - configuring\n"
        "2026-11-25 13:04:12.679 - dataset_manager - ERROR - Dataset configuration failed: TokenizerError(...)\n"
        "2026-11-25 13:04:12.684 - system_controller - ERROR - Failed for SystemController\n"
    )
    assert first_error(tmp_path, "All runs failed") == "Dataset configuration failed: TokenizerError(...)"
    assert first_error(tmp_path / "nothing", "a\nAll runs failed\n") == "All runs failed"


def test_a_load_generator_that_met_a_dead_model_process_is_retried_and_one_that_met_a_live_server_is_not():
    """genai-perf's own words where one of the measured model's processes died (the chaos soak's CI failure: exit 3
    on a champion the serve reloads in seconds) make the failure transient; a live server answering otherwise, a
    check failed; a server gone, transient."""
    import socket

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        live = f"127.0.0.1:{listening.getsockname()[1]}"
        dead = "Thread [0] had error: Stub process 'tiny-qwen2-antonyms-v1_0_1' is not healthy."
        assert isinstance(tool_failed("benchmark: genai-perf exited with 1", live, dead), TransientError)
        assert type(tool_failed("benchmark: genai-perf exited with 1", live, "bad input shape")) is CheckFailed
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{closed.getsockname()[1]}"
    assert isinstance(tool_failed("benchmark: genai-perf exited with 1", gone), TransientError)


def test_rounds_go_on_while_the_candidates_own_interval_straddles_its_objective(monkeypatch, caplog):
    """CI saw a candidate rejected as inconclusive on 3 runs (TTFT p99 interval -337..1155 ms against 1000) with
    bench.max_rounds 2 unused: only the throughput ratio asked for more rounds. Every check the gate decides on an
    interval does now: the second round's 3 runs decide it."""
    ttft = iter([400, 1500, 300, 350, 380, 360, 390, 370, 365, 375])
    calls: list[str] = []

    class Runs:
        runs_per_round = 3

        def measure(self, served, concurrency, label=""):
            calls.append(served.name)
            return replace(LEVEL, ttft_p99_ms=next(ttft)) if served.name == "candidate" else LEVEL

    champion, candidate = (type("Served", (), {"name": name})() for name in ("champion", "candidate"))
    profile = load_profile(
        "cpu-tiny",
        ["bench.tool=aiperf", "bench.rounds=1", "bench.max_rounds=3", "gate.p99_time_to_first_token_ms=1000"],
    )
    monkeypatch.setattr("tasks.benchmark.logger", lambda: logging.getLogger("test.benchmark"))
    caplog.set_level(logging.INFO, "test.benchmark")
    rounds, comparison = compare_in_rounds(Runs(), champion, candidate, 2, profile)
    assert len(rounds["candidate"]) == 6 and comparison.rounds == 6  # two rounds, not one and not three
    assert "undecided: gate.p99_time_to_first_token_ms 1000 (-389..1.86e+03)" in caplog.text
    check = next(
        c
        for c in decide(
            profile.gate, "svc", "2", "1", ServingSummary.of({2: rounds["candidate"]}, 0, 8, 0.9), comparison
        ).checks
        if "first token" in c.name
    )
    assert check.verdict == "pass" and check.samples == 6
    # genai-perf's own checks stay on the median: its rounds do not wait on them
    genai_perf = load_profile(
        "cpu-tiny", ["bench.rounds=1", "bench.max_rounds=3", "gate.p99_time_to_first_token_ms=1000"]
    )
    ttft = iter([400, 1500, 300, 350])
    rounds, _ = compare_in_rounds(Runs(), champion, candidate, 2, genai_perf)
    assert len(rounds["candidate"]) == 3
