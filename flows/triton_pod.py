"""`llmops triton`: one tritonserver as `llmops serve` starts its own (explicit model control, the model-control API
locked to LLMOPS_TRITON_CONTROL_KEY, the Python backend and the profile's launch), in the foreground and with no model
loaded, for a gateway elsewhere to fill: on Kubernetes, a pod of the Deployment a KEDA ScaledObject scales, which
`llmops serve --triton-discover` finds by its headless Service and loads every routed version on before it takes a
request (infra/kubernetes/serving-autoscale.yaml). With `--artifacts s3://BUCKET/PREFIX` (LLMOPS_ARTIFACTS), the
gateway's S3 store, a model fetches its files from the store itself, with this pod's AWS_* credentials (read-only
ones suffice), into $LLMOPS_HOME/cache/objects, and a load request carries its config alone; without it, the files
arrive in the load requests (at most tasks/serving/client.py:SENT_FILES_LIMIT). Either way a model may read from
its own folder and what it fetched alone (tasks/serving/model_roots.py). SIGTERM stops Triton (its
--exit-timeout-secs lets the requests it has finish); a Triton that dies on its own ends the command with exit 4 and
its log's last lines.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import threading
from pathlib import Path

from tasks.platform.config import Profile
from tasks.platform.errors import BadInput, TransientError
from tasks.serving.champion import triton_launch
from tasks.serving.client import CONTROL_KEY_ENV
from tasks.serving.model_roots import CACHE_ENV, ROOTS_ENV, STORE_ENV, STORE_SCHEME
from tasks.serving.server import TritonServer

# What boto3 inside a model reads to reach the store: tritonserver and its stubs get no AWS variable otherwise
# (tasks/platform/child_env.py)
STORE_VARIABLES = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_MAX_ATTEMPTS",
    "AWS_CA_BUNDLE",
)


def store_env(home: Path, artifacts: str | None) -> dict[str, str]:
    """The variables a model needs to fetch from the S3 store `artifacts` (none: no store, files come with the
    loads); BadInput for a store that is not S3 (a local folder is a shared disk: `llmops serve`'s own replicas)."""
    if not artifacts:
        return {}
    if not artifacts.startswith(STORE_SCHEME):
        raise BadInput(
            f"--artifacts {artifacts}: a Triton that shares no disk fetches from an S3 store (s3://BUCKET/PREFIX)"
        )
    found = {name: os.environ[name] for name in STORE_VARIABLES if os.environ.get(name)}
    return {**found, STORE_ENV: artifacts.rstrip("/"), CACHE_ENV: str(home / "cache" / "objects")}


def loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def run_triton(profile: Profile, home: Path, artifacts: str | None = None) -> None:
    listen = profile.serve.listen
    store = store_env(home, artifacts)
    if not os.environ.get(CONTROL_KEY_ENV):
        raise BadInput(
            f"{CONTROL_KEY_ENV}: not set; the gateway that loads models here needs the key this Triton locks its "
            "model-control API with (on Kubernetes, from the Secret both pods read)"
        )
    if not loopback(listen.triton_host) and not listen.triton_ports_firewalled:
        raise BadInput(
            f"serve.listen.triton_host {listen.triton_host}: Triton answers inference there without API keys; keep it "
            "on 127.0.0.1, or close its ports to all but the gateway (a NetworkPolicy) and say so with "
            "--triton-ports-firewalled"
        )
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    launcher, env = triton_launch(profile, home)
    ports = (listen.triton_http_port, listen.triton_grpc_port, listen.triton_metrics_port)
    server = TritonServer.start(
        home,
        profile.serve.triton_binary,
        launcher=launcher,
        extra_env={**env, ROOTS_ENV: "", **store},  # no store folder here: its own folder, or what it fetched
        host=listen.triton_host,
        ports=ports,
        die_with_parent=True,
    )
    print(
        f"llmops triton: serving at {server.client.url} (gRPC {server.client.grpc_url}, metrics "
        f"{server.client.metrics_url}), no model loaded: `llmops serve --triton-discover` loads them"
        f"{' (their files fetched from ' + store[STORE_ENV] + ')' if store else ''}; log "
        f"{server.log_path}; SIGTERM stops",
        flush=True,
    )
    try:
        while not stopped.wait(1):
            if not server.running():
                raise TransientError(f"tritonserver exited with {server.process.returncode}: {server.log_tail(3)}")
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    print("llmops triton: stopped", flush=True)
