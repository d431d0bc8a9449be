"""A service of one version for one caller: `llmops predict` where no `llmops serve` runs."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from flows.release import open_serving_context
from flows.serve import adopt_alone, gateway_config
from tasks.platform.config import Profile
from tasks.platform.ports import free_port
from tasks.runtime.fleet import Fleet
from tasks.runtime.gateway import Gateway
from tasks.runtime.gateway.running import Listener, RunningGateway
from tasks.serving.champion import served_version


@contextmanager
def serving_alone(profile: Profile, version, tracking_uri: str | None, artifacts: str | None) -> Iterator[str]:
    """A Triton and a gateway of the caller's own serving registry `version` (an MLflow ModelVersion) alone as the
    service, on loopback ports with no keys and no capture, for `llmops predict` where no `llmops serve` runs; the
    service's deployment record is neither read nor written. Yields the gateway's URL; both stop after."""
    ctx = open_serving_context(profile, tracking_uri, artifacts)
    served = served_version(ctx, profile.registry.model_name, version)
    fleet = Fleet(ctx, profile.serve.listen, lambda line: print(line, file=sys.stderr, flush=True))
    gateway = None
    try:
        fleet.start((free_port(), free_port(), free_port()), 1, served)
        inner = Gateway(gateway_config(ctx, fleet, served, profile.serve.listen, {}, None, None))
        adopt_alone(inner, served)
        port = free_port()
        gateway = RunningGateway([Listener(inner.app(), "127.0.0.1", port)], inner).start()
        yield f"http://127.0.0.1:{port}"
    finally:
        if gateway is not None:
            gateway.stop()
        fleet.stop()
