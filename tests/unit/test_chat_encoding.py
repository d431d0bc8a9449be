"""One prompt encoding from training to serving: every copy of encode_prompt gives the same token ids,
and the train/serve contract names each kind of mismatch."""

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from tasks.base_model import CHATML_TEMPLATE, train_tokenizer
from tasks.platform.errors import CheckFailed
from tasks.quality.chat import encode_prompt, prompt_ids, serving_request
from tasks.quality.contract import PROBES, read_contract, require_same

ROOT = Path(__file__).resolve().parents[2]
SERVING_MODELS = [
    "infra/triton/llm/1/model.py",
    "infra/triton/vllm/1/model.py",
    "infra/triton/tensorrtllm/preprocessing/1/model.py",
]
CONVERSATIONS = PROBES  # English and Chinese, with and without a system prompt, multi-turn


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    texts = ["\n".join(m["content"] for m in c) for c in CONVERSATIONS] * 4
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(texts, 300).save_pretrained(folder)
    return folder


def serving_copy(path: str):
    """A Triton model file imported outside Triton (its pb_utils import is a stand-in: only encode_prompt runs)."""
    sys.modules.setdefault("triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    spec = importlib.util.spec_from_file_location(f"serving_{Path(path).parent.parent.name}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", SERVING_MODELS)
def test_every_serving_copy_encodes_like_training(path, tokenizer_dir):
    from tasks.quality.models import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    model = serving_copy(path)
    for conversation in CONVERSATIONS:
        text, history = serving_request(conversation)
        served = model.encode_prompt(tokenizer, text, model.chat_history(json.dumps(history, ensure_ascii=False)), True)
        assert served == prompt_ids(tokenizer, conversation) == encode_prompt(tokenizer, text, history, True)
        assert model.encode_prompt(tokenizer, text, [], False) == encode_prompt(tokenizer, text, [], False)
    with pytest.raises(ValueError, match="chat_history must be a JSON list"):
        model.chat_history('{"role": "system"}')


def test_the_system_prompt_reaches_the_prompt(tokenizer_dir):
    from tasks.quality.models import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    with_system = tokenizer.decode(prompt_ids(tokenizer, CONVERSATIONS[3]))
    assert with_system.startswith("<|im_start|>system\n你是一名理财顾问。<|im_end|>")
    assert with_system.endswith("<|im_start|>assistant\n")


def changed(tokenizer_dir: Path, tmp_path: Path, edit) -> Path:
    from tasks.quality.models import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    edit(tokenizer)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "edit, named",
    [
        (
            lambda t: setattr(
                t, "chat_template", CHATML_TEMPLATE.replace("'<|im_start|>' + message['role']", "message['role']")
            ),
            "chat template",
        ),
        (lambda t: setattr(t, "eos_token", "<|endoftext|>"), "eos_token_id"),
        (lambda t: setattr(t, "pad_token", "<|im_start|>"), "pad_token_id"),
        (
            lambda t: t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<tool_call>"]}),
            "special tokens",
        ),
    ],
)
def test_the_contract_names_each_kind_of_mismatch(tokenizer_dir, tmp_path, edit, named):
    trained = read_contract(tokenizer_dir)
    assert not require_same(trained, read_contract(tokenizer_dir), "same")
    with pytest.raises(
        CheckFailed, match=rf"^train/serve contract: the serving config differs from training: .*{named}"
    ):
        require_same(trained, read_contract(changed(tokenizer_dir, tmp_path, edit)), "the serving config")


def test_a_generation_config_stop_id_joins_the_contract(tokenizer_dir, tmp_path):
    trained = read_contract(tokenizer_dir)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [trained.eos_token_id, 0]}))
    with pytest.raises(CheckFailed, match=r"stop_token_ids \[0, \d+\] \(trained with \[\d+\]\)"):
        require_same(trained, read_contract(tokenizer_dir, tmp_path), "the merged model")


def test_chinese_streams_whole_characters_even_when_tokens_split_them(tokenizer_dir):
    """A byte-level tokenizer that has not seen a character splits it over several tokens; decoding a prefix
    of them gives U+FFFD. The streamed pieces (tasks/quality/chat.py:stream_delta and the llm model's copy) never
    carry a broken character and add up to the whole answer."""
    from tasks.quality.chat import stream_delta
    from tasks.quality.models import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    answer = "利率下调，债券价格上涨。 Rates fell; bonds rose."
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    prefixes = [tokenizer.decode(ids[:n], skip_special_tokens=True) for n in range(1, len(ids) + 1)]
    assert any(p.endswith("\ufffd") for p in prefixes), "the test needs a character split over tokens"
    copies = [
        serving_copy(path).stream_delta
        for path in (
            "infra/triton/llm/1/model.py",
            "infra/triton/vllm/1/model.py",
            "infra/triton/tensorrtllm/bls/1/model.py",
        )
    ]
    for delta_of in (stream_delta, *copies):
        sent, pieces = "", []
        for n, text in enumerate(prefixes, 1):
            delta, sent = delta_of(text, sent, final=n == len(ids))
            pieces.append(delta)
        assert "".join(pieces) == answer and not any("\ufffd" in p for p in pieces)
        naive = [prefixes[0]] + [b[len(a) :] for a, b in zip(prefixes, prefixes[1:], strict=False)]
        assert "".join(naive) != answer  # what slicing the text without holding back sends
