"""deploy_canary: the candidate next to the champion on one Triton, behind the service's router.

Each registered version is its own Triton model and a router model splits traffic by weight
(tasks/serving/models.py). The rollout policy that moves the weights (steps, live checks, promote,
rollback) is tasks/rollout.py.

Aliases: `challenger` when the candidate is deployed (here), `champion` when it is promoted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import RunContext, logger
from tasks.register import Registered
from tasks.serving.champion import serve_champion, served_version
from tasks.serving.client import Triton
from tasks.serving.models import Served, install_model, retire


@dataclass
class Deployment:
    triton: Triton
    service: str
    candidate: Served
    champion: Served | None
    steps: list[dict] = field(default_factory=list)

    @property
    def unchanged(self) -> bool:
        """The candidate already is the champion (a rerun with nothing new): nothing to roll out."""
        return self.champion is not None and self.champion.version == self.candidate.version


def deploy_canary(ctx: RunContext, registered: Registered, triton: Triton) -> Deployment:
    service = ctx.profile.registry.model_name
    client = ctx.tracker.client
    candidate = served_version(ctx, service, client.get_model_version(registered.name, registered.version))
    champion = serve_champion(ctx, triton)
    if champion is not None and champion.version == candidate.version:
        logger().info(f"canary: v{candidate.version} is already the champion; nothing to roll out")
        return Deployment(triton, service, candidate, champion)
    try:
        load_s = install_model(triton, ctx.profile, candidate)
        ctx.tracker.log_metrics("canary", {"candidate_load_s": load_s})
    except CheckFailed:
        retire(triton, service, candidate)
        raise
    client.set_registered_model_alias(registered.name, "challenger", registered.version)
    logger().info(
        f"canary: {candidate.name} ready next to "
        f"{champion.name if champion else 'no champion (first release)'}; alias challenger -> v{registered.version}"
    )
    return Deployment(triton, service, candidate, champion)
