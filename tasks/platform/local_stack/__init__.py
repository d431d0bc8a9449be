"""The local stack: an S3 server, an MLflow server, a Prefect server and a process worker, all on 127.0.0.1.

    llmops stack up       start what is not running (ports, logs and data under $LLMOPS_HOME/stack)
    llmops stack up --db postgres
                          the same, with Prefect's and MLflow's databases on a PostgreSQL server
                          the stack starts (Debian's postgresql; sqlite is the embedded default)
    llmops stack status   what runs where, with URLs and health
    llmops stack env      shell exports that point llmops, prefect, mlflow and boto3 at the stack
    llmops stack down     stop by PID: the worker first, then the servers

Triton is not part of it: `llmops serve` (or a release run) starts it. The worker runs flow runs as
subprocesses of this project's venv with the stack's environment, so a run started from the Prefect
UI writes to the stack's S3 and MLflow like a run started here.

Why our own small supervisor rather than docker compose or systemd: neither is available on the
machines this runs on (no Docker, no root); every service here is a plain process from the venv.

The modules: process (a supervised process), s3, mlflow_server, prefect_server (with the work pool
and the worker), postgres (for --db postgres) and stack (the whole: up, down, status, stack.json).
Their public names are importable from here, where the CLI, deploy and the tests take them.
"""

from tasks.platform.local_stack.mlflow_server import start_mlflow
from tasks.platform.local_stack.postgres import (
    DB_USER,
    postgres_account,
    postgres_client_env,
    postgres_data_dir,
    postgres_program,
    prepare_postgres,
    start_postgres,
)
from tasks.platform.local_stack.prefect_server import (
    API,
    CPU_POOL,
    ensure_process_pool,
    prefect_api,
    prefect_server_env,
    prefect_session,
    start_prefect,
    start_worker,
    worker_online,
)
from tasks.platform.local_stack.process import BIN, Server, start, tail
from tasks.platform.local_stack.s3 import BUCKETS, s3_env, start_s3
from tasks.platform.local_stack.stack import (
    DATABASES,
    DEFAULT_PORTS,
    SERVICES,
    Stack,
    require_running,
    start_groups,
    wanted_services,
)

__all__ = [
    "API",
    "BIN",
    "BUCKETS",
    "CPU_POOL",
    "DATABASES",
    "DB_USER",
    "DEFAULT_PORTS",
    "SERVICES",
    "Server",
    "Stack",
    "ensure_process_pool",
    "postgres_account",
    "postgres_client_env",
    "postgres_data_dir",
    "postgres_program",
    "prefect_api",
    "prefect_server_env",
    "prefect_session",
    "prepare_postgres",
    "require_running",
    "s3_env",
    "start",
    "start_groups",
    "start_mlflow",
    "start_postgres",
    "start_prefect",
    "start_s3",
    "start_worker",
    "tail",
    "wanted_services",
    "worker_online",
]
