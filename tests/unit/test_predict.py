"""llmops predict without a server: what a row of each input format sends and keeps as its reference, a row that
cannot be read named by its line, the output kept in input order whatever order answers come in, also when a run
stops half way and a rerun completes it; the service's faults handled (a mock transport: error handling only).
Answers from a real service: tests/integration/test_serving.py."""

import asyncio
import json
import random

import httpx
import pytest

from tasks.data.prompt_rows import read_rows
from tasks.platform.errors import BadInput
from tasks.serving.predict import (
    OrderedWriter,
    Requests,
    partial_of,
    predict_rows,
    read_answered,
    served_name,
)


def test_each_input_format_sends_its_prompt_and_keeps_its_reference(tmp_path):
    data = tmp_path / "mixed.jsonl"
    records = [
        {"instruction": "Antonym of hot:", "input": "", "output": "cold"},
        {"instruction": "Antonym of big:"},  # a prompt without its answer
        {"prompt": "What is the opposite of up?", "id": "q-3"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Opposite of wet?"}]},
        {"conversations": [{"from": "human", "value": "Opposite of old?"}, {"from": "gpt", "value": "new"}]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = read_rows(str(data))
    assert [r.id for r in rows] == ["1", "2", "q-3", "4", "5"] and all(r.error is None for r in rows)
    assert [r.messages[-1]["content"] for r in rows] == [
        "Antonym of hot:", "Antonym of big:", "What is the opposite of up?", "Opposite of wet?", "Opposite of old?",
    ]  # fmt: skip
    assert [r.reference for r in rows] == ["cold", None, None, None, "new"]
    assert rows[3].messages[0] == {"role": "system", "content": "Be brief."}
    array = tmp_path / "array.json"
    array.write_text(json.dumps(records[:2]))
    assert [(r.id, r.line, r.reference) for r in read_rows(str(array))] == [("0", None, "cold"), ("1", None, None)]


def test_a_text_file_is_a_prompt_a_line_and_a_bad_row_is_named_by_its_line(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("Opposite of hot?\n\nOpposite of big?\n")
    assert [(r.id, r.messages) for r in read_rows(str(text))] == [
        ("1", [{"role": "user", "content": "Opposite of hot?"}]),
        ("3", [{"role": "user", "content": "Opposite of big?"}]),
    ]
    data = tmp_path / "bad.jsonl"
    data.write_text(
        '{"prompt": "fine"}\n{"prompt": 7}\n{"messages": []}\n{"prompt": "cut off\n{"prompt": "x", "id": 1}\n'
    )
    rows = read_rows(str(data))
    assert rows[0].error is None
    assert rows[1].error == f"data file {data} line 2: field 'prompt' must be a non-empty string"
    assert "line 3" in rows[2].error and rows[2].line == 3
    assert rows[3].error.startswith(f"data file {data} line 4: invalid JSON") and rows[3].line == 4
    assert rows[4].error == f"data file {data} line 5: id '1' repeats an earlier row's (ids name answers in the output)"
    with pytest.raises(BadInput, match="no such file"):
        read_rows(str(tmp_path / "missing.jsonl"))


def test_answers_are_written_in_input_order_and_an_interrupted_run_keeps_what_it_answered(tmp_path):
    out = tmp_path / "answers.jsonl"
    writer = OrderedWriter(out, {})
    writer.resolve(2, {"id": "c"})
    writer.resolve(0, {"id": "a"})
    writer.resolve(4, {"id": "e"})
    writer.close()  # stopped here: 1 and 3 never answered
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "c", "e"]
    assert not list(tmp_path.glob(".*.partial*"))

    earlier = read_answered(out)
    writer = OrderedWriter(out, {0: earlier["a"], 2: earlier["c"], 4: earlier["e"]})
    writer.resolve(3, {"id": "d"})
    writer.resolve(1, None)  # failed this time: a gap, nothing written
    writer.close()
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "c", "d", "e"]


def test_a_line_cut_off_by_a_killed_run_is_not_an_answer_and_its_partial_file_is_read(tmp_path):
    out = tmp_path / "answers.jsonl"
    out.write_text('{"id": "1", "answer": "cold"}\n')
    partial_of(out).write_text('{"id": "1", "answer": "cold"}\n{"id": "2", "answer": "small"}\n{"id": "3", "ans')
    assert list(read_answered(out)) == ["1", "2"]


def test_the_service_name_answers_the_champion_and_another_version_only_by_a_listed_name():
    assert served_name(["svc"], "svc", None, 3, "gw") == "svc"
    assert served_name(["svc"], "svc", 3, 3, "gw") == "svc"
    assert served_name(["svc", "svc-v4"], "svc", 4, 3, "gw") == "svc-v4"
    with pytest.raises(BadInput, match=r"--version 4: gw answers only as svc \(its champion, v3\)"):
        served_name(["svc"], "svc", 4, 3, "gw")
    with pytest.raises(BadInput, match="gw serves other, not svc"):
        served_name(["other"], "svc", None, None, "gw")


def service(busy_first: set[str], refused: set[str], seen: list[str]):
    """A chat endpoint answering each prompt upper-cased after a random delay; `busy_first` prompts get one 503
    first, `refused` ones a 400."""

    async def answer(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["messages"][-1]["content"]
        seen.append(prompt)
        await asyncio.sleep(random.uniform(0, 0.02))
        if prompt in busy_first:
            busy_first.discard(prompt)
            return httpx.Response(503, headers={"retry-after": "0"}, json={"error": {"message": "queue full"}})
        if prompt in refused:
            return httpx.Response(400, json={"error": {"message": "max_tokens over the context"}})
        body = {
            "choices": [{"message": {"content": prompt.upper()}, "finish_reason": "stop"}],
            "usage": {"completion_tokens": 1},
        }
        return httpx.Response(200, json=body)

    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


def test_answers_keep_input_order_busy_rows_are_retried_and_refused_ones_reported(tmp_path):
    data = tmp_path / "prompts.txt"
    data.write_text("".join(f"p{i}\n" for i in range(40)))
    rows, out, errors = read_rows(str(data)), tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
    seen: list[str] = []
    client = service({"p3", "p17"}, {"p9"}, seen)
    summary = asyncio.run(predict_rows(rows, Requests("http://svc", "svc"), out, errors, 8, client))
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["answer"] for r in written] == [f"P{i}" for i in range(40) if i != 9]
    assert (summary.answered, summary.failed, summary.service_failures) == (39, 1, 0)
    assert [json.loads(line) for line in errors.read_text().splitlines()] == [
        {
            "id": "10", "line": 10, "where": f"data file {data} line 10",
            "error": "HTTP 400: max_tokens over the context", "kind": "refused",
        }
    ]  # fmt: skip

    seen.clear()  # a rerun sends only the row that failed, and writes every row once
    asyncio.run(predict_rows(rows, Requests("http://svc", "svc"), out, errors, 8, service(set(), set(), seen)))
    assert seen == ["p9"] and not errors.exists()
    assert [json.loads(line)["answer"] for line in out.read_text().splitlines()] == [f"P{i}" for i in range(40)]


def test_an_interrupted_run_leaves_a_valid_output_and_the_rerun_completes_it(tmp_path):
    data = tmp_path / "prompts.txt"
    data.write_text("".join(f"p{i}\n" for i in range(30)))
    rows, out, errors = read_rows(str(data)), tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
    seen: list[str] = []

    async def interrupted():
        run = asyncio.ensure_future(
            predict_rows(rows, Requests("http://svc", "svc"), out, errors, 4, service(set(), set(), seen))
        )
        while len(seen) < 12:
            await asyncio.sleep(0.001)
        run.cancel()  # what asyncio.run does to its task on Ctrl-C
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(interrupted())
    first = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert 0 < len(first) < 30 and first == sorted(first, key=int)
    sent_before = list(seen)
    seen.clear()
    asyncio.run(predict_rows(rows, Requests("http://svc", "svc"), out, errors, 4, service(set(), set(), seen)))
    final = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert final == [str(i) for i in range(1, 31)]  # each row once, in input order
    assert not set(seen) & {f"p{int(i) - 1}" for i in first} and len(sent_before) >= 12


def test_a_model_the_service_refuses_stops_the_run_with_its_reason_instead_of_failing_each_row(tmp_path):
    """A version the gateway lists but will not answer by name (serve.version_pinning off): one line naming the
    setting, exit 2 (BadInput), not a 400 in the errors file for every row."""
    from tasks.platform.errors import BadInput

    data = tmp_path / "prompts.txt"
    data.write_text("".join(f"p{i}\n" for i in range(20)))
    reason = "model 'svc-v2' is a version of 'svc'; pinning a version is off here (serve.version_pinning)"

    async def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": reason, "param": "model"}})

    client = httpx.AsyncClient(transport=httpx.MockTransport(refuse))
    requests = Requests("http://svc", "svc-v2")
    out, errors = tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
    with pytest.raises(BadInput, match=r"refused the model 'svc-v2': .*serve.version_pinning"):
        asyncio.run(predict_rows(read_rows(str(data)), requests, out, errors, 4, client))
    assert not errors.exists() or "serve.version_pinning" not in errors.read_text()
