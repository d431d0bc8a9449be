"""`llmops serve`: the champion behind Triton and the OpenAI-compatible gateway, until stopped."""

from __future__ import annotations

import argparse

from flows.cli.common import add_overrides_flag
from tasks.platform.project import llmops_home

# `llmops serve` flags that set serve.listen.* (flag, key, type, help)
SERVE_LISTEN_FLAGS = (
    ("--host", "host", str, "gateway bind address (default 127.0.0.1)"),
    ("--port", "port", int, "gateway port (default 8080; 0: any free port)"),
    ("--control-host", "control_host", str, "the control API's bind address (default 127.0.0.1)"),
    ("--control-port", "control_port", int, "the control API's port (default 8081)"),
    (
        "--gateway-metrics-host",
        "gateway_metrics_host",
        str,
        "bind address of the gateway's /metrics (default 127.0.0.1)",
    ),
    (
        "--gateway-metrics-port",
        "gateway_metrics_port",
        int,
        "port of the gateway's /metrics (default 8082; 0: any free)",
    ),
    ("--triton-host", "triton_host", str, "Triton's bind address (default 127.0.0.1)"),
    ("--triton-http-port", "triton_http_port", int, "Triton HTTP port (default 8000)"),
    ("--triton-grpc-port", "triton_grpc_port", int, "Triton gRPC port (default 8001)"),
    ("--metrics-port", "triton_metrics_port", int, "Triton's Prometheus metrics port (default 8002)"),
    ("--tls-cert", "tls_cert", str, "PEM certificate: the gateway speaks HTTPS"),
    ("--tls-key", "tls_key", str, "PEM private key of --tls-cert"),
)
# `llmops serve` switches that set serve.listen.* to true (flag, key, help)
SERVE_LISTEN_SWITCHES = (
    ("--behind-tls-proxy", "behind_tls_proxy", "a proxy in front terminates TLS: plain HTTP off loopback"),
    (
        "--triton-ports-firewalled",
        "triton_ports_firewalled",
        "Triton's ports are closed to clients by other means (NetworkPolicy, firewall): --triton-host off loopback",
    ),
)

DESCRIPTION = (
    "Serve the champion: Triton with the champion loaded, and the gateway clients call (OpenAI-compatible /v1 and "
    "Triton's /v2/models/NAME/generate for the service name, with API keys, TLS and request limits), which draws "
    "each request's version from the service's route table. The control API (--control-port, loopback, locked to "
    "this serve's own control key: LLMOPS_SERVE_CONTROL_KEY, else a fresh one in $LLMOPS_HOME/serving/control.key) "
    "changes the routes; the table is kept in $LLMOPS_HOME/serving/SERVICE.json and read back at start. Triton is "
    "restarted with backoff if it dies. `llmops run` with the same LLMOPS_HOME rolls candidates out on this "
    "service. API keys: LLMOPS_API_KEYS_FILE (one a line) or "
    "LLMOPS_API_KEYS (comma-separated); needed when --host is not a loopback address, and so is TLS "
    "(--tls-cert/--tls-key, or --behind-tls-proxy). Limits per key and overall: the profile's serve.limits."
)

EPILOG = """examples:
  llmops serve &                         # gateway :8080, control API :8081, Triton :8000 (HTTP) :8001 (gRPC) :8002
  llmops serve &                         # gateway :8080 (its /metrics :8082), Triton :8000 (HTTP) :8001 (gRPC) :8002 (metrics)
  curl -s localhost:8080/health/ready
  curl -s localhost:8081/control/v1/deployment -H "llmops-control-key: $(cat .llmops/serving/control.key)"
  curl -s localhost:8080/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "hot"}], "max_tokens": 8}'
  LLMOPS_API_KEYS_FILE=/etc/llmops/api-keys llmops serve --host 0.0.0.0 --tls-cert c.pem --tls-key k.pem"""


def register(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the champion (Triton + an OpenAI-compatible gateway) until stopped",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--profile", default="cpu-tiny", help="profile name or YAML path (default: cpu-tiny)")
    add_overrides_flag(serve, "override a profile value (repeatable)")
    serve.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite under $LLMOPS_HOME)")
    serve.add_argument("--artifacts", help="artifact store: folder or s3://bucket/prefix (default: $LLMOPS_HOME/store)")
    for flag, key, kind, text in SERVE_LISTEN_FLAGS:
        serve.add_argument(flag, dest=key, type=kind, help=f"{text} (serve.listen.{key})")
    for flag, key, text in SERVE_LISTEN_SWITCHES:
        serve.add_argument(flag, dest=key, action="store_true", help=f"{text} (serve.listen.{key})")
    serve.add_argument(
        "--triton-url",
        action="append",
        default=[],
        help="front a running Triton this serve does not own instead of starting serve.replicas of its own "
        "(repeat for several replicas); its control key: --triton-control-key-file (or LLMOPS_TRITON_CONTROL_KEY_FILE)",
    )
    serve.add_argument(
        "--triton-grpc-url", action="append", default=[], help="each --triton-url's gRPC endpoint, in the same order"
    )
    serve.add_argument(
        "--triton-metrics-url", action="append", default=[], help="each --triton-url's metrics URL, in the same order"
    )
    serve.add_argument(
        "--triton-discover",
        metavar="NAME",
        help="front the Tritons NAME resolves to, resolved again every 5 s (on Kubernetes: the headless Service of "
        "`llmops triton` pods that a KEDA ScaledObject scales, infra/kubernetes/serving-autoscale.yaml), each on "
        "serve.listen's Triton ports: one that appears loads every routed version before it takes a request, one "
        "that goes away is drained; their control key: --triton-control-key-file (or LLMOPS_TRITON_CONTROL_KEY)",
    )
    serve.add_argument(
        "--triton-control-key-file",
        metavar="PATH",
        help="with --triton-url or --triton-discover: the file of those Tritons' control key",
    )
    serve.set_defaults(handler=command_serve)


def listen_overrides(args) -> list[str]:
    """The serve.listen.* values the flags set."""
    values = [
        f"serve.listen.{key}={getattr(args, key)}"
        for _, key, _, _ in SERVE_LISTEN_FLAGS
        if getattr(args, key) is not None
    ]
    return values + [f"serve.listen.{key}=true" for _, key, _ in SERVE_LISTEN_SWITCHES if getattr(args, key)]


def command_serve(args) -> None:
    from tasks.platform.config import check_machine, load_profile

    profile = load_profile(args.profile, [*args.overrides, *listen_overrides(args)])
    check_machine(profile, ["serve"])
    home = llmops_home()
    home.mkdir(parents=True, exist_ok=True)
    from flows.serve import serve

    serve(profile, home, args.tracking_uri, args.artifacts, attached(args), discovered(args, profile))


def attached(args) -> list:
    """The Tritons of --triton-url, each with its gRPC and metrics endpoints where given; the key from the file given
    for them (never this home's own)."""
    from tasks.platform.errors import BadInput
    from tasks.serving.client import Triton, refuse_plain_http

    if not args.triton_url:
        return []
    if args.triton_discover:
        raise BadInput("--triton-url and --triton-discover: give one (the Tritons named, or those a name resolves to)")
    for flag in ("triton_grpc_url", "triton_metrics_url"):
        if getattr(args, flag) and len(getattr(args, flag)) != len(args.triton_url):
            raise BadInput(f"--{flag.replace('_', '-')}: give one for each --triton-url, in the same order")
    key = given_control_key(args)
    tritons = []
    for index, url in enumerate(args.triton_url):
        refuse_plain_http(url)
        grpc = args.triton_grpc_url[index] if args.triton_grpc_url else None
        metrics = args.triton_metrics_url[index] if args.triton_metrics_url else None
        tritons.append(Triton.attach(url, None, metrics, grpc, key))
    return tritons


def given_control_key(args) -> str | None:
    """The control key of Tritons this serve does not own: from --triton-control-key-file, else the environment."""
    import os
    from pathlib import Path

    from tasks.serving.client import ATTACH_KEY_FILE_ENV, attach_control_key

    if args.triton_control_key_file:
        os.environ[ATTACH_KEY_FILE_ENV] = str(Path(args.triton_control_key_file).resolve())
    return attach_control_key()


def discovered(args, profile):
    """--triton-discover's name, on the profile's Triton ports (serve.listen), or None."""
    from tasks.runtime.discovery import Discovery
    from tasks.serving.client import refuse_plain_http

    if not args.triton_discover:
        return None
    discovery = Discovery(args.triton_discover, profile.serve.listen, given_control_key(args))
    refuse_plain_http(discovery.url(args.triton_discover))  # the pods' network carries the control key
    return discovery
