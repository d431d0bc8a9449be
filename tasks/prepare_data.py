"""prepare_data: read, validate, clean, split and fingerprint an SFT dataset.

Every record is normalised to OpenAI-style messages (tasks/data/records.py) and written in LlamaFactory's
sharegpt layout with a `dataset_info.json` (tasks/data/splits.py), so training reads exactly what was
validated here.
"""

from __future__ import annotations

import json
from pathlib import Path

from tasks.data.records import clean_and_split, read_source, source_digest
from tasks.data.splits import load_split, write_dataset
from tasks.platform.stage_cache import RunContext, StageResult, logger, run_cached


def prepare_data(ctx: RunContext) -> StageResult:
    cfg = ctx.profile.data
    files = read_source(cfg.source)
    eval_files = read_source(cfg.eval_source) if cfg.eval_source else None

    def produce(out_dir: Path) -> dict:
        data = clean_and_split(files, cfg, eval_files)
        write_dataset(data, out_dir)
        log = logger()
        log.info(
            f"prepare_data: {data.stats['records_read']} read, {data.stats['duplicates_dropped']} duplicates and "
            f"{data.stats['empty_answers_dropped']} empty answers dropped, "
            f"{data.stats['train_records']} train / {data.stats['eval_records']} eval"
        )
        return data.stats

    result = run_cached(
        ctx,
        "prepare_data",
        {
            "source": source_digest(files),
            "eval_source": source_digest(eval_files) if eval_files else None,
            "config": cfg.model_dump(exclude={"source", "eval_source"}),
        },
        produce,
        headline=lambda m: f"{m['train_records']} train / {m['eval_records']} eval",
    )
    folder = ctx.store.fetch(result.artifact.digest)
    stats = json.loads((folder / "stats.json").read_text())
    result.metrics = {**result.metrics, "fingerprint": stats["fingerprint"]}
    log_dataset_input(ctx, folder, cfg.source, stats["fingerprint"])
    if stats.get("eval_fingerprint"):
        ctx.tracker.set_tags({"data.eval_fingerprint": stats["eval_fingerprint"], "data.eval_source": cfg.eval_source})
        result.metrics["eval_fingerprint"] = stats["eval_fingerprint"]
    return result


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
