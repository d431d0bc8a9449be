"""The control API of `llmops serve`: what releases (and operators) change on a running service, on a listener of its
own (loopback by default; serve.listen.control_host), every call authenticated by the serve's control key in the
`llmops-control-key` header (never a client's API key).

    GET    /control/v1/deployment   the route table: champion, candidate, weights, shadow, the release holding it
    PUT    /control/v1/deployment   a whole table (a release's candidate, a promotion, a rollback), with lease_s
    PUT    /control/v1/routes       {"weights": {VERSION: WEIGHT, ...}, "release": RUN, "lease_s": S}: a canary step
    PUT    /control/v1/shadow       {"version": VERSION, "fraction": F, "release": RUN, "lease_s": S}: copies start
    DELETE /control/v1/shadow       copies stop
    PUT    /control/v1/lease        {"release": RUN, "lease_s": S}: the release that holds the routes holds them longer
    PUT    /control/v1/owner        {"release": RUN, "lease_s": S, "waiting": null|"approval"}: the release owns the
                                    service for S seconds (taken, renewed, or taken over from a lapsed owner) and is
                                    given its fencing epoch (owner.epoch: the next one for a new owner, the same on a
                                    renewal); 409 with {"error": ..., "owner": {...}} naming the owner while another
                                    one holds it. Where serve.autoscale scaled the service to zero, the answer comes
                                    once a replica serves (within serve.autoscale.cold_start_timeout_s)
    DELETE /control/v1/owner        {"release": RUN, "epoch": N}: that release gives the service up (nothing where it
                                    is not the owner)
    PUT    /control/v1/loads        {"models": [MODEL, ...], "epoch": N}: the owner declares the Triton models it loads
                                    (before it loads them); the serve's reconciler unloads a model of the service that
                                    neither the table routes nor a live owner declared (tasks/runtime/fleet.py)
    POST   /control/v1/versions     {"version": {"name", "model", "adapter", "source"}, "load_timeout_s": S, "fresh":
                                    B}: the serve loads it on every replica from the store with the settings its
                                    source carries (tasks/runtime/loads.py): {"replicas": [{"url", "load_s",
                                    "artifact_sha256", "said"}]}; 409 where it does not load or a hung load was
                                    abandoned, 504 where a replica did not serve. DELETE {"version"}: unloaded (409
                                    while routed). GET /control/v1/replicas: [{"url", "models"}], what is loaded where
    PUT    /control/v1/rollout      {"steps": [..], "window_s": S, "max_error_rate": R, "max_mean_latency_ms": MS,
                                    "await_decision": B, "release": RUN, "lease_s": S}: the table's candidate rolled out
                                    by the service's controller (tasks/runtime/rollouts.py); its status is the table's
                                    `rollout` (GET /control/v1/deployment), held by the release's lease
    POST   /control/v1/rollout/decision  {"decision": "abort"|"next", "reason": TEXT, "release": RUN}: abort it (the
                                    champion alone), or route the next step of a rollout paused for the release
    POST   /v2/models/NAME/generate[_stream]   the service's name (drawn by weight) or one version by its name:
                                    the release's probes and served scoring, through the gateway's own path
    GET    /health/live, /health/ready, /metrics   as on the gateway's own listener, without a key

Fencing: every write (deployment, routes, shadow, lease, loads, versions, rollout) of a release carries the epoch its
ownership was given and the release it was given to ({"epoch": N, "epoch_of": RUN}; a write whose own `release`
names it may leave epoch_of out); while a release owns the service, a write whose epoch and release are not the
owner's, or that carries none, is a 409 {"error": ..., "owner": {...}} naming the owner, and so is a write with an epoch once
that ownership lapsed: a release that lost the service (taken over, or its lease lapsed in a long benchmark) cannot
write over the next one's canary (Chubby's sequencers, Kubernetes' resourceVersion). A write without an epoch (an
operator's) is taken while no release owns the service.

A change takes effect for the next request (the table is swapped in memory, no model is loaded again) once the
deployment record holds it (tasks/control/contract.py). `lease_s`: the release's hold on a candidate's routes or a
shadow copy; past it, the gateway serves the champion alone (a release that died never leaves traffic split). Every
refusal is Triton's error shape, {"error": "..."}, naming the field.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tasks.control.contract import Owner, RoutesError, RouteTable, Version, parse_models, parse_weights
from tasks.platform.errors import CheckFailed, TransientError
from tasks.runtime.gateway.access import Guard, current, triton_error
from tasks.runtime.gateway.app import Gateway
from tasks.runtime.gateway.protocol import RequestError
from tasks.runtime.loads import Versions
from tasks.runtime.rollouts import decided, submitted
from tasks.serving.client import CONTROL_HEADER

CONTROL_CLIENT = "control"  # the client name the control key's requests are counted under
MAX_LEASE_S = 24 * 3600.0
MAX_OWNER_S = 366 * 24 * 3600.0  # a release waiting for a person owns the service until its approval timeout
MAX_RESTART_S = 3600.0

Endpoint = Callable[[Request], Awaitable[Response]]


class Fenced(RequestError):
    """A write refused by the fence: not the live owner's epoch. Answered 409 with the owner, as PUT /owner's."""

    def __init__(self, message: str, owner: Owner | None):
        super().__init__(409, message)
        self.owner = owner

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": self.message, "owner": asdict(self.owner) if self.owner else None}, status_code=409
        )


def fence(table: RouteTable, data: dict[str, Any], now: float) -> None:
    """Refuse a write that does not carry the live owner's epoch and release; one without an epoch only while no
    release owns the service. Both, because an epoch alone may be given twice: one that a record lost with its
    volume (an emptyDir) gave starts over at 1. Called under the table's lock, on the owner the record holds."""
    epoch, release = data.get("epoch"), data.get("epoch_of", data.get("release"))
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
        raise RequestError(400, "epoch: the whole number PUT /control/v1/owner gave the release")
    if epoch is not None and not (isinstance(release, str) and release):
        raise RequestError(400, "epoch_of: a write with an epoch names the release it was given to")
    owner = table.owner
    if owner is None or owner.expired(now):
        if epoch is None:
            return
        lapsed = f"the ownership of release {owner.release} lapsed" if owner else "no release owns it"
        raise Fenced(f"{table.service}: a write of epoch {epoch} refused: {lapsed}; own the service again", owner)
    if epoch == owner.epoch and release == owner.release:
        return
    given = f"epoch {epoch}" if epoch is not None else "no epoch"
    raise Fenced(f"{table.service} is owned by {owner.describe()}; a write with {given} refused", owner)


class ControlApi:
    def __init__(self, gateway: Gateway, key: str, versions: Versions | None = None):
        """`versions`: what loads a release's versions on the Tritons (None: a gateway that loads nothing)."""
        self.gateway, self.key, self.versions = gateway, key, versions

    def authorize(self, request: Request) -> None:
        given = request.headers.get(CONTROL_HEADER, "")
        if not given or not hmac.compare_digest(given.encode(), self.key.encode()):
            raise RequestError(401, f"the control API needs the serve's control key in the {CONTROL_HEADER} header")
        current().client = CONTROL_CLIENT

    async def read_json(self, request: Request) -> dict[str, Any]:
        body = await self.gateway.body(request)
        try:
            data = orjson.loads(body) if body else {}
        except orjson.JSONDecodeError as exc:
            raise RequestError(400, f"request body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise RequestError(400, "request body must be a JSON object")
        return data

    @staticmethod
    def lease(data: dict[str, Any], most: float = MAX_LEASE_S) -> float | None:
        value = data.get("lease_s")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= most:
            raise RequestError(400, f"lease_s: seconds in (0, {most:.0f}]")
        return float(value)

    async def apply(self, path: str, method: str, data: dict[str, Any]) -> Response:
        """The table a PUT or DELETE asks for, made of the current one under the table's lock (a renewal or the
        lease's watch in between is not undone), checked and fenced there, and made the gateway's (record first)."""
        lease, now = self.lease(data), time.time()

        def change(current: RouteTable) -> RouteTable:
            table = self.changed(current, path, method, data)
            try:
                table.check()
            except RoutesError as exc:
                raise RequestError(400, str(exc)) from None
            fence(current, data, now)
            # a change that gives no lease keeps the hold there is (a shadow stopped while a candidate is routed)
            expires_at = now + lease if lease else table.expires_at if table.release else None
            return replace(
                table, updated_at=now, expires_at=expires_at, owner=current.owner, last_epoch=current.last_epoch
            )

        return JSONResponse((await self.gateway.amend(change)).as_json())

    def endpoint(self, act: Callable[[Request, dict[str, Any]], Awaitable[Response]]) -> Endpoint:
        """One route's endpoint: the control key checked, the body read as JSON, `act` answered, every refusal in
        Triton's error shape (a fence's with the owner)."""

        async def answer(request: Request) -> Response:
            try:
                self.authorize(request)
                # a DELETE's body too, where it has one: the release and its epoch (an operator's may have none)
                wanted = request.method in ("PUT", "POST") or "content-type" in request.headers
                data = await self.read_json(request) if wanted and request.method != "GET" else {}
                return await act(request, data)
            except Fenced as refused:
                return refused.response()
            except RequestError as error:
                return triton_error(error)

        return answer

    async def deployment(self, request: Request, data: dict[str, Any]) -> Response:
        if request.method == "GET":
            return JSONResponse(self.gateway.table.as_json())
        return await self.apply(request.url.path, request.method, data)

    async def change_table(self, request: Request, data: dict[str, Any]) -> Response:
        return await self.apply(request.url.path, request.method, data)

    async def renew(self, data: dict[str, Any]) -> Response:
        """The hold of the release that holds the routes, `lease_s` from now; the routes themselves untouched."""
        table, lease = self.gateway.table, self.lease(data)
        if lease is None or not data.get("release") or data["release"] != table.release:
            raise RequestError(
                409, f"release: the routes are held by {table.release or 'no release'}, not {data.get('release')}"
            )
        now = time.time()

        def change(current: RouteTable) -> RouteTable:
            fence(current, data, now)
            return replace(current, expires_at=now + lease)

        return JSONResponse((await self.gateway.amend(change)).as_json())

    async def own(self, method: str, data: dict[str, Any]) -> Response:
        """Take, renew or give up the service's ownership; the check and the change under the table's lock (two
        releases asking at once: one owns it, the other is told who)."""
        release = data.get("release")
        if not isinstance(release, str) or not release:
            raise RequestError(400, "release: a run id")
        lease = self.lease(data, MAX_OWNER_S)
        waiting = data.get("waiting") or None
        if method == "PUT" and lease is None:
            raise RequestError(400, "lease_s: required")
        if waiting not in (None, "approval"):
            raise RequestError(400, "waiting: null or approval")
        refused: list[Owner] = []

        def change(table: RouteTable) -> RouteTable | None:
            owner, now = table.owner, time.time()
            mine = owner is not None and owner.release == release
            if method == "DELETE":
                same = mine and data.get("epoch") in (None, owner.epoch)  # type: ignore[union-attr]
                return replace(table, owner=None) if same else None
            if owner is not None and not mine and not owner.expired(now):
                refused.append(owner)
                return None
            if owner is not None and mine and not owner.expired(now):  # renewed: the same ownership, the same epoch
                return replace(table, owner=replace(owner, expires_at=now + (lease or 0), waiting=waiting))
            # a new owner, or one whose lease lapsed (the gateway served the champion alone meanwhile, and its writes
            # were refused): the next epoch, and every write of an older one is refused
            epoch = table.last_epoch + 1
            return replace(table, owner=Owner(release, now, now + (lease or 0), waiting, epoch), last_epoch=epoch)

        table = await self.gateway.amend(change)
        if refused:
            return JSONResponse(
                {"error": f"{table.service} is owned by {refused[0].describe()}", "owner": asdict(refused[0])},
                status_code=409,
            )
        if method == "PUT":  # scaled to zero (serve.autoscale): the new owner is answered once a replica serves
            await self.gateway.triton.woken()
        return JSONResponse(table.as_json())

    async def declare(self, data: dict[str, Any]) -> Response:
        """What the owner loads, in its ownership; only the live owner's epoch may declare."""
        try:
            loads = parse_models(data.get("models"), "models")
        except RoutesError as exc:
            raise RequestError(400, str(exc)) from None
        if data.get("epoch") is None:
            raise RequestError(400, "epoch: the whole number PUT /control/v1/owner gave the release")
        now = time.time()

        def change(current: RouteTable) -> RouteTable:
            fence(current, data, now)
            assert current.owner is not None  # the fence passes an epoch only for the live owner
            return replace(current, owner=replace(current.owner, loads=loads))

        return JSONResponse((await self.gateway.amend(change)).as_json())

    async def roll_out(self, data: dict[str, Any]) -> Response:
        """The release's plan for the table's candidate, walked by the controller from its next round."""
        lease, now = self.lease(data), time.time()
        if lease is None:
            raise RequestError(400, "lease_s: required (the release's hold on its candidate's routes)")

        def change(current: RouteTable) -> RouteTable:
            fence(current, data, now)
            return submitted(current, data, lease, now)

        return JSONResponse((await self.gateway.amend(change)).as_json())

    async def decide(self, data: dict[str, Any]) -> Response:
        """The release's decision on its rollout; one that ended already is answered with the table that says how."""
        now = time.time()

        def change(current: RouteTable) -> RouteTable | None:
            fence(current, data, now)
            return decided(current, data, now)

        return JSONResponse((await self.gateway.amend(change)).as_json())

    @staticmethod
    def changed(table: RouteTable, path: str, method: str, data: dict[str, Any]) -> RouteTable:
        """The table a PUT or DELETE asks for, of `table` (the current one)."""
        release = data.get("release") or None
        if release is not None and not isinstance(release, str):
            raise RequestError(400, "release: a run id or null")
        try:
            if path.endswith("/deployment"):  # the owner and the epoch are not a table's to change (PUT /owner is)
                whole = {**data, "service": table.service, "updated_at": time.time(), "owner": None, "last_epoch": 0}
                ended = table.champion_alone("the release replaced the whole table", time.time()).rollout
                return replace(
                    RouteTable.of({**whole, "rollout": None}),
                    owner=table.owner,
                    last_epoch=table.last_epoch,
                    rollout=ended,
                )
            if table.rollout is not None and table.rollout.active and method == "PUT" and path.endswith("/routes"):
                raise RequestError(
                    409,
                    f"routes: release {table.rollout.release}'s rollout is walked by the service's controller; "
                    "abort it first (POST /control/v1/rollout/decision)",
                )
            if path.endswith("/routes"):
                return replace(table, weights=parse_weights(data.get("weights")), release=release)
            if method == "DELETE":
                return replace(table, shadow=None, shadow_fraction=0.0)
            fraction = data.get("fraction")
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
                raise RoutesError("fraction: a number in (0, 1]")
            return replace(
                table, shadow=str(data.get("version") or ""), shadow_fraction=float(fraction), release=release
            )
        except RoutesError as exc:
            raise RequestError(400, str(exc)) from None

    async def version(self, request: Request, data: dict[str, Any]) -> Response:
        """POST: the version loaded on every replica; DELETE: unloaded from each."""
        try:
            version = Version.of(data.get("version"), "version")
        except RoutesError as exc:
            raise RequestError(400, str(exc)) from None
        timeout, fresh = data.get("load_timeout_s", 300), data.get("fresh", False)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_RESTART_S:
            raise RequestError(400, f"load_timeout_s: seconds in (0, {MAX_RESTART_S:.0f}]")
        if not isinstance(fresh, bool):
            raise RequestError(400, "fresh: true or false")
        if self.versions is None:
            raise RequestError(409, "this gateway loads no versions")
        fence(self.gateway.table, data, time.time())
        try:
            if request.method == "DELETE":
                unloaded = await self.gateway.pools.job(self.versions.unload_everywhere, version)
                return JSONResponse({"name": version.name, "unloaded": unloaded})
            loaded = await self.gateway.pools.job(self.versions.load_everywhere, version, float(timeout), fresh)
        except (ValueError, KeyError) as exc:  # settings the profile refuses, a source naming no artifact
            raise RequestError(400, f"version.source: {exc}") from None
        except CheckFailed as exc:
            raise RequestError(409, str(exc)) from None
        except TransientError as exc:
            raise RequestError(504, str(exc)) from None
        return JSONResponse({"name": version.name, "replicas": loaded})

    async def replicas(self) -> Response:
        held = await self.gateway.pools.answer(self.versions.held) if self.versions is not None else []
        return JSONResponse({"replicas": held})

    async def generate(self, request: Request) -> Response:
        try:
            self.authorize(request)
            return await self.gateway.generate_v2(request, pinned=True)
        except RequestError as error:
            return triton_error(error)

    async def not_routed(self, request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        return triton_error(RequestError(status, f"no route {request.method} {request.url.path} here"))

    def app(self, lifespan: bool = False) -> Starlette:
        """The control listener's app; `lifespan`: it runs the gateway's background work (a gateway with no client
        listener: the temporary one of `llmops run`)."""
        gateway = self.gateway
        routes = [
            Route("/health/live", gateway.live),
            Route("/health/ready", gateway.ready),
            Route("/metrics", gateway.prometheus),
            Route("/control/v1/deployment", self.endpoint(self.deployment), methods=["GET", "PUT"]),
            Route("/control/v1/routes", self.endpoint(self.change_table), methods=["PUT"]),
            Route("/control/v1/shadow", self.endpoint(self.change_table), methods=["PUT", "DELETE"]),
            Route("/control/v1/lease", self.endpoint(lambda _, data: self.renew(data)), methods=["PUT"]),
            Route(
                "/control/v1/owner",
                self.endpoint(lambda request, data: self.own(request.method, data)),
                methods=["PUT", "DELETE"],
            ),
            Route("/control/v1/loads", self.endpoint(lambda _, data: self.declare(data)), methods=["PUT"]),
            Route("/control/v1/versions", self.endpoint(self.version), methods=["POST", "DELETE"]),
            Route("/control/v1/replicas", self.endpoint(lambda _, data: self.replicas()), methods=["GET"]),
            Route("/control/v1/rollout", self.endpoint(lambda _, data: self.roll_out(data)), methods=["PUT"]),
            Route("/control/v1/rollout/decision", self.endpoint(lambda _, data: self.decide(data)), methods=["POST"]),
            Route("/v2/models/{model}/generate", self.generate, methods=["POST"]),
            Route("/v2/models/{model}/generate_stream", self.generate, methods=["POST"]),
        ]
        guard = Middleware(Guard, routes=routes, metrics=gateway.metrics, max_in_flight=0)
        return Starlette(
            routes=routes,
            middleware=[guard],
            exception_handlers={HTTPException: self.not_routed},
            lifespan=gateway.lifespan if lifespan else None,
        )
