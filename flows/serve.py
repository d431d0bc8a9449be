"""`llmops serve`: keep the champion served until stopped, as a service that stays up.

- Triton (the models; its HTTP port carries the locked model-control API the release runs use) on
  `serve.listen.triton_*` ports, with the champion loaded, published in $LLMOPS_HOME/triton/server.json so that
  `llmops run` with the same LLMOPS_HOME rolls its candidates out on it; `serve.replicas` of them (or Tritons it
  does not own, `--triton-url` repeated), every version loaded on each (tasks/runtime/fleet.py).
- The gateway clients call (tasks/runtime/gateway/) on `serve.listen.host:port`: OpenAI-compatible /v1 and
  Triton's generate API for the service name, each request's version drawn from the service's route table, API
  keys, TLS, request limits; /health/ready says whether the routed versions answer (a Kubernetes readiness probe),
  /health/live that the process does.
- The gateway's control API on `serve.listen.control_host:control_port` (loopback), locked to this serve's own
  control key (LLMOPS_SERVE_CONTROL_KEY, else a fresh one, in $LLMOPS_HOME/serving/control.key while it runs):
  release runs change the routes there. The table lives in the deployment record
  ($LLMOPS_HOME/serving/<service>.json), which this command reads at start: the champion it names serves again
  without asking MLflow (the registry's champion where there is no record yet).
- If a Triton it started dies, it is started again on the same ports with backoff (1, 2, 4 ... 30 s), and every
  version of the route table loaded again; after `serve.listen.restart_limit` deaths in a row (each within a minute
  of its start) `llmops serve` exits 4. Its Tritons die with this process, even a SIGKILLed one.
- Every 30 s, the suspended releases of this home past their approval timeout are rejected on their behalf, so
  that they go on and roll back (tasks/platform/decisions.py).
- SIGTERM or Ctrl-C stops the gateway and Triton and removes server.json and the control key.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from flows.release import open_serving_context
from flows.serve_listen import LOOPBACK, Ports, check_listen, choose_ports, client_credentials
from tasks.control.contract import RouteTable, read_record, record_path
from tasks.platform.config import ListenSection, Profile
from tasks.platform.config.autoscale import AutoscaleSection
from tasks.platform.decisions import EXPIRY_CHECK_S, expire_overdue
from tasks.platform.errors import BadInput
from tasks.platform.stage_cache import RunContext
from tasks.runtime.autoscale import Autoscaler
from tasks.runtime.discovery import Discovery, Membership
from tasks.runtime.fleet import Fleet
from tasks.runtime.gateway import Gateway, GatewayConfig, KeyRing
from tasks.runtime.gateway.capture import CaptureSettings
from tasks.runtime.gateway.control import ControlApi
from tasks.runtime.gateway.logs import LogWriter
from tasks.runtime.gateway.running import Listener, RunningGateway
from tasks.runtime.loads import ReleaseLoads
from tasks.serving.champion import (
    as_route,
    promoted_rollout,
    registry_champion,
    registry_follows_record,
    served_of,
)
from tasks.serving.client import Triton
from tasks.serving.models import Served
from tasks.serving.publication import new_serve_key, publish, unpublish

REGISTRY_S = 2.0  # how often the table is looked at for a promotion the registry has not followed yet
RECONCILE_S = 5.0  # how often what the replicas hold is made what the table serves (Fleet.reconcile)


def serve(
    profile: Profile,
    home: Path,
    tracking_uri: str | None,
    artifacts: str | None,
    attach: list[Triton] | None = None,
    discover: Discovery | None = None,
) -> None:
    """`attach`: Tritons this serve does not own (`--triton-url`); `discover`: those a name resolves to, round after
    round (`--triton-discover`); else it starts serve.replicas of its own."""
    listen = profile.serve.listen
    api_keys = client_credentials(profile)
    check_listen(listen, api_keys.keys or api_keys.tokens is not None)
    ports = choose_ports(listen, own_tritons=discover is None)
    ctx = open_serving_context(profile, tracking_uri, artifacts)
    service = profile.registry.model_name
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    recorded = read_record(record_path(home, service))
    champion = starting_champion(ctx, recorded)
    source = "the deployment record" if recorded is not None and recorded.champion is not None else "the registry"
    fleet = Fleet(ctx, listen, lambda line: print(line, flush=True))
    if discover is not None:
        attach = discover.first(profile.serve.load_timeout_s, lambda line: print(line, flush=True))
    start_fleet(fleet, profile, ports, champion, attach, discovered=discover is not None)
    gateway, serve_key, logs = None, new_serve_key(), show_access_log()
    try:
        gateway = start_gateway(ctx, fleet, champion, listen, ports, api_keys, serve_key)
        fleet.table = lambda: gateway.gateway.table if gateway is not None else None
        fleet.probe = lambda: gateway.call(gateway.gateway.prober.round()) if gateway is not None else None
        scheme = "https" if listen.tls_cert else "http"
        local = "127.0.0.1" if listen.host in ("0.0.0.0", "::", "") else listen.host
        gateway_url = f"{scheme}://{local}:{ports.gateway}"
        control_local = "127.0.0.1" if listen.control_host in ("0.0.0.0", "::", "") else listen.control_host
        control_url = f"{scheme if listen.control_host not in LOOPBACK else 'http'}://{control_local}:{ports.control}"
        metrics_host = listen.gateway_metrics_host
        metrics_url = (
            f"http://{'127.0.0.1' if metrics_host in ('0.0.0.0', '::', '') else metrics_host}:{ports.gateway_metrics}"
        )
        publish(home, fleet.tritons, gateway_url, control_url, serve_key, service, metrics_url)
        tritons = ", ".join(f"{t.url} (gRPC {t.grpc_url}, metrics {t.metrics_url})" for t in fleet.tritons)
        print(
            f"serving {service} (champion v{champion.version} from {source}) at {scheme}://{listen.host}:{ports.gateway}/v1 "
            f"(OpenAI) and /v2/models/{service}/generate; "
            f"{len(api_keys.keys) or 'no'} API key{'' if len(api_keys.keys) == 1 else 's'}; control API {control_url}; "
            f"Triton {tritons}; the gateway's metrics {metrics_url}/metrics; Ctrl-C stops",
            flush=True,
        )
        limits = profile.serve.limits
        print(f"llmops serve: {gateway.gateway.limits.summary(limits.max_in_flight, bool(api_keys.keys))}", flush=True)

        def republish() -> None:  # at zero, server.json keeps the first replica's endpoints: the next one starts there
            if fleet.tritons:
                publish(home, fleet.tritons, gateway_url, control_url, serve_key, service, metrics_url)

        start_loops(profile, fleet, gateway, discover, republish, stopped, champion)
        registry = threading.Thread(target=registry_follows, args=(ctx, recorded, fleet, stopped), daemon=True)
        registry.start()
        while not stopped.wait(0.5):
            for replica in fleet.dead():
                # server.json stays while the replica restarts: it names this serve, which lives, so a release started
                # now waits for the replica instead of starting a second service on the same record
                if not fleet.restart(replica, stopped):
                    return
                republish()  # same ports, new key
    except KeyboardInterrupt:
        pass
    finally:
        unpublish(home)
        if gateway is not None:
            gateway.stop()
        if logs is not None:
            logs.close()
        fleet.stop()
        print("llmops serve: stopped", flush=True)


def start_loops(
    profile: Profile,
    fleet: Fleet,
    gateway: RunningGateway,
    discover: Discovery | None,
    republish: Callable[[], object],
    stopped: threading.Event,
    champion: Served,
) -> None:
    """The serve's loops beside its gateway: expired approvals, the reconciler, serve.autoscale's policy (its in_flight
    target by default what the tune stage measured the champion to hold), and the lookups of --triton-discover's
    name."""
    say = lambda line: print(line, flush=True)  # noqa: E731
    loops: list[tuple[str, Callable, tuple]] = [
        ("approval-expiry", expire_approvals, (fleet.ctx.home, stopped)),
        ("reconcile", reconcile, (fleet, stopped)),
    ]
    fleet.count = reconcile_counter(gateway.gateway)
    autoscale = profile.serve.autoscale
    if autoscale is not None and discover is None:
        policy = autoscale_policy(profile, champion, say)
        loops.append(("autoscale", Autoscaler(policy, fleet, gateway, republish, say).run, (stopped,)))
    if discover is not None:
        members = Membership(discover, fleet, gateway, say, republish)
        if autoscale is not None and autoscale.min_replicas == 0:  # KEDA takes the pods to zero: a request waits
            gateway.gateway.triton.wake_with(members.woken.set, autoscale.cold_start_timeout_s)
        loops.append(("discovery", members.run, (stopped,)))
    for name, loop, args in loops:
        threading.Thread(target=loop, args=args, daemon=True, name=name).start()


def autoscale_policy(profile: Profile, champion: Served, say: Callable[[str], None]) -> AutoscaleSection:
    """serve.autoscale with its target; an in_flight one left unset is what the tune stage measured the champion to
    hold within the TTFT objective (its recorded settings' capacity), said, else 4."""
    assert profile.serve.autoscale is not None
    measured = (champion.settings or {}).get("capacity", {}).get("in_flight")
    policy = profile.serve.autoscale.with_target(profile.gate.p99_time_to_first_token_ms, measured)
    if measured and policy.signal == "in_flight" and profile.serve.autoscale.target is None:
        say(
            f"llmops serve: autoscale: target {measured:g} requests in flight per replica, what the tune stage "
            f"measured v{champion.version} to hold within gate.p99_time_to_first_token_ms"
        )
    return policy


def start_fleet(
    fleet: Fleet,
    profile: Profile,
    ports: Ports,
    champion: Served,
    attach: list[Triton] | None,
    discovered: bool = False,
) -> None:
    """The Tritons `attach` names, else serve.replicas (serve.autoscale's min_replicas) of this serve's own. With
    `discovered` ones, serve.autoscale is the policy that scales their pods (a KEDA ScaledObject), not this serve's."""
    autoscale = profile.serve.autoscale
    if attach:
        if autoscale is not None and not discovered:
            raise BadInput(
                "serve.autoscale: it starts and stops Tritons of its own; not with --triton-url (on Kubernetes a KEDA "
                "ScaledObject scales Triton pods that --triton-discover finds: `llmops profiles autoscaler`)"
            )
        fleet.attach(attach, champion)
    else:
        # with min_replicas 0 too, one to start with: the champion is seen to load before the serve says it serves
        count = max(autoscale.min_replicas, 1) if autoscale is not None else profile.serve.replicas
        fleet.start((ports.http, ports.grpc, ports.metrics), count, champion)


def reconcile(fleet: Fleet, stopped: threading.Event, every_s: float = RECONCILE_S) -> None:
    """What the replicas hold converges to the table every few seconds (Fleet.reconcile): a candidate that a dead
    release left loaded goes once its ownership and hold lapsed."""
    while not stopped.wait(every_s):
        try:
            fleet.reconcile()
        except Exception as exc:  # a round that failed is said; the next one tries again
            print(f"llmops serve: reconcile: {type(exc).__name__}: {exc}", flush=True)


def reconcile_counter(gateway: Gateway) -> Callable[[str, str], None]:
    from prometheus_client import Counter

    actions = Counter(
        "llmops_serve_reconcile_actions",
        "What the serve did to make its replicas hold what the route table serves, by action and model.",
        ["action", "model"],
        registry=gateway.metrics.registry,
    )
    return lambda action, model: actions.labels(action, model).inc()


def expire_approvals(home: Path, stopped: threading.Event, every_s: float = EXPIRY_CHECK_S) -> None:
    """While serving: the suspended releases (and harvests) of this home past their approval timeout are rejected
    on their behalf, so that they roll back (tasks/platform/decisions.py)."""
    while not stopped.wait(every_s):
        for line in expire_overdue(home):
            print(f"llmops serve: {line}", flush=True)


def registry_follows(
    ctx: RunContext, recorded: RouteTable | None, fleet: Fleet, stopped: threading.Event, every_s: float = REGISTRY_S
) -> None:
    """The registry's champion made the record's where they differ, said: at the start (off its path: MLflow may be
    slow or away, the serve starts from the store alone), then once for each rollout the controller promotes (its
    release may be stopped or dead, its own alias write never made; both write the same version). A failed write is
    tried again each round, said once."""
    unsaid, handled = registry_to_record(ctx, recorded, ""), None
    while not stopped.wait(every_s):
        table = fleet.table()
        if table is None or table.rollout is None or not promoted_rollout(table):
            continue
        rollout = (table.rollout.release, table.rollout.updated_at)
        if rollout != handled:
            unsaid = registry_to_record(ctx, table, unsaid)
            handled = rollout if not unsaid else None


def registry_to_record(ctx: RunContext, table: RouteTable | None, said_before: str) -> str:
    """One comparison of the registry's champion with `table`'s, what was done said; the failure said, returned (''
    where none), and not said again where it is `said_before`."""
    try:
        said, failed = registry_follows_record(ctx, table), ""
    except Exception as exc:  # MLflow away or refusing
        failed = f"llmops serve: the registry's champion not compared with the record ({type(exc).__name__}: {exc})"
        said = failed if failed != said_before else None
    if said:
        print(said[:500], flush=True)
    return failed


def starting_champion(ctx: RunContext, table: RouteTable | None) -> Served:
    """The champion the deployment record names (from the store alone), else the registry's."""
    service = ctx.profile.registry.model_name
    if table is not None and table.champion is not None:
        return served_of(ctx, service, table.champion)
    champion = registry_champion(ctx)
    if champion is None:
        raise BadInput(f"registered model {service}: no champion yet; run `llmops run` first")
    return champion


def show_access_log() -> LogWriter | None:
    """The gateway's access log (one JSON line a request) and its fault log on stderr, beside serve's own lines,
    written by a thread of their own (tasks/runtime/gateway/logs.py): a stderr nobody reads stops no request. None
    where the loggers have handlers already (a test's)."""
    import logging

    names = [name for name in ("llmops.gateway", "llmops.gateway.access") if not logging.getLogger(name).handlers]
    return LogWriter(sys.stderr).start(names) if names else None


def capture_settings(ctx: RunContext) -> CaptureSettings | None:
    """serve.capture as the gateway takes it; None where capture is off."""
    from datetime import timedelta

    from tasks.data.exchanges import default_location, open_exchange_log
    from tasks.data.redact import Redactor

    capture = ctx.profile.serve.capture
    if not capture.enabled:
        return None
    location = capture.location or default_location(ctx.store.uri)
    print(f"capture: {capture.sample_rate:.0%} of exchanges and all feedback kept in {location}", flush=True)
    return CaptureSettings(
        log=open_exchange_log(location),
        service=ctx.profile.registry.model_name,
        sample_rate=capture.sample_rate,
        redactor=Redactor.with_patterns(capture.redact),
        retention=timedelta(days=capture.retention_days),
        flush_s=capture.flush_s,
        max_pending=capture.max_pending,
    )


def start_gateway(
    ctx: RunContext,
    fleet: Fleet,
    champion: Served,
    listen: ListenSection,
    ports: Ports,
    api_keys: KeyRing,
    serve_key: str,
) -> RunningGateway:
    gateway = Gateway(
        gateway_config(
            ctx, fleet, champion, listen, api_keys, serve_key, record_path(ctx.home, ctx.profile.registry.model_name)
        )
    )
    if gateway.table.champion is None or gateway.table.champion.name != champion.name:  # no record yet: the registry's
        adopt_alone(gateway, champion)
    tls = {"tls_cert": listen.tls_cert, "tls_key": listen.tls_key}
    control_tls = tls if listen.control_host not in LOOPBACK else {}
    return RunningGateway(
        [
            Listener(gateway.app(), listen.host, ports.gateway, **tls),
            Listener(
                ControlApi(gateway, serve_key, ReleaseLoads(fleet)).app(),
                listen.control_host,
                ports.control,
                **control_tls,
            ),
            Listener(gateway.metrics_app(), listen.gateway_metrics_host, ports.gateway_metrics),
        ],
        gateway,
    ).start()


def gateway_config(
    ctx: RunContext,
    fleet: Fleet,
    champion: Served,
    listen: ListenSection,
    api_keys: KeyRing | dict,
    serve_key: str | None,
    record: Path | None,
) -> GatewayConfig:
    import json

    limits = ctx.profile.serve.limits
    model_config = json.loads((champion.model_dir / "config.json").read_text())
    return GatewayConfig(
        triton_url=fleet.tritons[0].url,
        more_replicas=[triton.url for triton in fleet.tritons[1:]],
        service=ctx.profile.registry.model_name,
        context_tokens=int(model_config.get("max_position_embeddings", 2048)),
        default_max_tokens=ctx.profile.serve.default_max_tokens,
        max_body_bytes=listen.max_request_bytes,
        api_keys=api_keys,
        tokenizer_dir=champion.model_dir,
        apply_chat_template=ctx.profile.serve.apply_chat_template,
        requests_per_second=limits.requests_per_second,
        request_burst_s=limits.burst_s,
        tokens_per_minute=limits.tokens_per_minute,
        max_in_flight=limits.max_in_flight,
        max_in_flight_per_key=limits.max_in_flight_per_key,
        shadow_records=ctx.home / "shadow" if record is not None else None,
        capture=capture_settings(ctx) if record is not None else None,
        record=record,
        control_key=serve_key,
        health=ctx.profile.serve.health,
        recover=fleet.recover,
        backend=ctx.profile.serve.backend,
        version_pinning=ctx.profile.serve.version_pinning,
    )


def adopt_alone(gateway: Gateway, served: Served) -> None:
    route = as_route(served)
    gateway.adopt(RouteTable(gateway.config.service, route, weights={route.name: 100.0}))
