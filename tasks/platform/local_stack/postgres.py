"""PostgreSQL for `llmops stack up --db postgres`: Debian's server programs, a cluster initialized once
with a password-protected `llmops` superuser, listening on 127.0.0.1 only, holding the `prefect` and
`mlflow` databases, each owned by a login role of its own name: Prefect's server cannot read or change
MLflow's records, nor the other way round, and neither is a superuser."""

from __future__ import annotations

import glob
import hashlib
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from tasks.platform.child_env import write_secret
from tasks.platform.errors import BadInput, CheckFailed
from tasks.platform.local_stack.process import Server, start

DB_USER = "llmops"  # the superuser: makes the databases and roles, serves no client
OWNED_DATABASES = ("prefect", "mlflow")  # each owned by the login role of the same name


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
    """initdb once: the `llmops` superuser with a password (scram-sha-256 over TCP), no trust auth. A cluster whose
    password file is gone is one nobody can log in to: as root the data lives outside the stack's folder
    (postgres_data_dir), so a stack removed and made again at the same path found its predecessor's cluster, and its
    start waited out its 120 s with every login refused. Such a cluster is replaced, and the stack says so."""
    if (data_dir / "PG_VERSION").is_file():
        if passfile.is_file():
            return
        print(
            f"stack: postgres: {data_dir} holds the cluster of a stack removed from this folder (its password file"
            f" {passfile} is gone); starting a new one",
            file=sys.stderr,
        )
        shutil.rmtree(data_dir)
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
                database_owners(cursor, passfile)
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


def database_owners(cursor, passfile: Path) -> None:
    """Each of OWNED_DATABASES owned by its own login role, with a password of its own in the passfile; no other
    role but the superuser may connect to it. A database made before the roles existed (owned by the superuser,
    its tables too) is handed over whole: the database, its public schema and every table, sequence, view and
    type in it."""
    cursor.execute("SELECT rolname FROM pg_roles")
    roles = {row[0] for row in cursor.fetchall()}
    cursor.execute("SELECT datname, pg_get_userbyid(datdba) FROM pg_database")
    owners = dict(cursor.fetchall())
    for database in OWNED_DATABASES:
        if database not in roles:
            password = secrets.token_urlsafe(24)
            cursor.execute(f"CREATE ROLE {database} LOGIN PASSWORD %s", (password,))
            lines = [line for line in passfile.read_text().splitlines() if not line.endswith(f":{database}:{database}")]
            # libpq takes the first line that matches: the role's own before the superuser's
            write_secret(passfile, "\n".join([f"127.0.0.1:*:{database}:{database}:{password}", *lines]) + "\n")
        if database not in owners:
            cursor.execute(f"CREATE DATABASE {database} OWNER {database}")
        elif owners[database] != database:
            hand_over(cursor.connection, database, passfile)
        cursor.execute(f"REVOKE CONNECT, TEMPORARY ON DATABASE {database} FROM PUBLIC")


def hand_over(admin, database: str, passfile: Path) -> None:
    """Give `database` and everything in its public schema to the role `database` (REASSIGN OWNED cannot: the
    superuser made by initdb also owns the system's objects)."""
    import psycopg2

    info = admin.get_dsn_parameters()
    with admin.cursor() as cursor:
        cursor.execute(f"ALTER DATABASE {database} OWNER TO {database}")
    inside = psycopg2.connect(
        host=info["host"], port=info["port"], user=DB_USER, dbname=database, passfile=str(passfile), connect_timeout=5
    )
    try:
        with inside, inside.cursor() as cursor:
            cursor.execute(f"ALTER SCHEMA public OWNER TO {database}")
            cursor.execute(
                """SELECT c.relkind, quote_ident(c.relname) FROM pg_class c
                   JOIN pg_namespace n ON n.oid = c.relnamespace
                   WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
                   AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.objid = c.oid AND d.deptype IN ('a', 'i'))"""
            )  # a sequence a column owns follows its table
            kinds = {"r": "TABLE", "p": "TABLE", "v": "VIEW", "m": "MATERIALIZED VIEW", "S": "SEQUENCE"}
            for kind, name in cursor.fetchall():
                cursor.execute(f"ALTER {kinds[kind]} public.{name} OWNER TO {database}")
            cursor.execute(
                """SELECT quote_ident(t.typname) FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
                   WHERE n.nspname = 'public' AND t.typtype IN ('e', 'd') """
            )
            for (name,) in cursor.fetchall():
                cursor.execute(f"ALTER TYPE public.{name} OWNER TO {database}")
    finally:
        inside.close()
