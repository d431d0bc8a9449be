"""PostgreSQL for `llmops stack up --db postgres`: Debian's server programs, a cluster initialized once
with a password-protected `llmops` superuser, listening on 127.0.0.1 only, holding the `prefect` and
`mlflow` databases."""

from __future__ import annotations

import glob
import hashlib
import os
import secrets
import shutil
import subprocess
from pathlib import Path

from tasks.platform.child_env import write_secret
from tasks.platform.errors import BadInput, CheckFailed
from tasks.platform.local_stack.process import Server, start

DB_USER = "llmops"


def postgres_program(name: str) -> str:
    """Debian keeps PostgreSQL's server programs in /usr/lib/postgresql/<major>/bin, off PATH."""
    found = shutil.which(name) or max(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), default=None)
    if found is None:
        raise BadInput(
            f"--db postgres: PostgreSQL's `{name}` not found; install it (Debian: apt-get install postgresql)"
        )
    return found


def postgres_account() -> str | None:
    """PostgreSQL refuses to run as root: as root it runs as Debian's `postgres` account."""
    return "postgres" if os.geteuid() == 0 else None


def postgres_data_dir(stack_root: Path) -> Path:
    """Under the stack's folder, except as root: `postgres` cannot enter a folder private to root
    (pytest's and many $HOMEs are), so the data goes under that account's own home, one folder per stack."""
    if postgres_account() is None:
        return stack_root / "postgres"
    return Path("/var/lib/postgresql/llmops") / hashlib.sha256(str(stack_root.resolve()).encode()).hexdigest()[:16]


def postgres_client_env(passfile: Path) -> dict:
    """libpq (MLflow's psycopg2) and asyncpg (Prefect's) both read the password from PGPASSFILE, so
    no connection URL, command line or log holds it."""
    return {"PGPASSFILE": str(passfile)}


def prepare_postgres(data_dir: Path, passfile: Path, log_dir: Path) -> None:
    """initdb once: the `llmops` superuser with a password (scram-sha-256 over TCP), no trust auth."""
    if (data_dir / "PG_VERSION").is_file():
        return
    account = postgres_account()
    password = secrets.token_urlsafe(24)
    data_dir.mkdir(parents=True, exist_ok=True)
    pwfile = data_dir.parent / f".{data_dir.name}.pw"
    write_secret(pwfile, password + "\n")
    if account:
        for path in (data_dir.parent, data_dir, pwfile):
            shutil.chown(path, account, account)
    data_dir.chmod(0o700)
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        with open(log_dir / "postgres-initdb.log", "ab") as log:
            result = subprocess.run(
                [
                    postgres_program("initdb"),
                    "-D",
                    str(data_dir),
                    "-U",
                    DB_USER,
                    f"--pwfile={pwfile}",
                    "--auth-host=scram-sha-256",
                    "--auth-local=scram-sha-256",
                    "--encoding=UTF8",
                    "--locale=C",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                user=account,
                group=account,
                extra_groups=[] if account else None,
                timeout=120,
            )
    finally:
        pwfile.unlink(missing_ok=True)
    if result.returncode != 0:
        shutil.rmtree(data_dir, ignore_errors=True)
        raise CheckFailed(f"postgres: initdb failed; see {log_dir / 'postgres-initdb.log'}")
    passfile.parent.mkdir(parents=True, exist_ok=True)
    write_secret(passfile, f"127.0.0.1:*:*:{DB_USER}:{password}\n")


def start_postgres(data_dir: Path, passfile: Path, port: int, log_dir: Path) -> Server:
    """PostgreSQL on 127.0.0.1 only (no Unix socket), with the `prefect` and `mlflow` databases."""
    prepare_postgres(data_dir, passfile, log_dir)
    url = f"postgresql://{DB_USER}@127.0.0.1:{port}"

    def ready() -> bool:
        import psycopg2

        connection = psycopg2.connect(
            host="127.0.0.1", port=port, user=DB_USER, dbname="postgres", passfile=str(passfile), connect_timeout=2
        )
        try:
            connection.autocommit = True  # CREATE DATABASE runs outside a transaction
            with connection.cursor() as cursor:
                cursor.execute("SELECT datname FROM pg_database")
                existing = {row[0] for row in cursor.fetchall()}
                for database in ("prefect", "mlflow"):
                    if database not in existing:
                        cursor.execute(f"CREATE DATABASE {database}")
        finally:
            connection.close()
        return True

    return start(
        "postgres",
        [
            postgres_program("postgres"),
            "-D",
            str(data_dir),
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-c",
            "unix_socket_directories=",
        ],
        url,
        ready,
        log_dir,
        user=postgres_account(),
    )
