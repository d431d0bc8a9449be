"""The stack as a whole: which services run where (stack.json, with the generated S3 credentials), started
in dependency order and stopped in reverse, and the environment a client of the running stack needs."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tasks.platform.child_env import write_secret
from tasks.platform.errors import BadInput
from tasks.platform.local_stack.mlflow_server import (
    GRANTS,
    READER,
    RELEASE,
    login_env,
    provision_accounts,
    start_mlflow,
)
from tasks.platform.local_stack.postgres import postgres_client_env, postgres_data_dir, start_postgres
from tasks.platform.local_stack.prefect_server import AUTH_ENV, start_prefect, start_worker
from tasks.platform.local_stack.process import Server
from tasks.platform.local_stack.s3 import s3_env, start_s3
from tasks.platform.ports import free_port, port_in_use

DEFAULT_PORTS = {"postgres": 5432, "s3": 9000, "mlflow": 5000, "prefect": 4200}
# Start order; `down` stops in reverse, so the worker goes before the Prefect server it polls
# (a worker whose API is gone ignores SIGTERM), and PostgreSQL after its clients.
SERVICES = ("postgres", "s3", "mlflow", "prefect", "worker")
DATABASES = ("sqlite", "postgres")


def wanted_services(db: str | None) -> list[str]:
    """The services a stack on database `db` runs: PostgreSQL only for `postgres`, in start order."""
    return [name for name in SERVICES if name != "postgres" or db == "postgres"]


def start_groups(db: str) -> tuple[tuple[str, ...], ...]:
    """The services in groups started one after the other, each group's side by side: MLflow and
    Prefect need only S3 and the database and take ~15 s each."""
    storage = ("postgres", "s3") if db == "postgres" else ("s3",)
    return storage, ("mlflow", "prefect"), ("worker",)


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
        write_secret(self.state_file, json.dumps(state, indent=2))  # it holds the S3 secret: mode 600 from the start

    def servers(self, state: dict) -> dict[str, Server]:
        return {name: Server(**record) for name, record in state["services"].items()}

    def client_env(self, state: dict) -> dict:
        """What a release run (and so every client that starts one, the worker included) needs in its environment:
        MLflow's release account, which may move aliases, never the admin."""
        ports, creds = state["ports"], state["s3_credentials"]
        return {
            "LLMOPS_HOME": str(self.home),
            "PREFECT_API_URL": f"http://127.0.0.1:{ports['prefect']}/api",
            "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{ports['mlflow']}",
            "LLMOPS_ARTIFACTS": "s3://artifacts/llmops",
            # where a run started through the Prefect API may read data and write answers (run_policy.py): the
            # stack's data bucket, which retrain watches, the flywheel fills and predict reads and writes
            "LLMOPS_RUN_LOCATIONS": "s3://datasets",
            **({AUTH_ENV: state["prefect_auth"]} if "prefect_auth" in state else {}),
            **(login_env(RELEASE, state["mlflow_accounts"][RELEASE]) if "mlflow_accounts" in state else {}),
            **s3_env(f"http://127.0.0.1:{ports['s3']}", creds["key"], creds["secret"]),
        }

    def reader_env(self, state: dict) -> dict:
        """What a client that only reads MLflow (a dashboard) needs: its URL and the read-only account."""
        return {
            "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{state['ports']['mlflow']}",
            **login_env(READER, state["mlflow_accounts"][READER]),
        }

    @property
    def passfile(self) -> Path:
        return self.root / "postgres.pgpass"

    def database(self, state: dict) -> tuple[str, str, dict]:
        """The backend store URIs of MLflow and Prefect, and the environment their servers need."""
        if state.get("db", "sqlite") == "sqlite":
            return f"sqlite:///{self.root / 'mlflow.db'}", "", {}
        server = f"127.0.0.1:{state['ports']['postgres']}"
        return (  # each as the role that owns its database (postgres.py): no superuser serves a client
            f"postgresql+psycopg2://mlflow@{server}/mlflow",
            f"postgresql+asyncpg://prefect@{server}/prefect",
            postgres_client_env(self.passfile),
        )

    def up(self, ports: dict[str, int | None], say: Callable[[str], None] = print, db: str | None = None) -> dict:
        """Start what is not running on `ports` (None: the last or default port, 0: any free one) and
        database `db` (None: the last one, else sqlite); the state saved to stack.json."""
        state = self.load()
        running = {n: s for n, s in self.servers(state).items() if s.alive()}
        state["db"] = self._database_kind(state, db, running)
        state["ports"] = self._ports(state, ports, running)
        state.setdefault("s3_credentials", {"key": "llmops", "secret": secrets.token_urlsafe(24)})
        state.setdefault("prefect_auth", f"llmops:{secrets.token_urlsafe(24)}")
        state.setdefault(
            "mlflow_login", {"password": secrets.token_urlsafe(24), "secret_key": secrets.token_urlsafe(32)}
        )
        accounts = state.setdefault("mlflow_accounts", {})
        new_accounts = [account for account in GRANTS if account not in accounts]
        for account in new_accounts:
            accounts[account] = secrets.token_urlsafe(24)
        state["services"] = {n: s.record() for n, s in running.items()}
        starters = self._starters(state)
        if new_accounts and "mlflow" in running:  # a stack made before the accounts, its MLflow still up
            self.save(state)
            provision_accounts(running["mlflow"].url, state["mlflow_login"]["password"], accounts)
            say(f"stack: mlflow accounts {', '.join(new_accounts)} made")
        for group in start_groups(state["db"]):
            self._start_group(group, starters, running, state, say)
        return state

    @staticmethod
    def _database_kind(state: dict, db: str | None, running: dict[str, Server]) -> str:
        """`db`, else the stack's; switching while services run would leave them on the old one."""
        if db is not None and db != state.get("db", db) and running:
            raise BadInput(
                f"--db {db}: the stack runs on {state['db']}; `llmops stack down` first "
                f"(the runs and models recorded on {state['db']} stay there)"
            )
        return db or state.get("db", "sqlite")

    @staticmethod
    def _ports(state: dict, requested: dict[str, int | None], running: dict[str, Server]) -> dict[str, int]:
        """Each service's port: requested, else the last one used, else the default; 0 becomes a free
        port. A service to start finds its port free or fails with a clear error."""
        chosen = {
            **DEFAULT_PORTS,
            **state.get("ports", {}),
            **{name: port for name, port in requested.items() if port is not None},
        }
        for name in wanted_services(state["db"]):
            if name not in DEFAULT_PORTS or name in running:  # the worker listens on no port of its own
                continue
            if chosen[name] == 0:
                chosen[name] = free_port()
            elif port_in_use(chosen[name]):
                raise BadInput(
                    f"--{name}-port {chosen[name]}: port in use on 127.0.0.1; pick another (0 = any free port)"
                )
        return chosen

    def _starters(self, state: dict) -> dict[str, Callable[[], Server]]:
        """How to start each service on the state's ports, database and credentials."""
        chosen, credentials = state["ports"], state["s3_credentials"]
        env = self.client_env(state)
        logs = self.root / "logs"
        mlflow_store, prefect_store, db_env = self.database(state)
        prefect_db_env = {**db_env, "PREFECT_SERVER_DATABASE_CONNECTION_URL": prefect_store} if prefect_store else {}
        return {
            "postgres": lambda: start_postgres(postgres_data_dir(self.root), self.passfile, chosen["postgres"], logs),
            "s3": lambda: start_s3(self.root / "s3", chosen["s3"], credentials["key"], credentials["secret"], logs),
            "mlflow": lambda: start_mlflow(
                mlflow_store,
                chosen["mlflow"],
                s3_env(env["AWS_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]),
                logs,
                db_env,
                {**state["mlflow_login"], "folder": str(self.root), "accounts": state["mlflow_accounts"]},
            ),
            "prefect": lambda: start_prefect(
                self.root / "prefect-server", chosen["prefect"], logs, prefect_db_env, state["prefect_auth"]
            ),
            "worker": lambda: start_worker(
                env["PREFECT_API_URL"], {**env, "PREFECT_HOME": str(self.home / "prefect")}, logs
            ),
        }

    def _start_group(
        self,
        group: tuple[str, ...],
        starters: dict[str, Callable[[], Server]],
        running: dict[str, Server],
        state: dict,
        say: Callable[[str], None],
    ) -> None:
        """Start the group's services that are not running side by side; the state is saved after the
        group, so that after a failure in a later one `down` still stops what started."""
        for name in group:
            if name in running:
                say(f"stack: {name} already running (pid {running[name].pid})")
        todo = [name for name in group if name not in running]
        if not todo:
            return
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
        self.save(state)
        if failures:
            raise failures[0]

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


def require_running(home: Path, reader: bool = False) -> dict:
    """The client environment of a running stack (`reader`: only MLflow's, with the read-only account), or a clear
    error."""
    stack = Stack(home)
    state = stack.load()
    needed = wanted_services(state.get("db"))
    stopped = [n for n in needed if n not in state["services"] or not Server(**state["services"][n]).alive()]
    if stopped:
        raise BadInput(
            f"local stack under {stack.root}: not running ({', '.join(stopped)} down); run `llmops stack up`"
        )
    return stack.reader_env(state) if reader else stack.client_env(state)
