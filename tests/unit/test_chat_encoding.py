"""One prompt encoding from training to serving: every served model runs the one copy of the text helpers
(tasks/serving/model_text.py, copied into each rendered model folder) and encodes as training does, and the
train/serve contract names each kind of mismatch."""

import ast
import base64
import functools
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
from tasks.serving import model_text
from tasks.serving.client import load_parameters
from tasks.serving.model_config import serving_model
from tasks.serving.repository import render_model

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
        "svc": ("router", {"max_batch_size": 8, "max_in_flight": 64, "routes": "svc-v1=90,svc-v2=10", "shadow": ""}),
        "svc-v3": serving_model(load_profile("qwen-7b-qlora-2xa10"), Path("/checkpoints/v3"), "e" * 64, 40960),
        "svc-v4": (
            "adapter",
            {
                "max_batch_size": 8,
                "base_model": "svc-base",
                "adapter_dir": "/a",
                "artifact_sha256": "b@c",
                "max_in_flight": 64,
            },
        ),
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
    helper = Path(model_text.__file__).read_bytes()
    python_models = {template for template, folder in rendered.items() if (folder / "1" / "model.py").is_file()}
    assert python_models == {"llm", "vllm", "router", "llmapi", "adapter"}
    for template in python_models:
        folder = rendered[template]
        assert (folder / "1" / model_text.FILE_NAME).read_bytes() == helper, template
        # what a load request sends when the server has no shared repository (tasks/serving/client.py)
        sent = load_parameters(folder)[f"file:1/{model_text.FILE_NAME}"]
        assert base64.b64decode(sent) == helper


def test_the_text_helpers_import_only_the_standard_library():
    """The copy runs in Triton's Python-backend stub, where neither this project nor its packages are."""
    tree = ast.parse(Path(model_text.__file__).read_text())
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


class ForwardedRequest:
    """A request as the router's execute reads it, whose sender notes what is sent: (code, message, flags)."""

    def __init__(self, sent: list) -> None:
        self.sent = sent

    def inputs(self) -> list:
        return []

    def get_response_sender(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(send=lambda response, flags: self.sent.append((response.c, response.m, flags)))


def router_model(rendered, monkeypatch, max_in_flight: int):
    """The rendered router's model, initialized, with pb_utils a stand-in for the calls its Forwarder makes."""
    stand_in = types.SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
        TritonError=type(
            "TritonError", (), {"UNAVAILABLE": 14, "__init__": lambda self, m, c: vars(self).update(m=m, c=c)}
        ),
        InferenceResponse=lambda error: error,
    )
    router = served_model(rendered["router"], monkeypatch)
    monkeypatch.setattr(router, "pb_utils", stand_in)
    model = router.TritonPythonModel()
    parameters = {"routes": "svc-v1=100", "max_in_flight": str(max_in_flight)}
    model.initialize(
        {"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in parameters.items()}})}
    )
    return router, model


def test_the_router_refuses_requests_past_its_bound_in_flight_at_once(rendered, monkeypatch):
    """Past max_in_flight requests being forwarded, the router answers the next one at once with UNAVAILABLE
    (Triton's HTTP 503) instead of queueing it in its worker pool; a finished request frees its place. pb_utils
    is a stand-in for the calls that decide this; the router on a real Triton: tests/integration/test_serving.py."""
    import threading
    import time

    router, model = router_model(rendered, monkeypatch, max_in_flight=2)
    release, refused = threading.Event(), []
    # the BLS call the workers make (model_text.relay, shared with the adapter models' Forwarder) waits
    monkeypatch.setitem(router.Forwarder.forward.__globals__, "relay", lambda *args: release.wait(10))
    Request = functools.partial(ForwardedRequest, refused)

    model.execute([Request(), Request(), Request()])
    assert refused == [(14, "the service has 2 requests in flight; retry shortly", 1)]
    release.set()
    deadline = time.monotonic() + 10
    while model.forwarder.in_flight and time.monotonic() < deadline:  # the two forwarded requests finish
        time.sleep(0.01)
    model.execute([Request(), Request()])  # their places are free again
    model.finalize()  # waits for the requests in flight
    assert model.forwarder.in_flight == 0 and len(refused) == 1


def test_the_router_lets_go_of_a_finished_bls_stream_only_after_holding_it(rendered, monkeypatch):
    """Each finished BLS stream is held STREAM_HOLD_S before the worker lets go of it, so the Python backend's own
    cleanup of the stream (on a thread without the GIL) never destroys it (tasks/serving/model_text.py)."""
    import time
    import weakref

    router, model = router_model(rendered, monkeypatch, max_in_flight=2)
    monkeypatch.setitem(router.Forwarder.forward.__globals__, "STREAM_HOLD_S", 0.5)

    class Stream:  # what exec(decoupled=True) returned
        pass

    streams: list[weakref.ref] = []

    def relay(*args):
        stream = Stream()
        streams.append(weakref.ref(stream))
        return stream

    monkeypatch.setitem(router.Forwarder.forward.__globals__, "relay", relay)
    model.execute([ForwardedRequest([])])
    deadline = time.monotonic() + 10
    while (model.forwarder.in_flight or not streams) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert streams[0]() is not None  # finished, and held
    time.sleep(0.6)
    model.execute([ForwardedRequest([])])  # the next finished request lets go of what was held long enough
    while streams[0]() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert streams[0]() is None and streams[1]() is not None
    model.finalize()
