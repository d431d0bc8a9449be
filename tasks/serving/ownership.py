"""One release of a service at a time: the service's ownership, kept in its deployment record by its gateway
(tasks/serving/routes.py `Owner`, the control API's PUT/DELETE /control/v1/owner), with an expiry.

A release owns the service from loading its candidate until it is promoted or rolled back. It renews its ownership
every third of its lease from a thread of its own, so a release that dies or hangs lets it lapse and the next release
takes the service over; nothing is bound to a process or to the Prefect server (a Prefect or worker restart loses
nothing). Another release of the service queues while the owner deploys, measures and ramps (up to
run.serving_lock_timeout_s), and fails at once, naming the owner and since when, while the owner waits for a person:
a wait for approval may last a day, and a retrain schedule that queued behind it would only pile up.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from tasks.platform.errors import CheckFailed, TransientError
from tasks.platform.stage_cache import logger
from tasks.serving.routes import Owner
from tasks.serving.service import ServiceControl

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

    def take(self, timeout_s: float, poll_s: float = POLL_S) -> float:
        """Own the service, queued behind a working owner for up to timeout_s; the seconds waited. CheckFailed
        naming the owner where it waits for approval (at once) or still works after timeout_s."""
        started = time.monotonic()
        noted: str | None = None
        while True:
            owner = self.control.own(self.release, self.lease_s, self.waiting)
            if owner is None:
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
                self.renew()

        self.renewing = threading.Thread(target=renew, name="own-service", daemon=True)
        self.renewing.start()

    def stop_renewing(self) -> None:
        """No renewal after this returns (one in flight has landed)."""
        self.stopped.set()
        if self.renewing is not None and self.renewing is not threading.current_thread():
            self.renewing.join()

    def renew(self, lease_s: float | None = None) -> Owner | None:
        """Renewed now (for lease_s, where given); the other release that owns the service where this one lost it
        (it let its ownership lapse and was taken over), logged."""
        try:
            owner = self.control.own(self.release, lease_s or self.lease_s, self.waiting)
        except (CheckFailed, TransientError) as exc:  # the service is away for a moment: the lease outlasts it
            logger().warning(f"serving lock: the ownership of {self.service} was not renewed: {exc}")
            return None
        if owner is not None:
            logger().warning(f"serving lock: {self.service} was taken over by {owner.describe()}")
        return owner

    def wait_for_approval(self, lease_s: float) -> None:
        """Marked as waiting for a person (others fail fast instead of queueing), owned for lease_s from now."""
        self.waiting = "approval"
        self.renew(lease_s)

    def suspend(self, lease_s: float) -> None:
        """Owned, waiting for approval, for lease_s from now with no process left to renew it (the release suspended;
        its run, started again by the decision, owns the service on). The renewals stop first: one of a lease (a
        third of canary.hold_s) landing after this would let the service go while the release waits."""
        self.stop_renewing()
        self.waiting = "approval"
        self.renew(lease_s)

    def decided(self) -> None:
        self.waiting = None
        self.renew()

    def give_up(self) -> None:
        """Renewing stops and the service is free (where the service cannot be reached, the ownership lapses)."""
        self.stop_renewing()
        try:
            self.control.disown(self.release)
        except (CheckFailed, TransientError) as exc:
            logger().warning(f"serving lock: {self.service} not given up ({exc}); it lapses in {self.lease_s:.0f}s")
