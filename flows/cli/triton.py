"""`llmops triton`: a tritonserver for a gateway elsewhere (`llmops serve --triton-discover`), in the foreground."""

from __future__ import annotations

import argparse
import os

from flows.cli.common import add_overrides_flag
from tasks.platform.project import llmops_home

FLAGS = (  # flag, serve.listen key, type, help
    ("--host", "triton_host", str, "bind address (default 127.0.0.1)"),
    ("--http-port", "triton_http_port", int, "HTTP port, with the locked model-control API (default 8000)"),
    ("--grpc-port", "triton_grpc_port", int, "gRPC port (default 8001)"),
    ("--metrics-port", "triton_metrics_port", int, "Prometheus metrics port (default 8002)"),
)

EPILOG = """examples:
  LLMOPS_TRITON_CONTROL_KEY=$(cat key) llmops triton --http-port 9000 --grpc-port 9001 --metrics-port 9002 &
  LLMOPS_TRITON_CONTROL_KEY=$(cat key) llmops triton --host 0.0.0.0 --triton-ports-firewalled   # a pod
  LLMOPS_TRITON_CONTROL_KEY=$(cat key) AWS_ENDPOINT_URL=http://s3:9000 AWS_ACCESS_KEY_ID=... \
    AWS_SECRET_ACCESS_KEY=... llmops triton --artifacts s3://artifacts/llmops   # fetches the models from S3"""


def register(commands) -> None:
    triton = commands.add_parser(
        "triton",
        help="run one Triton for a gateway elsewhere to load (a pod that `llmops serve --triton-discover` finds)",
        description="Run tritonserver as `llmops serve` runs its own (explicit model control, its model-control API "
        "locked to LLMOPS_TRITON_CONTROL_KEY, which must be set; the profile's Python backend and launch) in the "
        "foreground, with no model loaded: the `llmops serve` that finds it (--triton-discover, on the same "
        "serve.listen Triton ports) loads every routed version on it before it takes a request, the files fetched "
        "from the S3 store (--artifacts) or sent with the load. "
        "SIGTERM stops it; a Triton that dies on its own exits 4.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    triton.add_argument("--profile", default="cpu-tiny", help="profile name or YAML path (default: cpu-tiny)")
    add_overrides_flag(triton, "override a profile value (repeatable)")
    for flag, key, kind, text in FLAGS:
        triton.add_argument(flag, dest=key, type=kind, help=f"{text} (serve.listen.{key})")
    triton.add_argument(
        "--artifacts",
        default=os.environ.get("LLMOPS_ARTIFACTS"),
        help="the S3 artifact store of the serve that loads it (s3://BUCKET/PREFIX; default $LLMOPS_ARTIFACTS): its "
        "models fetch their files from it with this process's AWS_* credentials, and a load request carries only the "
        "config; without it, the files come with the load requests (at most 45 MiB a model)",
    )
    triton.add_argument(
        "--triton-ports-firewalled",
        action="store_true",
        help="its ports are closed to all but the gateway by other means (a NetworkPolicy): --host off loopback",
    )
    triton.set_defaults(handler=command_triton)


def command_triton(args) -> None:
    from flows.triton_pod import run_triton
    from tasks.platform.config import check_machine, load_profile

    listen = [f"serve.listen.{key}={getattr(args, key)}" for _, key, _, _ in FLAGS if getattr(args, key) is not None]
    if args.triton_ports_firewalled:
        listen.append("serve.listen.triton_ports_firewalled=true")
    profile = load_profile(args.profile, [*args.overrides, *listen])
    check_machine(profile, ["serve"])
    home = llmops_home()
    home.mkdir(parents=True, exist_ok=True)
    run_triton(profile, home, args.artifacts)
