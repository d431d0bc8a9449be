"""The shared stage machinery: content cache hits need the artifact; retries only for transient faults."""

import pytest

from tasks.config import load_profile
from tasks.errors import BadInput, TransientError
from tasks.stage import RunContext, run_cached, stage_task
from tasks.store import LocalStore
from tasks.tracking import start_run


@pytest.fixture
def ctx(tmp_path):
    tracker = start_run(f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "mlartifacts", "unit", {})
    return RunContext(load_profile("cpu-tiny", ["run.retry_delay_s=0"]), LocalStore(tmp_path / "store"), tracker, tmp_path)


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
