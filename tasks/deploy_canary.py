"""deploy_canary: the candidate next to the champion on the service's Triton, known to its gateway at 0%.

Each registered version is its own Triton model (tasks/serving/models.py); the gateway in front of Triton draws each
request's version from the service's route table (tasks/control/contract.py), which this stage and the rollout change
through the gateway's control API. The rollout policy that moves the weights (steps, live checks, promote,
rollback) is tasks/rollout.py.

Aliases: `challenger` when the candidate is deployed (here), `champion` when it is promoted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from tasks.control.contract import RouteTable
from tasks.platform.errors import CheckFailed, LostService, TransientError
from tasks.platform.stage_cache import RunContext, logger
from tasks.platform.tracking import Registered
from tasks.serving.champion import as_route, load_on_service, serve_champion, served_version, serving_champion
from tasks.serving.client import Triton
from tasks.serving.models import Served
from tasks.serving.service import Service, ServiceControl


@dataclass
class Deployment:
    served: Service
    candidate: Served
    champion: Served | None
    release: str  # the run that holds the candidate's routes (the control API's `release`)
    hold_s: (
        float  # how long each change of the routes holds unrenewed (canary.lease_s) before the champion serves alone
    )
    steps: list[dict] = field(default_factory=list)
    loaded: list[dict] = field(default_factory=list)  # the candidate on each replica: url, load_s, artifact_sha256
    holding: threading.Event = field(default_factory=threading.Event)  # set: not renewing

    def headline(self) -> str:
        if self.unchanged:
            return f"{self.candidate.name} already the champion"
        return f"{self.candidate.name} next to {self.champion.name if self.champion else 'no champion'}"

    @property
    def triton(self) -> Triton:
        """The first replica: where the benchmark measures."""
        return self.served.triton

    def retire(self, served: Served) -> None:
        """`served` unloaded from every replica by the service; nothing where this release lost the service (the next
        owner's)."""
        self.control.unload(as_route(served))

    @property
    def control(self) -> ServiceControl:
        return self.served.control

    @property
    def service(self) -> str:
        return self.served.name

    @property
    def unchanged(self) -> bool:
        """The candidate already is the champion (a rerun with nothing new): nothing to roll out."""
        return self.champion is not None and self.champion.version == self.candidate.version

    def table(self, weights: dict[str, float], candidate: bool = True, shadow: float = 0.0) -> RouteTable:
        """The service's table with the champion and (where `candidate`) the candidate, routed by `weights`; with
        `shadow`, that share of the answered requests copied to the candidate."""
        return replace(
            RouteTable(self.service),
            champion=as_route(self.champion) if self.champion else None,
            candidate=as_route(self.candidate) if candidate else None,
            weights={name: weight for name, weight in weights.items() if weight > 0},
            shadow=self.candidate.name if shadow else None,
            shadow_fraction=shadow,
            release=self.release if candidate else None,
        )

    def route(self, weights: dict[str, float], shadow: float = 0.0, hold_s: float = 0.0) -> None:
        """Route the service by `weights` (and copy `shadow`) from the next request on, held for hold_s (at least)."""
        self.control.put_table(self.table(weights, shadow=shadow), max(self.hold_s, hold_s))

    def keep_holding(self) -> None:
        """Renew this release's hold on the routes every third of canary.lease_s until `let_go`, from a thread of its
        own: a stage longer than the hold (a benchmark, tuning) keeps the candidate in the routes; a release that
        dies (or waits for a person without a process) stops renewing, and its hold lapses."""
        self.holding.clear()

        def renew() -> None:
            while not self.holding.wait(self.hold_s / 3):
                try:
                    self.control.renew(self.release, self.hold_s)
                except LostService:
                    return  # said by whoever found it; the release's next write ends it
                except (CheckFailed, TransientError) as exc:  # another release holds the routes, or the service is away
                    logger().warning(f"canary: the hold on {self.service}'s routes was not renewed: {exc}")

        threading.Thread(target=renew, name="hold-routes", daemon=True).start()

    def let_go(self) -> None:
        self.holding.set()

    def champion_alone(self) -> None:
        """The champion serving every request again (no candidate in the table); no route at all before one."""
        self.control.put_table(self.table({self.champion.name: 100.0} if self.champion else {}, candidate=False))


def deploy_canary(ctx: RunContext, registered: Registered, served: Service) -> Deployment:
    client = ctx.tracker.client
    candidate = served_version(ctx, served.name, client.get_model_version(registered.name, registered.version))
    deployment, load_s = load_both(ctx, served, candidate)
    if deployment.unchanged:
        logger().info(f"canary: v{candidate.version} is already the champion; nothing to roll out")
        return deployment
    ctx.tracker.log_metrics("canary", {"candidate_load_s": load_s})
    champion = deployment.champion
    deployment.route({champion.name: 100.0} if champion else {})
    deployment.keep_holding()
    client.set_registered_model_alias(registered.name, "challenger", registered.version)
    logger().info(
        f"canary: {candidate.name} ready next to "
        f"{champion.name if champion else 'no champion (first release)'}; alias challenger -> v{registered.version}"
    )
    return deployment


def load_both(ctx: RunContext, served: Service, candidate: Served) -> tuple[Deployment, float]:
    """The champion (the service's, else the registry's) and the candidate loaded on every replica by the service
    (from the store: the release loads nothing on its Tritons); the seconds the candidate's load took (0: nothing to
    load). A candidate that fails to load is retired again by the service, and one whose load hangs is the service's
    to end (tasks/runtime/fleet.py:Fleet.load_everywhere): CheckFailed, unretried."""
    champion = serving_champion(ctx, served)
    # declared before any load: `llmops serve`'s reconciler unloads what no live owner declared and no route needs
    served.control.declare([model for version in (champion, candidate) if version for model in version.models])
    champion = serve_champion(ctx, served, champion)
    # the release's one id: the one its ownership of the service carries (the Prefect flow run's), in the routes too
    release = served.control.fence.release if served.control.fence else ctx.tracker.run_id
    deployment = Deployment(served, candidate, champion, release, ctx.profile.canary.lease_s)
    if deployment.unchanged:
        return deployment, 0.0
    deployment.loaded = load_on_service(ctx, served, candidate)
    return deployment, max(float(replica["load_s"]) for replica in deployment.loaded)
