"""The Triton replicas of `llmops serve`: `serve.replicas` tritonserver processes it starts and keeps (the first on
`serve.listen`'s ports, the others on free ones chosen once), or Tritons it does not own (`llmops serve --triton-url`
repeated). Every version in the service's route table is loaded on each; the gateway balances over them
(tasks/runtime/gateway/replicas.py).

A replica this serve started that dies is started again on its ports with backoff (1, 2, 4 ... 30 s) and every
version of the table loaded on it again; after `serve.listen.restart_limit` deaths in a row (each within a minute of
its start) the serve gives up (exit 4). A model that keeps failing its probes is loaded again on its replica
(`recover`); where that fails and it serves the champion on a replica this serve started, that replica is SIGKILLed,
and so restarted. What a release asks the serve to load on them is tasks/runtime/loads.py's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tasks.control.contract import RouteTable, Version
from tasks.platform.config import ListenSection
from tasks.platform.errors import CheckFailed, TransientError
from tasks.platform.ports import free_port
from tasks.platform.stage_cache import RunContext
from tasks.serving.adapters import base_model_name
from tasks.serving.champion import released_profile, served_of, triton_launch
from tasks.serving.client import Triton
from tasks.serving.models import Served, install_model
from tasks.serving.server import TritonServer
from tasks.serving.versions import of_service

STAYED_UP_S = 60  # a Triton that lived this long did not die of its start: the count of deaths starts over


@dataclass
class Replica:
    index: int
    client: Triton
    server: TritonServer | None = None  # None: a Triton this serve does not own
    ports: tuple[int, int, int] | None = None
    deaths: int = 0
    started: float = field(default_factory=time.monotonic)
    restarting: bool = False  # the fleet starts it again and loads its versions: no recovery meanwhile
    # held while `restarting`, `server`, `client` and `started` change together: the watch, the probes' recovery, the
    # autoscaler and a release's hung load read them from four threads, each one coherent set
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def owned(self) -> bool:
        return self.server is not None

    def running(self) -> bool:
        return self.server is None or self.server.running()


class Fleet:
    def __init__(self, ctx: RunContext, listen: ListenSection, say: Callable[[str], None] = print):
        self.ctx, self.listen, self.say = ctx, listen, say
        self.replicas: list[Replica] = []
        self.table: Callable[[], RouteTable | None] = lambda: None  # the gateway's table, once there is a gateway
        self.probe: Callable[[], None] = lambda: None  # the gateway's probes, at once (a restarted replica rejoins)
        self.count: Callable[[str, str], None] = lambda action, model: None  # reconcile's actions on /metrics
        self.first_ports: tuple[int, int, int] | None = None  # serve.listen's: the first replica's, after zero too

    @property
    def tritons(self) -> list[Triton]:
        return [replica.client for replica in self.replicas]

    # --- starting ---------------------------------------------------------------------------------------------

    def start(self, first_ports: tuple[int, int, int], count: int, champion: Served) -> None:
        """`count` tritonserver processes, `champion` loaded on each."""
        self.first_ports = first_ports
        try:
            for index in range(count):
                ports = first_ports if index == 0 else (free_port(), free_port(), free_port())
                server = self.spawn(index, ports)
                replica = Replica(index, server.client, server, ports)
                self.replicas.append(replica)
                self.load_at_start(replica, champion)
        except BaseException:
            self.stop()
            raise

    def load_at_start(self, replica: Replica, champion: Served) -> None:
        """The champion loaded on a Triton this serve just started. Where the load fails without an answer (it
        outlasted serve.load_timeout_s, or the connection broke), that Triton is killed with its model processes
        and started again, up to serve.listen.restart_limit times: Triton 2.51's Python backend waits for a model
        process's first message without a deadline (python_backend#408 gave it one upstream, in a later release),
        and such a load hung here for 300 s under the test suite's load, every instance's weights loaded."""
        while True:
            try:
                self.load(replica, [champion])
                return
            except TransientError as exc:
                assert replica.server is not None
                replica.server.kill()
                replica.deaths += 1
                if replica.deaths > self.listen.restart_limit:
                    raise TransientError(
                        f"{exc}; Triton started {replica.deaths} {'time' if replica.deaths == 1 else 'times'} "
                        f"(serve.listen.restart_limit {self.listen.restart_limit}); see {replica.server.log_path}"
                    ) from None
                self.say(
                    f"llmops serve: {exc}; starting that Triton again ({replica.deaths} of {self.listen.restart_limit})"
                )
                server = self.spawn(replica.index, replica.ports)
                with replica.lock:
                    replica.server, replica.client, replica.started = server, server.client, time.monotonic()

    def attach(self, tritons: list[Triton], champion: Served) -> None:
        """Tritons this serve does not own, `champion` loaded on each (its files sent where none shares a disk)."""
        for index, triton in enumerate(tritons):
            replica = Replica(index, triton)
            self.replicas.append(replica)
            self.load(replica, [champion])

    def spawn(self, index: int, ports: tuple[int, int, int] | None) -> TritonServer:
        ctx = self.ctx
        launcher, env = triton_launch(ctx.profile, ctx.home)
        return TritonServer.start(
            ctx.home,
            ctx.profile.serve.triton_binary,
            launcher=launcher,
            extra_env=env,
            host=self.listen.triton_host,
            ports=ports,
            die_with_parent=threading.current_thread() is threading.main_thread(),
            replica=index,
            model_roots=ctx.store.local_folders(),
        )

    def load(self, replica: Replica, versions: list[Served]) -> None:
        for served in versions:
            install_model(replica.client, released_profile(self.ctx.profile, served), served)

    # --- growing and shrinking (serve.autoscale, tasks/runtime/autoscale.py) -------------------------------------

    def grow(self) -> Replica:
        """One more tritonserver on free ports, every version of the table loaded on it before anyone hears of it. One
        that does not start or load is killed and never joins (TransientError, CheckFailed or OSError)."""
        index = max((r.index for r in self.replicas), default=-1) + 1
        ports = (free_port(), free_port(), free_port())
        if not self.replicas and self.first_ports is not None:  # back from zero: where server.json says it is
            index, ports = 0, self.first_ports
        server = self.spawn(index, ports)
        replica = Replica(index, server.client, server, ports)
        try:
            self.load(replica, self.table_versions())
        except BaseException:
            server.kill()
            raise
        self.replicas = [*self.replicas, replica]  # a new list: the watch and the reconciler iterate the old one
        return replica

    def join(self, triton: Triton) -> Replica:
        """A Triton this serve does not own (found by `--triton-discover`) joins, every version of the table loaded
        on it before anyone hears of it."""
        replica = Replica(max((r.index for r in self.replicas), default=-1) + 1, triton)
        self.load(replica, self.table_versions())
        self.replicas = [*self.replicas, replica]
        return replica

    def newest(self) -> Replica | None:
        """The replica a scale-down stops: the last one started; the first (serve.listen's ports) only when it is the
        last one (serve.autoscale's scale to zero)."""
        alone = len(self.replicas) == 1
        started = [r for r in self.replicas if r.owned and (r.index > 0 or alone) and not r.restarting]
        return max(started, key=lambda r: r.index, default=None)

    def retire(self, replica: Replica) -> None:
        """A replica the gateway drained leaves the fleet, then its Triton stops (out of the list first: the serve's
        watch would start a stopped replica again)."""
        self.replicas = [r for r in self.replicas if r is not replica]
        if replica.server is not None:
            replica.server.stop()

    # --- keeping them up ----------------------------------------------------------------------------------------

    def dead(self) -> list[Replica]:
        return [replica for replica in self.replicas if not replica.running()]

    def restart(self, replica: Replica, stopped: threading.Event) -> bool:
        """Start a dead replica again with backoff and load the table's versions on it; False when stopped meanwhile.
        Past serve.listen.restart_limit deaths in a row: TransientError."""
        assert replica.server is not None
        with replica.lock:
            replica.restarting = True
        try:
            return self.restart_with_backoff(replica, stopped)
        finally:
            with replica.lock:
                replica.restarting = False

    def restart_with_backoff(self, replica: Replica, stopped: threading.Event) -> bool:
        assert replica.server is not None
        code = replica.server.process.returncode
        self.say(f"llmops serve: Triton {replica.client.url} exited with {code} ({replica.server.log_tail(2)})")
        replica.deaths = replica.deaths + 1 if time.monotonic() - replica.started < STAYED_UP_S else 1
        while replica.deaths <= self.listen.restart_limit:
            delay = min(30, 2 ** (replica.deaths - 1))
            self.say(
                f"llmops serve: restarting Triton in {delay}s (death {replica.deaths} of {self.listen.restart_limit} "
                "allowed)"
            )
            if stopped.wait(delay):
                return False
            try:
                server = self.spawn(replica.index, replica.ports)
                with replica.lock:
                    replica.server, replica.client, replica.started = server, server.client, time.monotonic()
                self.load(replica, self.table_versions())
            except (TransientError, OSError, CheckFailed) as exc:
                self.say(f"llmops serve: restart failed: {exc}")
                replica.server.kill()  # one that started but did not load: it would hold the ports of the next try
                replica.deaths += 1
                continue
            self.probe()
            self.say(f"llmops serve: Triton restarted ({replica.client.url}); every version serving again")
            return True
        raise TransientError(
            f"Triton died {replica.deaths} {'time' if replica.deaths == 1 else 'times'} in a row "
            f"(serve.listen.restart_limit {self.listen.restart_limit}); "
            f"see {replica.server.log_path}"
        )

    def table_versions(self) -> list[Served]:
        """The versions of the gateway's table, from the store alone (versions_to_load)."""
        return versions_to_load(self.ctx, self.table())

    def recover(self, url: str, model: str) -> str:
        """The gateway's probes' recovery of `model` on replica `url` (tasks/runtime/gateway/probes.py)."""
        replica = next(r for r in self.replicas if r.client.url == url)
        with replica.lock:  # one coherent Triton: a restart swapping it meanwhile is told apart, never mixed in
            if replica.restarting:
                return "restarting"
            server, client = replica.server, replica.client
        try:
            repository = client.repository
            if server is not None and repository is not None and (repository / model).is_dir():
                before = server.model_processes([model])
                client.reload(model, timeout=self.ctx.profile.serve.load_timeout_s)
                started = {p.pid for p in server.model_processes([model])} - {p.pid for p in before}
                if started and (left := server.end_left_behind(before)):  # never the instances it kept serving
                    self.say(
                        f"llmops serve: {model} on {url}: ended {len(left)} of its old model processes, left behind"
                    )
            else:  # not this machine's repository, or a replica that joined after the version's release loaded it
                for served in self.table_versions():
                    if model in (served.name, served.answered_by[0]):
                        client.unload(model)
                        self.load(replica, [served])
            return "reloaded"
        except (CheckFailed, TransientError) as exc:
            table = self.table()
            champion = table.champion if table is not None else None
            if server is None or champion is None or champion.model != model or not server.running():
                raise
            self.say(f"llmops serve: {model} did not load again on {url} ({exc}); restarting that Triton")
            server.kill()  # the serve's watch starts it again and loads the table's versions
            return "restarted"

    # --- reconciling what the replicas hold with the table ---------------------------------------------------------

    def reconcile(self) -> list[str]:
        """What each replica holds made what the table wants (tasks/control/contract.py `RouteTable.wanted`): every
        model of this service that no version in the table needs and no live owner declared is unloaded (a candidate
        a dead or stopped release left, its engine), each action said and counted; the actions. A routed version
        missing from a replica is the probes' to load again (`recover`)."""
        if self.table() is None:
            return []
        service = self.ctx.profile.registry.model_name
        done: list[str] = []
        for replica in self.replicas:
            if replica.restarting or not replica.running():
                continue
            try:
                held = replica.client.loaded_models()
            except Exception:  # unreachable for a moment: the next round sees it
                continue
            leftovers = [m for m in held if of_service(m, service) and not self.wanted(m)]
            for model in sorted(leftovers, key=lambda name: name == base_model_name(service)):  # adapters first
                if self.wanted(model):  # declared or routed meanwhile
                    continue
                try:
                    replica.client.unload(model)
                except Exception as exc:
                    self.say(f"llmops serve: reconcile: {model} not unloaded from {replica.client.url}: {exc}")
                    continue
                self.say(
                    f"llmops serve: reconcile: unloaded {model} from {replica.client.url} "
                    "(no version in the table needs it and no live owner declared it)"
                )
                self.count("unload", model)
                done.append(f"unload {model} {replica.client.url}")
        return done

    def wanted(self, model: str) -> bool:
        table = self.table()
        return table is None or model in table.wanted(time.time())

    def stop(self) -> None:
        for replica in self.replicas:
            if replica.server is not None:
                replica.server.stop()


def versions_to_load(ctx: RunContext, table: RouteTable | None) -> list[Served]:
    """The versions of `table` (the champion first), from the store alone. A version written without a source (an
    operator's second name for a model another version loads, PUT by hand) is not one to load."""
    versions: list[Version] = table.versions() if table is not None else []
    return [served_of(ctx, ctx.profile.registry.model_name, v) for v in versions if v.source]
