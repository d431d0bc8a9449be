"""prepare_data: read, validate, clean, split and fingerprint an SFT dataset.

Accepts JSONL or JSON in alpaca (instruction/input/output), sharegpt (conversations of
from/value) or OpenAI messages (role/content) format, from a file, a folder or s3://.
Every record is normalised to OpenAI-style messages and written in LlamaFactory's sharegpt
layout with a `dataset_info.json`, so training reads exactly what was validated here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from tasks.config import DataSection
from tasks.errors import BadInput
from tasks.stage import RunContext, StageResult, logger, run_cached

ROLES_SHAREGPT = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
ROLES_OPENAI = {"user", "assistant", "system"}
DATA_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class SourceFile:
    name: str
    content: bytes


def read_source(source: str) -> list[SourceFile]:
    """The raw files of a data source: one file, every .jsonl/.json in a folder, or an S3 key/prefix."""
    if source.startswith("s3://"):
        return read_s3_source(source)
    path = Path(source)
    if path.is_file():
        return [SourceFile(str(path), path.read_bytes())]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)
        if not files:
            raise BadInput(f"data folder {source}: no .jsonl or .json files")
        return [SourceFile(str(p), p.read_bytes()) for p in files]
    raise BadInput(f"data source {source}: no such file or folder")


def read_s3_source(uri: str) -> list[SourceFile]:
    from tasks.store import s3_client, split_s3_uri

    bucket, key = split_s3_uri(uri)
    client = s3_client()
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
        keys += [o["Key"] for o in page.get("Contents", []) if o["Key"].endswith(DATA_SUFFIXES)]
    keys = [k for k in keys if k == key or k.startswith(key.rstrip("/") + "/") or not key]
    if not keys:
        raise BadInput(f"data source {uri}: no .jsonl or .json objects there")
    return [SourceFile(f"s3://{bucket}/{k}", client.get_object(Bucket=bucket, Key=k)["Body"].read()) for k in sorted(keys)]


def source_digest(files: list[SourceFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + hashlib.sha256(f.content).digest())
    return h.hexdigest()


def iter_raw_records(file: SourceFile):
    """Yield (where, record) with `where` naming the file and line (JSONL) or index (JSON array)."""
    try:
        text = file.content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"data file {file.name}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if file.name.endswith(".json") and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadInput(f"data file {file.name} line {exc.lineno}: invalid JSON ({exc.msg})") from None
        for index, item in enumerate(items):
            yield f"data file {file.name} record {index}", item
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"data file {file.name} line {lineno}", json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInput(f"data file {file.name} line {lineno}: invalid JSON ({exc.msg})") from None


def _text(record: dict, field: str, where: str, required: bool = True) -> str:
    if field not in record:
        if required:
            raise BadInput(f"{where}: field '{field}' is missing")
        return ""
    value = record[field]
    if not isinstance(value, str):
        raise BadInput(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    return value


def detect_format(record: dict, where: str) -> str:
    if "messages" in record:
        return "openai"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record or "output" in record:
        return "alpaca"
    raise BadInput(f"{where}: record has none of the fields 'instruction' (alpaca), 'conversations' (sharegpt), 'messages'")


def normalize(record, fmt: str, where: str) -> list[dict]:
    """One record as a list of {role, content} messages: optional system, then user/assistant turns."""
    if not isinstance(record, dict):
        raise BadInput(f"{where}: expected a JSON object, got {type(record).__name__}")
    fmt = detect_format(record, where) if fmt == "auto" else fmt
    if fmt == "alpaca":
        instruction = _text(record, "instruction", where)
        extra = _text(record, "input", where, required=False)
        output = _text(record, "output", where)
        messages = [{"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction}]
        messages.append({"role": "assistant", "content": output})
        system = _text(record, "system", where, required=False)
        return ([{"role": "system", "content": system}] if system else []) + messages
    field, role_key, content_key = ("conversations", "from", "value") if fmt == "sharegpt" else ("messages", "role", "content")
    turns = record.get(field)
    if not isinstance(turns, list) or not turns:
        raise BadInput(f"{where}: field '{field}' must be a non-empty list")
    messages = []
    for i, turn in enumerate(turns):
        at = f"{where}: {field}[{i}]"
        if not isinstance(turn, dict):
            raise BadInput(f"{at}: expected an object")
        role = _text(turn, role_key, at)
        role = ROLES_SHAREGPT.get(role) if fmt == "sharegpt" else (role if role in ROLES_OPENAI else None)
        if role is None:
            raise BadInput(f"{at}.{role_key}: unknown role {turn[role_key]!r}")
        messages.append({"role": role, "content": _text(turn, content_key, at)})
    body = messages[1:] if messages[0]["role"] == "system" else messages
    expected = ["user", "assistant"] * (len(body) // 2 + 1)
    if not body or [m["role"] for m in body] != expected[: len(body)] or len(body) % 2:
        raise BadInput(f"{where}: field '{field}' must alternate user/assistant turns and end with the assistant")
    return messages


def record_hash(messages: list[dict], salt: str = "") -> str:
    return hashlib.sha256((salt + json.dumps(messages, sort_keys=True, ensure_ascii=False)).encode()).hexdigest()


def is_eval(messages: list[dict], fraction: float, salt: str) -> bool:
    """Deterministic split: a record's place depends on its content only, not on file order."""
    return int(record_hash(messages, salt)[:15], 16) / 16**15 < fraction


@dataclass
class CleanData:
    train: list[list[dict]]
    eval: list[list[dict]]
    stats: dict
    fingerprint: str


def clean_and_split(files: list[SourceFile], cfg: DataSection) -> CleanData:
    seen: set[str] = set()
    records, duplicates, empty, total = [], 0, 0, 0
    for file in files:
        for where, raw in iter_raw_records(file):
            total += 1
            messages = normalize(raw, cfg.format, where)
            if not messages[-1]["content"].strip():
                empty += 1
                continue
            digest = record_hash(messages)
            if digest in seen:
                duplicates += 1
                continue
            seen.add(digest)
            records.append(messages)
    names = ", ".join(f.name for f in files)
    if not records:
        raise BadInput(f"data {names}: no usable records after cleaning ({total} read, {duplicates} duplicates, {empty} empty answers)")
    train = [m for m in records if not is_eval(m, cfg.eval_fraction, cfg.split_salt)]
    evals = [m for m in records if is_eval(m, cfg.eval_fraction, cfg.split_salt)]
    if not train or not evals:
        raise BadInput(
            f"data {names}: {len(records)} records leave an empty {'train' if not train else 'eval'} split "
            f"at data.eval_fraction={cfg.eval_fraction}"
        )
    fingerprint = hashlib.sha256("\n".join(sorted(seen)).encode()).hexdigest()
    stats = {"records_read": total, "duplicates_dropped": duplicates, "empty_answers_dropped": empty,
             "records": len(records), "train_records": len(train), "eval_records": len(evals)}
    return CleanData(train, evals, stats, fingerprint)


def dataset_info() -> dict:
    """LlamaFactory's dataset registry for the two splits, in its sharegpt/messages layout."""
    columns = {"messages": "messages"}
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user",
            "assistant_tag": "assistant", "system_tag": "system"}
    return {split: {"file_name": f"{split}.json", "formatting": "sharegpt", "columns": columns, "tags": tags}
            for split in ("train", "eval")}


def write_dataset(data: CleanData, out_dir: Path) -> None:
    for split, rows in (("train", data.train), ("eval", data.eval)):
        (out_dir / f"{split}.json").write_text(json.dumps([{"messages": m} for m in rows], ensure_ascii=False))
    (out_dir / "dataset_info.json").write_text(json.dumps(dataset_info(), indent=2))
    (out_dir / "stats.json").write_text(json.dumps({**data.stats, "fingerprint": data.fingerprint}, indent=2))


def load_split(folder: Path, split: str) -> list[list[dict]]:
    return [row["messages"] for row in json.loads((folder / f"{split}.json").read_text())]


def eval_conversations(ctx: RunContext, data: StageResult, limit: int | None = None) -> list[list[dict]]:
    """The held-out split of a prepared dataset artifact (verified on read)."""
    return load_split(ctx.store.fetch(data.artifact.digest), "eval")[:limit]


def prepare_data(ctx: RunContext) -> StageResult:
    cfg = ctx.profile.data
    files = read_source(cfg.source)

    def produce(out_dir: Path) -> dict:
        data = clean_and_split(files, cfg)
        write_dataset(data, out_dir)
        log = logger()
        log.info(f"prepare_data: {data.stats['records_read']} read, {data.stats['duplicates_dropped']} duplicates and "
                 f"{data.stats['empty_answers_dropped']} empty answers dropped, "
                 f"{data.stats['train_records']} train / {data.stats['eval_records']} eval")
        return data.stats

    result = run_cached(
        ctx, "prepare_data", {"source": source_digest(files), "config": cfg.model_dump(exclude={"source"})}, produce,
        headline=lambda m: f"{m['train_records']} train / {m['eval_records']} eval",
    )
    folder = ctx.store.fetch(result.artifact.digest)
    stats = json.loads((folder / "stats.json").read_text())
    result.metrics = {**result.metrics, "fingerprint": stats["fingerprint"]}
    log_dataset_input(ctx, folder, cfg.source, stats["fingerprint"])
    return result


def log_dataset_input(ctx: RunContext, folder: Path, source: str, fingerprint: str) -> None:
    """Record both splits as MLflow dataset inputs of the run (mlflow.data), with their counts."""
    import mlflow.data
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag

    inputs = []
    for split in ("train", "eval"):
        rows = load_split(folder, split)
        frame = pd.DataFrame({"messages": [json.dumps(m, ensure_ascii=False) for m in rows]})
        dataset = mlflow.data.from_pandas(frame, source=source, name=f"sft-{split}", digest=fingerprint[:16])
        inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", split)]))
    ctx.tracker.client.log_inputs(ctx.tracker.run_id, datasets=inputs)
    ctx.tracker.set_tags({"data.fingerprint": fingerprint, "data.source": source})
