"""predict: a dataset answered by a released version through the service's public OpenAI endpoint (`/v1` of the
gateway of `llmops serve`), the way clients are served (the same chat template and stop rules), with as many
requests in flight as the engine batches.

Input: any source prepare_data reads (a file, a folder of .jsonl/.json files or an S3 key/prefix; alpaca,
sharegpt, OpenAI messages; a record's last assistant turn, where there is one, is its reference and not sent),
records of plain prompts ({"prompt": "..."}), or a text file of one prompt per line. Output: one JSONL row per
answered input, in input order (id, prompt, answer, tokens, latency_s, finish_reason, and the reference where the
input had one). A row that cannot be read or answered goes to the errors file with its line and reason; the rest
are answered.

Resumable: rows whose id is already in the output are not sent again. Answers go, in input order, to a partial file
beside the output, which replaces the output when the run ends, also when it is interrupted (Ctrl-C); a run killed
outright leaves the previous output and the partial file, and the next run reads both.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.data.prompt_rows import Row
from tasks.platform.errors import BadInput, TransientError

# Statuses worth another try: the service is busy (429 rate limit, 503 queue full or restarting) or a hop failed.
RETRY_STATUSES = {408, 429, 502, 503, 504}


class RowRefused(Exception):
    """The service answered the row with a client error (400, 413, 422): the row, not the service, is at fault."""


@dataclass
class PredictSummary:
    rows: int
    answered: int  # by this run
    resumed: int  # already in the output
    failed: int
    service_failures: int  # of those, the service's (unreachable, 5xx, still busy after retries)
    seconds: float
    output: Path
    errors: Path | None

    @property
    def rows_per_second(self) -> float:
        return self.answered / self.seconds if self.seconds else 0.0

    def describe(self) -> str:
        failed = (
            f", {self.failed} not answered ({self.service_failures} by the service's fault) -> {self.errors}"
            if self.failed
            else ""
        )
        return (
            f"predict: {self.answered} answered in {self.seconds:.1f} s ({self.rows_per_second:.1f} rows/s), "
            f"{self.resumed} already in {self.output}{failed}"
        )


def partial_of(output: Path) -> Path:
    return output.with_name(f".{output.name}.partial")


def read_answered(output: Path) -> dict[str, dict]:
    """The rows of an earlier run's output and of a killed run's partial file, by id; an unreadable line (a run
    killed mid-write) is dropped."""
    answered: dict[str, dict] = {}
    for path in (output, partial_of(output)):
        if not path.is_file():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                answered[str(row["id"])] = row
            except (ValueError, KeyError, TypeError):
                continue
    return answered


class OrderedWriter:
    """Writes rows in input order as they resolve: a row answered now, one answered by an earlier run, or one that
    failed (which leaves a gap). What resolved out of order waits; `close` writes every answered row that is left,
    in input order, and replaces the output."""

    def __init__(self, output: Path, earlier: dict[int, dict]):
        self.output = output
        self.partial = partial_of(output)
        self.staged = self.partial.with_name(self.partial.name + ".new")  # the earlier partial stays until replaced
        self.file = open(self.staged, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self.waiting: dict[int, dict | None] = dict(earlier)
        self.next = 0
        self._flush()
        os.replace(self.staged, self.partial)  # the same open file, now under the partial's name

    def resolve(self, index: int, row: dict | None) -> None:
        self.waiting[index] = row
        self._flush()

    def _flush(self) -> None:
        while self.next in self.waiting:
            row = self.waiting.pop(self.next)
            if row is not None:
                self.file.write(json.dumps(row, ensure_ascii=False) + "\n")
            self.next += 1
        self.file.flush()

    def close(self) -> None:
        for index in sorted(self.waiting):
            row = self.waiting[index]
            if row is not None:
                self.file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.file.close()
        os.replace(self.partial, self.output)


@dataclass
class Requests:
    """How rows are sent: to which gateway, as which model, with what key and answer cap, how persistently."""

    base_url: str
    model: str
    max_tokens: int | None = None
    api_key: str | None = None
    attempts: int = 5

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/chat/completions"

    def body(self, row: Row) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": row.messages}
        return body | ({"max_tokens": self.max_tokens} if self.max_tokens is not None else {})

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def http_client(concurrency: int, timeout_s: float = 300.0):
    """An HTTP client for `concurrency` requests at once; it trusts SSL_CERT_FILE's CA where that is set
    (httpx's trust_env), as the service's other clients do for a private certificate."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=True)


async def served_models(client, requests: Requests, key_env: str) -> list[str]:
    """The model names the service answers (GET /v1/models): reachable, and the key accepted, before any row."""
    import httpx

    url = requests.base_url.rstrip("/") + "/v1/models"
    try:
        response = await client.get(url, headers=requests.headers())
    except httpx.TransportError as exc:
        raise TransientError(f"{url}: the service does not answer ({type(exc).__name__}: {exc})") from None
    if response.status_code in (401, 403):
        given = "the key in " + key_env if requests.api_key else "no key: set " + key_env
        raise BadInput(f"{url}: the service refused the request ({response.status_code}) with {given}")
    if response.status_code != 200:
        raise TransientError(f"{url}: HTTP {response.status_code}: {response.text[:200]}")
    return [m["id"] for m in response.json().get("data", [])]


def served_name(listed: list[str], service: str, version: int | None, champion: int | None, where: str) -> str:
    """The model name to ask for: the service's name for its champion (what its clients get), or the version's
    own name `<service>-vN` where the gateway lists it; anything else cannot be answered by this service."""
    if version is None or version == champion:
        if service not in listed:
            raise BadInput(f"{where} serves {', '.join(listed) or 'no model'}, not {service} (--profile?)")
        return service
    pinned = f"{service}-v{version}"
    if pinned not in listed:
        raise BadInput(
            f"--version {version}: {where} answers only as {', '.join(listed) or 'no model'} (its champion, "
            f"v{champion}) and names no other version; make v{version} the champion of a service to score it"
        )
    return pinned


@dataclass
class Target:
    """The version a run asks for: its number (None: the service's champion, whichever it is), the champion's number,
    and how many requests its engine batches at once."""

    version: int | None
    champion: int | None
    batch: int


def registered_target(profile, version: str, tracking_uri: str, batch_known: bool = False) -> Target:
    """`version` (champion, challenger or a number) of the profile's service in the registry, and its engine batch
    (from the settings it was released with); with `batch_known` and the champion, no registry is read."""
    if version == "champion" and batch_known:
        return Target(None, None, 0)
    found, champion = registered_version(profile, version, tracking_uri)
    return Target(
        None if version == "champion" else int(found.version),
        int(champion.version) if champion else None,
        engine_batch(released_settings(profile, found.tags.get("serve.model_settings"))),
    )


def registered_version(profile, version: str, tracking_uri: str):
    """The registry's ModelVersion of `version` (champion, challenger or a number) and the champion's (or None)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    if version not in ("champion", "challenger") and not version.isdigit():
        raise BadInput(f"--version {version}: expected champion, challenger or a version number")
    service = profile.registry.model_name
    client = MlflowClient(tracking_uri)

    def alias(name: str):
        try:
            return client.get_model_version_by_alias(service, name)
        except MlflowException as exc:
            if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise
            return None

    champion = alias("champion")
    try:
        found = client.get_model_version(service, version) if version.isdigit() else alias(version)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        found = None
    if found is None:
        raise BadInput(f"--version {version}: {service} has no such version in the registry at {tracking_uri}")
    return found, champion


def released_settings(profile, recorded: str | None):
    """`profile` with the serving settings a version was released with (its `serve.model_settings` tag), as the
    service serves it; a version registered before the tag serves with `profile`'s."""
    return profile.with_served_settings(json.loads(recorded)) if recorded else profile


def engine_batch(profile) -> int:
    """Requests in flight that a version's engine batches at once: serve.max_batch_size (vLLM's max_num_seqs),
    the LLM API's engine.max_batch_size, or the Python model's batch over its instances."""
    if profile.serve.backend == "vllm":
        return profile.serve.max_batch_size
    if profile.serve.backend == "llmapi":
        return profile.engine.max_batch_size
    return profile.serve.max_batch_size * profile.serve.instance_count


async def predict(
    rows: list[Row],
    requests: Requests,
    service: str,
    target: Target,
    output: Path,
    errors: Path,
    concurrency: int,
    key_env: str,
    progress: Callable[[int], None] | None = None,
) -> PredictSummary:
    """Ask the service which names it answers, choose the target's, and answer the rows."""
    async with http_client(concurrency) as client:
        listed = await served_models(client, requests, key_env)
        requests.model = served_name(listed, service, target.version, target.champion, requests.base_url)
        return await predict_rows(rows, requests, output, errors, concurrency, client, progress)


async def answer_row(client, requests: Requests, row: Row) -> tuple[dict, float]:
    """One chat completion with retries on a busy service (Retry-After honoured); (response, seconds)."""
    import httpx

    delay = 0.5
    for attempt in range(requests.attempts):
        last = attempt + 1 == requests.attempts
        started = time.perf_counter()
        try:
            response = await client.post(requests.url, json=requests.body(row), headers=requests.headers())
        except httpx.TransportError as exc:
            if last:
                raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
        else:
            if response.status_code == 200:
                return response.json(), time.perf_counter() - started
            if response.status_code not in RETRY_STATUSES or last:
                try:
                    error = response.json()["error"]
                    message, param = error["message"], error.get("param")
                except (ValueError, KeyError, TypeError, AttributeError):
                    message, param = response.text[:200], None
                if response.status_code in (400, 404) and param == "model":
                    # the model asked for (a pinned version with serve.version_pinning off, say): no row can be
                    # answered, so the run stops with the service's reason instead of failing each row with it
                    raise BadInput(f"{requests.base_url} refused the model {requests.model!r}: {message}")
                refused = 400 <= response.status_code < 500 and response.status_code not in RETRY_STATUSES
                raise (RowRefused if refused else RuntimeError)(f"HTTP {response.status_code}: {message}")
            retry_after = response.headers.get("retry-after")
            if retry_after and retry_after.replace(".", "", 1).isdigit():
                delay = max(delay, float(retry_after))
        await asyncio.sleep(delay)
        delay = min(delay * 2, 10.0)
    raise AssertionError("unreachable")


def answered_row(row: Row, response: dict, seconds: float) -> dict:
    choice = response["choices"][0]
    return {
        "id": row.id,
        "prompt": row.messages[-1]["content"],
        "answer": choice["message"]["content"],
        "tokens": (response.get("usage") or {}).get("completion_tokens"),
        "latency_s": round(seconds, 4),
        "finish_reason": choice.get("finish_reason"),
        **({"reference": row.reference} if row.reference is not None else {}),
    }


def failure(row: Row, error: str, kind: str) -> dict:
    return {"id": row.id, "line": row.line, "where": row.where, "error": error, "kind": kind}


async def predict_rows(
    rows: list[Row],
    requests: Requests,
    output: Path,
    errors: Path,
    concurrency: int,
    client=None,
    progress: Callable[[int], None] | None = None,
) -> PredictSummary:
    """Answer every row not already in `output`, `concurrency` at a time; write answers in input order and this
    run's failures to `errors` (none: no errors file)."""
    started = time.perf_counter()
    answered = read_answered(output)
    done = [row for row in rows if row.error is None and row.id in answered]
    writer = OrderedWriter(output, {row.index: answered[row.id] for row in done})
    failures: dict[int, dict] = {}  # by row index
    pending: asyncio.Queue[Row] = asyncio.Queue()
    for row in rows:
        if row.error is not None:
            failures[row.index] = failure(row, row.error, "unreadable")
            writer.resolve(row.index, None)
        elif row.id not in answered:
            pending.put_nowait(row)
    if progress is not None:
        progress(len(done) + len(failures))
    to_send, answered_now = pending.qsize(), 0

    async def worker(client) -> None:
        nonlocal answered_now
        while not pending.empty():
            row = pending.get_nowait()
            try:
                response, seconds = await answer_row(client, requests, row)
                writer.resolve(row.index, answered_row(row, response, seconds))
                answered_now += 1
            except (RowRefused, RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
                kind = "refused" if isinstance(exc, RowRefused) else "service"
                failures[row.index] = failure(row, str(exc)[:500], kind)
                writer.resolve(row.index, None)
            if progress is not None:
                progress(1)

    own_client = client is None
    client = client or http_client(concurrency)
    try:
        await asyncio.gather(*(worker(client) for _ in range(max(1, min(concurrency, to_send)))))
    finally:
        if own_client:
            await client.aclose()
        writer.close()
        write_failures(errors, [failures[index] for index in sorted(failures)])
    return PredictSummary(
        rows=len(rows),
        answered=answered_now,
        resumed=len(done),
        failed=len(failures),
        service_failures=sum(1 for f in failures.values() if f["kind"] == "service"),
        seconds=time.perf_counter() - started,
        output=output,
        errors=errors if failures else None,
    )


def write_failures(errors: Path, failures: list[dict]) -> None:
    """This run's failures in input order; none: no errors file (an earlier run's is removed)."""
    if failures:
        errors.write_text("".join(json.dumps(f, ensure_ascii=False) + "\n" for f in failures), encoding="utf-8")
    else:
        errors.unlink(missing_ok=True)
