"""tune_serving: the candidate's serving settings, searched on the Triton it will serve on, before the benchmark.

Each trial loads the candidate again with the trial's settings (TuneSection.space: the python backend's
max_batch_size, max_queue_delay_us and instance_count; vLLM's max_num_seqs; TensorRT-LLM's LLM API's batch and token
budgets) while the champion keeps serving every request next to it, measures it with genai-perf at
the benchmark's highest concurrency and request shape, and scores its goodput: requests per second that met the
time-to-first-token objective (gate.p99_time_to_first_token_ms) and tune.inter_token_latency_ms. Optuna's TPE
sampler picks the trials (seeded; the profile's own settings are the first), within tune.trials and tune.budget_s.
The candidate is left loaded with the best settings, which it keeps through the benchmark, the gate, the canary and
promotion (the registered version's serve.model_settings tag: the champion is later compared at its own).

Why Optuna and not Model Analyzer: Model Analyzer sweeps Triton configs with perf_analyzer and knows nothing of
goodput objectives nor of our rendered models; Optuna is already in the environment (LlamaFactory's) and is the
library the issue names. The result is cached in the store by model digest, search space, objectives, load shape,
engine and hardware: a rerun with the same model loads the tuned settings without searching again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.load.genai_perf import GenaiPerf, goodput_of
from tasks.platform.config import Profile
from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import RunContext, logger
from tasks.serving.champion import load_on_service

if TYPE_CHECKING:
    from tasks.deploy_canary import Deployment

RECORDS = "tune_serving"  # the store's record namespace of finished searches


@dataclass
class Trial:
    number: int
    settings: dict[str, int]
    goodput_per_s: float = 0.0
    requests_per_s: float = 0.0
    ttft_p99_ms: float = 0.0
    itl_p99_ms: float = 0.0
    error: str = ""


@dataclass
class Tuned:
    settings: dict[str, int]  # the candidate's serving settings now (serve.* names)
    default: Trial
    best: Trial
    trials: list[Trial] = field(default_factory=list)
    cached: bool = False

    def headline(self) -> str:
        gain = self.best.goodput_per_s / self.default.goodput_per_s if self.default.goodput_per_s else float("inf")
        source = "cached" if self.cached else f"{len(self.trials)} trials"
        return (
            f"{self.settings} ({source}): goodput {self.best.goodput_per_s:.1f}/s against "
            f"{self.default.goodput_per_s:.1f}/s at the profile's settings ({gain:.2f}x)"
        )


def cache_key(profile: Profile, artifact_sha256: str) -> str:
    """What a search's result depends on: the model, the space, the objectives, the load, the engine, the machine."""
    bench = profile.bench
    parts = {
        "model": artifact_sha256,
        "space": space(profile),
        "trials": profile.tune.trials,
        "seed": profile.tune.seed,
        "objectives": profile.goodput_objectives(),
        "load": [max(bench.concurrency), bench.input_tokens, bench.output_tokens, bench.request_count],
        "engine": [
            profile.serve.backend,
            profile.serve.torch_threads,
            version("genai-perf"),
            version("nvidia-pytriton"),
        ],
        "hardware": [profile.hardware.model_dump(mode="json"), os.cpu_count()],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def with_settings(profile: Profile, settings: dict[str, int]) -> Profile:
    """The profile serving with a trial's settings (serve.* names, engine.* dotted)."""
    return profile.with_served_settings(settings)


def space(profile: Profile) -> dict[str, list[int]]:
    """tune's values of each searched setting, and the profile's own value among them: the profile's settings are
    the first trial, and Optuna refuses a trial outside the space (cpu-tiny serves 2 instances, tune's default
    list is [1])."""
    own = defaults(profile)
    return {name: sorted({*values, own[name]}) for name, values in profile.tune.space(profile.serve.backend).items()}


def defaults(profile: Profile) -> dict[str, int]:
    """The profile's own values of the searched settings: the first trial."""
    values = {}
    for name in profile.tune.space(profile.serve.backend):
        section, _, field_name = name.rpartition(".")
        values[name] = int(getattr(profile.engine if section == "engine" else profile.serve, field_name))
    return values


def tune_serving(ctx: RunContext, deployment: Deployment) -> Tuned | None:
    """The candidate's best serving settings, loaded; None where tuning does not apply."""
    profile = ctx.profile
    key = cache_key(profile, deployment.candidate.artifact_sha256)
    recorded = ctx.store.get_record(RECORDS, key)
    if recorded is not None:
        tuned = Tuned(
            recorded["settings"],
            Trial(**recorded["default"]),
            Trial(**recorded["best"]),
            [Trial(**t) for t in recorded["trials"]],
            cached=True,
        )
    else:
        tuned = search(ctx, deployment, ctx.work_dir("tune_serving", ctx.tracker.run_id))
        ctx.store.put_record(RECORDS, key, asdict(tuned) | {"cached": False})
    load(ctx, deployment, tuned.settings)
    champion = deployment.champion
    deployment.route({champion.name: 100.0} if champion else {})  # the record's candidate with those settings
    track(ctx, tuned, deployment)
    logger().info(f"tune_serving: {tuned.headline()}")
    return tuned


def load(ctx: RunContext, deployment: Deployment, settings: dict[str, int]) -> None:
    """The candidate loaded again by the service with `settings` on every replica (the champion serves throughout);
    from then on its route carries them, so a replica that starts again serves it as measured."""
    tried = replace(deployment.candidate, settings={**(deployment.candidate.settings or {}), **settings})
    deployment.loaded = load_on_service(ctx, deployment.served, tried, fresh=True)
    deployment.candidate = tried


def search(ctx: RunContext, deployment: Deployment, out_dir: Path) -> Tuned:
    """Optuna's trials on the loaded candidate; genai-perf's runs under `out_dir`."""
    import optuna

    profile = ctx.profile
    candidate = deployment.candidate
    searched, concurrency = space(profile), max(profile.bench.concurrency)
    out_dir.mkdir(parents=True, exist_ok=True)
    grpc_url = deployment.triton.grpc_url
    if grpc_url is None:
        raise CheckFailed(f"tune_serving: Triton at {deployment.triton.url} has no gRPC endpoint for genai-perf")
    genai_perf = GenaiPerf(grpc_url, profile.bench, out_dir, goodput=profile.goodput_objectives())
    genai_perf.measure(candidate, concurrency, "-warmup")  # the prompts, and the candidate's first answers

    def measure(settings: dict[str, int], number: int, label: str) -> Trial:
        measured = Trial(number, settings)
        try:
            with_settings(profile, settings)
        except ValueError as exc:  # e.g. engine.max_num_tokens below train.cutoff_len: nothing to load
            measured.error = str(exc).splitlines()[-1][:300]
            return measured
        try:
            load(ctx, deployment, settings)
            level = genai_perf.measure(candidate, concurrency, label)
            goodput = goodput_of(out_dir / f"{candidate.name}-c{concurrency}{label}")
            measured = Trial(number, settings, goodput, level.requests_per_s, level.ttft_p99_ms, level.itl_p99_ms)
        except CheckFailed as exc:  # a setting that does not load or serve is a trial with no goodput
            measured.error = str(exc)[:300]
        return measured

    trials: list[Trial] = []

    combinations = math.prod(len(values) for values in searched.values())

    def objective(trial: optuna.Trial) -> float:
        settings = {name: int(trial.suggest_categorical(name, values)) for name, values in searched.items()}
        earlier = next((t for t in trials if t.settings == settings), None)
        if earlier is not None:  # TPE repeats itself on a small categorical space: a repeat costs no load
            logger().info(f"tune_serving: trial {trial.number} {settings}: measured as trial {earlier.number}")
            return earlier.goodput_per_s
        measured = measure(settings, trial.number, f"-trial{trial.number}")
        trials.append(measured)
        if len(trials) == combinations:  # every combination measured: nothing left to search
            trial.study.stop()
        logger().info(
            f"tune_serving: trial {trial.number} {settings}: goodput {measured.goodput_per_s:.1f}/s, "
            f"{measured.requests_per_s:.1f} req/s, TTFT p99 {measured.ttft_p99_ms:.0f} ms{measured.error and ' ' + measured.error}"
        )
        return measured.goodput_per_s

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=profile.tune.seed))
    study.enqueue_trial(defaults(profile))  # the profile's own settings: the baseline every trial is compared with
    started = time.monotonic()
    study.optimize(objective, n_trials=profile.tune.trials, timeout=profile.tune.budget_s)
    logger().info(f"tune_serving: {len(trials)} trials in {time.monotonic() - started:.0f}s")
    default, best = trials[0], max(trials, key=lambda t: t.goodput_per_s)
    if best.goodput_per_s <= default.goodput_per_s * (1 + profile.tune.min_gain):
        return Tuned(default.settings, default, default, trials)  # nothing won: the profile's settings stay
    return confirm(profile, default, best, trials, measure)


def confirm(
    profile: Profile,
    default: Trial,
    best: Trial,
    trials: list[Trial],
    measure: Callable[[dict[str, int], int, str], Trial],
) -> Tuned:
    """The search's best against the profile's settings again, in alternating rounds: the best of several noisy
    single runs is partly luck (on 2 cores one setting measured 23 and then 36 requests/s), so it is adopted only
    where the medians of the rounds still show tune.min_gain."""
    rounds: dict[str, list[float]] = {"default": [], "best": []}
    for index in range(profile.tune.confirm_rounds):
        order = ("default", "best") if index % 2 == 0 else ("best", "default")
        for which in order:
            settings = default.settings if which == "default" else best.settings
            rounds[which].append(measure(settings, -1, f"-confirm{index}-{which}").goodput_per_s)
    default_goodput, best_goodput = statistics.median(rounds["default"]), statistics.median(rounds["best"])
    won = best_goodput > default_goodput * (1 + profile.tune.min_gain)
    logger().info(
        f"tune_serving: confirmation over {profile.tune.confirm_rounds} rounds: {best.settings} {best_goodput:.1f}/s "
        f"against the profile's {default_goodput:.1f}/s: {'adopted' if won else 'not adopted (within tune.min_gain)'}"
    )
    confirmed_default = Trial(
        default.number, default.settings, default_goodput, default.requests_per_s, default.ttft_p99_ms
    )
    if not won:
        return Tuned(default.settings, confirmed_default, confirmed_default, trials)
    confirmed_best = Trial(best.number, best.settings, best_goodput, best.requests_per_s, best.ttft_p99_ms)
    return Tuned(best.settings, confirmed_default, confirmed_best, trials)


def track(ctx: RunContext, tuned: Tuned, deployment: Deployment) -> None:
    """Every trial as MLflow metrics (one step each), the table, the plot; the settings on the registered version."""
    for trial in tuned.trials:
        values = {"goodput_per_s": trial.goodput_per_s, "requests_per_s": trial.requests_per_s}
        ctx.tracker.log_metrics("tune", values | {"ttft_p99_ms": trial.ttft_p99_ms}, step=trial.number)
    ctx.tracker.log_metrics(
        "tune",
        {
            "best_goodput_per_s": tuned.best.goodput_per_s,
            "default_goodput_per_s": tuned.default.goodput_per_s,
            "best_ttft_p99_ms": tuned.best.ttft_p99_ms,
        },
    )
    ctx.tracker.set_tags({"tune.settings": json.dumps(tuned.settings), "tune.cached": str(tuned.cached).lower()})
    ctx.tracker.log_json("tune_trials.json", asdict(tuned))
    plot = plot_trials(tuned, ctx.work_dir("tune_serving", ctx.tracker.run_id) / "tune_trials.png")
    ctx.tracker.log_file(plot)
    version = ctx.tracker.client.get_model_version(ctx.profile.registry.model_name, deployment.candidate.version)
    recorded: dict[str, Any] = json.loads(version.tags.get("serve.model_settings", "{}"))
    served = ctx.profile.with_served_settings(recorded | tuned.settings).served_settings()
    capacity = measured_capacity(ctx.profile, tuned.best)
    if capacity is not None:  # serve.autoscale's default in_flight target where this version is the champion
        served["capacity"] = capacity
        ctx.tracker.log_metrics("tune", {"capacity_in_flight": capacity["in_flight"]})
    ctx.tracker.client.set_model_version_tag(
        version.name, version.version, "serve.model_settings", json.dumps(served, sort_keys=True)
    )
    publish(tuned)


def measured_capacity(profile: Profile, best: Trial) -> dict[str, float] | None:
    """What one replica was measured to hold with the chosen settings: the benchmark's highest concurrency (the
    requests in flight of genai-perf's closed loop) where its TTFT p99 met gate.p99_time_to_first_token_ms; None where
    it did not, or there is no objective (a lower concurrency was not measured, so nothing is known below it)."""
    objective = profile.gate.p99_time_to_first_token_ms
    if objective is None or best.error or best.goodput_per_s <= 0 or best.ttft_p99_ms > objective:
        return None
    return {"in_flight": float(max(profile.bench.concurrency)), "ttft_p99_ms": round(best.ttft_p99_ms, 1)}


def plot_trials(tuned: Tuned, path: Path) -> Path:
    """Goodput against TTFT p99 of every trial, the profile's settings and the chosen ones marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.scatter([t.ttft_p99_ms for t in tuned.trials], [t.goodput_per_s for t in tuned.trials], label="trials")
    for trial, label, marker in ((tuned.default, "profile's settings", "s"), (tuned.best, "chosen", "*")):
        axes.scatter([trial.ttft_p99_ms], [trial.goodput_per_s], marker=marker, s=180, label=label)
    axes.set_xlabel("TTFT p99 (ms)")
    axes.set_ylabel("goodput (requests/s meeting the objectives)")
    axes.set_title("tune_serving: the candidate's serving settings")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def publish(tuned: Tuned) -> None:
    """The top trials as a Prefect table artifact on the run (nothing outside a flow run)."""
    from prefect.artifacts import create_table_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return
    top = sorted(tuned.trials, key=lambda t: -t.goodput_per_s)[:5]
    rows = [
        {"trial": t.number, **t.settings, "goodput/s": round(t.goodput_per_s, 2), "TTFT p99 ms": round(t.ttft_p99_ms)}
        for t in top
    ]
    create_table_artifact(rows, key="tune-serving", description=tuned.headline())
