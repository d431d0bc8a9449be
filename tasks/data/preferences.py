"""Preference data (issue 78): pairs of a better and a worse answer to one prompt, or answers rated desirable or not
(KTO), read, validated, de-duplicated and split by prompt.

The layouts are LlamaFactory's (0.9.5, data/converter.py): alpaca with `chosen` and `rejected` strings; sharegpt or
openai messages ending with the user's turn, with `chosen` and `rejected` each an assistant turn ({from, value} or
{role, content}; a string is taken as the assistant's); and an SFT record of any of the three layouts with a
boolean `kto_tag` (true: desirable). LlamaFactory itself skips a malformed example with a warning ("Skipping this
abnormal example", SharegptDatasetConverter.__call__), so a bad pair would be lost quietly in training: here it is
refused naming its line and field. A prompt's pairs all go to one split (its hash decides), so no prompt is scored
on that it trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from tasks.data.records import (
    HARVESTED,
    PREFERENCE_FIELDS,
    SourceFile,
    alternates,
    detect_format,
    fingerprint_of,
    is_eval,
    iter_raw_records,
    normalize,
    record_hash,
    string_field,
    turn_message,
    turns_of,
)
from tasks.platform.config import DataSection
from tasks.platform.errors import BadInput
from tasks.quality.chat import Conversation, Message

PreferenceKind = Literal["pairs", "kto"]


@dataclass(frozen=True)
class PreferenceRecord:
    """A prompt (an optional system turn, then user and assistant turns ending with the user's) and either two
    answers, the better first (`rejected` set), or one answer rated desirable or not (`desirable` set)."""

    prompt: Conversation
    chosen: str
    rejected: str | None = None
    desirable: bool | None = None
    harvested: bool = False  # from served traffic (`llmops data harvest --pairs`): never in the eval split

    @property
    def kind(self) -> PreferenceKind:
        return "kto" if self.desirable is not None else "pairs"

    def digest(self) -> str:
        answers = f"{self.chosen}\0{self.rejected}\0{self.desirable}"  # one answer rated both ways is two records
        return record_hash([*self.prompt, Message(role="assistant", content=answers)])


def is_preference_record(record) -> bool:
    return isinstance(record, dict) and any(name in record for name in PREFERENCE_FIELDS)


def normalize_preference(record, fmt: str, where: str) -> PreferenceRecord:
    if not isinstance(record, dict):
        raise BadInput(f"{where}: expected a JSON object, got {type(record).__name__}")
    fmt = detect_format(record, where) if fmt == "auto" else fmt
    if "kto_tag" in record:
        return rated_answer(record, fmt, where)
    prompt = prompt_of(record, fmt, where)
    chosen, rejected = (answer_of(record, name, fmt, where) for name in ("chosen", "rejected"))
    if chosen.strip() == rejected.strip():
        raise BadInput(f"{where}: fields 'chosen' and 'rejected' hold the same answer: the pair prefers nothing")
    return PreferenceRecord(prompt, chosen, rejected)


def prompt_of(record: dict, fmt: str, where: str) -> Conversation:
    if fmt == "alpaca":
        instruction = string_field(record, "instruction", where)
        extra = string_field(record, "input", where, required=False)
        system = string_field(record, "system", where, required=False)
        if not instruction.strip():
            raise BadInput(f"{where}: field 'instruction' is empty")
        user = Message(role="user", content=f"{instruction}\n\n{extra}" if extra else instruction)
        return [*([Message(role="system", content=system)] if system else []), user]
    field = "conversations" if fmt == "sharegpt" else "messages"
    prompt = turns_of(record, fmt, where)
    if not alternates(prompt, ending="user"):
        raise BadInput(
            f"{where}: field '{field}' must alternate user/assistant turns and end with the user (a pair's answers "
            "are 'chosen' and 'rejected')"
        )
    return prompt


def answer_of(record: dict, name: str, fmt: str, where: str) -> str:
    """`chosen` or `rejected`: a string, or an assistant turn in the record's layout."""
    if name not in record:
        raise BadInput(f"{where}: field '{name}' is missing (a preference pair needs 'chosen' and 'rejected')")
    value = record[name]
    if isinstance(value, dict):
        turn = turn_message(value, "sharegpt" if fmt == "sharegpt" else "openai", f"{where}: {name}")
        if turn["role"] != "assistant":
            raise BadInput(f"{where}: field '{name}' is a {turn['role']} turn; it must be the assistant's")
        value = turn["content"]
    elif not isinstance(value, str):
        raise BadInput(f"{where}: field '{name}' must be a string or an assistant turn, got {type(value).__name__}")
    if not value.strip():
        raise BadInput(f"{where}: field '{name}' is empty")
    return value


def rated_answer(record: dict, fmt: str, where: str) -> PreferenceRecord:
    """A KTO record: an SFT record's prompt and answer, and `kto_tag` true (desirable) or false."""
    desirable = record["kto_tag"]
    if not isinstance(desirable, bool):
        raise BadInput(f"{where}: field 'kto_tag' must be true or false, got {type(desirable).__name__}")
    sft = {key: value for key, value in record.items() if key != "kto_tag"}
    if fmt == "alpaca" and "output" not in sft:
        raise BadInput(f"{where}: field 'output' is missing (a KTO record rates one answer)")
    messages = normalize(sft, fmt, where)
    if not messages[-1]["content"].strip():
        raise BadInput(f"{where}: the answer a KTO record rates is empty")
    return PreferenceRecord(messages[:-1], messages[-1]["content"], desirable=desirable)


@dataclass
class PreferenceData:
    """Validated preference records of one kind, split by prompt, and what was read and dropped on the way."""

    kind: PreferenceKind
    train: list[PreferenceRecord]
    eval: list[PreferenceRecord]
    read: int
    duplicates: int
    prompts: int
    fingerprint: str
    eval_prompts: int
    harvested_held_out: int = 0  # harvested pairs left out: their prompt hashed into the eval split


def read_preferences(files: list[SourceFile], cfg: DataSection) -> PreferenceData:
    """Every record of `files` as a preference record of one kind, duplicates dropped, split by the prompt's hash at
    data.eval_fraction."""
    names = ", ".join(f.name for f in files)
    records: list[PreferenceRecord] = []
    seen: set[str] = set()
    read = duplicates = 0
    first: tuple[str, PreferenceKind] | None = None
    for file in files:
        for where, raw in iter_raw_records(file):
            read += 1
            if isinstance(raw, dict) and HARVESTED in raw and "kto_tag" in raw:
                raise BadInput(
                    f"{where}: a harvested record rated for KTO (the service's ratings are harvested as pairs)"
                )
            record = normalize_preference(raw, cfg.format, where)
            if isinstance(raw, dict) and HARVESTED in raw:  # `llmops data harvest --pairs`: trained on, never an exam
                record = replace(record, harvested=True)
            if first is None:
                first = (where, record.kind)
            elif record.kind != first[1]:
                raise BadInput(
                    f"{where}: a {describe_kind(record.kind)} record among {describe_kind(first[1])} ({first[0]} "
                    "was the first); one dataset trains one preference method"
                )
            digest = record.digest()
            if digest in seen:
                duplicates += 1
                continue
            seen.add(digest)
            records.append(record)
    if first is None:
        raise BadInput(f"data {names}: no records")
    prompt_hashes = {record_hash(r.prompt) for r in records}
    held_out = [is_eval(r.prompt, cfg.eval_fraction, cfg.split_salt) for r in records]
    train = [r for r, out in zip(records, held_out, strict=True) if not out]
    evals = [r for r, out in zip(records, held_out, strict=True) if out and not r.harvested]
    # a harvested pair is never an exam, and its prompt is never trained on where a curated pair of it is one
    harvested_held_out = sum(out and r.harvested for r, out in zip(records, held_out, strict=True))
    if not train or not evals:
        raise BadInput(
            f"data {names}: {len(prompt_hashes)} prompts leave an empty {'train' if not train else 'eval'} split at "
            f"data.eval_fraction={cfg.eval_fraction} (a prompt's pairs stay in one split)"
        )
    eval_prompts = len({record_hash(r.prompt) for r in evals})
    fingerprint = fingerprint_of([r.digest() for r in records])
    found = PreferenceData(first[1], train, evals, read, duplicates, len(prompt_hashes), fingerprint, eval_prompts)
    found.harvested_held_out = harvested_held_out
    return found


def describe_kind(kind: PreferenceKind) -> str:
    return "KTO (kto_tag)" if kind == "kto" else "preference pair (chosen/rejected)"


def is_preference_data(files: list[SourceFile]) -> bool:
    """Whether the first record of the first file is a preference record (the rest are checked as they are read)."""
    for _, raw in iter_raw_records(files[0]):
        return is_preference_record(raw)
    return False


def llamafactory_rows(records: list[PreferenceRecord]) -> list[dict]:
    """The records in LlamaFactory's sharegpt layout with role/content tags (dataset_info below)."""
    rows = []
    for r in records:
        if r.desirable is not None:
            rows.append({"messages": [*r.prompt, Message(role="assistant", content=r.chosen)], "kto_tag": r.desirable})
        else:
            chosen, rejected = (Message(role="assistant", content=text or "") for text in (r.chosen, r.rejected))
            rows.append({"messages": r.prompt, "chosen": chosen, "rejected": rejected})
    return rows


def dataset_info(kind: PreferenceKind) -> dict:
    """LlamaFactory's dataset registry for the two splits: `ranking` for pairs (its data/loader.py refuses a dataset
    without it for the DPO family's stage, and one with it for SFT), `kto_tag` for KTO (data/parser.py's columns)."""
    from tasks.data.splits import dataset_info as sft_info

    info = sft_info()
    for entry in info.values():
        if kind == "pairs":
            entry["ranking"] = True
            entry["columns"] = {"messages": "messages", "chosen": "chosen", "rejected": "rejected"}
        else:
            entry["columns"] = {"messages": "messages", "kto_tag": "kto_tag"}
    return info


def write_preference_dataset(data: PreferenceData, out_dir: Path) -> None:
    """The two splits as LlamaFactory reads them for its DPO family (stage rm's pairwise processor) or KTO."""
    for split, records in (("train", data.train), ("eval", data.eval)):
        (out_dir / f"{split}.json").write_text(json.dumps(llamafactory_rows(records), ensure_ascii=False))
    (out_dir / "dataset_info.json").write_text(json.dumps(dataset_info(data.kind), indent=2))
