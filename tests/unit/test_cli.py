"""The llmops command: help everywhere, one-line errors with documented exit codes, fail fast."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

LLMOPS = Path(sys.executable).parent / "llmops"
ROOT = Path(__file__).resolve().parents[2]


def cli_env(home, **extra) -> dict:
    """The environment of an `llmops` child: this checkout's code (the installed command may be another
    checkout's editable install), its own LLMOPS_HOME."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "LLMOPS_HOME": str(home), **extra}


def llmops(*args, env_home=None):
    env = cli_env(env_home or "/nonexistent/llmops-home")
    return subprocess.run([str(LLMOPS), *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["run"],
        ["profiles"],
        ["profiles", "list"],
        ["profiles", "show"],
        ["profiles", "validate"],
        ["profiles", "autoscaler"],
        ["stack"],
        ["stack", "up"],
        ["stack", "status"],
        ["stack", "env"],
        ["stack", "down"],
        ["deploy"],
        ["data"],
        ["data", "push"],
        ["data", "validate"],
        ["serve"],
        ["triton"],
        ["gate"],
        ["approval-proxy"],
    ],
)
def test_every_command_has_help(args):
    result = llmops(*args, "--help")
    assert result.returncode == 0 and "usage: llmops" in result.stdout


def test_run_help_documents_exit_codes_and_examples():
    out = llmops("run", "--help").stdout
    assert "exit codes:" in out and "--set" in out and "s3://" in out


def test_profiles_list_and_show():
    assert "cpu-tiny" in llmops("profiles", "list").stdout
    shown = llmops("profiles", "show", "cpu-tiny", "--set", "train.lora_rank=4").stdout
    assert "lora_rank: 4" in shown and "tolerance:" in shown


def test_bad_override_is_one_line_exit_2():
    result = llmops("profiles", "validate", "cpu-tiny", "--set", "merge.tolerence=1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["llmops: error: profile cpu-tiny: merge.tolerence: unknown key"]


def test_gpu_profile_without_gpu_fails_fast_and_creates_nothing(tmp_path):
    started = time.monotonic()
    result = llmops("run", "--profile", "qwen-7b-qlora-2xa10", env_home=tmp_path / "home")
    assert result.returncode == 2
    assert "need(s) 2 CUDA GPU(s) (hardware.gpus), this machine has 0" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "home").exists()
    assert time.monotonic() - started < 60


def test_missing_data_file_is_bad_input(tmp_path):
    result = llmops("profiles", "validate", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "not found" in result.stderr


def test_service_commands_without_a_stack_say_what_to_do(tmp_path):
    home = tmp_path / "home"
    status = llmops("stack", "status", env_home=home)
    assert status.returncode == 0 and "not started" in status.stdout and "llmops stack up" in status.stdout
    for args in (["stack", "env"], ["deploy"], ["data", "push", "profiles/data/antonyms.jsonl", "s3://datasets/sft/"]):
        env = {k: v for k, v in cli_env(home).items() if k != "PREFECT_API_URL"}
        result = subprocess.run([str(LLMOPS), *args], capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.strip().splitlines()[-1].startswith("llmops: error: local stack under ")
        assert "run `llmops stack up`" in result.stderr


def test_deploy_against_an_unreachable_prefect_server_is_one_clear_line(tmp_path):
    env = cli_env(tmp_path, PREFECT_API_URL="http://127.0.0.1:9/api")
    result = subprocess.run([str(LLMOPS), "deploy"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "llmops: error: PREFECT_API_URL http://127.0.0.1:9/api: no Prefect "
        "server answers (ConnectionError); run `llmops stack up` or fix the URL"
    )


def test_one_exit_code_table_for_help_errors_and_readme():
    from tasks.platform.errors import (
        EXIT_CODES,
        ArtifactMissing,
        BadInput,
        CheckFailed,
        LostService,
        TransientError,
        exit_codes_markdown,
    )

    readme = (ROOT / "README.md").read_text()
    assert exit_codes_markdown() in readme
    help_text = llmops("--help").stdout
    for code, meaning in EXIT_CODES.items():
        assert f"{code:>3}  {meaning[:40]}" in help_text
    assert {e.exit_code for e in (BadInput, CheckFailed, TransientError, ArtifactMissing, LostService)} <= set(
        EXIT_CODES
    )


def test_data_validate_prints_what_prepare_data_would_see(tmp_path):
    dataset = ROOT / "profiles" / "data" / "finance_qa_zh.jsonl"
    result = llmops("data", "validate", str(dataset), "--profile", "cpu-tiny-qa-zh")
    assert result.returncode == 0, result.stderr
    assert "records read           288" in result.stdout and "train / eval           241 / 47" in result.stdout
    held_out = tmp_path / "held_out.jsonl"  # the first 30 records as a fixed held-out set
    held_out.write_text("".join(dataset.read_text(encoding="utf-8").splitlines(keepends=True)[:30]), encoding="utf-8")
    result = llmops("data", "validate", str(dataset), "--eval-source", str(held_out), "--profile", "cpu-tiny-qa-zh")
    assert result.returncode == 0, result.stderr
    assert "train / eval           258 / 30" in result.stdout and "30 overlapping records left out" in result.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "x", "output": null}\n')
    result = llmops("data", "validate", str(bad))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"llmops: error: data file {bad} line 2: field 'output' must be a string, got NoneType"
    ]


def test_run_on_bad_data_fails_before_anything_starts(tmp_path):
    bad = tmp_path / "gbk.jsonl"
    bad.write_bytes('{"instruction": "反义词", "output": "冷"}'.encode("gbk"))
    result = llmops("run", "--data", str(bad), env_home=tmp_path / "home")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"llmops: error: data file {bad}: not UTF-8")
    assert not (tmp_path / "home").exists()  # no Prefect server, no store, no MLflow database


def test_an_mlflow_server_with_the_default_local_store_is_refused_before_anything_starts(tmp_path):
    """MLFLOW_TRACKING_URI names a server and no LLMOPS_ARTIFACTS: the store under LLMOPS_HOME, whose paths that server
    refuses as model version sources (tests/integration/test_release.py shows the server's refusal). Nothing listens
    on the URL: the refusal comes before any call to it. A worker's flow run meets the same check (open_context)."""
    home = tmp_path / "home"
    env = {k: v for k, v in cli_env(home, MLFLOW_TRACKING_URI="http://127.0.0.1:9").items() if k != "LLMOPS_ARTIFACTS"}
    result = subprocess.run([str(LLMOPS), "run"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"llmops: error: --artifacts (LLMOPS_ARTIFACTS): the local store {home / 'store'} cannot hold what the MLflow "
        "server at http://127.0.0.1:9 registers (it refuses a path on this machine as a model version's source): give "
        "an s3://bucket/prefix store, or leave --tracking-uri (MLFLOW_TRACKING_URI) unset for the registry under "
        "LLMOPS_HOME"
    ]
    assert not home.exists()


def test_a_workers_release_meets_the_same_store_check_before_its_mlflow_run(tmp_path, monkeypatch):
    from flows.release import open_context
    from tasks.platform.config import load_profile
    from tasks.platform.errors import BadInput

    monkeypatch.setenv("LLMOPS_HOME", str(tmp_path))
    monkeypatch.delenv("LLMOPS_ARTIFACTS", raising=False)
    with pytest.raises(BadInput, match=r"^--artifacts \(LLMOPS_ARTIFACTS\): the local store .* cannot hold"):
        open_context(load_profile("cpu-tiny"), "https://127.0.0.1:9", str(tmp_path / "store"))
    assert not list(tmp_path.iterdir())


def test_bad_input_is_one_line_and_debug_adds_its_traceback(tmp_path):
    home = tmp_path / "home"
    result = llmops("run", "--set", "train.bogus=1", env_home=home)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["llmops: error: profile cpu-tiny: train.bogus: unknown key"]
    debug = llmops("--debug", "run", "--set", "train.bogus=1", env_home=home)
    assert debug.returncode == 2
    assert debug.stderr.startswith("Traceback (most recent call last)") and "raise BadInput" in debug.stderr
    assert debug.stderr.splitlines()[-1] == result.stderr.strip()
    assert not home.exists()  # no run log for a command that ran no flow


def test_a_commands_process_leaves_out_what_no_stage_calls(tmp_path):
    """Before any command runs, scikit-learn is absent to importlib (transformers, which stages import, imports it
    whenever it is installed: tasks/platform/unused_imports.py); scipy, which the quality gate calls, is not."""
    check = (
        "import importlib.util, sys; from pathlib import Path; from flows.cli.app import prepare_environment; "
        "prepare_environment(Path(sys.argv[1])); "
        "print(importlib.util.find_spec('sklearn') is None, importlib.util.find_spec('scipy') is None)"
    )
    result = subprocess.run([sys.executable, "-c", check, str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert result.stdout.split() == ["True", "False"], result.stderr[-2000:]


# The real entry point with one more command, `llmops fail check|bug`: a release flow whose stage (the real
# stage_task wrapper) fails the way evaluate refuses a candidate, or with a bug.
FAILING_STAGE = """
import sys
from types import SimpleNamespace

from flows.cli import app, entry
from tasks.platform.project import llmops_home
from tasks.platform.errors import CheckFailed, LostService


def release_with_a_failing_stage(args):
    llmops_home().mkdir(parents=True, exist_ok=True)  # as `llmops run` does, before Prefect is imported
    from prefect import flow

    from tasks.platform.config import load_profile
    from tasks.platform.stage_cache import stage_task

    def evaluate():
        if args.kind == "bug":
            return 1 / 0
        if args.kind == "lost":
            raise LostService("demo is owned by release run-2 (epoch 2); this release wrote nothing more")
        raise CheckFailed("evaluate: candidate exact_match 0.10 is below the champion's 0.50")

    @flow(name="release")
    def release():
        return stage_task(evaluate, load_profile("cpu-tiny"))()

    release()


def register(commands):
    command = commands.add_parser("fail")
    command.add_argument("kind", choices=["check", "bug", "lost"])
    command.set_defaults(handler=release_with_a_failing_stage)


app.COMMANDS += (SimpleNamespace(register=register),)
sys.argv[0] = "llmops"
entry()
"""
REFUSAL = "llmops: error: evaluate: candidate exact_match 0.10 is below the champion's 0.50"


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """One Prefect API server for this module's flow runs (each would otherwise start its own)."""
    from tasks.platform.prefect_api import TemporaryPrefectAPI

    api = TemporaryPrefectAPI(tmp_path_factory.mktemp("prefect-api") / "api.log")
    try:
        api.wait_healthy(180)
        yield api.url
    finally:
        api.stop()


def failing_release(tmp_path, prefect_api, *args):
    script = tmp_path / "llmops_with_a_failing_stage.py"
    script.write_text(FAILING_STAGE)
    env = cli_env(tmp_path / "home", PREFECT_API_URL=prefect_api)
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=180
    )


def test_a_failed_check_in_a_flow_is_one_line_and_its_traceback_goes_to_the_run_log(tmp_path, prefect_api):
    result = failing_release(tmp_path, prefect_api, "fail", "check")
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.splitlines()[-1] == REFUSAL
    (log,) = (tmp_path / "home" / "logs").glob("fail-*.log")
    (flow_failure,) = [line for line in result.stderr.splitlines() if "Encountered exception" in line]
    assert "during execution: CheckFailed(" in flow_failure and flow_failure.endswith(f"(traceback in {log})")
    text = log.read_text()
    assert text.count("Traceback (most recent call last)") == 1 and 'raise CheckFailed("evaluate: ' in text
    assert text.rstrip().endswith(f"ERROR   | llmops - {REFUSAL}")


def test_debug_shows_a_failed_checks_traceback_and_a_bug_always_shows_its_own(tmp_path, prefect_api):
    debug = failing_release(tmp_path, prefect_api, "--debug", "fail", "check")
    assert debug.returncode == 3, debug.stderr
    assert debug.stderr.count("Traceback (most recent call last)") == 1  # Prefect's; not printed twice
    assert 'raise CheckFailed("evaluate: ' in debug.stderr and debug.stderr.splitlines()[-1] == REFUSAL
    bug = failing_release(tmp_path, prefect_api, "fail", "bug")
    assert bug.returncode == 1, bug.stderr
    assert bug.stderr.count("Traceback (most recent call last)") == 1 and "return 1 / 0" in bug.stderr
    assert bug.stderr.splitlines()[-1] == "llmops: error: ZeroDivisionError: division by zero"


def test_a_release_that_lost_its_service_ends_in_one_line_and_exit_6_unretried(tmp_path, prefect_api):
    """LostService (tasks/serving/ownership.py) through Prefect's task and flow to the CLI: not retried (it writes
    nothing more), one line naming the owner now, its own exit code."""
    lost = failing_release(tmp_path, prefect_api, "fail", "lost")
    assert lost.returncode == 6, lost.stderr
    assert lost.stderr.splitlines()[-1] == (
        "llmops: error: demo is owned by release run-2 (epoch 2); this release wrote nothing more"
    )
    assert "Retry" not in lost.stdout + lost.stderr


def test_the_approval_proxy_needs_the_operators_key(tmp_path):
    env = {k: v for k, v in cli_env(tmp_path).items() if k != "LLMOPS_APPROVAL_PROXY_KEY_FILE"}
    run = [str(LLMOPS), "approval-proxy", "--upstream", "http://127.0.0.1:4200"]
    no_oidc = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert no_oidc.returncode == 2 and "--oidc-jwks, --oidc-issuer, --oidc-audience" in no_oidc.stderr
    run += ["--oidc-jwks", str(tmp_path / "jwks.json"), "--oidc-issuer", "https://id", "--oidc-audience", "llmops"]
    in_clear = subprocess.run(
        [*run[:-6], "--oidc-jwks", "http://id.example/jwks", *run[-4:]], capture_output=True, text=True, env=env
    )
    assert in_clear.returncode == 2 and "plain http:// to another machine" in in_clear.stderr.splitlines()[-1]
    missing = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 2
    assert (
        missing.stderr.strip()
        .splitlines()[-1]
        .endswith("llmops approval-proxy: --key-file (or LLMOPS_APPROVAL_PROXY_KEY_FILE) is required")
    )
    short = tmp_path / "short.key"
    short.write_text("0123\n")
    too_short = subprocess.run([*run, "--key-file", str(short)], capture_output=True, text=True, env=env, timeout=120)
    assert too_short.returncode == 2 and f"approval proxy key file {short}: 4 bytes, at least 32" in too_short.stderr
    good = tmp_path / "proxy.key"
    good.write_text("ab" * 32)
    good.chmod(0o600)
    nobody = subprocess.run([*run, "--key-file", str(good)], capture_output=True, text=True, env=env, timeout=120)
    assert nobody.returncode == 2 and "name who may decide releases: --approver PERSON" in nobody.stderr  # issue 74


def test_predict_refuses_in_one_line_what_it_cannot_score(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Opposite of hot?\n")
    for args, last_line in [
        (["--data", str(tmp_path / "missing.jsonl")], f"--data {tmp_path / 'missing.jsonl'}: no such file or folder"),
        (["--data", str(prompts)], f"--version champion: tiny-qwen2-antonyms has no such version in the registry at sqlite:///{tmp_path}/mlflow.db"),
        (["--data", str(prompts), "--url", "http://127.0.0.1:9", "--concurrency", "2"], "http://127.0.0.1:9/v1/models: the service does not answer"),
    ]:  # fmt: skip
        result = llmops("predict", *args, env_home=tmp_path)
        assert result.stderr.strip().splitlines()[-1].startswith(f"llmops: error: {last_line}"), result.stderr
        assert result.returncode == (4 if "does not answer" in last_line else 2)
    assert not list(tmp_path.glob("*.answers.jsonl"))


def test_a_users_data_is_split_on_its_own_and_too_little_of_it_is_refused_before_anything_starts(tmp_path):
    """cpu-tiny's curated exam is the antonyms': other data is judged on its own hash split (issue 59), and data too
    small for an eval split evaluate could decide on is refused in a second, naming the counts."""
    finance = ROOT / "profiles" / "data" / "finance_qa_zh.jsonl"
    result = llmops("data", "validate", str(finance))  # cpu-tiny, as `llmops run --data` splits it
    assert result.returncode == 0, result.stderr
    assert "train / eval           241 / 47  (eval: hash split of finance_qa_zh.jsonl" in result.stdout
    # how evaluate would judge it (issue 72): the metric from the references, the length in cpu-tiny's own tokens
    assert "  metric                 rouge_l (open-ended references: median 35 characters, 100% over 3 words)\n" in (
        result.stdout
    )
    assert "  answers of up to       74 tokens (references: 95th percentile 57 tokens, median 45)" in result.stdout
    result = llmops("data", "validate", str(finance), "--eval-data", "profile")
    assert "train / eval           288 / 39  (eval: data.eval_source antonyms-eval.jsonl" in result.stdout
    assert "  metric                 exact_match (closed references: 100% of 39 at most 3 words)" in result.stdout
    assert result.stdout.startswith("data ")  # the tokenizer's training printed no progress bar above it
    small = tmp_path / "small.jsonl"
    small.write_text("".join(finance.read_text(encoding="utf-8").splitlines(keepends=True)[:60]), encoding="utf-8")
    result = llmops("run", "--data", str(small), "--set", "evaluate.metric=rouge_l", env_home=tmp_path / "home")
    assert result.returncode == 3, result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "llmops: error: prepare_data: the eval split (hash split of small.jsonl) has 11 samples, fewer than "
            "evaluate.min_samples 20: too few to decide on"
        )
    )
    assert not (tmp_path / "home").exists()  # refused before any server, store or MLflow database


def test_data_validate_reads_preference_pairs_and_refuses_a_bad_one(tmp_path):
    pairs = ROOT / "profiles" / "data" / "antonym-pairs.jsonl"
    result = llmops("data", "validate", str(pairs))
    assert result.returncode == 0, result.stderr
    assert "valid preference pair (chosen/rejected) records" in result.stdout
    assert "prompts                240" in result.stdout and "train / eval pairs     199 / 41" in result.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"instruction": "a", "chosen": "b", "rejected": "c"}\n{"instruction": "x", "chosen": "y", "rejected": ""}\n'
    )
    result = llmops("data", "validate", str(bad))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"llmops: error: data file {bad} line 2: field 'rejected' is empty"]
    result = llmops("run", "--data", str(pairs), env_home=tmp_path / "home")  # train.stage sft: refused first
    assert result.returncode == 2 and "line 1: field 'chosen' makes it a preference record" in result.stderr
    assert not (tmp_path / "home").exists()
