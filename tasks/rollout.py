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
from dataclasses import dataclass

from tasks.control.contract import RouteTable
from tasks.data.splits import eval_conversations
from tasks.deploy_canary import Deployment
from tasks.platform.errors import LostService, RampFailed, RegistryBehind
from tasks.platform.run_log import exit_code
from tasks.platform.stage_cache import RunContext, StageResult, logger
from tasks.platform.store import outlast_outage
from tasks.reporting.evidence import CANARY_STEPS, release_folder
from tasks.serving import prometheus
from tasks.serving.champion import as_route, not_found
from tasks.serving.service import ServiceControl, version_counters


@dataclass
class Window:
    requests: int
    failures: int
    candidate_requests: float
    candidate_failures: float
    candidate_mean_latency_ms: float | None
    client_p99_ms: float | None


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


def watch_window(ctx: RunContext, deployment: Deployment, prompts: list[str]) -> Window:
    """One step's window: probes through the gateway, and how the candidate's requests went meanwhile (all of them,
    clients' and probes', as the gateway counted them)."""
    cfg, control, name = ctx.profile.canary, deployment.control, deployment.candidate.name
    before, started = version_counters(control.metrics(), name), time.time()
    sent, failed, latencies = probe(
        control, deployment.service, prompts, cfg.window_s, cfg.probe_concurrency, ctx.profile.bench.output_tokens
    )
    after, ended = version_counters(control.metrics(), name), time.time()
    if cfg.prometheus_url:
        scraped = prometheus.wait_for_scrape(cfg.prometheus_url, name, ended, timeout=max(30, 3 * cfg.window_s))
        counters = prometheus.version_counters(cfg.prometheus_url, name, started, scraped)
        ok, bad, seconds = counters.successes, counters.failures, counters.seconds
    else:
        ok, bad, seconds = after.ok - before.ok, after.failed - before.failed, after.seconds - before.seconds
    p99 = statistics.quantiles(latencies, n=100)[98] if len(latencies) >= 2 else None
    return Window(sent, failed, ok + bad, bad, seconds / ok * 1000 if ok else None, p99)


def breach(ctx: RunContext, deployment: Deployment, window: Window) -> str | None:
    cfg = ctx.profile.canary
    for triton in deployment.tritons:
        if not triton.is_ready(deployment.candidate.name):
            return f"{deployment.candidate.name} is not ready on {triton.url}"
    if window.requests and window.failures / window.requests > cfg.max_error_rate:
        return f"{window.failures}/{window.requests} client requests failed (max error rate {cfg.max_error_rate})"
    if window.candidate_requests and window.candidate_failures / window.candidate_requests > cfg.max_error_rate:
        return f"candidate failed {window.candidate_failures:.0f}/{window.candidate_requests:.0f} requests"
    if window.candidate_mean_latency_ms is not None and window.candidate_mean_latency_ms > cfg.max_mean_latency_ms:
        return (
            f"candidate mean latency {window.candidate_mean_latency_ms:.1f} ms > canary.max_mean_latency_ms "
            f"{cfg.max_mean_latency_ms}"
        )
    return None


# --- the rollout decision -------------------------------------------------------------------------


def ramp(ctx: RunContext, deployment: Deployment, prompts: list[str]) -> str | None:
    """Walk the traffic steps; return the breach that stopped it, or None when 100% was reached."""
    champion = deployment.champion
    steps = ctx.profile.canary.steps if champion else [100]  # the first release is deployed directly
    for weight in steps:
        weights: dict[str, float] = {deployment.candidate.name: weight}
        if champion and weight < 100:
            weights[champion.name] = 100 - weight
        started = time.perf_counter()
        deployment.route(weights)
        step_ms = (time.perf_counter() - started) * 1000
        window = watch_window(ctx, deployment, prompts)
        problem = breach(ctx, deployment, window)
        step = {"weight": weight, "at": time.time(), "step_ms": step_ms, **window.__dict__, "breach": problem}
        deployment.steps.append(step)
        keep_steps(ctx, deployment.steps)
        ctx.tracker.log_metrics(
            "canary",
            {
                "weight": weight,
                "step_ms": step_ms,
                "client_requests": window.requests,
                "client_failures": window.failures,
                "candidate_requests": window.candidate_requests,
                "candidate_failures": window.candidate_failures,
                "candidate_mean_latency_ms": window.candidate_mean_latency_ms or 0.0,
            },
            step=weight,
        )
        logger().info(
            f"canary: {weight}% to {deployment.candidate.name} (in effect in {step_ms:.0f} ms): {window.requests} requests, "
            f"{window.failures} failed, candidate {window.candidate_requests:.0f} requests "
            f"mean {window.candidate_mean_latency_ms or 0:.1f} ms"
            + (" (from Prometheus)" if ctx.profile.canary.prometheus_url else "")
            + (f" -> BREACH: {problem}" if problem else "")
        )
        if problem:
            return problem
    return None


def keep_steps(ctx: RunContext, steps: list[dict]) -> None:
    """The ramp so far, beside the gate's report, for the release report (a ramp that fails midway too)."""
    folder = release_folder(ctx.home, ctx.tracker.run_id)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CANARY_STEPS).write_text(json.dumps(steps, indent=1))


def promote(ctx: RunContext, deployment: Deployment) -> None:
    """The candidate is the champion: in the gateway's table (and its record) first, then in the registry. The
    registry's writes outlast an MLflow outage of run.storage_outage_s; where they still fail, the service already
    serves the candidate (its deployment record says so, and `llmops serve` restarts from it), and the error says
    what each holds and that the same release run again moves the alias (deploy_canary finds the candidate serving
    as the champion: unchanged, and the alias follows)."""
    candidate = as_route(deployment.candidate)
    deployment.control.put_table(RouteTable(deployment.service, candidate, weights={candidate.name: 100.0}))
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
