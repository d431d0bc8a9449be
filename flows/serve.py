"""`llmops serve`: keep the registered champion served until stopped, as a service that stays up.

- Triton (the models; its HTTP port carries the locked control API the release runs use) on
  `serve.listen.triton_*` ports, with the champion behind the router (the service's stable name),
  published in $LLMOPS_HOME/triton/server.json so that `llmops run` with the same LLMOPS_HOME rolls its
  candidates out on it.
- The gateway clients call (tasks/serving/gateway/) on `serve.listen.host:port`: OpenAI-compatible /v1 and
  Triton's generate API for the service name, API keys, TLS, request limits; /health/ready says
  whether the service name answers (a Kubernetes readiness probe), /health/live that the process does.
- If Triton dies, it is started again on the same ports with backoff (1, 2, 4 ... 30 s), and the
  champion and router are loaded again; after `serve.listen.restart_limit` deaths in a row (each within
  a minute of its start) `llmops serve` exits 4. Triton dies with this process, even a SIGKILLed one.
- SIGTERM or Ctrl-C stops the gateway and Triton and removes server.json.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from flows.release import open_serving_context
from tasks.platform.config import ListenSection, Profile
from tasks.platform.errors import BadInput, TransientError
from tasks.platform.ports import free_port, port_in_use
from tasks.platform.stage_cache import RunContext
from tasks.serving.champion import serve_champion, triton_launch
from tasks.serving.client import control_key
from tasks.serving.gateway import Gateway, GatewayConfig, KeyRing
from tasks.serving.gateway.capture import CaptureSettings
from tasks.serving.models import Served
from tasks.serving.server import TritonServer, publish, unpublish

LOOPBACK = ("127.0.0.1", "localhost", "::1")
STAYED_UP_S = 60  # a Triton that lived this long did not die of its start: the count of deaths starts over
SHADOW_POLL_S = 1.0  # how often the gateway reads the router's shadow parameter (one config GET on loopback)


@dataclass
class Ports:
    gateway: int
    http: int
    grpc: int
    metrics: int


def choose_ports(listen: ListenSection) -> Ports:
    """The configured ports, 0 replaced by a free one, chosen once: restarts keep them."""
    wanted = {
        "port": listen.port,
        "triton_http_port": listen.triton_http_port,
        "triton_grpc_port": listen.triton_grpc_port,
        "triton_metrics_port": listen.triton_metrics_port,
    }
    for name, port in wanted.items():
        if port and port_in_use(port):
            raise BadInput(
                f"serve.listen.{name} {port}: port in use; pick another (--{name.replace('_', '-')}, 0 = any free port)"
            )
    chosen = [port or free_port() for port in wanted.values()]
    return Ports(*chosen)


def check_listen(listen: ListenSection, api_keys: dict) -> None:
    """Refuse an open service off loopback (no API keys, or keys in cleartext), a Triton whose ports clients
    could reach (it answers inference without keys), and TLS files that are not there."""
    if listen.host not in LOOPBACK:
        if not api_keys:
            raise BadInput(
                f"serve.listen.host {listen.host}: clients from other machines need API keys; "
                "set LLMOPS_API_KEYS_FILE (one key a line) or LLMOPS_API_KEYS"
            )
        if listen.tls_cert is None and not listen.behind_tls_proxy:
            raise BadInput(
                f"serve.listen.host {listen.host}: keys from other machines would cross in cleartext; give "
                "--tls-cert and --tls-key, or --behind-tls-proxy where a proxy in front terminates TLS"
            )
    if listen.triton_host not in LOOPBACK and not listen.triton_ports_firewalled:
        raise BadInput(
            f"serve.listen.triton_host {listen.triton_host}: Triton answers inference there without API keys; "
            "keep it on 127.0.0.1, or close its ports to clients (a NetworkPolicy, a firewall) and say so with "
            "--triton-ports-firewalled"
        )
    for name in ("tls_cert", "tls_key"):
        path = getattr(listen, name)
        if path is not None and not Path(path).is_file():
            raise BadInput(f"serve.listen.{name} {path}: no such file")


def serve(profile: Profile, home: Path, tracking_uri: str | None, artifacts: str | None) -> None:
    listen = profile.serve.listen
    api_keys = KeyRing(os.environ)  # follows LLMOPS_API_KEYS_FILE: a key removed there stops working, no restart
    check_listen(listen, api_keys.keys)
    ports = choose_ports(listen)
    ctx = open_serving_context(profile, tracking_uri, artifacts)
    service = profile.registry.model_name
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    server, champion = start_serving(ctx, home, listen, ports)
    gateway = None
    try:
        gateway = start_gateway(ctx, server, champion, listen, ports, api_keys)
        scheme = "https" if listen.tls_cert else "http"
        local = "127.0.0.1" if listen.host in ("0.0.0.0", "::", "") else listen.host
        gateway_url = f"{scheme}://{local}:{ports.gateway}"
        publish(home, server, gateway_url)
        print(
            f"serving {service} (champion v{champion.version}) at {scheme}://{listen.host}:{ports.gateway}/v1 "
            f"(OpenAI) and /v2/models/{service}/generate; "
            f"{len(api_keys.keys) or 'no'} API key{'' if len(api_keys.keys) == 1 else 's'}; Triton {server.client.url} "
            f"(gRPC {server.client.grpc_url}, metrics {server.client.metrics_url}); Ctrl-C stops",
            flush=True,
        )
        deaths, started = 0, time.monotonic()
        while not stopped.wait(0.5):
            if server.running():
                continue
            deaths = deaths + 1 if time.monotonic() - started < STAYED_UP_S else 1
            print(f"llmops serve: Triton exited with {server.process.returncode} ({server.log_tail(2)})", flush=True)
            unpublish(home)
            restarted = restart(ctx, home, listen, ports, deaths, stopped)
            if restarted is None:
                return
            server = restarted
            publish(home, server, gateway_url)
            started = time.monotonic()  # same ports: the gateway's upstream URL holds
    except KeyboardInterrupt:
        pass
    finally:
        unpublish(home)
        if gateway is not None:
            gateway.stop()
        server.stop()
        print("llmops serve: stopped", flush=True)


def start_serving(ctx: RunContext, home: Path, listen: ListenSection, ports: Ports) -> tuple[TritonServer, Served]:
    """Triton on the chosen ports with the champion behind the router, published for release runs."""
    launcher, env = triton_launch(ctx.profile, home)
    server = TritonServer.start(
        home,
        ctx.profile.serve.triton_binary,
        launcher=launcher,
        extra_env=env,
        host=listen.triton_host,
        ports=(ports.http, ports.grpc, ports.metrics),
        die_with_parent=threading.current_thread() is threading.main_thread(),
    )
    try:
        champion = serve_champion(ctx, server.client)
        if champion is None:
            raise BadInput(
                f"registered model {ctx.profile.registry.model_name}: no champion yet; run `llmops run` first"
            )
    except BaseException:
        server.stop()
        raise
    return server, champion


def restart(
    ctx: RunContext, home: Path, listen: ListenSection, ports: Ports, deaths: int, stopped: threading.Event
) -> TritonServer | None:
    """Start Triton again with backoff; None when stopped meanwhile. Gives up past the restart limit."""
    while deaths <= listen.restart_limit:
        delay = min(30, 2 ** (deaths - 1))
        print(
            f"llmops serve: restarting Triton in {delay}s (death {deaths} of {listen.restart_limit} allowed)",
            flush=True,
        )
        if stopped.wait(delay):
            return None
        try:
            server, champion = start_serving(ctx, home, listen, ports)
        except (TransientError, OSError) as exc:
            print(f"llmops serve: restart failed: {exc}", flush=True)
            deaths += 1
            continue
        print(f"llmops serve: Triton restarted; champion v{champion.version} serving again", flush=True)
        return server
    raise TransientError(
        f"Triton died {deaths} {'time' if deaths == 1 else 'times'} in a row "
        f"(serve.listen.restart_limit {listen.restart_limit}); "
        f"see {home / 'triton' / 'tritonserver.log'}"
    )


def show_access_log() -> None:
    """The gateway's access log (one JSON line a request) and its fault log on stderr, beside serve's own lines."""
    import logging

    for name in ("llmops.gateway", "llmops.gateway.access"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False


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


class RunningGateway:
    """The gateway's uvicorn server, in a thread of this process."""

    def __init__(self, gateway: Gateway, server, thread: threading.Thread):
        self.gateway, self.server, self.thread = gateway, server, thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def start_gateway(
    ctx: RunContext, server: TritonServer, champion: Served, listen: ListenSection, ports: Ports, api_keys: KeyRing
) -> RunningGateway:
    import json

    import uvicorn

    model_config = json.loads((champion.model_dir / "config.json").read_text())
    gateway = Gateway(
        GatewayConfig(
            triton_url=server.client.url,
            service=ctx.profile.registry.model_name,
            context_tokens=int(model_config.get("max_position_embeddings", 2048)),
            default_max_tokens=ctx.profile.serve.default_max_tokens,
            max_body_bytes=listen.max_request_bytes,
            api_keys=api_keys,
            tokenizer_dir=champion.model_dir,
            apply_chat_template=ctx.profile.serve.apply_chat_template,
            requests_per_second=ctx.profile.serve.limits.requests_per_second,
            request_burst_s=ctx.profile.serve.limits.burst_s,
            tokens_per_minute=ctx.profile.serve.limits.tokens_per_minute,
            max_in_flight=ctx.profile.serve.limits.max_in_flight,
            shadow_poll_s=SHADOW_POLL_S,
            control_key=lambda: control_key(ctx.home),  # the published one: it changes when Triton restarts
            shadow_records=ctx.home / "shadow",
            capture=capture_settings(ctx),
            backend=ctx.profile.serve.backend,
            version_pinning=ctx.profile.serve.version_pinning,
        )
    )
    show_access_log()
    config = uvicorn.Config(
        gateway.app(),
        host=listen.host,
        port=ports.gateway,
        ssl_certfile=listen.tls_cert,
        ssl_keyfile=listen.tls_key,
        log_level="warning",
        access_log=False,  # requests carry keys in headers; uvicorn's access log prints none, but stays off
        lifespan="on",
    )
    uvicorn_server = uvicorn.Server(config)
    thread = threading.Thread(target=uvicorn_server.run, name="gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uvicorn_server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise BadInput(f"gateway on {listen.host}:{ports.gateway}: did not start (see the lines above)")
        time.sleep(0.1)
    return RunningGateway(gateway, uvicorn_server, thread)
