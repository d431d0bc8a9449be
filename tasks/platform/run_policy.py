"""What a flow run started through the Prefect API may name: allow-lists, which the operator sets in the worker's
environment.

Whoever reaches the Prefect API (the UI's login, a token) writes a run's parameters. A URL there receives the
worker's secrets (the Triton control key, the MLflow login, the OpenAI key), a path there is read or written by the
worker (its SSH keys, its pgpass). So every endpoint and location a run's parameters name is checked here, before
the flow reads a secret or a file, and refused with one line naming the parameter and the setting. One list per
kind of endpoint, by what it receives (issue 74, finding 2: one list for all let `tracking_uri` name the judge's
host, which then got the MLflow login):

    LLMOPS_RUN_TRITONS     Tritons' HTTP, gRPC and metrics endpoints (they get the Triton control key); the older
                           LLMOPS_TRITON_URLS counts too.
    LLMOPS_RUN_MLFLOW      MLflow servers a run may track to (they get the MLflow login).
    LLMOPS_RUN_SERVICES    services' gateways that `llmops predict` may send a dataset to (they get the API key).
    LLMOPS_RUN_JUDGES      judges' OpenAI-compatible APIs (they get the judge's key, the eval split and the answers).
    LLMOPS_RUN_METRICS     Prometheus servers a canary may read (what they answer reaches the run's log).
    LLMOPS_RUN_MODELS      comma-separated hub model ids (org/name) a run may name as base_model.source; an s3://
                           prefix or a folder there is a location (LLMOPS_RUN_LOCATIONS).
    LLMOPS_RUN_LOCATIONS   comma-separated folders and s3://bucket/prefix that a run may read data from or write to.
                           A local path is taken as it resolves (symbolic links followed), so a link planted inside
                           a listed folder reaches nothing outside it.

Each endpoint list is comma-separated URLs or host:port, compared by scheme, host and port, parsed as the HTTP client
parses them (a URL with userinfo or a backslash is refused). A URL on one list is refused for another kind, naming
the list it would need. The single LLMOPS_RUN_ENDPOINTS of before is refused with one line saying how to split it.

What the worker itself is set to (its own LLMOPS_TRITON_URL, MLFLOW_TRACKING_URI, LLMOPS_ARTIFACTS, ...) and the
project's embedded data (profiles/data) are always allowed. A run started from a terminal (`llmops run`) is its
user's own and is not checked.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

from tasks.platform.config import Profile
from tasks.platform.errors import BadInput
from tasks.platform.project import PROJECT_ROOT

OLD_ENDPOINTS_ENV = "LLMOPS_RUN_ENDPOINTS"  # one list for every kind: refused (finding 2)
TRITON_URLS_ENV = "LLMOPS_TRITON_URLS"  # the older allow-list, of Tritons only
# a kind of endpoint: (its allow-list, what it receives)
ENDPOINT_KINDS = {
    "triton": ("LLMOPS_RUN_TRITONS", "the Triton control key"),
    "mlflow": ("LLMOPS_RUN_MLFLOW", "the MLflow login"),
    "service": ("LLMOPS_RUN_SERVICES", "a service's API key and the dataset"),
    "judge": ("LLMOPS_RUN_JUDGES", "the judge's key, the eval split and the answers"),
    "metrics": ("LLMOPS_RUN_METRICS", "a read whose answer reaches the run's log"),
}
LOCATIONS_ENV = "LLMOPS_RUN_LOCATIONS"
MODELS_ENV = "LLMOPS_RUN_MODELS"  # hub model ids a run may train on
EMBEDDED_DATA = PROJECT_ROOT / "profiles" / "data"


def listed(env: str) -> list[str]:
    return [item.strip() for item in os.environ.get(env, "").split(",") if item.strip()]


Endpoint = tuple[str | None, str, int | None]  # (scheme, host, port); no scheme for a host:port (gRPC)


def endpoint(value: str) -> Endpoint:
    """(scheme, host, port) of a URL or a host:port as urllib3 parses it, the scheme's port where it names none:
    requests (MLflow's client, the Prometheus and judge reads), tritonclient's HTTP client and httpx all connect to
    the host urllib3's parser (or one that agrees with it on these forms) finds. ValueError where a client could read
    it otherwise: userinfo (`https://evil.example\\@mlflow.corp` is evil.example to urllib3, mlflow.corp to
    urllib.parse), a backslash, whitespace or a control character, or a form urllib3 writes back differently."""
    from urllib3.exceptions import LocationParseError
    from urllib3.util import parse_url

    if "\\" in value or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError("holds a backslash, whitespace or a control character")
    try:
        parsed = parse_url(value)
    except LocationParseError:
        raise ValueError("is no URL the HTTP client reads") from None
    if parsed.auth is not None:
        raise ValueError("carries a user name or password (userinfo), which a client may take for the host")
    if parsed.url.lower() != value.lower():
        raise ValueError(f"is read by the HTTP client as {parsed.url}, not as written")
    if not parsed.host:
        raise ValueError("names no host")
    scheme = parsed.scheme if "://" in value else None
    default = {"http": 80, "https": 443}.get(scheme or "")
    return scheme, parsed.host.lower(), parsed.port if parsed.port is not None else default


def same_endpoint(one: Endpoint, other: Endpoint) -> bool:
    """Scheme, host and port alike: `http://mlflow.corp:443` is not `https://mlflow.corp` (the login would go in
    clear), and a host:port (a gRPC endpoint; an HTTP client given one picks its own scheme) only a listed host:port."""
    return one == other


def listed_endpoints(values: Iterable[str]) -> list[Endpoint]:
    """The allow-list's entries as endpoints; an entry no client could read the same way admits nothing."""
    found = []
    for value in values:
        try:
            found.append(endpoint(value))
        except ValueError:
            continue
    return found


def kind_list(kind: str) -> list[str]:
    """The allow-list of endpoints of `kind` (ENDPOINT_KINDS), the older Triton list with the Tritons'."""
    if OLD_ENDPOINTS_ENV in os.environ:
        lists = ", ".join(env for env, _ in ENDPOINT_KINDS.values())
        raise BadInput(
            f"{OLD_ENDPOINTS_ENV} (in this worker's environment): one list for every kind of endpoint is no longer "
            f"read; list each endpoint by what it receives, in {lists} (docs/security.md)"
        )
    return [*listed(ENDPOINT_KINDS[kind][0]), *(listed(TRITON_URLS_ENV) if kind == "triton" else [])]


def refuse_unlisted_endpoint(parameter: str, value: str | None, kind: str, own: Iterable[str | None] = ()) -> None:
    """`value` (a run parameter's URL or host:port, an endpoint of `kind`) must be one of the worker's own settings
    or on that kind's list, compared as the client that will use it parses it."""
    if not value:
        return
    try:
        asked = endpoint(value)
    except ValueError as why:
        raise BadInput(f"{parameter} {value}: {why}; nothing was sent") from None
    allowed = [*kind_list(kind), *(o for o in own if o)]
    if any(same_endpoint(asked, entry) for entry in listed_endpoints(allowed)):
        return
    env, receives = ENDPOINT_KINDS[kind]
    elsewhere = [
        other_env
        for other, (other_env, _) in ENDPOINT_KINDS.items()
        if other != kind and any(same_endpoint(asked, entry) for entry in listed_endpoints(kind_list(other)))
    ]
    listed_for = f"; it is on {', '.join(elsewhere)}, which admits no other kind" if elsewhere else ""
    raise BadInput(
        f"{parameter} {value}: a run started through the Prefect API may send {receives} only to this worker's own "
        f"endpoints or one of {env} in its environment ({', '.join(listed(env)) or 'empty'}){listed_for}; nothing "
        "was sent"
    )


def refuse_unlisted_location(parameter: str, value: str | None, own: Iterable[str | None] = ()) -> None:
    """`value` (a run parameter's file, folder or s3:// URI) must lie inside one of the worker's own locations, the
    embedded data, or a listed one."""
    if not value:
        return
    allowed = [*listed(LOCATIONS_ENV), *(o for o in own if o), str(EMBEDDED_DATA)]
    if any(inside(value, place) for place in allowed):
        return
    raise BadInput(
        f"{parameter} {value}: a run started through the Prefect API may read and write only inside this worker's "
        f"own locations or one of {LOCATIONS_ENV} in its environment ({', '.join(listed(LOCATIONS_ENV)) or 'empty'});"
        " nothing was read or written"
    )


def inside(value: str, place: str) -> bool:
    """`value` is `place` or lies under it: s3:// URIs by bucket and key prefix at a '/' boundary, local paths as
    they resolve (links followed: one planted inside `place` that points out of it is outside)."""
    if value.startswith("s3://") or place.startswith("s3://"):
        if not (value.startswith("s3://") and place.startswith("s3://")):
            return False
        base = place.rstrip("/")
        return value.rstrip("/") == base or value.startswith(f"{base}/")
    if "://" in value or "://" in place:
        return False
    target, folder = Path(value).expanduser().resolve(), Path(place).expanduser().resolve()
    return target == folder or folder in target.parents


def refuse_unlisted_model(parameter: str, value: str) -> None:
    """A base model a run names (base_model.source, issue 74 finding 3): the release trains on its weights, and with
    gate.approval harvested by default one promotes without a person. An s3:// prefix or a folder (what copy_model
    reads with the worker's keys and rights) must lie inside LLMOPS_RUN_LOCATIONS; a hub id must be on
    LLMOPS_RUN_MODELS; the tiny model made here from the run's own data needs neither."""
    if value == "tiny-qwen2" or value.startswith("models:/"):  # a registered version: the run's own registry and store
        return
    if value.startswith(("s3://", "/", ".", "~")) or Path(value).exists():
        refuse_unlisted_location(parameter, value)
        return
    if value not in listed(MODELS_ENV):
        raise BadInput(
            f"{parameter} {value}: a run started through the Prefect API may name a hub model only from {MODELS_ENV} "
            f"in this worker's environment ({', '.join(listed(MODELS_ENV)) or 'empty'}); nothing was downloaded"
        )


def refuse_unlisted_tracking(parameter: str, value: str | None, own: str | None) -> None:
    """An MLflow tracking URI: a server is an endpoint (it gets the worker's MLflow login), a database or folder a
    location."""
    if not value or value == own:
        return
    scheme = urlsplit(value).scheme
    if scheme in ("http", "https", "databricks"):
        refuse_unlisted_endpoint(parameter, value, "mlflow", [own])
    elif scheme in ("sqlite", "file", ""):
        path = value.split("://", 1)[1] if "://" in value else value
        refuse_unlisted_location(parameter, path.removeprefix("/") if path.startswith("//") else path)
    else:
        raise BadInput(f"{parameter} {value}: a run started through the Prefect API may name an http(s) MLflow server")


def check_release_parameters(
    data_source: str | None,
    eval_data: str | None,
    tracking_uri: str | None,
    artifacts: str | None,
    triton_url: str | None,
    triton_repository: str | None,
    triton_grpc_url: str | None,
    triton_metrics_url: str | None,
) -> None:
    """A release run's parameters from the Prefect API, each against the policy, before anything is read."""
    env = os.environ.get
    refuse_unlisted_location("data_source", data_source)
    refuse_unlisted_location("eval_data", None if eval_data == "profile" else eval_data)
    refuse_unlisted_tracking("tracking_uri", tracking_uri, env("MLFLOW_TRACKING_URI"))
    refuse_unlisted_location("artifacts", artifacts, [env("LLMOPS_ARTIFACTS")])
    refuse_unlisted_endpoint("triton_url", triton_url, "triton", [env("LLMOPS_TRITON_URL")])
    refuse_unlisted_location("triton_repository", triton_repository, [env("LLMOPS_TRITON_REPOSITORY")])
    refuse_unlisted_endpoint("triton_grpc_url", triton_grpc_url, "triton", [env("LLMOPS_TRITON_GRPC_URL")])
    refuse_unlisted_endpoint("triton_metrics_url", triton_metrics_url, "triton", [env("LLMOPS_TRITON_METRICS_URL")])


# Every profile setting that names a place a run reads from or sends to, and the policy an override of it meets (a
# FILE_ONLY one no override may set at all). tests/unit/test_run_parameters.py walks the profile's schema: a text
# setting that is in neither this nor PLACELESS, nor FILE_ONLY, fails it.
OVERRIDE_POLICY: dict[str, str] = {
    "base_model.source": "model",
    "data.source": "location",
    "data.eval_source": "location",
    "data.harvest_eval_source": "location",
    "canary.prometheus_url": "metrics",
    "evaluate.judge.url": "judge",
}
# Text settings that name no place a run reads or sends to, and why.
PLACELESS: dict[str, str] = {
    "name": "the profile's name",
    "description": "prose",
    "hardware.gpu_type": "a label a pool matches",
    "hardware.kubernetes.node_selector": "labels a pod is scheduled by",
    "hardware.kubernetes.tolerations": "taints a pod tolerates",
    "hardware.kubernetes.cpu_request": "a quantity",
    "hardware.kubernetes.memory_request": "a quantity",
    "data.split_salt": "a salt",
    "train.template": "a chat template's name (LlamaFactory's)",
    "train.lora_target": "module names",
    "train.lr_scheduler_type": "a scheduler's name",
    "evaluate.judge.model": "a model's name at the judge (its URL is policed)",
    "evaluate.judge.rubric": "prose",
    "serve.listen.host": "an address `llmops serve` binds: no run starts its listeners",
    "serve.listen.control_host": "an address `llmops serve` binds: no run starts its listeners",
    "serve.listen.gateway_metrics_host": "an address `llmops serve` binds: no run starts its listeners",
    "serve.listen.triton_host": "an address `llmops serve` and `llmops triton` bind: no run starts them",
    "serve.listen.tls_cert": "read by `llmops serve`'s listeners alone, which no run starts",
    "serve.listen.tls_key": "read by `llmops serve`'s listeners alone, which no run starts",
    "serve.capture.redact": "patterns",
    "registry.model_name": "a name in the run's own registry",
    "run.remote_stages": "deployments of the same Prefect server the run was started on (an operator's)",
}


def setting(config: Profile, key: str) -> object:
    """The value at `key` (a.b.c) of `config`; None where a section on the way is unset (no judge)."""
    value: object = config
    for part in key.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def check_profile_locations(config: Profile, shipped: Profile) -> None:
    """What a run's `overrides` changed of the shipped profile's locations and endpoints, against the policy."""
    for key, policy in OVERRIDE_POLICY.items():
        value, written = setting(config, key), setting(shipped, key)
        if value == written or value is None:
            continue
        parameter = f"overrides {key}"
        if policy == "location":
            refuse_unlisted_location(parameter, str(value))
        elif policy == "model":
            refuse_unlisted_model(parameter, str(value))
        else:
            refuse_unlisted_endpoint(parameter, str(value), policy)
