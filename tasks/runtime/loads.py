"""A release's versions on the replicas of `llmops serve` (POST and DELETE /control/v1/versions, GET
/control/v1/replicas): the serve loads them from the artifact store with the serving settings each carries, so a
release holds no Triton key and loads nothing itself (issue 73). A load that hangs is the serve's to end: Triton 2.51
waits for a model process's first message without a deadline (python_backend src/stub_launcher.cc,
ModelInstanceStubProcess: parent_message_queue_->Pop()), and a retry on that server waits behind it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from tasks.control.contract import Version
from tasks.platform.config import Profile
from tasks.platform.errors import CheckFailed, TransientError
from tasks.platform.run_log import Said
from tasks.runtime.fleet import Fleet, Replica
from tasks.serving.champion import released_profile, served_of
from tasks.serving.client import Triton
from tasks.serving.models import Served, install_model, retire, triton_unload_quietly


class Versions(Protocol):
    """What loads a release's versions on the service's Tritons: the serve's (ReleaseLoads), or the
    one Triton of a release's own service (tasks/runtime/standalone.py)."""

    def load_everywhere(self, version: Version, load_timeout_s: float, fresh: bool = False) -> list[dict[str, Any]]: ...

    def unload_everywhere(self, version: Version) -> list[str]: ...

    def held(self) -> list[dict[str, Any]]: ...


class ReleaseLoads:
    """The serve's: on every replica of its fleet."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.loading = threading.Lock()  # a release's loads, one at a time

    def load_everywhere(self, version: Version, load_timeout_s: float, fresh: bool = False) -> list[dict[str, Any]]:
        """A release's version loaded on every replica from the artifact store, with the serving settings it carries:
        the release loads nothing on the service's Tritons itself; a load past `load_timeout_s` (the release's
        serve.load_timeout_s) is taken for hung. `fresh`: unloaded first (tune_serving's trials, new
        settings on the same version). A version that does not load is unloaded again (CheckFailed: why, in one
        line); one whose load hangs is the serve's to end (`hung_load`): where another replica serves the champion
        that Triton is started again and the load tried once more; on the last one serving the champion the load is
        abandoned (CheckFailed). ValueError: settings the profile refuses. One load at a time: a retry waits."""
        served = served_of(self.fleet.ctx, self.fleet.ctx.profile.registry.model_name, version)
        profile = with_load_timeout(released_profile(self.fleet.ctx.profile, served), load_timeout_s)
        timeout_s = 2 * load_timeout_s + 60  # a load, the restart of the replica it hung on, and the load again
        loaded = []
        with self.loading:
            for replica in list(self.fleet.replicas):
                client = self.settled(replica, timeout_s)
                if fresh:
                    triton_unload_quietly(client, served.name)
                with Said() as said:
                    try:
                        seconds = install_model(client, profile, served)
                    except TransientError as exc:
                        seconds = self.load_hung(replica, served, profile, exc, timeout_s)
                    except CheckFailed:  # it does not load: unloaded again where it did, unless it serves
                        if not self.routed(version):
                            for done in self.fleet.replicas:
                                retire(done.client, self.fleet.ctx.profile.registry.model_name, served)
                        raise
                loaded.append(loaded_on(client, served, seconds, said))
                self.fleet.say(f"llmops serve: {served.name} loaded on {client.url} in {seconds:.1f}s")
        return loaded

    def load_hung(self, replica: Replica, served: Served, profile: Profile, exc: Exception, timeout_s: float) -> float:
        url = replica.client.url
        self.fleet.say(f"llmops serve: {exc}; deciding what becomes of the load on Triton {url}")
        try:
            outcome = self.hung_load(url, served.models, timeout_s)
        except CheckFailed as refused:
            raise CheckFailed(f"{served.name}'s load hung on Triton {url} ({exc}) and {refused}") from None
        if outcome != "restarted":
            raise CheckFailed(
                f"{served.name}'s load hung on Triton {url}, the last replica serving the champion: its model "
                "processes were ended and the load abandoned; the champion served throughout"
            )
        self.fleet.say(f"llmops serve: Triton {url} started again; loading {served.name} once more")
        try:
            return install_model(replica.client, profile, served)
        except TransientError as again:  # retried once: a version that hangs every time is refused
            raise CheckFailed(f"{served.name}'s load hung again after Triton {url} restarted: {again}") from None

    def settled(self, replica: Replica, timeout_s: float) -> Triton:
        """The replica's Triton once it is not being started again (its restart loads only the table's versions)."""
        deadline = time.monotonic() + timeout_s
        while replica.restarting or not replica.running():
            if time.monotonic() > deadline:
                raise TransientError(f"Triton {replica.client.url} did not serve again within {timeout_s:.0f}s")
            time.sleep(0.2)
        return replica.client

    def held(self) -> list[dict[str, Any]]:
        """What each replica holds (GET /control/v1/replicas); None where it does not answer."""
        return [held_by(replica.client) for replica in list(self.fleet.replicas)]

    def routed(self, version: Version) -> bool:
        table = self.fleet.table()
        return table is not None and table.version(version.name) is not None

    def unload_everywhere(self, version: Version) -> list[str]:
        """A release's version unloaded from every replica (its way: an adapter's engine goes with its last adapter);
        never one the table routes. The replicas it was unloaded from."""
        if self.routed(version):
            raise CheckFailed(f"{version.name} is in the service's routes: route it away before unloading it")
        served = served_of(self.fleet.ctx, self.fleet.ctx.profile.registry.model_name, version)
        done = []
        for replica in list(self.fleet.replicas):
            if replica.running() and not replica.restarting:
                retire(replica.client, self.fleet.ctx.profile.registry.model_name, served)
                done.append(replica.client.url)
        return done

    def hung_load(self, url: str, models: list[str], timeout_s: float) -> str:
        """A release's load of `models` hung on replica `url` (its control API, tasks/runtime/gateway/control.py).
        Triton 2.51 waits for a model process's first message without a deadline (python_backend
        src/stub_launcher.cc, ModelInstanceStubProcess: parent_message_queue_->Pop()), and a retry on that server
        waits behind it. Where another replica serves the champion, that Triton is killed with its model processes
        and back once the watch started it again with the table's versions: "restarted", and the release loads again.
        Where it is the last replica serving the champion, it is never restarted for a candidate: the candidate's
        model processes are ended (their memory freed) and its load is abandoned ("abandoned"); the load's thread
        stays blocked inside that Triton until it next starts, so the version is not loaded there again."""
        replica = next((r for r in self.fleet.replicas if r.client.url == url), None)
        if replica is None or replica.server is None:
            raise CheckFailed(f"Triton {url} is not one this serve started; restart it where it was started")
        table = self.fleet.table()
        champion = table.champion if table is not None else None
        serving = [r for r in self.fleet.replicas if r is not replica and r.running() and not r.restarting]
        if champion is not None and not serving:  # a candidate never costs the champion its clients
            # only what loads for the release alone: never a model the table routes, nor one serving (the base engine
            # an adapter candidate registers with serves the champion)
            routed = table.models() if table else set()
            hung = [m for m in models if m not in routed and not replica.client.is_ready(m)]
            ended = replica.server.end_model_processes(hung) if hung else []
            self.fleet.say(
                f"llmops serve: a release's load of {', '.join(hung)} hung on Triton {url}, the last replica serving "
                f"the champion {champion.name}: its model processes ended ({len(ended)}), the load abandoned"
            )
            self.fleet.count("abandon", ",".join(hung))
            return "abandoned"
        self.fleet.say(f"llmops serve: a release's load hung on Triton {url}; starting that Triton again")
        with replica.lock:
            started, restarting, server = replica.started, replica.restarting, replica.server
        if not restarting:  # else the watch is starting it already
            server.kill()
        deadline = time.monotonic() + timeout_s
        while replica.started == started or replica.restarting or not replica.running():
            if time.monotonic() > deadline:
                raise TransientError(f"Triton {url} did not serve again within {timeout_s:.0f}s of its restart")
            time.sleep(0.2)
        return "restarted"


def loaded_on(triton: Triton, served: Served, seconds: float, said: list[str]) -> dict[str, Any]:
    """One replica's answer to a release's load: how long it took, the artifact its model config names (what the gate
    checks it measured; None where the config cannot be read) and what the load said (the release's log shows it)."""
    try:
        digest: str | None = triton.model_parameter(served.name, "artifact_sha256")
    except Exception:
        digest = None
    return {"url": triton.url, "load_s": round(seconds, 3), "artifact_sha256": digest, "said": said[-20:]}


def with_load_timeout(profile: Profile, load_timeout_s: float) -> Profile:
    """`profile` taking a load past `load_timeout_s` for hung: the release's serve.load_timeout_s, for its version."""
    return profile.model_copy(update={"serve": profile.serve.model_copy(update={"load_timeout_s": load_timeout_s})})


def held_by(triton: Triton) -> dict[str, Any]:
    try:
        models: list[str] | None = sorted(triton.loaded_models())
    except Exception:  # starting again, or gone
        models = None
    return {"url": triton.url, "models": models}
