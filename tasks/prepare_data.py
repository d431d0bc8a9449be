"""prepare_data: read, validate, clean, split and fingerprint the dataset the train stage learns from.

SFT records are normalised to OpenAI-style messages (tasks/data/records.py); preference pairs and KTO's rated answers
(train.stage dpo, kto) are read as tasks/data/preferences.py says. Either is written in LlamaFactory's sharegpt layout
with a `dataset_info.json` (tasks/data/splits.py), so training reads exactly what was validated here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tasks.data.preferences import (
    PreferenceData,
    PreferenceKind,
    describe_kind,
    read_preferences,
    write_preference_dataset,
)
from tasks.data.records import (
    CleanData,
    SourceFile,
    clean_and_split,
    read_data,
    read_exams,
    read_source,
    source_digest,
)
from tasks.data.splits import load_split, require_samples, write_dataset
from tasks.platform.config import DataSection, EvaluateSection, TrainSection
from tasks.platform.errors import BadInput
from tasks.platform.stage_cache import RunContext, StageMetrics, StageResult, logger, run_cached


@dataclass
class DatasetMetrics(StageMetrics):
    """What was read, dropped and split, and the fingerprints the run and the registry are tagged with."""

    STAGES = ("prepare_data",)

    records_read: int
    duplicates_dropped: int
    empty_answers_dropped: int
    records: int
    train_records: int
    eval_records: int
    fingerprint: str
    eval_records_read: int | None = None  # with data.eval_source: the held-out set's records ...
    eval_overlap_dropped: int | None = None  # ... and the training records dropped for being in it
    eval_fingerprint: str | None = None
    harvested_records: int | None = None  # records the flywheel harvested from served traffic (gate.approval)
    harvested_with_history: int | None = None  # ... of which a client wrote earlier assistant turns (mask_history)
    eval_split: str | None = None  # where the eval split came from: "hash split of qa.jsonl" (a tag, not a metric)
    preference: str | None = None  # train.stage dpo/kto: "pairs" or "kto" (a tag)
    prompts: int | None = None  # ... the distinct prompts, which the split keeps whole
    harvested_held_out: int | None = None  # ... harvested pairs left out: their prompt hashed into the eval split

    @classmethod
    def of_data(cls, data: CleanData) -> DatasetMetrics:
        return cls(
            **data.stats,
            fingerprint=data.fingerprint,
            eval_fingerprint=data.eval_fingerprint or None,
            eval_split=data.eval_split,
        )

    @classmethod
    def of_preferences(cls, data: PreferenceData, names: str) -> DatasetMetrics:
        return cls(
            records_read=data.read,
            duplicates_dropped=data.duplicates,
            empty_answers_dropped=0,  # an empty answer is refused, naming its line
            records=len(data.train) + len(data.eval),
            train_records=len(data.train),
            eval_records=len(data.eval),
            fingerprint=data.fingerprint,
            eval_split=f"hash split of {names} by prompt",
            preference=data.kind,
            prompts=data.prompts,
            # the flywheel's pairs: a release trained on them waits for a person as an SFT one does (gate.approval)
            harvested_records=sum(r.harvested for r in data.train) or None,
            harvested_held_out=data.harvested_held_out or None,
        )

    def headline(self) -> str:
        origin = f" ({self.eval_split})" if self.eval_split else ""
        kind = f" {'pairs' if self.preference == 'pairs' else 'rated answers'}" if self.preference else ""
        return f"{self.train_records} train / {self.eval_records} eval{kind}{origin}"


def preference_data(files: list[SourceFile], cfg: DataSection, stage: str) -> PreferenceData:
    """The preference records train.stage `stage` learns from: pairs for dpo, rated answers for kto."""
    data = read_preferences(files, cfg)
    wanted: PreferenceKind = "pairs" if stage == "dpo" else "kto"
    if data.kind != wanted:
        raise BadInput(
            f"data {cfg.source}: train.stage {stage} learns from {describe_kind(wanted)} records; these are "
            f"{describe_kind(data.kind)} records"
        )
    return data


def read_dataset(cfg: DataSection, stage: str) -> DatasetMetrics:
    """What prepare_data would report of this data, read and validated here (`llmops run` checks local data first)."""
    if stage == "sft":
        return DatasetMetrics.of_data(read_data(cfg))
    files = read_source(cfg.source)
    return DatasetMetrics.of_preferences(preference_data(files, cfg, stage), ", ".join(f.name for f in files))


def prepare_data(ctx: RunContext) -> StageResult:
    cfg = ctx.profile.data
    files = read_source(cfg.source)
    eval_files, harvest_eval_files = read_exams(cfg)

    stage = ctx.profile.train.stage

    def produce(out_dir: Path) -> dict:
        if stage != "sft":
            preferences = preference_data(files, cfg, stage)
            write_preference_dataset(preferences, out_dir)
            metrics = DatasetMetrics.of_preferences(preferences, ", ".join(f.name for f in files))
            harvested = (
                f", {metrics.harvested_records or 0} of them harvested from served traffic (train only; "
                f"{metrics.harvested_held_out or 0} left out, their prompt in the eval split)"
                if metrics.harvested_records or metrics.harvested_held_out
                else ""
            )
            logger().info(
                f"prepare_data: {metrics.records_read} read, {metrics.duplicates_dropped} duplicates dropped, "
                f"{metrics.prompts} prompts, {metrics.headline()}{harvested}"
            )
            return metrics.as_mlflow()
        data = clean_and_split(files, cfg, eval_files, harvest_eval_files)
        refuse_unmasked_history(DatasetMetrics.of_data(data), ctx.profile.train, cfg.source)  # before writing
        write_dataset(data, out_dir)
        metrics = DatasetMetrics.of_data(data)
        logger().info(
            f"prepare_data: {metrics.records_read} read, {metrics.duplicates_dropped} duplicates and "
            f"{metrics.empty_answers_dropped} empty answers dropped, {metrics.headline()}"
        )
        return metrics.as_mlflow()

    result = run_cached(
        ctx,
        "prepare_data",
        {
            "source": source_digest(files),
            "eval_source": source_digest(eval_files) if eval_files else None,
            "harvest_eval_source": source_digest(harvest_eval_files) if harvest_eval_files else None,
            "config": cfg.model_dump(exclude={"source", "eval_source", "harvest_eval_source"}),
            # an SFT key as before: the caches stay; a preference result made before harvested pairs were counted
            # (which gate.approval reads) is made again
            **({"preference": stage, "harvested_counted": True} if stage != "sft" else {}),
        },
        produce,
        headline=lambda m: DatasetMetrics.from_mlflow(m).headline(),
    )
    dataset = DatasetMetrics.of(result)
    refuse_unmasked_history(dataset, ctx.profile.train, cfg.source)  # a cache hit made under another train section
    if dataset.harvested_records:
        ctx.tracker.set_tags({"data.harvested_records": str(dataset.harvested_records)})
    if dataset.eval_split:
        ctx.tracker.set_tags({"data.eval_split": dataset.eval_split})
    refuse_too_few_samples(dataset, ctx.profile.evaluate)
    log_dataset_input(ctx, ctx.store.fetch(result.artifact.digest), cfg.source, dataset.fingerprint)
    if dataset.eval_fingerprint:
        exam = cfg.curated_exam
        ctx.tracker.set_tags({"data.eval_fingerprint": dataset.eval_fingerprint, "data.eval_source": exam})
    return result


def refuse_too_few_samples(dataset: DatasetMetrics, cfg: EvaluateSection) -> None:
    """Refused before training rather than by evaluate after it: the split's size is known here. The refusal names
    where the split came from and whether evaluate.max_samples cut it."""
    named = "the eval split" + (f" ({dataset.eval_split})" if dataset.eval_split else "")
    if cfg.max_samples < dataset.eval_records:
        advice = f"raise evaluate.max_samples (the split holds {dataset.eval_records})"
        require_samples(cfg.max_samples, cfg, "prepare_data", f"{named} cut to evaluate.max_samples", advice)
    require_samples(dataset.eval_records, cfg, "prepare_data", named)


def refuse_unmasked_history(dataset: DatasetMetrics, train: TrainSection, source: str) -> None:
    """Harvested records whose earlier assistant turns a client wrote train only with those turns masked:
    LlamaFactory labels every assistant turn of a record unless mask_history (its data/processor/supervised.py,
    SupervisedDatasetProcessor._encode_data_example, 0.9.5: `if self.data_args.mask_history and turn_idx != 0:
    target_label = [IGNORE_INDEX] * target_len`). A system turn never is a label (template.py, Template._encode:
    the system text joins the first prompt, whose labels are IGNORE_INDEX)."""
    if dataset.harvested_with_history and not train.mask_history:
        raise BadInput(
            f"data {source}: {dataset.harvested_with_history} harvested records hold assistant turns a client wrote "
            "before the answer, which training would learn: set train.mask_history true (train on the last answer "
            "only) or drop them"
        )


def log_dataset_input(ctx: RunContext, folder: Path, source: str, fingerprint: str) -> None:
    """Record both splits as MLflow dataset inputs of the run (mlflow.data), with their counts."""
    import pandas as pd
    from mlflow.data.pandas_dataset import from_pandas
    from mlflow.entities import DatasetInput, InputTag

    inputs = []
    for split in ("train", "eval"):
        rows = load_split(folder, split)
        frame = pd.DataFrame({"messages": [json.dumps(m, ensure_ascii=False) for m in rows]})
        dataset = from_pandas(frame, source=source, name=f"sft-{split}", digest=fingerprint[:16])
        inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", split)]))
    ctx.tracker.client.log_inputs(ctx.tracker.run_id, datasets=inputs)
    ctx.tracker.set_tags({"data.fingerprint": fingerprint, "data.source": source})
