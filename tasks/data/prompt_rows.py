"""The rows `llmops predict` sends: any source prepare_data reads (a file, a folder of .jsonl/.json files or an S3
key/prefix; alpaca, sharegpt, OpenAI messages; a record's last assistant turn, where there is one, is its reference
and not sent), records of plain prompts ({"prompt": "..."}), or a text file of one prompt per line. A row that
cannot be read carries its error (with its file and line) instead of messages, so the rest are still answered."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.data.records import DATA_SUFFIXES, SourceFile, iter_raw_records, normalize, read_source
from tasks.platform.errors import BadInput


@dataclass
class Row:
    """One input: its place in the input, its id, the messages to send, its reference; or why it cannot be sent."""

    index: int
    id: str
    where: str
    line: int | None  # in its file (JSONL, text); None for a JSON array's record
    messages: list[dict[str, str]] = field(default_factory=list)
    reference: str | None = None
    error: str | None = None


def read_rows(source: str) -> list[Row]:
    """Every input row, in input order; a row that cannot be read carries its error instead of messages."""
    path = Path(source)
    if not source.startswith("s3://") and path.is_file() and not path.name.endswith(DATA_SUFFIXES):
        return prompt_lines(path)
    files = read_source(source)
    rows: list[Row] = []
    for file in files:
        prefix = "" if len(files) == 1 else f"{Path(file.name).name}:"  # ids stay unique across files
        rows += records_of(file, prefix, start=len(rows))
    seen: set[str] = set()
    for row in rows:
        if row.id in seen and row.error is None:
            row.error = f"{row.where}: id {row.id!r} repeats an earlier row's (ids name answers in the output)"
        seen.add(row.id)
    if not rows:
        raise BadInput(f"--data {source}: no rows")
    return rows


def prompt_lines(path: Path) -> list[Row]:
    """A text file: each non-empty line one prompt, its id its line number."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BadInput(f"data file {path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise BadInput(f"--data {path}: no rows")
    return [
        Row(i, str(n), f"data file {path} line {n}", n, [{"role": "user", "content": line}])
        for i, (n, line) in enumerate(lines)
    ]


def records_of(file: SourceFile, prefix: str, start: int) -> list[Row]:
    rows = []
    for index, (where, record) in enumerate(iter_raw_records(file, keep_invalid=True), start=start):
        place = where.rsplit(" ", 1)[-1]
        line = int(place) if " line " in where else None
        row_id = prefix + (str(record["id"]) if isinstance(record, dict) and "id" in record else place)
        try:
            if isinstance(record, BadInput):
                raise record
            messages, reference = prompt_of(record, where)
        except BadInput as exc:
            rows.append(Row(index, row_id, where, line, error=str(exc)))
        else:
            rows.append(Row(index, row_id, where, line, messages, reference))
    return rows


def prompt_of(record: Any, where: str) -> tuple[list[dict[str, str]], str | None]:
    """The messages to send and the reference answer, if the record has one."""
    if isinstance(record, dict) and "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise BadInput(f"{where}: field 'prompt' must be a non-empty string")
        return [{"role": "user", "content": prompt}], None
    if isinstance(record, dict) and "instruction" in record and "output" not in record:
        record = {**record, "output": ""}  # an alpaca prompt without its answer
        return plain(normalize(record, "alpaca", where))[:-1], None
    if isinstance(record, dict) and isinstance(record.get("messages"), list) and record["messages"]:
        last = record["messages"][-1]
        if isinstance(last, dict) and last.get("role") == "user":  # a conversation waiting for its answer
            with_answer = {**record, "messages": [*record["messages"], {"role": "assistant", "content": ""}]}
            return plain(normalize(with_answer, "openai", where))[:-1], None
    messages = plain(normalize(record, "auto", where))
    return messages[:-1], messages[-1]["content"]


def plain(conversation) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": m["content"]} for m in conversation]
