"""A release's service where no `llmops serve` runs it: the runtime's gateway (its control listener only), started in
the release's own process in front of a Triton it attached to or started, for the release alone. Where `llmops serve`
runs the service, the release attaches to it instead (tasks/serving/publication.py:published_service).

The one place outside the runtime's own command that starts the runtime: flows/release.py calls `open_service`; the
release's stages reach the service it returns through tasks/serving/service.py only.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.control.contract import RouteTable, Version, record_path
from tasks.platform.config import Profile
from tasks.platform.errors import CheckFailed, TransientError
from tasks.platform.ports import free_port
from tasks.platform.run_log import Said
from tasks.platform.stage_cache import RunContext, logger
from tasks.runtime.fleet import versions_to_load
from tasks.runtime.loads import held_by, loaded_on, with_load_timeout
from tasks.serving.champion import released_profile, served_of, triton_launch
from tasks.serving.client import Triton, TritonTarget, attach_control_key
from tasks.serving.models import Served, install_model, retire, triton_unload_quietly
from tasks.serving.publication import awaited_service, published, published_service
from tasks.serving.server import TritonServer
from tasks.serving.service import Service, ServiceControl

SERVE_BACK_S = 180.0  # a serve its supervisor starts again loads its versions first (on cpu-tiny: 20 to 40 s)


def open_service(ctx: RunContext, target: TritonTarget | None) -> Service:
    """The service to roll out on: the one `llmops serve` runs for this LLMOPS_HOME (its Triton, its control API);
    else a Triton (the target, the one an `llmops serve` of another service runs here, or one started here) with a
    temporary gateway of this run's own in front of it, which `Service.stop` ends with the Triton it started. The
    control key of Triton: for a target only the one given for it (TritonTarget); for `llmops serve`'s Triton the key
    file it publishes; a started one makes its own."""
    service_name = ctx.profile.registry.model_name
    server = None
    if target is not None:
        triton = Triton.attach(
            target.url,
            Path(target.repository) if target.repository else None,
            target.metrics_url,
            target.grpc_url,
            target.control_key,
        )
        triton.reread_key = attach_control_key  # the operator's key file, read again where Triton refuses the key
        if target.serve_url and target.serve_key:  # the `llmops serve` in front of it routes
            return Service(service_name, [triton], ServiceControl(target.serve_url, target.serve_key))
    else:
        serving = published_service(ctx.home, service_name) or awaited_service(
            ctx.home, service_name, SERVE_BACK_S, logger().warning
        )
        if serving is not None:
            return serving
        published_triton = published(ctx.home)
        if published_triton is not None:  # another service's serve: its first replica
            triton = published_triton
        else:
            launcher, env = triton_launch(ctx.profile, ctx.home)
            server = TritonServer.start(
                ctx.home,
                ctx.profile.serve.triton_binary,
                launcher=launcher,
                extra_env=env,
                model_roots=ctx.store.local_folders(),
            )
            triton = server.client
    own = OwnTriton(ctx, triton, server)
    try:
        gateway, control = temporary_gateway(ctx, triton, own)
    except BaseException:
        if server is not None:
            server.stop()
        raise
    own.table = lambda: gateway.gateway.table

    def stop() -> None:
        gateway.stop()
        if own.server is not None:
            own.server.stop()

    return Service(service_name, [triton], control, stop)


class OwnTriton:
    """The loads of a release's own service (POST /control/v1/versions on its temporary gateway): its one Triton, the
    one it started or attached to. A load that hangs on one this run started (no clients) kills it with its model
    processes and starts it again on its ports, the table's versions loaded, then the load once more; on one it
    attached to, Prefect's retry (TransientError)."""

    def __init__(self, ctx: RunContext, triton: Triton, server: TritonServer | None):
        self.ctx, self.triton, self.server = ctx, triton, server
        self.table: Callable[[], RouteTable] = lambda: RouteTable(ctx.profile.registry.model_name)
        self.loaded: set[str] = set()  # the versions this run loaded: its gateway's probes judge these alone

    def has_loaded(self, version: Version) -> bool:
        return version.name in self.loaded

    def load_everywhere(self, version: Version, load_timeout_s: float, fresh: bool = False) -> list[dict[str, Any]]:
        served = served_of(self.ctx, self.ctx.profile.registry.model_name, version)
        profile = with_load_timeout(released_profile(self.ctx.profile, served), load_timeout_s)
        with Said() as said:
            if fresh:
                triton_unload_quietly(self.triton, served.name)
            seconds = self.install(version, served, profile)
        self.loaded.add(version.name)
        return [loaded_on(self.triton, served, seconds, said)]

    def install(self, version: Version, served: Served, profile: Profile) -> float:
        try:
            return install_model(self.triton, profile, served)
        except CheckFailed:
            if self.table().version(version.name) is None:
                retire(self.triton, self.ctx.profile.registry.model_name, served)
            raise
        except TransientError as exc:
            if self.server is None:
                raise
            logger().warning(f"canary: {exc}; starting this run's Triton {self.triton.url} again")
            self.restart()
        logger().info(f"canary: Triton {self.triton.url} started again; loading {served.name} once more")
        try:
            return install_model(self.triton, profile, served)
        except TransientError as again:
            raise CheckFailed(
                f"{served.name}'s load hung again after Triton {self.triton.url} restarted: {again}"
            ) from None

    def restart(self) -> None:
        assert self.server is not None
        ctx = self.ctx
        launcher, env = triton_launch(ctx.profile, ctx.home)
        self.server.kill()
        self.server = TritonServer.start(
            ctx.home,
            ctx.profile.serve.triton_binary,
            launcher=launcher,
            extra_env=env,
            ports=self.server.ports,
            model_roots=ctx.store.local_folders(),
        )
        self.triton.control_key = self.server.client.control_key  # a new Triton, a new key; the same ports
        for served in versions_to_load(ctx, self.table()):
            install_model(self.triton, released_profile(ctx.profile, served), served)

    def held(self) -> list[dict[str, Any]]:
        return [held_by(self.triton)]

    def unload_everywhere(self, version: Version) -> list[str]:
        if self.table().version(version.name) is not None:
            raise CheckFailed(f"{version.name} is in the service's routes: route it away before unloading it")
        retire(
            self.triton,
            self.ctx.profile.registry.model_name,
            served_of(self.ctx, self.ctx.profile.registry.model_name, version),
        )
        self.loaded.discard(version.name)
        return [self.triton.url]


def temporary_gateway(ctx: RunContext, triton: Triton, versions: OwnTriton):
    """The gateway of `llmops serve` with its control listener only, on a free loopback port, for this run: the
    same routing, deadlines and counters as a service's, and the service's deployment record of this home."""
    from tasks.runtime.gateway import Gateway, GatewayConfig
    from tasks.runtime.gateway.control import ControlApi
    from tasks.runtime.gateway.running import Listener, RunningGateway

    key, port, service = secrets.token_urlsafe(32), free_port(), ctx.profile.registry.model_name
    config = GatewayConfig(
        triton_url=triton.url,
        service=service,
        context_tokens=1 << 20,  # no client of its own: each model refuses what exceeds its context itself
        record=record_path(ctx.home, service),
        control_key=key,
        shadow_records=ctx.home / "shadow",
        health=ctx.profile.serve.health,
        recover=reloading(triton, ctx.profile.serve.load_timeout_s) if triton.repository is not None else None,
        probed=versions.has_loaded,  # the champion a fresh Triton has yet to load: no fault, no recovery (issue 73)
    )
    gateway = Gateway(config)
    running = RunningGateway(
        [Listener(ControlApi(gateway, key, versions).app(lifespan=True), "127.0.0.1", port)], gateway
    )
    running.start()
    logger().info(f"serving: a gateway for {service} on 127.0.0.1:{port} in front of Triton {triton.url}")
    return running, ServiceControl(f"http://127.0.0.1:{port}", key)


def reloading(triton: Triton, timeout_s: float):
    """A model that keeps failing its probes, loaded again from the Triton's repository (this machine shares it)."""

    def reload(replica: str, model: str) -> str:
        triton.load(model, timeout=timeout_s)
        return "reloaded"

    return reload
