"""`llmops deploy`: register infra/prefect.yaml's deployments (and their work pools) with a Prefect server."""

from __future__ import annotations

import argparse
import os

from flows.cli.common import prefect_api_env, say

EPILOG = """examples:
  llmops deploy                               # against the local stack, or PREFECT_API_URL when set
  llmops deploy --gpu-pool llmops-cpu         # one machine: heavy stages on the process pool too"""


def register(commands) -> None:
    deploy = commands.add_parser(
        "deploy",
        help="register infra/prefect.yaml's deployments with the Prefect server",
        description="Create the work pools (llmops-cpu: process; the GPU pool: kubernetes, with "
        "infra/work-pools/kubernetes-gpu.json) when missing, then run `prefect deploy --all` on "
        "infra/prefect.yaml against PREFECT_API_URL (or the local stack).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    deploy.add_argument(
        "--gpu-pool",
        default="llmops-gpu",
        help="work pool for the heavy stages (train, quantize, build_engine); default llmops-gpu",
    )
    deploy.set_defaults(handler=command_deploy)


def command_deploy(args) -> str:
    from flows.deploy import deploy

    os.environ.update(prefect_api_env())
    return deploy(args.gpu_pool, say=say)
