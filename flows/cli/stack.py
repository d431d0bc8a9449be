"""`llmops stack up|status|env|down`: the local stack (Prefect server + worker, MLflow, S3, PostgreSQL)."""

from __future__ import annotations

import argparse

from flows.cli.common import say
from tasks.platform.project import llmops_home

DESCRIPTION = (
    "A local stack on 127.0.0.1: an S3 server (rclone), an MLflow server (S3 artifacts), "
    "a Prefect server and a process worker on the llmops-cpu pool; Prefect and MLflow keep their "
    "databases in sqlite files, or on a PostgreSQL server the stack starts (--db postgres). State, logs "
    "and data live in $LLMOPS_HOME/stack."
)

EPILOG = """examples:
  llmops stack up                       # default ports: Prefect 4200, MLflow 5000, S3 9000
  llmops stack up --db postgres         # Prefect and MLflow on PostgreSQL (port 5432), as in production
  eval "$(llmops stack env)"            # point llmops, prefect, mlflow and boto3 at it
  llmops stack env --mlflow-reader      # MLflow's read-only login, for a dashboard
  llmops deploy                         # register the deployments of infra/prefect.yaml
  llmops stack status
  llmops stack down                     # the worker first, then the servers"""

SERVICES = ("prefect", "mlflow", "s3", "postgres")


def register(commands) -> None:
    stack = commands.add_parser(
        "stack",
        help="start, inspect or stop the local stack (Prefect server + worker, MLflow, S3)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = stack.add_subparsers(dest="action", required=True, metavar="ACTION")
    register_up(actions)
    actions.add_parser(
        "status", help="show what runs where", description="Show each service, its PID, URL and log."
    ).set_defaults(handler=stack_status)
    env = actions.add_parser(
        "env",
        help="print shell exports for the stack",
        description='Print `export` lines; use as: eval "$(llmops stack env)". They log into MLflow as the '
        "release account, which may move registered-model aliases (what release runs need).",
    )
    env.add_argument(
        "--mlflow-reader",
        action="store_true",
        help="print only MLflow's URL and the read-only account's login (for a dashboard or another client that "
        "only looks): it reads every experiment, run and registered model and gets 403 on any change",
    )
    env.set_defaults(handler=stack_env)
    actions.add_parser(
        "down",
        help="stop the stack (worker first)",
        description="Stop every service by PID, the worker before the Prefect server.",
    ).set_defaults(handler=stack_down)


def register_up(actions) -> None:
    up = actions.add_parser(
        "up",
        help="start every service that is not running",
        description="Start the services that are not running; idempotent.",
    )
    up.add_argument(
        "--db",
        choices=("sqlite", "postgres"),
        help="the database of Prefect's server and MLflow's tracking store (default: last used, else sqlite); "
        "postgres runs Debian's PostgreSQL on 127.0.0.1 with its data under the stack's folder",
    )
    for service in SERVICES:
        up.add_argument(
            f"--{service}-port",
            type=int,
            metavar="PORT",
            help=f"port for {service} on 127.0.0.1 (0: any free port; default: last used, else the usual)",
        )
    up.set_defaults(handler=stack_up)


def local_stack():
    from tasks.platform.local_stack import Stack

    return Stack(llmops_home())


def stack_up(args) -> str:
    stack = local_stack()
    ports = {service: getattr(args, f"{service}_port") for service in SERVICES}
    state = stack.up(ports, say=say, db=args.db)
    env = stack.client_env(state)
    return "\n".join(
        [
            f"Prefect UI:  {env['PREFECT_API_URL'].removesuffix('/api')} (it asks once for the PREFECT_API_AUTH_STRING "
            "that `llmops stack env` exports)",
            f"MLflow UI:   {env['MLFLOW_TRACKING_URI']} (log in as llmops-reader to look: "
            "`llmops stack env --mlflow-reader` prints its password)",
            f"S3:          {env['AWS_ENDPOINT_URL']}",
            f"database:    {state['db']}"
            + (f" (PostgreSQL on 127.0.0.1:{state['ports']['postgres']})" if state["db"] == "postgres" else ""),
            'use it:      eval "$(llmops stack env)"; llmops deploy',
        ]
    )


def stack_down(args) -> None:
    local_stack().down(say=say)


def stack_env(args) -> str:
    import shlex

    from tasks.platform.local_stack import require_running

    exports = require_running(llmops_home(), reader=args.mlflow_reader)
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in exports.items())


def stack_status(args) -> str:
    stack = local_stack()
    rows = stack.status()
    if not rows:
        return f"stack: not started (state folder {stack.root}); run `llmops stack up`"
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in rows[0]}
    lines = ["  ".join(k.ljust(widths[k]) for k in rows[0])]
    lines += ["  ".join(str(r[k]).ljust(widths[k]) for k in r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
