"""Reading, validating, cleaning and splitting SFT records.

Accepts JSONL or JSON in alpaca (instruction/input/output), sharegpt (conversations of
from/value) or OpenAI messages (role/content) format, from a file, a folder or s3://.
Every record is normalised to OpenAI-style messages.

A record the flywheel harvested from served traffic carries `"harvested": {...}` (tasks/data/harvest.py): clients
wrote its prompt, maybe its answer, so it never enters an eval split; data holding such records needs a curated
held-out set (data.eval_source, or data.harvest_eval_source where a run names other data), which itself may hold none.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from tasks.platform.config import DataSection
from tasks.platform.errors import BadInput
from tasks.quality.chat import Conversation, Message

ROLES_SHAREGPT = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
ROLES_OPENAI = {"user", "assistant", "system"}
HARVESTED = "harvested"  # a record's key naming where the flywheel harvested it from
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
    from tasks.platform.store import s3_client, split_s3_uri

    bucket, key = split_s3_uri(uri)
    client = s3_client()
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
        keys += [o["Key"] for o in page.get("Contents", []) if o["Key"].endswith(DATA_SUFFIXES)]
    keys = [k for k in keys if k == key or k.startswith(key.rstrip("/") + "/") or not key]
    if not keys:
        raise BadInput(f"data source {uri}: no .jsonl or .json objects there")
    return [
        SourceFile(f"s3://{bucket}/{k}", client.get_object(Bucket=bucket, Key=k)["Body"].read()) for k in sorted(keys)
    ]


def source_digest(files: list[SourceFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + hashlib.sha256(f.content).digest())
    return h.hexdigest()


def iter_raw_records(file: SourceFile, keep_invalid: bool = False):
    """Yield (where, record) with `where` naming the file and line (JSONL) or index (JSON array). A JSONL line that
    is not JSON stops the reading, or with `keep_invalid` is yielded as its BadInput in place of the record (scoring
    a file answers the rest; training from half a file would be wrong)."""
    try:
        # utf-8-sig: a byte-order mark (Windows and Excel exports) is read as no text; CRLF endings split like LF.
        text = file.content.decode("utf-8-sig")
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
        where = f"data file {file.name} line {lineno}"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            invalid = BadInput(f"{where}: invalid JSON ({reason})")
            if not keep_invalid:
                raise invalid from None
            record = invalid
        yield where, record


def string_field(record: dict, field: str, where: str, required: bool = True) -> str:
    if field not in record:
        if required:
            raise BadInput(f"{where}: field '{field}' is missing")
        return ""
    value = record[field]
    if not isinstance(value, str):
        raise BadInput(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    return value


PREFERENCE_FIELDS = ("chosen", "rejected", "kto_tag")  # LlamaFactory's preference columns (tasks/data/preferences.py)


def detect_format(record: dict, where: str) -> str:
    if "messages" in record:
        return "openai"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record or "output" in record:
        return "alpaca"
    raise BadInput(
        f"{where}: record has none of the fields 'instruction' (alpaca), 'conversations' (sharegpt), 'messages'"
    )


def normalize(record, fmt: str, where: str) -> Conversation:
    """One record as a list of {role, content} messages: optional system, then user/assistant turns."""
    if not isinstance(record, dict):
        raise BadInput(f"{where}: expected a JSON object, got {type(record).__name__}")
    if preference := next((name for name in PREFERENCE_FIELDS if name in record), None):
        raise BadInput(
            f"{where}: field '{preference}' makes it a preference record; train.stage sft learns one answer per "
            "prompt ('output' or the last assistant turn), so preference data is not SFT data (`llmops data validate` "
            "reads it)"
        )
    fmt = detect_format(record, where) if fmt == "auto" else fmt
    if fmt == "alpaca":
        instruction = string_field(record, "instruction", where)
        extra = string_field(record, "input", where, required=False)
        output = string_field(record, "output", where)
        system = string_field(record, "system", where, required=False)
        prompt = Message(role="user", content=f"{instruction}\n\n{extra}" if extra else instruction)
        answer = Message(role="assistant", content=output)
        return [*([Message(role="system", content=system)] if system else []), prompt, answer]
    field = TURNS[fmt][0]
    messages = turns_of(record, fmt, where)
    if not alternates(messages, ending="assistant"):
        raise BadInput(f"{where}: field '{field}' must alternate user/assistant turns and end with the assistant")
    return messages


TURNS = {"sharegpt": ("conversations", "from", "value"), "openai": ("messages", "role", "content")}


def turns_of(record: dict, fmt: str, where: str) -> Conversation:
    """The turns of a sharegpt or openai record as messages, each role and content checked (not their order)."""
    field, role_key, content_key = TURNS[fmt]
    turns = record.get(field)
    if not isinstance(turns, list) or not turns:
        raise BadInput(f"{where}: field '{field}' must be a non-empty list")
    return [turn_message(turn, fmt, f"{where}: {field}[{i}]") for i, turn in enumerate(turns)]


def turn_message(turn, fmt: str, at: str) -> Message:
    """One sharegpt ({from, value}) or openai ({role, content}) turn as a message."""
    _, role_key, content_key = TURNS[fmt]
    if not isinstance(turn, dict):
        raise BadInput(f"{at}: expected an object")
    given = string_field(turn, role_key, at)
    role = ROLES_SHAREGPT.get(given) if fmt == "sharegpt" else (given if given in ROLES_OPENAI else None)
    if role is None:
        raise BadInput(f"{at}.{role_key}: unknown role {given!r}")
    return Message(role=role, content=string_field(turn, content_key, at))


def alternates(messages: Conversation, ending: str) -> bool:
    """An optional system turn, then user and assistant turns in turn, the last one `ending`'s."""
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    expected = ["user", "assistant"] * (len(body) // 2 + 1)
    return bool(body) and [m["role"] for m in body] == expected[: len(body)] and body[-1]["role"] == ending


def record_hash(messages: Conversation, salt: str = "") -> str:
    return hashlib.sha256((salt + json.dumps(messages, sort_keys=True, ensure_ascii=False)).encode()).hexdigest()


def is_eval(messages: Conversation, fraction: float, salt: str) -> bool:
    """Deterministic split: a record's place depends on its content only, not on file order."""
    return int(record_hash(messages, salt)[:15], 16) / 16**15 < fraction


@dataclass
class CleanData:
    train: list[Conversation]
    eval: list[Conversation]
    stats: dict
    fingerprint: str
    eval_fingerprint: str = ""
    eval_split: str = ""  # where the eval split came from, for people: "hash split of qa.jsonl"


@dataclass
class Records:
    """Validated, de-duplicated conversations of some files, and what was dropped on the way."""

    conversations: list[Conversation]
    hashes: list[str]
    read: int
    duplicates: int
    empty: int
    harvested: set[str] = field(default_factory=set)  # hashes of the records harvested from served traffic

    def describe(self) -> str:
        return f"{self.read} read, {self.duplicates} duplicates, {self.empty} empty answers"

    def with_history(self) -> int:
        """Harvested records with an assistant turn before their answer: a client wrote it."""
        return sum(
            1
            for m, h in zip(self.conversations, self.hashes, strict=True)
            if h in self.harvested and any(turn["role"] == "assistant" for turn in m[:-1])
        )


def read_records(files: list[SourceFile], fmt: str) -> Records:
    seen: set[str] = set()
    conversations, hashes, harvested, duplicates, empty, total = [], [], set(), 0, 0, 0
    for file in files:
        for where, raw in iter_raw_records(file):
            total += 1
            messages = normalize(raw, fmt, where)
            if not messages[-1]["content"].strip():
                empty += 1
                continue
            digest = record_hash(messages)
            if isinstance(raw, dict) and HARVESTED in raw:
                harvested.add(digest)  # a duplicate of a curated record is harvested too: it counts once, here
            if digest in seen:
                duplicates += 1
                continue
            seen.add(digest)
            conversations.append(messages)
            hashes.append(digest)
    return Records(conversations, hashes, total, duplicates, empty, harvested)


def fingerprint_of(hashes: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(hashes)).encode()).hexdigest()


def clean_and_split(
    files: list[SourceFile],
    cfg: DataSection,
    eval_files: list[SourceFile] | None = None,
    harvest_eval_files: list[SourceFile] | None = None,
) -> CleanData:
    """Train and eval splits: a content-hash split of `files`, or with `eval_files` (data.eval_source)
    all of `files` for training and the fixed held-out set for eval (its records dropped from training).
    `harvest_eval_files` (data.harvest_eval_source) is that held-out set for data holding harvested records."""
    names = ", ".join(f.name for f in files)
    found = read_records(files, cfg.format)
    if not found.conversations:
        raise BadInput(f"data {names}: no usable records after cleaning ({found.describe()})")
    stats = {"records_read": found.read, "duplicates_dropped": found.duplicates, "empty_answers_dropped": found.empty}
    if found.harvested:
        stats |= {"harvested_records": len(found.harvested), "harvested_with_history": found.with_history()}
    if found.harvested and eval_files is None:
        if harvest_eval_files is None:
            raise BadInput(
                f"data {names}: {len(found.harvested)} records were harvested from served traffic, whose clients wrote "
                "them; a hash split would put some in the eval split: name a curated held-out set in data.eval_source "
                "(--eval-data)"
            )
        split = held_out_split(found, names, harvest_eval_files, cfg, "data.harvest_eval_source")
        split.eval_split += f", the curated exam of {len(found.harvested)} harvested records"
    elif eval_files is None:
        split = hash_split(found, names, cfg, location_name(cfg.source, files))
    else:
        split = held_out_split(found, names, eval_files, cfg, "data.eval_source")
    counts = {"records": len(split.train) + len(split.eval), "train_records": len(split.train)}
    split.stats = stats | split.stats | counts | {"eval_records": len(split.eval)}
    return split


def hash_split(found: Records, names: str, cfg: DataSection, location: str) -> CleanData:
    """Each record to train or eval by the hash of its content (is_eval)."""
    train = [m for m in found.conversations if not is_eval(m, cfg.eval_fraction, cfg.split_salt)]
    evals = [m for m in found.conversations if is_eval(m, cfg.eval_fraction, cfg.split_salt)]
    if not train or not evals:
        raise BadInput(
            f"data {names}: {len(found.conversations)} records leave an empty {'train' if not train else 'eval'} "
            f"split at data.eval_fraction={cfg.eval_fraction}"
        )
    return CleanData(train, evals, {}, fingerprint_of(found.hashes), "", f"hash split of {location}")


def held_out_split(
    found: Records, names: str, eval_files: list[SourceFile], cfg: DataSection, setting: str
) -> CleanData:
    """Every record to train but those in the held-out set (`setting` names it), which is the eval split."""
    held_out = read_records(eval_files, cfg.format)
    eval_names = ", ".join(f.name for f in eval_files)
    if not held_out.conversations:
        raise BadInput(f"{setting} {eval_names}: no usable records after cleaning ({held_out.describe()})")
    if held_out.harvested:
        raise BadInput(
            f"{setting} {eval_names}: {len(held_out.harvested)} records were harvested from served "
            "traffic; the held-out set the gate scores on must be curated, never written by clients"
        )
    overlap = set(held_out.hashes)
    train = [m for m, h in zip(found.conversations, found.hashes, strict=True) if h not in overlap]
    if not train:
        raise BadInput(f"data {names}: every record is also in {setting} {eval_names}; nothing left to train on")
    eval_fingerprint = fingerprint_of(held_out.hashes)
    fingerprint = hashlib.sha256(f"{fingerprint_of(found.hashes)}+eval:{eval_fingerprint}".encode()).hexdigest()
    stats = {"eval_records_read": held_out.read, "eval_overlap_dropped": len(found.conversations) - len(train)}
    origin = f"{setting} {location_name(None, eval_files)}"
    return CleanData(train, held_out.conversations, stats, fingerprint, eval_fingerprint, origin)


def location_name(source: str | None, files: list[SourceFile]) -> str:
    """A data location as a person names it: one file by its name, several by their folder or prefix."""
    if len(files) == 1:
        return files[0].name.rsplit("/", 1)[-1]
    return source or files[0].name.rsplit("/", 1)[0] + "/"


def read_exams(cfg: DataSection) -> tuple[list[SourceFile] | None, list[SourceFile] | None]:
    """The files of data.eval_source, and of data.harvest_eval_source where eval_source names none."""
    if cfg.eval_source:
        return read_source(cfg.eval_source), None
    return None, read_source(cfg.harvest_eval_source) if cfg.harvest_eval_source else None


def read_data(cfg: DataSection) -> CleanData:
    """What prepare_data will see for this data section (read, validated, cleaned, split)."""
    return clean_and_split(read_source(cfg.source), cfg, *read_exams(cfg))
