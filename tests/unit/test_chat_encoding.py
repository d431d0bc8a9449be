"""One prompt encoding from training to serving: every served model runs the one copy of the text helpers
(tasks/text/model_text.py, copied into each rendered model folder) and encodes as training does, and the
train/serve contract names each kind of mismatch."""

import ast
import base64
import importlib.util
import inspect
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from tasks.base_model import CHATML_TEMPLATE, train_tokenizer
from tasks.platform.config import load_profile
from tasks.platform.errors import CheckFailed
from tasks.quality.chat import encode_prompt, prompt_ids, serving_request, stream_delta
from tasks.quality.contract import PROBES, read_contract, require_same
from tasks.serving import adapter_registry
from tasks.serving.client import load_parameters
from tasks.serving.model_config import serving_model
from tasks.serving.repository import render_model
from tasks.text import model_text

CONVERSATIONS = PROBES  # English and Chinese, with and without a system prompt, multi-turn
PROMPT_ENCODERS = ["llm", "vllm", "llmapi"]  # the models that turn a request into token ids
STREAMERS = ["llm", "vllm", "llmapi"]  # the models that detokenize a streamed answer


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    """Every kind of served model, rendered as a release renders it: {template: rendered folder}."""
    repository = tmp_path_factory.mktemp("repository")
    models = {
        "svc-v1": serving_model(load_profile("cpu-tiny"), Path("/m"), "a" * 64),
        "svc-v2": serving_model(load_profile("cpu-tiny", ["serve.backend=vllm"]), Path("/m"), "a" * 64),
        "svc-v3": serving_model(load_profile("qwen-7b-qlora-2xa10"), Path("/checkpoints/v3"), "e" * 64, 40960),
        "svc-v4": ("lora", {"base_model": "svc-base", "adapter_dir": "/a", "artifact_sha256": "b@c"}),
    }
    return {template: render_model(template, repository, name, values) for name, (template, values) in models.items()}


def served_model(folder: Path, monkeypatch) -> types.ModuleType:
    """A rendered model's model.py imported as Triton's Python-backend stub imports it: with its version folder
    on sys.path, where `model_text` must be found (pb_utils is a stand-in: only the text helpers run)."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    monkeypatch.syspath_prepend(str(folder / "1"))
    spec = importlib.util.spec_from_file_location(f"served_{folder.name}", folder / "1" / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.pop("model_text", None)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop("model_text", None)  # the next model imports its own folder's copy
    return module


def test_every_python_backend_model_carries_the_one_copy_of_the_text_helpers(rendered):
    python_models = {template for template, folder in rendered.items() if (folder / "1" / "model.py").is_file()}
    assert python_models == {"llm", "vllm", "llmapi", "lora"}
    for helper_module in (model_text, adapter_registry):
        helper = Path(helper_module.__file__).read_bytes()
        for template in python_models:
            folder = rendered[template]
            assert (folder / "1" / helper_module.FILE_NAME).read_bytes() == helper, template
            # what a load request sends when the server has no shared repository (tasks/serving/client.py)
            sent = load_parameters(folder)[f"file:1/{helper_module.FILE_NAME}"]
            assert base64.b64decode(sent) == helper


@pytest.mark.parametrize("helper_module", [model_text, adapter_registry])
def test_the_copied_helpers_import_only_the_standard_library(helper_module):
    """The copy runs in Triton's Python-backend stub, where neither this project nor its packages are."""
    tree = ast.parse(Path(helper_module.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported and {name.split(".")[0] for name in imported} <= sys.stdlib_module_names


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    texts = ["\n".join(m["content"] for m in c) for c in CONVERSATIONS] * 4
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(texts, 300).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("template", PROMPT_ENCODERS)
def test_every_served_model_encodes_like_training(template, rendered, tokenizer_dir, monkeypatch):
    from tasks.quality.models import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    model = served_model(rendered[template], monkeypatch)
    assert inspect.getfile(model.encode_prompt) == str(rendered[template] / "1" / model_text.FILE_NAME)
    for conversation in CONVERSATIONS:
        text, history = serving_request(conversation)
        served = model.encode_prompt(tokenizer, text, model.chat_history(json.dumps(history, ensure_ascii=False)), True)
        assert served == prompt_ids(tokenizer, conversation) == encode_prompt(tokenizer, text, history, True)
        assert model.encode_prompt(tokenizer, text, [], False) == encode_prompt(tokenizer, text, [], False)
    with pytest.raises(ValueError, match="chat_history must be a JSON list"):
        model.chat_history('{"role": "system"}')


def test_a_request_input_is_its_value_or_the_default():
    """input_value reads a request as pb_utils.get_input_tensor_by_name does (request.inputs(), tensor.name()):
    a BYTES input as text, a numeric one as a Python number, a missing one as the default."""

    class Tensor:  # the two methods of Triton's pb_utils.Tensor that input_value calls
        def __init__(self, name, array):
            self._name, self._array = name, array

        def name(self):
            return self._name

        def as_numpy(self):
            return self._array

    given = [
        Tensor("text_input", np.array([["利率".encode()]], dtype=np.object_)),
        Tensor("max_tokens", np.array([[7]], dtype=np.int32)),
    ]
    request = types.SimpleNamespace(inputs=lambda: given)
    assert model_text.input_value(request, "text_input", None) == "利率"
    max_tokens = model_text.input_value(request, "max_tokens", 16)
    assert max_tokens == 7 and type(max_tokens) is int
    assert model_text.input_value(request, "chat_history", "") == ""


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


def test_chinese_streams_whole_characters_even_when_tokens_split_them(rendered, tokenizer_dir, monkeypatch):
    """A byte-level tokenizer that has not seen a character splits it over several tokens; decoding a prefix
    of them gives U+FFFD. The streamed pieces (tasks/quality/chat.py:stream_delta and each streaming model's
    rendered copy) never carry a broken character and add up to the whole answer."""
    from tasks.quality.models import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    answer = "利率下调，债券价格上涨。 Rates fell; bonds rose."
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    prefixes = [tokenizer.decode(ids[:n], skip_special_tokens=True) for n in range(1, len(ids) + 1)]
    assert any(p.endswith("\ufffd") for p in prefixes), "the test needs a character split over tokens"
    copies = [served_model(rendered[template], monkeypatch).stream_delta for template in STREAMERS]
    for delta_of in (stream_delta, *copies):
        sent, pieces = "", []
        for n, text in enumerate(prefixes, 1):
            delta, sent = delta_of(text, sent, final=n == len(ids))
            pieces.append(delta)
        assert "".join(pieces) == answer and not any("\ufffd" in p for p in pieces)
        naive = [prefixes[0]] + [b[len(a) :] for a, b in zip(prefixes, prefixes[1:], strict=False)]
        assert "".join(naive) != answer  # what slicing the text without holding back sends


def test_the_vllm_model_renders_the_tools_it_is_given_with_the_chat_template(rendered, tokenizer_dir, monkeypatch):
    """The `tools` input (tool_calls.py sends it) reaches the prompt through the template, as vLLM's server renders
    tools; without it the prompt is training's."""
    from tasks.quality.models import load_tokenizer
    from tests.unit.test_tool_calls import TOOLS_TEMPLATE, WEATHER

    tokenizer = load_tokenizer(tokenizer_dir)
    tokenizer.chat_template = TOOLS_TEMPLATE
    model = served_model(rendered["vllm"], monkeypatch)
    tools = model.tool_definitions(json.dumps([WEATHER]))
    prompt = tokenizer.decode(model.encode_prompt(tokenizer, "Weather in Paris?", [], True, tools))
    assert json.dumps(WEATHER) in prompt and prompt.endswith("Weather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    assert model.tool_definitions("") is None
    assert model.encode_prompt(tokenizer, "hi", [], True, None) == encode_prompt(tokenizer, "hi", [], True)
    with pytest.raises(ValueError, match="tools must be a JSON list"):
        model.tool_definitions('{"type": "function", "function": {"name": "f"}}')
