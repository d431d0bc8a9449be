"""The shared stage machinery: content cache hits need the artifact; retries only for transient faults;
the code version of a stage follows every project module it uses."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.platform.config import load_profile
from tasks.platform.errors import BadInput, TransientError
from tasks.platform.stage_cache import RunContext, run_cached, stage_task
from tasks.platform.store import LocalStore
from tasks.platform.tracking import start_run


@pytest.fixture
def ctx(tmp_path):
    tracker = start_run(f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "mlartifacts", "unit", {})
    return RunContext(
        load_profile("cpu-tiny", ["run.retry_delay_s=0"]), LocalStore(tmp_path / "store"), tracker, tmp_path
    )


def test_second_call_is_a_cache_hit_and_a_deleted_artifact_is_rebuilt(ctx):
    calls = []

    def produce(out_dir):
        calls.append(out_dir)
        (out_dir / "weights.bin").write_bytes(b"w" * 10)
        return {"score": 1.0}

    first = run_cached(ctx, "unit", {"input": 1}, produce)
    second = run_cached(ctx, "unit", {"input": 1}, produce)
    assert (first.cached, second.cached, len(calls)) == (False, True, 1)
    assert second.metrics == {"score": 1.0} and second.artifact == first.artifact

    (ctx.store.fetch(first.artifact.digest) / "weights.bin").unlink()
    third = run_cached(ctx, "unit", {"input": 1}, produce)
    assert not third.cached and len(calls) == 2
    assert ctx.store.exists(third.artifact.digest)

    other = run_cached(ctx, "unit", {"input": 2}, produce)
    assert not other.cached and len(calls) == 3


def test_failed_stage_writes_no_record(ctx):
    def produce(out_dir):
        (out_dir / "half.bin").write_bytes(b"x")
        raise BadInput("bad")

    with pytest.raises(BadInput):
        run_cached(ctx, "unit-fail", {"input": 1}, produce)
    assert not (ctx.store.root / "objects").exists()


def test_prefect_retries_transient_faults_only(ctx):
    from prefect import flow

    attempts = {"transient": 0, "bad": 0}

    def flaky(kind: str) -> str:
        attempts[kind] += 1
        if kind == "transient" and attempts[kind] < 3:
            raise TransientError("S3 restarting")
        if kind == "bad":
            raise BadInput("bad data")
        return "ok"

    @flow
    def pipeline(kind: str):
        return stage_task(flaky, ctx.profile)(kind)

    assert pipeline("transient") == "ok"
    assert attempts["transient"] == 3
    with pytest.raises(BadInput):
        pipeline("bad")
    assert attempts["bad"] == 1


STAGE_MODULES = [
    "tasks.prepare_data",
    "tasks.base_model",
    "tasks.train",
    "tasks.evaluate",
    "tasks.merge",
    "tasks.quantize",
    "tasks.build_engine",
]


def stage_code_versions(project: Path) -> dict[str, str]:
    """Each stage's code version, computed by the copy of the project at `project` (its own tasks/platform/stage_cache.py)."""
    script = (
        "import json; from tasks.platform.stage_cache import module_code_version; "
        f"print(json.dumps({{m: module_code_version(m) for m in {STAGE_MODULES!r}}}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=project,
        env={"PYTHONPATH": str(project)},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout)


def test_editing_a_helper_reruns_only_the_stages_that_use_it(tmp_path):
    root = Path(__file__).resolve().parents[2]
    project = tmp_path / "project"
    for folder in ("tasks", "flows", "infra/triton"):
        shutil.copytree(root / folder, project / folder, ignore=shutil.ignore_patterns("__pycache__"))
    before = stage_code_versions(project)

    metrics = (
        project / "tasks" / "quality" / "metrics.py"
    )  # imported by evaluate; through it by quantize and build_engine
    metrics.write_text(metrics.read_text() + "\n\ndef new_helper() -> None:\n    pass\n")
    after_metrics = stage_code_versions(project)
    assert {m for m in STAGE_MODULES if before[m] != after_metrics[m]} == {
        "tasks.evaluate",
        "tasks.quantize",
        "tasks.build_engine",
    }
    contract = (
        project / "tasks" / "quality" / "contract.py"
    )  # the train/serve contract: recorded at train, checked after it
    contract.write_text(contract.read_text() + "\n# an edit\n")
    after_contract = stage_code_versions(project)
    assert {m for m in STAGE_MODULES if after_metrics[m] != after_contract[m]} == {
        "tasks.train",
        "tasks.merge",
        "tasks.quantize",
        "tasks.build_engine",
    }


# Render Triton models (approve reads only the gate's report: tasks/quality/checks.py)
RENDERING_STAGES = {
    *("tasks.benchmark", "tasks.deploy_canary", "tasks.shadow", "tasks.gate", "tasks.rollout"),
    "tasks.tune_serving",  # loads the candidate with each trial's settings
}


def test_every_template_dir_is_a_project_module_and_a_folder(monkeypatch):
    from tasks.platform import stage_cache

    for module, folder in stage_cache.TEMPLATE_DIRS.items():
        assert stage_cache.module_file(module) is not None, module
        assert folder.is_dir() and any(folder.iterdir()), folder
        assert stage_cache.template_dir(module) == folder
    # a module that moved away fails loudly instead of dropping its templates from every code version
    monkeypatch.setitem(stage_cache.TEMPLATE_DIRS, "tasks.moved_away", stage_cache.PROJECT_ROOT / "infra" / "triton")
    with pytest.raises(ValueError, match=r"^TEMPLATE_DIRS: tasks.moved_away is not a module of this project"):
        stage_cache.template_dir("tasks.train")


def code_versions(project: Path, modules: list[str]) -> dict[str, str]:
    """Each module's code version, computed by the copy of the project at `project`."""
    script = (
        "import json; from tasks.platform.stage_cache import module_code_version; "
        f"print(json.dumps({{m: module_code_version(m) for m in {modules!r}}}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=project, env={"PYTHONPATH": str(project)}, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_editing_a_served_models_code_reruns_the_stages_that_render_models(tmp_path):
    """The models' templates and the text helpers copied into them (tasks/text/model_text.py) are part
    of the code version of every stage that renders models, through tasks/serving/repository.py."""
    from tasks.platform.stage_cache import module_closure

    assert "tasks.text.model_text" in module_closure("tasks.serving.repository")
    root = Path(__file__).resolve().parents[2]
    project = tmp_path / "project"
    for folder in ("tasks", "flows", "infra/triton"):
        shutil.copytree(root / folder, project / folder, ignore=shutil.ignore_patterns("__pycache__"))
    stages = sorted(f"tasks.{path.stem}" for path in (root / "tasks").glob("*.py") if path.stem != "__init__")
    before = code_versions(project, stages)

    template = project / "infra" / "triton" / "llm" / "1" / "model.py"
    template.write_text(template.read_text() + "\n# an edit\n")
    after_template = code_versions(project, stages)
    assert {m for m in stages if before[m] != after_template[m]} == RENDERING_STAGES

    helper = project / "tasks" / "text" / "model_text.py"
    helper.write_text(helper.read_text() + "\n# an edit\n")
    after_helper = code_versions(project, stages)
    # the rendering stages through tasks/serving/repository.py, and every other stage through tasks/quality/chat.py:
    # training and evaluation encode prompts with the same encode_prompt; approve, which encodes nothing, is not one
    changed = {m for m in stages if after_template[m] != after_helper[m]}
    assert changed == set(stages) - {"tasks.approve"} and changed > RENDERING_STAGES


def test_a_full_disk_is_exit_4_naming_where_and_keeps_nothing_of_the_stage(ctx):
    import errno

    from tasks.platform.errors import DiskFull

    def produce(out_dir):
        (out_dir / "half.bin").write_bytes(b"x")
        raise OSError(errno.ENOSPC, "No space left on device", str(out_dir / "model.safetensors"))

    with pytest.raises(
        DiskFull, match=r"unit-full: disk full at .*model.safetensors \(.* free, 0 bytes needed\)"
    ) as failed:
        run_cached(ctx, "unit-full", {"input": 1}, produce)
    assert failed.value.exit_code == 4
    assert not list((ctx.home / "work" / "unit-full").rglob("half.bin"))
    assert ctx.store.records() == []


def test_a_stage_that_cannot_fit_is_refused_before_it_runs(ctx, monkeypatch):
    """The room a stage needs is its known multiple of its largest input (merge: the merged weights)."""
    from tasks.platform import disk
    from tasks.platform.errors import DiskFull

    base = run_cached(ctx, "unit-base", {"input": 1}, lambda out: (out / "w.bin").write_bytes(b"w" * 4096) and {})
    monkeypatch.setattr(disk, "free_bytes", lambda folder: 1000)
    ran = []
    with pytest.raises(DiskFull, match=r"merge: disk full at .* \(1000 bytes free, 4.40 KiB needed\)"):
        run_cached(ctx, "merge", {"base": base.artifact.digest}, lambda out: ran.append(out) or {})
    assert ran == []
    run_cached(ctx, "prepare_data", {"input": 2}, lambda out: (out / "d.json").write_text("[]") and {})  # no input


def test_mlflow_faults_that_may_pass_are_transient_and_the_rest_are_not():
    """Only what may pass is retried (and is exit 4 once retries run out): the server unreachable or timing out,
    a 5xx, sqlite's lock. Not found, a refused login or a bad request say the same thing the next time."""
    from mlflow.exceptions import MlflowException, RestException
    from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, TEMPORARILY_UNAVAILABLE, UNAUTHENTICATED
    from sqlalchemy.exc import OperationalError

    from tasks.platform.errors import is_transient
    from tasks.platform.run_log import exit_code

    url = "http://127.0.0.1:5000/api/2.0/mlflow/registered-models/alias"
    transient = [
        MlflowException(f"API request to {url} failed with exception HTTPConnectionPool(...): Max retries exceeded"),
        MlflowException(f"API request to {url} failed with timeout exception ReadTimeout(...)."),
        MlflowException("internal", error_code=INTERNAL_ERROR),
        MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE),
        OperationalError("UPDATE runs ...", {}, Exception("database is locked")),
    ]
    lasting = [
        RestException(
            {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "Registered model alias champion not found"}
        ),
        MlflowException("who are you", error_code=UNAUTHENTICATED),
        RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "bad"}),
    ]
    assert [is_transient(e) for e in transient] == [True] * len(transient)
    assert [is_transient(e) for e in lasting] == [False] * len(lasting)
    assert {exit_code(e) for e in transient} == {4}


def test_only_a_missing_model_or_alias_means_no_champion():
    """A champion lookup that fails any other way (a 5xx after MLflow's retries, a timeout, a refused login) is
    raised, never read as "no champion": that would make the release a first one, routed 100% with no canary."""
    from types import SimpleNamespace

    from mlflow.exceptions import MlflowException, RestException
    from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_PARAMETER_VALUE, UNAUTHENTICATED

    from tasks.serving.champion import champion_version

    def ctx_raising(exc: Exception):
        def lookup(name, alias):
            raise exc

        client = SimpleNamespace(get_model_version_by_alias=lookup)
        profile = SimpleNamespace(registry=SimpleNamespace(model_name="svc"))
        return SimpleNamespace(tracker=SimpleNamespace(client=client), profile=profile)

    missing = [
        RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "Registered Model with name=svc not found"}),
        MlflowException("Registered model alias champion not found.", error_code=INVALID_PARAMETER_VALUE),
    ]
    assert [champion_version(ctx_raising(e)) for e in missing] == [None, None]
    for failure in (
        MlflowException("internal", error_code=INTERNAL_ERROR),
        MlflowException("API request to http://127.0.0.1:5000/api failed with timeout exception ReadTimeout(...)."),
        MlflowException("who are you", error_code=UNAUTHENTICATED),
    ):
        with pytest.raises(MlflowException):
            champion_version(ctx_raising(failure))


def test_a_service_whose_table_names_a_champion_is_not_a_first_release(monkeypatch):
    """The registry says no champion (its alias was lost), the service's route table names one: the release
    canaries against the champion clients get, not as a first release."""
    from types import SimpleNamespace

    from tasks.control.contract import RouteTable, Version
    from tasks.serving import champion as champion_module

    routed = Version("svc-v3", "svc-v3", None, {"version": "3", "artifacts": {"merge": "abc"}, "settings": None})
    table = RouteTable("svc", champion=routed, weights={"svc-v3": 100.0})
    service = SimpleNamespace(name="svc", control=SimpleNamespace(table=lambda: table))
    monkeypatch.setattr(champion_module, "registry_champion", lambda ctx: None)
    monkeypatch.setattr(champion_module, "served_of", lambda ctx, name, version: ("served", version.name))
    assert champion_module.serving_champion(SimpleNamespace(), service) == ("served", "svc-v3")
