"""rollout, promote, rollback: the policy that walks the candidate's traffic share up on the live service.

After a passed gate the gateway's routes walk `canary.steps` (one control-API call each, in effect for the next
request: no model is loaded again); each step sends real requests through the gateway for `window_s` and checks the
candidate's health, error rate (client side, and the gateway's counters of the candidate's requests, read from the
gateway or from the Prometheus at `canary.prometheus_url`) and mean latency. A breach rolls back: the champion alone
in the routes, candidate unloaded, no alias moved. After 100% the alias `champion` moves, the gateway's table names
the candidate champion, and the old champion is unloaded.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass, field

from tasks.control.rollout import Rollout, Window
from tasks.data.splits import eval_conversations
from tasks.deploy_canary import Deployment
from tasks.platform.errors import CheckFailed, LostService, RampFailed, RegistryBehind, TransientError
from tasks.platform.run_log import exit_code
from tasks.platform.stage_cache import RunContext, StageResult, logger
from tasks.platform.store import outlast_outage
from tasks.platform.tracking import not_found
from tasks.reporting.evidence import CANARY_STEPS, release_folder
from tasks.serving import prometheus
from tasks.serving.service import ServiceControl

POLL_S = 0.5  # the release's probes between two reads of the rollout's status
FIRST_STEP_S = 30.0  # the controller routes a submitted rollout in its next round; this long means it is not running


@dataclass
class Clients:
    """The release's own probes through the gateway during one step (client side: what a client saw)."""

    requests: int = 0
    failures: int = 0
    latencies: list[float] = field(default_factory=list)

    def add(self, sent: int, failed: int, latencies: list[float]) -> None:
        self.requests, self.failures = self.requests + sent, self.failures + failed
        self.latencies.extend(latencies)

    @property
    def p99_ms(self) -> float | None:
        return statistics.quantiles(self.latencies, n=100)[98] if len(self.latencies) >= 2 else None


def probe(
    control: ServiceControl, service: str, prompts: list[str], seconds: float, concurrency: int, max_tokens: int
) -> tuple[int, int, list[float]]:
    """Send real requests through the gateway, for the service's name, for `seconds` (bounded: stops by itself)."""
    stop = time.monotonic() + seconds
    counts, latencies, lock = [0, 0], [], threading.Lock()

    def client(offset: int) -> None:
        i = offset
        while time.monotonic() < stop:
            started = time.perf_counter()
            try:
                control.generate(service, prompts[i % len(prompts)], max_tokens=max_tokens, timeout=30)
                ok = True
            except Exception:
                ok = False
            with lock:
                counts[0] += 1
                counts[1] += 0 if ok else 1
                latencies.append((time.perf_counter() - started) * 1000)
            i += concurrency

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts[0], counts[1], latencies


def analysed(ctx: RunContext, deployment: Deployment, window: Window, clients: Clients) -> str | None:
    """The release's own analysis of a window the controller passed (canary.prometheus_url: the rollout waits for it):
    what its clients saw, and the candidate's counters as the Prometheus watching the service scraped them."""
    cfg, name = ctx.profile.canary, deployment.candidate.name
    if clients.requests and clients.failures / clients.requests > cfg.max_error_rate:
        return f"{clients.failures}/{clients.requests} client requests failed (max error rate {cfg.max_error_rate})"
    if not cfg.prometheus_url:
        return None
    scraped = prometheus.wait_for_scrape(cfg.prometheus_url, name, window.ended_at, timeout=max(30, 3 * cfg.window_s))
    counters = prometheus.version_counters(cfg.prometheus_url, name, window.started_at, scraped)
    requests = counters.ok + counters.failed  # refused (over a limit) is the client's share, not the candidate's
    if requests and counters.failed / requests > cfg.max_error_rate:
        return f"candidate failed {counters.failed:.0f}/{requests:.0f} requests (from Prometheus)"
    mean_ms = counters.seconds / counters.ok * 1000 if counters.ok else None
    if mean_ms is not None and mean_ms > cfg.max_mean_latency_ms:
        return f"candidate mean latency {mean_ms:.1f} ms > canary.max_mean_latency_ms {cfg.max_mean_latency_ms} (from Prometheus)"
    return None


# --- the rollout decision -------------------------------------------------------------------------


def ramp(ctx: RunContext, deployment: Deployment, prompts: list[str]) -> str | None:
    """The rollout submitted to the service, whose controller walks the steps (tasks/runtime/rollouts.py); meanwhile
    this release probes through the gateway, follows the status, and where it analyses the windows itself
    (canary.prometheus_url) says `next` or `abort` after each. The breach that ended it, or None once promoted."""
    cfg, control = ctx.profile.canary, deployment.control
    plan = {
        "steps": cfg.steps if deployment.champion else [100],  # the first release is deployed directly
        "window_s": cfg.window_s,
        "max_error_rate": cfg.max_error_rate,
        "max_mean_latency_ms": cfg.max_mean_latency_ms,
        "await_decision": bool(cfg.prometheus_url),
    }
    routed_first(control, control.start_rollout(plan, deployment.release, deployment.hold_s).rollout)
    clients, seen = Clients(), 0
    while True:
        clients.add(
            *probe(control, deployment.service, prompts, POLL_S, cfg.probe_concurrency, ctx.profile.bench.output_tokens)
        )
        rollout = control.table().rollout
        if rollout is None or rollout.release != deployment.release:
            raise CheckFailed(f"the service's record holds no rollout of release {deployment.release} any more")
        for window in rollout.windows[seen:]:
            problem = window.breach or (analysed(ctx, deployment, window, clients) if plan["await_decision"] else None)
            note_step(ctx, deployment, window, clients, problem)
            clients, seen = Clients(), seen + 1
            if problem and rollout.active:
                control.decide(deployment.release, "abort", problem)
                return problem
        if rollout.phase == "promoted":
            return None
        if rollout.phase == "rolled_back":
            return rollout.reason or "rolled back by the service"
        if rollout.phase == "paused" and seen == len(rollout.windows):
            control.decide(deployment.release, "next" if rollout.step + 1 < len(rollout.steps) else "promote")


def routed_first(control: ServiceControl, rollout: Rollout | None) -> None:
    """Once the controller routed the first step (its next round, 0.2 s at most): probes sent before it would meet the
    table as it was, which for a first release routes nothing (41 of 536 probes answered 503 so)."""
    deadline = time.monotonic() + FIRST_STEP_S
    while rollout is not None and rollout.phase == "ramping" and not rollout.step_started_at:
        if time.monotonic() > deadline:
            raise TransientError(f"the service routed no step of the rollout within {FIRST_STEP_S:.0f}s")
        time.sleep(0.05)
        rollout = control.table().rollout


def note_step(ctx: RunContext, deployment: Deployment, window: Window, clients: Clients, problem: str | None) -> None:
    """One step as the controller watched it and the release's clients saw it: in the run's log, MLflow and the
    report's steps."""
    weight, name = window.weight, deployment.candidate.name
    step = {
        "weight": weight,
        "at": window.started_at,
        "step_ms": window.step_ms,
        "requests": clients.requests,
        "failures": clients.failures,
        "candidate_requests": window.requests,
        "candidate_failures": window.failures,
        "candidate_mean_latency_ms": window.mean_latency_ms,
        "client_p99_ms": clients.p99_ms,
        "breach": problem,
    }
    deployment.steps.append(step)
    keep_steps(ctx, deployment.steps)
    metrics = {k: float(step[k] or 0.0) for k in ("weight", "step_ms", "candidate_requests", "candidate_failures")}
    metrics |= {"client_requests": clients.requests, "client_failures": clients.failures}
    metrics["candidate_mean_latency_ms"] = window.mean_latency_ms or 0.0
    ctx.tracker.log_metrics("canary", metrics, step=int(weight))
    logger().info(
        f"canary: {weight:g}% to {name} (in effect in {window.step_ms:.0f} ms): {clients.requests} requests, "
        f"{clients.failures} failed, candidate {window.requests:.0f} requests "
        f"mean {window.mean_latency_ms or 0:.1f} ms"
        + (" (checked on Prometheus too)" if ctx.profile.canary.prometheus_url else "")
        + (f" -> BREACH: {problem}" if problem else "")
    )


def keep_steps(ctx: RunContext, steps: list[dict]) -> None:
    """The ramp so far, beside the gate's report, for the release report (a ramp that fails midway too)."""
    folder = release_folder(ctx.home, ctx.tracker.run_id)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CANARY_STEPS).write_text(json.dumps(steps, indent=1))


def promote(ctx: RunContext, deployment: Deployment) -> None:
    """The candidate is the champion: the service's controller made it so in its table and record (ramp returned
    None); then the old champion leaves the replicas and the registry follows. The registry's writes outlast an MLflow
    outage of run.storage_outage_s; where they still fail, the service already serves the candidate (its deployment
    record says so, and `llmops serve` moves the alias within seconds of the promotion), and the error says what
    each holds and that the same release run again moves the alias (deploy_canary finds the candidate serving as the
    champion: unchanged, and the alias follows)."""
    if deployment.champion and deployment.champion.name != deployment.candidate.name:
        deployment.retire(deployment.champion)
    try:
        name_champion(ctx, deployment.candidate.version)
    except Exception as exc:
        raise RegistryBehind(
            f"the service {deployment.service} serves {deployment.candidate.name} as its champion (its route table "
            f"and deployment record), but the registry's alias champion could not be moved to "
            f"v{deployment.candidate.version} ({type(exc).__name__}: {str(exc)[:200]}); run the same release again "
            "once MLflow answers: it finds the candidate serving and moves the alias"
        ) from exc
    logger().info(f"canary: promoted {deployment.candidate.name}; alias champion -> v{deployment.candidate.version}")


def name_champion(ctx: RunContext, version: str) -> None:
    """Alias champion -> `version`, challenger removed: retried while MLflow is unreachable (transient faults)."""
    client, name = ctx.tracker.client, ctx.profile.registry.model_name

    def write() -> None:
        from mlflow.exceptions import MlflowException

        client.set_registered_model_alias(name, "champion", version)
        try:
            client.delete_registered_model_alias(name, "challenger")
        except MlflowException as exc:  # none to remove (a rerun after the alias write failed) is fine
            if not not_found(exc):
                raise

    outlast_outage("registry: alias champion", write, ctx.profile.run.storage_outage_s, logger().warning)


def rollback(ctx: RunContext, deployment: Deployment, reason: str) -> None:
    """The champion alone in the routes, candidate unloaded, no alias moved."""
    deployment.champion_alone()
    deployment.retire(deployment.candidate)
    logger().warning(f"canary: rolled back {deployment.candidate.name}: {reason}")


def ramp_failed(ctx: RunContext, deployment: Deployment, exc: Exception) -> RampFailed:
    """Rolled back, traffic first: what the service serves now and why, as one line with the cause's exit code.
    Raised as a RampFailed, which no Prefect retry runs again: the candidate it would route to is unloaded."""
    cause = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
    rollback(ctx, deployment, f"the ramp failed: {cause}")
    serving = f"{deployment.champion.name} serves alone" if deployment.champion else "nothing is routed"
    return RampFailed(
        f"canary: {deployment.candidate.name} rolled back during its ramp ({serving}; no alias moved): {cause}",
        exit_code(exc),
    )


def eval_prompts(ctx: RunContext, data: StageResult) -> list[str]:
    return [c[-2]["content"] for c in eval_conversations(ctx, data)]


def rollout(ctx: RunContext, deployment: Deployment, approved: bool, rejection: str, data: StageResult) -> str:
    """promote | rollback: walk the canary steps after a passed gate (and a person's approval, where required);
    any breach rolls back. `rejection`: why a candidate that is not approved rolls back."""
    if deployment.unchanged:
        name_champion(ctx, deployment.candidate.version)  # where an earlier run's alias write failed: it follows now
        outcome = "unchanged"
    elif not approved:
        rollback(ctx, deployment, rejection)
        outcome = "rejected"
    else:
        try:
            problem = ramp(ctx, deployment, eval_prompts(ctx, data))
            deployment.let_go()  # ended: the service's controller holds no routes of this release any more
        except LostService:  # another release owns the service: its routes are not this one's to roll back
            raise
        except Exception as exc:  # MLflow, the gateway: live traffic is never left split, and no retry routes again
            raise ramp_failed(ctx, deployment, exc) from exc
        except BaseException as exc:  # Ctrl-C
            rollback(ctx, deployment, f"the ramp was interrupted ({type(exc).__name__})")
            raise
        if problem:
            rollback(ctx, deployment, f"canary breach: {problem}")
            outcome = "rolled_back"
        else:
            promote(ctx, deployment)
            outcome = "promoted"
    deployment.let_go()
    ctx.tracker.set_tags({"release.outcome": outcome})
    ctx.tracker.log_json("canary.json", {"outcome": outcome, "steps": deployment.steps})
    return outcome
