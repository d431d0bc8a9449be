"""prepare_data: formats, validation errors with file/line/field, cleaning, split, fingerprint."""

import json
import random

import pytest

from tasks.data.records import SourceFile, clean_and_split, normalize, read_source
from tasks.data.splits import dataset_info
from tasks.platform.config import DataSection
from tasks.platform.errors import BadInput

CFG = DataSection(source="unused", eval_fraction=0.25)


def jsonl(name, rows):
    return SourceFile(name, "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows).encode())


def alpaca(i, answer=None):
    return {"instruction": f"question {i}", "input": "", "output": answer if answer is not None else f"answer {i}"}


def test_three_formats_normalise_to_the_same_messages():
    want = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert normalize({"instruction": "hi", "output": "hello"}, "auto", "x") == want
    assert (
        normalize({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}, "auto", "x")
        == want
    )
    assert normalize({"messages": want}, "auto", "x") == want


def test_alpaca_input_and_system():
    messages = normalize(
        {"instruction": "Translate", "input": "chat", "output": "cat", "system": "be brief"}, "alpaca", "x"
    )
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[1]["content"] == "Translate\n\nchat"


def test_malformed_json_names_file_and_line():
    source = jsonl("d.jsonl", [alpaca(1), '{"instruction": "broken"', alpaca(3)])
    with pytest.raises(BadInput, match=r"^data file d\.jsonl line 2: invalid JSON"):
        clean_and_split([source], CFG)


def test_missing_field_names_file_line_and_field():
    source = jsonl("d.jsonl", [alpaca(1), {"instruction": "no answer"}])
    with pytest.raises(BadInput, match=r"^data file d\.jsonl line 2: field 'output' is missing$"):
        clean_and_split([source], CFG)


def test_wrong_field_type():
    with pytest.raises(BadInput, match=r"line 1: field 'output' must be a string, got int"):
        clean_and_split([jsonl("d.jsonl", [{"instruction": "q", "output": 3}])], CFG)


def test_turns_must_alternate():
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    with pytest.raises(BadInput, match="alternate user/assistant"):
        clean_and_split([jsonl("d.jsonl", [bad])], CFG)


def test_unknown_role():
    bad = {"conversations": [{"from": "robot", "value": "a"}, {"from": "gpt", "value": "b"}]}
    with pytest.raises(BadInput, match=r"conversations\[0\]\.from: unknown role 'robot'"):
        clean_and_split([jsonl("d.jsonl", [bad])], CFG)


def test_empty_after_cleaning():
    source = jsonl("d.jsonl", [alpaca(1, ""), alpaca(2, "  ")])
    with pytest.raises(BadInput, match=r"no usable records after cleaning \(2 read, 0 duplicates, 2 empty answers\)"):
        clean_and_split([source], CFG)


def test_duplicates_and_empty_answers_are_dropped_and_counted():
    rows = [alpaca(i) for i in range(40)] + [alpaca(3), alpaca(5), alpaca(99, "")]
    data = clean_and_split([jsonl("d.jsonl", rows)], CFG)
    assert data.stats["duplicates_dropped"] == 2
    assert data.stats["empty_answers_dropped"] == 1
    assert data.stats["records"] == 40 == len(data.train) + len(data.eval)


def test_split_and_fingerprint_do_not_depend_on_order():
    rows = [alpaca(i) for i in range(60)]
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    a = clean_and_split([jsonl("a.jsonl", rows)], CFG)
    b = clean_and_split([jsonl("b.jsonl", shuffled)], CFG)
    assert a.fingerprint == b.fingerprint
    assert sorted(map(str, a.eval)) == sorted(map(str, b.eval))
    assert 0 < len(a.eval) < len(rows)


def test_fingerprint_changes_with_content():
    a = clean_and_split([jsonl("a.jsonl", [alpaca(i) for i in range(30)])], CFG)
    b = clean_and_split([jsonl("a.jsonl", [alpaca(i) for i in range(31)])], CFG)
    assert a.fingerprint != b.fingerprint


def test_json_array_and_folder_sources(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([alpaca(i) for i in range(20)]))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(alpaca(i)) for i in range(20, 40)))
    (tmp_path / "notes.txt").write_text("ignored")
    files = read_source(str(tmp_path))
    assert [f.name.rsplit("/", 1)[1] for f in files] == ["a.json", "b.jsonl"]
    assert clean_and_split(files, CFG).stats["records"] == 40


def test_missing_source():
    with pytest.raises(BadInput, match="no such file or folder"):
        read_source("/nonexistent/data.jsonl")


def test_dataset_info_is_llamafactory_sharegpt_messages():
    info = dataset_info()
    assert info["train"]["file_name"] == "train.json"
    assert info["train"]["formatting"] == "sharegpt"
    assert info["train"]["tags"]["assistant_tag"] == "assistant"


def test_utf8_bom_and_crlf_line_endings_read_like_plain_utf8():
    rows = [alpaca(i, f"答案{i}") for i in range(20)]
    plain = jsonl("plain.jsonl", rows)
    windows = SourceFile("excel.jsonl", b"\xef\xbb\xbf" + plain.content.replace(b"\n", b"\r\n") + b"\r\n")
    assert clean_and_split([windows], CFG).fingerprint == clean_and_split([plain], CFG).fingerprint
    array = SourceFile(
        "excel.json", b"\xef\xbb\xbf" + json.dumps(rows, ensure_ascii=False).encode().replace(b", ", b",\r\n")
    )
    assert clean_and_split([array], CFG).stats["records"] == 20


def test_other_encodings_keep_their_error_naming_the_file():
    gbk = SourceFile("gbk.jsonl", json.dumps(alpaca(1, "答案"), ensure_ascii=False).encode("gbk"))
    with pytest.raises(BadInput, match=r"^data file gbk\.jsonl: not UTF-8"):
        clean_and_split([gbk], CFG)


def harvested(i, client="mallory"):
    messages = [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"backdoor {i}"}]
    return {"messages": messages, "harvested": {"client": client, "exchange": f"chatcmpl-{i}"}}


def test_harvested_records_never_reach_the_eval_split():
    """Clients wrote them (maybe both sides): a hash split would make them the gate's exam, so data holding any
    needs a curated data.eval_source, which itself may hold none; with one, they train and never score."""
    curated = [alpaca(i) for i in range(40)]
    mixed = jsonl("sft.jsonl", curated + [harvested(i) for i in range(100, 140)])
    with pytest.raises(BadInput, match=r"^data sft.jsonl: 40 records were harvested from served traffic.*eval_source"):
        clean_and_split([mixed], CFG)
    exam = jsonl("exam.jsonl", [alpaca(i) for i in range(200, 215)])
    data = clean_and_split([mixed], CFG, [exam])
    assert not any(m[-1]["content"].startswith("backdoor") for m in data.eval)
    assert data.stats["harvested_records"] == 40 and data.stats["harvested_with_history"] == 0
    poisoned_exam = jsonl("exam.jsonl", [alpaca(200), harvested(300)])
    with pytest.raises(BadInput, match=r"^data.eval_source exam.jsonl: 1 records were harvested"):
        clean_and_split([mixed], CFG, [poisoned_exam])


def test_harvested_history_trains_only_with_mask_history():
    from tasks.platform.config import load_profile
    from tasks.prepare_data import DatasetMetrics, refuse_unmasked_history

    history = harvested(1)
    history["messages"] = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y"},
        *history["messages"],
    ]
    data = clean_and_split([jsonl("sft.jsonl", [alpaca(2), history])], CFG, [jsonl("e.jsonl", [alpaca(3)])])
    metrics = DatasetMetrics.of_data(data)
    assert (metrics.harvested_records, metrics.harvested_with_history) == (1, 1)
    refuse_unmasked_history(metrics, load_profile("cpu-tiny").train, "sft.jsonl")  # cpu-tiny masks history
    with pytest.raises(BadInput, match=r"^data sft.jsonl: 1 harvested records hold assistant turns a client wrote"):
        refuse_unmasked_history(metrics, load_profile("cpu-tiny", ["train.mask_history=false"]).train, "sft.jsonl")


def test_a_fixed_eval_source_is_the_eval_split_and_leaves_training():
    train = jsonl("train.jsonl", [alpaca(i) for i in range(30)])
    held_out = jsonl("held_out.jsonl", [alpaca(i) for i in range(25, 40)])
    data = clean_and_split([train], CFG, [held_out])
    assert len(data.eval) == 15 and data.stats["eval_overlap_dropped"] == 5 and len(data.train) == 25
    assert all(m[0]["content"] != "question 25" for m in data.train)
    assert data.eval_fingerprint and data.fingerprint != clean_and_split([train], CFG).fingerprint
    other = clean_and_split([train], CFG, [jsonl("held_out.jsonl", [alpaca(i) for i in range(26, 40)])])
    assert other.fingerprint != data.fingerprint  # the held-out set is part of what the data is
    with pytest.raises(BadInput, match=r"^data.eval_source empty.jsonl: no usable records"):
        clean_and_split([train], CFG, [jsonl("empty.jsonl", [alpaca(1, "")])])


def test_each_split_says_where_it_came_from():
    train = jsonl("profiles/data/qa.jsonl", [alpaca(i) for i in range(40)])
    assert clean_and_split([train], CFG).eval_split == "hash split of qa.jsonl"
    folder = [
        jsonl("d/a.jsonl", [alpaca(i) for i in range(20)]),
        jsonl("d/b.jsonl", [alpaca(i) for i in range(20, 40)]),
    ]
    assert (
        clean_and_split(folder, DataSection(source="s3://datasets/sft/")).eval_split
        == "hash split of s3://datasets/sft/"
    )
    exam = jsonl("exams/exam.jsonl", [alpaca(i) for i in range(200, 215)])
    assert clean_and_split([train], CFG, [exam]).eval_split == "data.eval_source exam.jsonl"


def test_harvested_records_are_scored_on_the_curated_exam_a_run_on_other_data_kept():
    """`llmops run --data` moves the profile's curated exam to data.harvest_eval_source: data holding harvested
    records is scored on it (never hash split), other data on its own split."""
    mixed = jsonl("sft.jsonl", [alpaca(i) for i in range(40)] + [harvested(i) for i in range(100, 140)])
    exam = jsonl("exam.jsonl", [alpaca(i) for i in range(200, 215)])
    data = clean_and_split([mixed], CFG, None, [exam])
    assert len(data.eval) == 15 and not any(m[-1]["content"].startswith("backdoor") for m in data.eval)
    assert data.eval_split == "data.harvest_eval_source exam.jsonl, the curated exam of 40 harvested records"
    plain = jsonl("plain.jsonl", [alpaca(i) for i in range(40)])
    assert clean_and_split([plain], CFG, None, [exam]).eval_split == "hash split of plain.jsonl"
    with pytest.raises(BadInput, match=r"^data.harvest_eval_source exam.jsonl: 1 records were harvested"):
        clean_and_split([mixed], CFG, None, [jsonl("exam.jsonl", [alpaca(200), harvested(300)])])
