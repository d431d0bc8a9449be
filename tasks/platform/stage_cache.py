"""What every stage shares: the content cache, the run context, and the thin Prefect task.

Why not Prefect's own result cache: Prefect keeps its cache record in its result storage and
cannot know that an artifact was deleted from the bucket or corrupted since. Here the record
lives in the artifact store next to the objects it names, and a hit is taken only when every
object it names still exists there at its recorded size (content is verified again on read).
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import logging
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import ClassVar, Self

from tasks.platform.config import Profile, sha256_json
from tasks.platform.disk import disk_full, is_disk_full, needed_bytes, require_room
from tasks.platform.errors import ArtifactMissing, CheckFailed, TransientError, is_transient
from tasks.platform.project import PROJECT_ROOT
from tasks.platform.store import Artifact, ArtifactStore, outlast_outage
from tasks.platform.tracking import Tracker


@dataclass
class RunContext:
    """What a stage needs besides its inputs: where to write, where to log."""

    profile: Profile
    store: ArtifactStore
    tracker: Tracker
    home: Path
    # Set where a stage ran elsewhere (a remote stage's flow run): here its result may only be read.
    cache_only: bool = False

    def work_dir(self, stage: str, key: str) -> Path:
        path = self.home / "work" / stage / key[:16]
        return path


@dataclass
class StageResult:
    """A stage's artifact and metrics. `metrics` is the flat dict the stage record stores and MLflow
    gets; each stage reads another's through that stage's typed view (`QuantizeMetrics.of(result)`)."""

    stage: str
    artifact: Artifact
    metrics: dict = field(default_factory=dict)
    cached: bool = False
    seconds: float = 0.0
    key: str = ""
    headline: str = ""

    def as_dict(self) -> dict:
        return {**asdict(self), "artifact": self.artifact.as_dict()}

    @classmethod
    def from_dict(cls, value: dict) -> StageResult:
        return cls(**{**value, "artifact": Artifact(**value["artifact"])})


@dataclass
class StageMetrics:
    """Base of a stage's metrics dataclass: flattened for MLflow and the stage record (`as_mlflow`), read
    back from a StageResult (`of`). Fields that are None (not measured on this path) are left out."""

    STAGES: ClassVar[tuple[str, ...]]  # the stages whose results these metrics describe

    def as_mlflow(self) -> dict[str, float | str]:
        return {name: value for name, value in asdict(self).items() if value is not None}

    @classmethod
    def from_mlflow(cls, values: dict) -> Self:
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})

    @classmethod
    def of(cls, result: StageResult) -> Self:
        if result.stage not in cls.STAGES:
            raise ValueError(f"{cls.__name__}: describes a result of {' or '.join(cls.STAGES)}, not of {result.stage}")
        return cls.from_mlflow(result.metrics)


def logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a flow/task (terminal + Prefect UI), a plain logger elsewhere."""
    try:
        from prefect import get_run_logger

        return get_run_logger()
    except Exception:
        return logging.getLogger("llmops")


PROJECT_PACKAGES = ("tasks", "flows")
# What a module renders, by module name: the folder joins the code version of every stage whose closure has
# that module. A name, not the module object: importing the module here would put it (and its templates) in
# every stage's closure. template_dir fails every code version while a name names no project module.
TEMPLATE_DIRS = {"tasks.serving.repository": PROJECT_ROOT / "infra" / "triton"}


def project_file(module: str) -> Path:
    path = module_file(module)
    if path is None:
        raise ValueError(f"{module}: not a module of this project")
    return path


def module_file(module: str) -> Path | None:
    """The source file of a project module (tasks.prepare_data -> tasks/prepare_data.py), or None when `module` is not one."""
    base = PROJECT_ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if module.split(".")[0] in PROJECT_PACKAGES and path.is_file():
            return path
    return None


def project_imports(module: str) -> set[str]:
    """The project modules `module` imports anywhere in its source (lazy imports inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(project_file(module).read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from tasks import metrics` names a module; `from tasks.prepare_data import load_split` a module's member
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if module_file(name) is not None}
    return found


def template_dir(module: str) -> Path | None:
    """The template folder `module` renders, None when it renders none. Every entry of TEMPLATE_DIRS is checked
    first: a moved module or folder would otherwise drop its templates from the code versions silently."""
    for name, folder in TEMPLATE_DIRS.items():
        if module_file(name) is None:
            raise ValueError(f"TEMPLATE_DIRS: {name} is not a module of this project (moved? update the key)")
        if not folder.is_dir():
            raise ValueError(f"TEMPLATE_DIRS: {name} renders {folder}, which is not a folder")
    return TEMPLATE_DIRS.get(module)


def module_closure(module: str) -> list[str]:
    """`module` and every project module it imports, transitively, sorted."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += project_imports(name) - seen
    return sorted(seen)


@cache
def module_code_version(module: str) -> str:
    """sha256 over the source of `module`, of every project module it imports (transitively), and of the
    templates those modules render: editing a helper a stage uses reruns that stage, and only the stages that use it."""
    digest = hashlib.sha256()
    for name in module_closure(module):
        digest.update(name.encode() + b"\0" + project_file(name).read_bytes())
        templates = template_dir(name)
        if templates is None:
            continue
        for path in sorted(templates.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(templates)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def code_version(func: Callable) -> str:
    """The code version of the stage that `func` belongs to (its module's, see module_code_version)."""
    if module_file(func.__module__) is None:  # a stage written outside the project (a test's): its own source
        return hashlib.sha256(inspect.getsource(sys.modules[func.__module__]).encode()).hexdigest()
    return module_code_version(func.__module__)


def run_cached(
    ctx: RunContext,
    stage: str,
    key_inputs: dict,
    produce: Callable[[Path], dict],
    headline: Callable[[dict], str] = lambda m: "",
) -> StageResult:
    """Return the stored result for `key_inputs`, or run `produce(out_dir) -> metrics` and store it."""
    key = sha256_json({"stage": stage, "code": code_version(produce), **key_inputs})
    log = logger()
    started = time.monotonic()
    record = ctx.store.get_record(f"stages/{stage}", key)
    if record is not None:
        if ctx.store.exists(record["artifact"]["digest"]):
            metrics = record["metrics"]
            ctx.tracker.log_metrics(stage, metrics)
            log.info(f"{stage}: cache hit {key[:12]} -> {record['artifact']['uri']}")
            return StageResult(
                stage, Artifact(**record["artifact"]), metrics, True, time.monotonic() - started, key, headline(metrics)
            )
        log.warning(f"{stage}: cached artifact {record['artifact']['digest'][:12]} is gone from the store; rerunning")
    if ctx.cache_only:
        raise ArtifactMissing(
            f"{stage}: ran on its deployment but its result (key {key[:12]}) is not in the artifact "
            f"store {ctx.store.uri}; the work pool's machines must use the same store (s3://)"
        )

    out_dir = ctx.work_dir(stage, key) / "output"
    needed = room_needed(ctx, stage, key_inputs)
    written_to = [ctx.home / "work", *ctx.store.local_folders()]
    require_room(stage, written_to, needed)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    log.info(f"{stage}: running (key {key[:12]})")

    def store_result() -> Artifact:
        artifact = ctx.store.put_dir(out_dir)
        ctx.store.put_record(f"stages/{stage}", key, {"artifact": artifact.as_dict(), "metrics": metrics})
        return artifact

    try:
        metrics = produce(out_dir)
        # The work is done: a store that is briefly away is waited for rather than failing the stage.
        artifact = outlast_outage(
            f"{stage}: storing the result", store_result, ctx.profile.run.storage_outage_s, log.warning
        )
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        shutil.rmtree(out_dir, ignore_errors=True)  # no partial output is kept (the store cleans its own staging)
        raise disk_full(stage, exc, written_to, needed) from None
    ctx.tracker.log_metrics(stage, metrics)
    seconds = time.monotonic() - started
    log.info(f"{stage}: done in {seconds:.1f}s -> {artifact.uri}")
    return StageResult(stage, artifact, metrics, False, seconds, key, headline(metrics))


def room_needed(ctx: RunContext, stage: str, key_inputs: dict) -> int:
    """What `stage` will write, from the largest store object among its inputs (the key's digests)."""
    sizes = [
        ctx.store.size(value) or 0
        for value in key_inputs.values()
        if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    ]
    full = stage == "train" and ctx.profile.train.finetuning_type == "full"
    return needed_bytes(stage, max(sizes, default=0), full)


def retry_if_transient(task, task_run, state) -> bool:
    """Prefect retry condition: retry network/server faults, never bad input or a failed check."""
    return is_transient(state.data)


def stage_task(fn: Callable, profile: Profile):
    """The thin Prefect task around a stage function: named, retried on transient faults only.
    A stage the profile places on a deployment (`run.remote_stages`) runs there instead."""
    from prefect import task
    from prefect.cache_policies import NO_CACHE
    from prefect.tasks import exponential_backoff

    deployment = next((d for stage, d in profile.run.remote_stages.items() if stage == fn.__name__), None)
    return task(
        name=fn.__name__,
        retries=profile.run.retries,
        retry_delay_seconds=exponential_backoff(profile.run.retry_delay_s),
        retry_jitter_factor=0.5,  # releases that failed together do not all retry at the same moment
        retry_condition_fn=retry_if_transient,
        cache_policy=NO_CACHE,
        persist_result=False,
    )(on_deployment(fn, deployment) if deployment else fn)


def job_variables(profile: Profile, stage: str | None = None) -> dict:
    """Job variables of the GPU pool's Kubernetes template (infra/work-pools/kubernetes-gpu.json) for one
    stage: its own image where the profile names one (`hardware.kubernetes.stage_images`)."""
    k8s = profile.hardware.kubernetes
    images: dict[str, str] = {str(name): image for name, image in k8s.stage_images.items()}
    image = images.get(stage, k8s.image) if stage else k8s.image
    if profile.hardware.accelerator != "cuda" or image is None:
        return {}
    values = {
        "image": image,
        "namespace": k8s.namespace,
        "gpu_count": profile.hardware.gpus,
        "node_selector": k8s.node_selector,
        "tolerations": k8s.tolerations,
    }
    values.update({k: v for k, v in (("cpu_request", k8s.cpu_request), ("memory_request", k8s.memory_request)) if v})
    return values


def on_deployment(fn: Callable, deployment: str) -> Callable:
    """Run stage `fn` as a flow run of `deployment` (flows/remote_stage.py, e.g. on the GPU work pool)
    and wait for it; then read its result from the shared artifact store. Prefect places and runs
    it: this process holds no GPU while the stage runs."""

    def dispatch(ctx: RunContext, *inputs: StageResult) -> StageResult:
        from prefect.client.schemas.objects import FlowRun
        from prefect.deployments import run_deployment

        logger().info(f"{fn.__name__}: running on deployment {deployment}")
        run: FlowRun = run_deployment(  # type: ignore[assignment]  # a sync call returns the FlowRun
            deployment,
            poll_interval=2,
            job_variables=job_variables(ctx.profile, fn.__name__) or None,
            flow_run_name=f"{fn.__name__}-{ctx.tracker.run_id[:8]}",
            parameters={
                "stage": fn.__name__,
                "profile": ctx.profile.model_dump(mode="json"),
                "artifacts": ctx.store.uri,
                "tracking_uri": ctx.tracker.tracking_uri,
                "mlflow_run_id": ctx.tracker.run_id,
                "experiment_id": ctx.tracker.experiment_id,
                "inputs": [i.as_dict() for i in inputs],
            },
        )
        state = run.state
        if state is None or not state.is_completed():
            message = (
                f"{fn.__name__} on {deployment}: flow run {run.name} ended {state.type.value if state else '?'}: "
                f"{state.message if state else ''}"
            )
            raise (TransientError if state is not None and state.is_crashed() else CheckFailed)(message)
        return fn(replace(ctx, cache_only=True), *inputs)

    dispatch.__name__ = dispatch.__qualname__ = fn.__name__
    dispatch.__doc__ = fn.__doc__
    return dispatch
