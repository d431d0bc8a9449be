"""One release of a service at a time: the service's ownership, kept in its deployment record by its gateway
(tasks/control/contract.py `Owner`, the control API's PUT/DELETE /control/v1/owner), with an expiry.

A release owns the service from loading its candidate until it is promoted or rolled back. It renews its ownership
every third of its lease from a thread of its own, so a release that dies or hangs lets it lapse and the next release
takes the service over; nothing is bound to a process or to the Prefect server (a Prefect or worker restart loses
nothing). Another release of the service queues while the owner deploys, measures and ramps (up to
run.serving_lock_timeout_s), and fails at once, naming the owner and since when, while the owner waits for a person:
a wait for approval may last a day, and a retrain schedule that queued behind it would only pile up.

Taking the service gives the release a fencing epoch, which every write it sends carries (ServiceControl.fence): a
release that lost the service (another took it over after its lease lapsed, or its renewals stopped landing for a
whole lease) is refused by the gateway and refuses itself from then on, so it never writes over the next release's
canary. It ends with one line naming the owner now (LostService, exit 6).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NoReturn

from prefect.exceptions import Pause

from tasks.platform.config import Profile
from tasks.platform.errors import CheckFailed, LostService, TransientError
from tasks.platform.stage_cache import logger
from tasks.platform.tracking import Tracker
from tasks.serving.service import Fence, Service, ServiceControl

POLL_S = 2.0  # how often a queued release asks again


@dataclass
class Ownership:
    control: ServiceControl
    service: str
    release: str  # the Prefect flow run (a resumed run is the same release)
    lease_s: float  # how long it holds without renewal
    waiting: str | None = None  # "approval" while it waits for a person
    stopped: threading.Event = field(default_factory=threading.Event)
    renewing: threading.Thread | None = None
    epoch: int | None = None  # the fencing epoch the service gave this release's ownership
    renewed_at: float = 0.0  # monotonic time the last renewal landed

    def take(self, timeout_s: float, poll_s: float = POLL_S) -> float:
        """Own the service, queued behind a working owner for up to timeout_s; the seconds waited. CheckFailed
        naming the owner where it waits for approval (at once) or still works after timeout_s."""
        started = time.monotonic()
        noted: str | None = None
        while True:
            owner = self.control.own(self.release, self.lease_s, self.waiting)
            if owner.release == self.release:
                self.epoch, self.renewed_at = owner.epoch, time.monotonic()
                self.control.fence = Fence(self.release, owner.epoch)
                return time.monotonic() - started
            if owner.waiting == "approval":
                raise CheckFailed(
                    f"{self.service} is owned by {owner.describe()}; a release does not queue behind a person's "
                    "decision: decide it (`llmops approve|reject`) and run again. Nothing was deployed"
                )
            waited = time.monotonic() - started
            if waited >= timeout_s:
                raise CheckFailed(
                    f"{self.service} is still owned by {owner.describe()} after {waited:.0f}s "
                    "(run.serving_lock_timeout_s); nothing was deployed"
                )
            if noted != owner.release:
                logger().info(f"serving lock: {self.service} is owned by {owner.describe()}; queued")
                noted = owner.release
            time.sleep(min(poll_s, max(0.0, timeout_s - waited)))

    def keep(self) -> None:
        """Renew every third of the lease until `give_up`, from a thread of its own."""
        self.stopped.clear()

        def renew() -> None:
            while not self.stopped.wait(self.lease_s / 3):
                try:
                    self.renew()
                except LostService:
                    return  # said; the release's next write ends it

        self.renewing = threading.Thread(target=renew, name="own-service", daemon=True)
        self.renewing.start()

    def stop_renewing(self) -> None:
        """No renewal after this returns (one in flight has landed)."""
        self.stopped.set()
        if self.renewing is not None and self.renewing is not threading.current_thread():
            self.renewing.join()

    def renew(self, lease_s: float | None = None) -> None:
        """Renewed now (for lease_s, where given). LostService where this release lost the service: taken over (its
        ownership lapsed and another release took it; or it was given a new epoch, so another owned it meanwhile),
        or no renewal landed for a whole lease: it writes nothing more from then on."""
        self.control.refuse_if_lost()
        try:
            owner = self.control.own(self.release, lease_s or self.lease_s, self.waiting)
        except (CheckFailed, TransientError) as exc:  # the service is away for a moment: the lease outlasts it
            if time.monotonic() - self.renewed_at < self.lease_s:
                logger().warning(f"serving lock: the ownership of {self.service} was not renewed: {exc}")
                return
            self.lose(f"{self.service}: no renewal of this release's ownership landed for {self.lease_s:g}s ({exc})")
        if owner.release == self.release and owner.epoch != self.epoch:
            # it lapsed (another release may have owned the service meanwhile and changed it; the gateway served the
            # champion alone): the ownership just given is not this release's to use, and is given up at once
            self.control.disown(self.release, owner.epoch)
            self.lose(f"{self.service}: this release's ownership lapsed before it was renewed (epoch {self.epoch})")
        if owner.release != self.release:
            self.lose(f"{self.service} is owned by {owner.describe()} now")
        self.renewed_at = time.monotonic()

    def lose(self, why: str) -> NoReturn:
        """The service is lost: renewals stop, every write is refused unsent, and the release ends with `why`."""
        self.stopped.set()
        logger().error(f"serving lock: {why}; this release writes nothing more")
        self.control.lose(f"{why}; this release wrote nothing more")

    def wait_for_approval(self, lease_s: float) -> None:
        """Marked as waiting for a person (others fail fast instead of queueing), owned for lease_s from now."""
        self.waiting = "approval"
        self.renew(lease_s)

    def suspend(self, lease_s: float) -> None:
        """Owned, waiting for approval, for lease_s from now with no process left to renew it (the release suspended;
        its run, started again by the decision, owns the service on). The renewals stop first: one of a lease (a
        third of canary.lease_s) landing after this would let the service go while the release waits."""
        self.stop_renewing()
        self.waiting = "approval"
        self.renew(lease_s)

    def decided(self) -> None:
        self.waiting = None
        self.renew()

    def give_up(self) -> None:
        """Renewing stops and the service is free (where the service cannot be reached, the ownership lapses; where
        this release lost it, it is another's)."""
        self.stop_renewing()
        if self.control.lost:
            return
        try:
            self.control.disown(self.release)
        except (CheckFailed, TransientError) as exc:
            logger().warning(f"serving lock: {self.service} not given up ({exc}); it lapses in {self.lease_s:.0f}s")


@contextmanager
def serving_lock(config: Profile, tracker: Tracker, served: Service, release: str, resumed: bool = False):
    """The service owned by this release (Ownership) from loading the candidate until it is
    promoted or rolled back; a second release of the model queues here for its turn, or fails at once while this
    one waits for a person. `resumed`: started again after a suspension, it owns the service already (what it
    waited and when it took it are those of its first process). Suspended, it stays the owner."""
    name = f"llmops-serving-{config.registry.model_name}"
    log = logger()
    log.info(f"serving lock {name}: acquiring (another release of {config.registry.model_name} may hold it)")
    ownership = Ownership(served.control, served.name, release, config.canary.lease_s)
    waited = ownership.take(config.run.serving_lock_timeout_s)
    ownership.keep()
    log.info(f"serving lock {name}: held by release {release} (epoch {ownership.epoch}) after {waited:.1f}s")
    tracker.set_tags({"release.id": release, "serving_lock.epoch": str(ownership.epoch)})
    if not resumed:
        tracker.log_metrics("serving_lock", {"wait_s": waited})
        tracker.set_tags({"serving_lock.acquired_at": f"{time.time():.3f}"})
    suspended = False
    try:
        yield ownership
    except Pause:  # prefect's: the run suspended for approval
        suspended = True
        raise
    finally:
        if suspended:  # owned, waiting for approval, until the approval timeout, with no process to renew it
            ownership.suspend(config.gate.approval_timeout_s + config.canary.hold_s)
        else:  # given up first: the tag is a record, the ownership is what the next release waits for
            ownership.give_up()
            try:
                tracker.set_tags({"serving_lock.released_at": f"{time.time():.3f}"})
            except Exception as exc:  # MLflow away (the failure being raised, often): said, not raised over it
                log.warning(f"serving lock {name}: released; MLflow did not record when ({type(exc).__name__})")
