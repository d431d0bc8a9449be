"""The ramp always ends in a defined state (issue 37): an exception during it routes the champion alone before it
re-raises; a promotion whose registry write fails after retries leaves the service serving the candidate as its
champion and says so (exit 4), and the same release run again moves the alias. The service's side is a stand-in
that records the tables it is given (the real control API is exercised in tests/integration/test_serving.py);
MLflow's side raises MLflow's own exceptions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

from tasks import rollout as rollout_module
from tasks.platform.errors import RampFailed, RegistryBehind
from tasks.platform.run_log import exit_code
from tasks.platform.stage_cache import retry_if_transient


class Registry:
    """MLflow's alias calls: fails `failures` times with a 503 (MLflow's own exception), then writes."""

    def __init__(self, failures: int = 0):
        self.failures, self.aliases = failures, {"champion": "1", "challenger": "2"}

    def set_registered_model_alias(self, name, alias, version):
        if self.failures:
            self.failures -= 1
            raise MlflowException("MLflow is restarting", error_code=TEMPORARILY_UNAVAILABLE)
        self.aliases[alias] = str(version)

    def delete_registered_model_alias(self, name, alias):
        self.aliases.pop(alias, None)


class Deployment:
    """What the rollout asks of a deployment, recording what the service was told."""

    def __init__(self):
        self.champion = SimpleNamespace(name="svc-v1", version="1")
        self.candidate = SimpleNamespace(name="svc-v2", version="2")
        self.unchanged, self.steps, self.events, self.service = False, [], [], "svc"
        self.control = SimpleNamespace(put_table=lambda table, *lease: self.events.append(("table", table.weights)))

    def champion_alone(self):
        self.events.append(("champion alone", None))

    def retire(self, served):
        self.events.append(("retire", served.name))

    def let_go(self):
        self.events.append(("let go", None))


def context(registry: Registry, outage_s: float = 0.5):
    profile = SimpleNamespace(
        registry=SimpleNamespace(model_name="svc"), run=SimpleNamespace(storage_outage_s=outage_s)
    )
    tracker = SimpleNamespace(client=registry, set_tags=lambda tags: None, log_json=lambda name, data: None)
    return SimpleNamespace(profile=profile, tracker=tracker)


@pytest.fixture(autouse=True)
def no_prompts(monkeypatch):
    monkeypatch.setattr(rollout_module, "eval_prompts", lambda ctx, data: ["q"])


def test_an_exception_during_the_ramp_routes_the_champion_alone_before_it_is_raised(monkeypatch):
    def failing_ramp(ctx, deployment, prompts):
        deployment.events.append(("table", {"svc-v2": 10.0, "svc-v1": 90.0}))
        raise MlflowException("API request to http://127.0.0.1:5000 failed with timeout exception ReadTimeout()")

    monkeypatch.setattr(rollout_module, "ramp", failing_ramp)
    deployment, registry = Deployment(), Registry()
    with pytest.raises(RampFailed) as raised:
        rollout_module.rollout(context(registry), deployment, True, "", None)
    assert exit_code(raised.value) == 4  # its cause's: MLflow stayed unreachable
    assert str(raised.value) == (
        "canary: svc-v2 rolled back during its ramp (svc-v1 serves alone; no alias moved): MlflowException: API "
        "request to http://127.0.0.1:5000 failed with timeout exception ReadTimeout()"
    )
    # no Prefect retry runs the rollout again: it would route traffic to the candidate it just unloaded
    assert not retry_if_transient(None, None, SimpleNamespace(data=raised.value))
    split = deployment.events.index(("table", {"svc-v2": 10.0, "svc-v1": 90.0}))
    assert deployment.events[split + 1 :] == [("champion alone", None), ("retire", "svc-v2")]  # traffic, then models
    assert registry.aliases["champion"] == "1"


def test_an_interrupted_ramp_routes_the_champion_alone_and_stays_an_interruption(monkeypatch):
    def interrupted_ramp(ctx, deployment, prompts):
        raise KeyboardInterrupt

    monkeypatch.setattr(rollout_module, "ramp", interrupted_ramp)
    deployment = Deployment()
    with pytest.raises(KeyboardInterrupt):
        rollout_module.rollout(context(Registry()), deployment, True, "", None)
    assert deployment.events == [("champion alone", None), ("retire", "svc-v2")]


def test_a_registry_write_during_promotion_outlasts_a_short_outage(monkeypatch):
    monkeypatch.setattr(rollout_module, "ramp", lambda ctx, deployment, prompts: None)
    monkeypatch.setattr("time.sleep", lambda s: None)
    deployment, registry = Deployment(), Registry(failures=2)
    assert rollout_module.rollout(context(registry, outage_s=60), deployment, True, "", None) == "promoted"
    assert registry.aliases == {"champion": "2"}


def test_a_promotion_the_registry_cannot_record_says_what_each_holds_and_a_rerun_moves_the_alias(monkeypatch):
    monkeypatch.setattr(rollout_module, "ramp", lambda ctx, deployment, prompts: None)
    deployment, registry = Deployment(), Registry(failures=10**6)
    with pytest.raises(RegistryBehind) as raised:
        rollout_module.rollout(context(registry, outage_s=0.3), deployment, True, "", None)
    message = str(raised.value)
    assert exit_code(raised.value) == 4
    assert "serves svc-v2 as its champion" in message and "run the same release again" in message
    assert ("retire", "svc-v1") in deployment.events  # the service's controller promoted: the old champion left
    assert registry.aliases["champion"] == "1"
    # the rerun: deploy_canary finds the candidate serving as the champion (unchanged), and the alias follows
    registry.failures, deployment.unchanged = 0, True
    assert rollout_module.rollout(context(registry), deployment, True, "", None) == "unchanged"
    assert registry.aliases == {"champion": "2"}
