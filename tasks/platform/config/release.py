"""Profile sections that decide a release: the canary's traffic steps, the benchmark load, the gate's
thresholds and the registered model's name."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.platform.config.base import FILE_ONLY, TRUST_ONLY, Section, TritonName


class CanarySection(Section):
    """Traffic steps of the rollout; each step is watched for `window_s` before the next."""

    steps: list[int] = Field(
        [10, 50, 100], description="Percentages of the service's traffic on the candidate, rising, ending at 100."
    )
    window_s: float = Field(3.0, gt=0, description="Seconds each step is watched before the next.")
    probe_concurrency: int = Field(
        4, ge=1, description="Concurrent probe requests sent through the gateway (the service's name) per step."
    )
    max_error_rate: float = Field(
        0.0, ge=0, le=1, description="Largest share of failed requests in a window (client side and the candidate's)."
    )
    max_mean_latency_ms: float = Field(
        2000, gt=0, description="Largest mean latency of the candidate's requests in a window, in milliseconds."
    )
    prometheus_url: str | None = Field(
        None,
        description="A Prometheus that scrapes the service's gateway (infra/monitoring/prometheus.yml): the "
        "candidate's requests, failures and latency (llmops_gateway_version_*) are read from it instead of from the "
        "gateway's /metrics directly.",
    )
    lease_s: float = Field(
        15,
        gt=0,
        description="The liveness lease of a running release: how long its ownership of the service (the serving "
        "lock) and its hold on the routes (its candidate, a step) last without renewal; it renews both every third "
        "of this. A release that dies or hangs stops renewing, and within this (plus the gateway's half-second check) "
        "the gateway of `llmops serve` serves the champion alone and its reconciler unloads the candidate; the next "
        "release may take the service over. Seconds, as a Kubernetes lease's 15 (renewed every 5): a release SIGKILLed "
        "at a 10% step kept 25 requests a second on its candidate for the 600 s lease it had before.",
    )
    hold_s: float = Field(
        600,
        gt=0,
        description="A hold on purpose, apart from the liveness lease: a release suspended for a person's approval "
        "(no process renews anything) owns the service for gate.approval_timeout_s plus this, its candidate at no "
        "live share.",
    )
    shadow_s: float = Field(
        0,
        ge=0,
        description="Before the benchmark and the first live step: seconds during which `llmops serve`'s gateway "
        "copies the service's answered requests to the candidate, whose answers reach no client; the gate compares "
        "them with the champion's. 0: no shadow.",
    )
    shadow_fraction: float = Field(
        1.0, gt=0, le=1, description="Share of the answered requests copied to the candidate during the shadow window."
    )
    shadow_min_requests: int = Field(
        20,
        ge=1,
        description="Fewer copies than this answered in the window (too little live traffic): the shadow checks "
        "are inconclusive, a reject that says so.",
    )

    @model_validator(mode="after")
    def _steps_rise_to_100(self) -> CanarySection:
        if (
            not self.steps
            or any(not 0 < s <= 100 for s in self.steps)
            or self.steps != sorted(self.steps)
            or self.steps[-1] != 100
        ):
            raise ValueError("steps must be rising percentages in (0, 100] ending at 100")
        return self


class BenchSection(Section):
    """The benchmark's load (genai-perf or AIPerf), the same for champion and candidate. With a champion, the
    highest concurrency is measured in interleaved rounds (champion, candidate, then candidate, champion, ...)
    and the gate reads the interval of the candidate/champion ratio over the rounds."""

    tool: Literal["genai-perf", "aiperf"] = Field(
        "genai-perf",
        description="The load generator. genai-perf: one run per measurement, over Triton's gRPC stream. aiperf "
        "(NVIDIA's successor to genai-perf): bench.profile_runs runs per measurement over Triton's HTTP stream, "
        "with goodput under the latency objectives (gate.p99_time_to_first_token_ms, "
        "tune.inter_token_latency_ms) and its own confidence intervals, which the gate's own checks then use.",
    )
    profile_runs: int = Field(
        3,
        ge=3,
        description="aiperf: profile runs per model and measurement (--num-profile-runs); in the comparison with the "
        "champion, paired single runs per model and round, each pair one sample of the gate's intervals (at least 3).",
    )
    aiperf_environment: str | None = Field(
        None,
        description="The venv holding aiperf (its pins collide with the orchestrator's); null: the repository's "
        ".venv-aiperf, built by `make setup-aiperf` (infra/local/setup-aiperf.sh).",
        json_schema_extra=FILE_ONLY,
    )
    concurrency: list[int] = Field(
        [1, 4], description="Concurrency levels, one genai-perf run each (the highest: one per round)."
    )
    input_tokens: int = Field(16, ge=1, description="Tokens of each synthetic prompt (the model's own tokenizer).")
    output_tokens: int = Field(8, ge=1, description="Tokens each request generates, exactly.")
    request_count: int = Field(
        128, ge=1, description="Measured requests per genai-perf run (32 on cpu-tiny is 0.1 s of load: mostly noise)."
    )
    warmup_request_count: int = Field(4, ge=0, description="Requests sent before measuring, per genai-perf run.")
    rounds: int = Field(
        4,
        ge=1,
        description="Interleaved rounds at the highest concurrency when a champion serves; each pairs one "
        "measurement of each model, in alternating order, so drift of the machine hits both. One round gives "
        "no interval: a ratio check on it is inconclusive.",
    )
    max_rounds: int = Field(
        8,
        ge=1,
        description="While a gate check decided on an interval straddles its threshold (the candidate/champion "
        "ratios; with AIPerf also the candidate's own p99s and rate), more rounds up to this many; still undecided, "
        "the check is inconclusive and the gate rejects.",
    )
    confidence: float = Field(0.9, gt=0, lt=1, description="Two-sided confidence of the ratios' intervals.")

    @model_validator(mode="after")
    def _concurrency_positive(self) -> BenchSection:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency must list levels >= 1")
        if self.max_rounds < self.rounds:
            raise ValueError(f"max_rounds ({self.max_rounds}) must be at least rounds ({self.rounds})")
        return self


class GateSection(Section):
    """Promotion thresholds; read by the benchmark gate. A null threshold is not checked."""

    p99_request_latency_ms: float | None = Field(
        None, gt=0, description="Largest P99 request latency of the candidate, in milliseconds."
    )
    p99_time_to_first_token_ms: float | None = Field(
        None, gt=0, description="Largest P99 time to first token of the candidate, in milliseconds."
    )
    max_error_rate: float = Field(0.0, ge=0, le=1, description="Largest share of failed benchmark requests.")
    min_requests_per_s: float | None = Field(
        None, gt=0, description="Absolute request rate at the highest bench concurrency (e.g. a 120 QPS target)."
    )
    min_throughput_ratio: float | None = Field(
        None,
        gt=0,
        description="Smallest candidate/champion throughput ratio at the highest bench concurrency, on its interval "
        "over the rounds: passes when the lower bound clears it (with a champion only).",
    )
    max_latency_ratio: float | None = Field(
        None,
        gt=0,
        description="Largest candidate/champion P99 request latency ratio at the highest bench concurrency, on its "
        "interval over the rounds: passes when the upper bound is within it (with a champion only).",
    )
    min_goodput_ratio: float | None = Field(
        None,
        gt=0,
        description="Smallest candidate/champion goodput ratio (requests/s meeting the latency objectives) at the "
        "highest bench concurrency, on its interval over the runs: passes when the lower bound clears it (with a "
        "champion and latency objectives only).",
    )
    max_task_metric_drop: float = Field(
        0.02,
        ge=0,
        description="On evaluate.metric: how much worse than the champion the candidate may score (served scores).",
    )
    max_serving_parity_drop: float = Field(
        0.05,
        ge=0,
        description="On evaluate.metric: how much worse the served candidate may score than the same model offline "
        "(a chat template, tokenizer or stop-token mismatch shows here).",
    )
    quality_on_interval: bool = Field(
        False,
        description="The task-metric drop vs the champion, the serving parity drop and the judge's drop decide on "
        "their paired interval's upper bound (at evaluate.confidence) instead of their point value. Strict on a small "
        "eval split: an equally good retrain that differs from the champion on two of 45 exact-match answers has an "
        "upper bound near 0.07. evaluate's improvement over the base decides on its interval either way.",
    )
    max_quantization_accuracy_drop: float = Field(
        0.05, ge=0, description="Largest task-metric drop from quantization, where the quantized artifact serves."
    )
    max_judge_drop: float = Field(
        0.05,
        ge=0,
        description="With evaluate.judge: how much lower than the champion's the candidate's judge score (0..1) may "
        "be, on its paired interval where gate.quality_on_interval is set.",
    )
    min_judge_score: float | None = Field(
        None, ge=0, le=1, description="With evaluate.judge: the smallest mean judge score (0..1) of the candidate."
    )
    min_win_rate: float = Field(
        0.5,
        ge=0,
        le=1,
        description="With evaluate.judge.pairwise: the candidate's smallest win rate over the champion (the base "
        "model on a first release), a tie counting a half, on its bootstrap interval's lower bound at "
        "evaluate.confidence (the point value without one). 0.5: the candidate surely at least as good (its wins "
        "and ties outweigh its losses on the whole interval); lower allows a margin (0.4: it may lose a little more "
        "often than it wins).",
    )
    min_shadow_agreement: float | None = Field(
        None,
        ge=0,
        le=1,
        description="With canary.shadow_s: smallest mean score (evaluate.metric) of the candidate's answers against "
        "the champion's on the copied greedy requests, decided on its interval (a fine-tune that should change "
        "answers needs a low value or none).",
    )
    approval: Literal["none", "harvested", "required"] = Field(
        "harvested",
        description="required: after the automatic checks pass, the release waits for a person to approve or reject "
        "it (the run's Resume form in the Prefect UI, or `llmops approve|reject RUN_ID --reason ...`). harvested: "
        "so does a release whose training data holds records harvested from served traffic (the flywheel); none: "
        "no release waits. An override or run parameter may raise it, never lower it.",
    )
    approval_timeout_s: float = Field(
        86400,
        gt=0,
        description="With approval required: no decision within this many seconds rejects the candidate. The waiting "
        "run owns the service until then: another release of the model fails at once, naming it, instead of "
        "queueing. A run of a Prefect deployment waits suspended (no process): at this timeout `llmops serve` "
        "rejects it on its behalf and it rolls back (with no serve, Prefect fails it 10 minutes later); `llmops run` "
        "waits in its process.",
    )
    allowed_signers: str | None = Field(
        None,
        description='An OpenSSH allowed-signers file (ssh-keygen(1): `principal namespaces="llmops-approval" '
        "key-type key`; relative to the profile file): a decision on a release or a harvest counts only when its "
        "principal signed it (`llmops approve --key`), bound to the run, the model, the version and the artifact's "
        "sha256; any other decision is refused and the run goes on waiting. null: decisions are unsigned records "
        "(`approval.verified` false).",
        json_schema_extra=TRUST_ONLY,
    )
    separate_duties: bool = Field(
        False,
        description="The principal who started a run may not decide it (needs allowed_signers).",
        json_schema_extra=TRUST_ONLY,
    )

    @model_validator(mode="after")
    def _duties_need_signatures(self) -> GateSection:
        if self.separate_duties and self.allowed_signers is None:
            raise ValueError("separate_duties needs allowed_signers: an unsigned decision names whoever it claims")
        return self


class RegistrySection(Section):
    """The MLflow registered model a release adds a version to; also the Triton service's name."""

    model_name: TritonName = Field(
        min_length=1,
        description="MLflow registered model and Triton service name (its versions serve as NAME-vN): letters, "
        "digits, '-', '_' or '.', starting with a letter or digit.",
    )


class TuneSection(Section):
    """tune_serving: before the benchmark, a search over the candidate's serving settings on the Triton it will
    serve on (Optuna's TPE sampler; the profile's own settings are the first trial), maximizing goodput: the
    requests per second that meet gate.p99_time_to_first_token_ms and inter_token_latency_ms, at the benchmark's
    highest concurrency and request shape. The best settings become the candidate's serving settings (the
    benchmark, the gate, the canary and the registered version's serve.model_settings). What is searched depends on
    serve.backend (`space`): python: serve.max_batch_size, max_queue_delay_us and instance_count; vllm:
    serve.max_batch_size (vLLM's max_num_seqs); llmapi: engine.max_batch_size and engine.max_num_tokens (the
    LLM's)."""

    enabled: bool = Field(False, description="Search the candidate's serving settings before the benchmark.")
    trials: int = Field(8, ge=1, description="Most settings tried, the profile's own first.")
    budget_s: float = Field(
        600, gt=0, description="Seconds the search may take; it stops after the trial running then."
    )
    seed: int = Field(0, description="The sampler's seed: the same model, space and seed try the same settings.")
    min_gain: float = Field(
        0.05, ge=0, description="Share of goodput the best settings must win over the profile's to be adopted."
    )
    confirm_rounds: int = Field(
        2,
        ge=1,
        description="Rounds in which the search's best and the profile's settings are measured again, alternately, "
        "before the best is adopted (one run each per round).",
    )
    inter_token_latency_ms: float | None = Field(
        None, gt=0, description="Goodput's inter-token latency objective per request (null: none)."
    )
    max_batch_size: list[int] = Field(
        [1, 2, 4, 8, 16],
        min_length=1,
        description="Values of serve.max_batch_size (python, vllm: vLLM's max_num_seqs) or engine.max_batch_size "
        "(llmapi).",
    )
    max_queue_delay_us: list[int] = Field(
        [0, 1000, 2000, 5000, 10000, 20000], min_length=1, description="Values of serve.max_queue_delay_us (python)."
    )
    instance_count: list[int] = Field(
        [1], min_length=1, description="Values of serve.instance_count (python); the profile's own is always tried."
    )
    max_num_tokens: list[int] = Field(
        [2048, 4096, 8192, 16384],
        min_length=1,
        description="Values of engine.max_num_tokens (llmapi); those below train.cutoff_len without "
        "engine.enable_chunked_prefill are trials that fail.",
    )

    def space(self, backend: str) -> dict[str, list[int]]:
        """The settings searched for serve.backend `backend` and their values: serve.* names, engine.* dotted."""
        batch = sorted(set(self.max_batch_size))
        if backend == "vllm":  # one engine batches continuously: Triton's batcher and instances do not apply
            return {"max_batch_size": batch}
        if backend == "llmapi":  # the LLM batches in flight; Triton's max_batch_size only bounds what it is handed
            return {"engine.max_batch_size": batch, "engine.max_num_tokens": sorted(set(self.max_num_tokens))}
        return {
            "max_batch_size": batch,
            "max_queue_delay_us": sorted(set(self.max_queue_delay_us)),
            "instance_count": sorted(set(self.instance_count)),
        }
