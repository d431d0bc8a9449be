"""The text helpers every served Triton model runs: request inputs, the chat history, the prompt's token ids,
the streamed deltas; and the forwarding of the models that only forward (the router, an adapter's model). Defined once here and copied next to each rendered model's model.py
(tasks/serving/repository.py:render_model), so the served models encode exactly as training does
(tasks/quality/chat.py re-exports encode_prompt and stream_delta from here).

Standard library only, and no project import: the copy runs inside Triton's Python-backend stub, whose
sys.path has the model's version folder (where the copy lies) but not this project, in NGC images too.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from typing import Any

# The file name of the copy in a rendered model's version folder; model.py imports it by this name. Distinct
# from any installed package: the stub appends the version folder to sys.path, after site-packages.
FILE_NAME = "model_text.py"

# How long a forwarding model holds a finished BLS stream before letting go of it. In Triton 2.51's Python backend
# (python_backend as of a2564ea, 2024-10-08, the r24.10 era) the stub's own map holds each decoupled BLS stream (a
# ResponseIterator, with every response it received) until a cleanup message is handled on the stub's utils thread
# (src/pb_stub.cc:1159-1191, Stub::SendCleanupId erases it from response_iterator_map_). Where Python let go of a
# stream first, that erase destroyed it on the utils thread, which does not hold the GIL, and ~PbTensor released
# the responses' numpy arrays there (src/pb_tensor.cc:502-506; upstream holds the GIL for it since b771f4f,
# 2024-12-11, "Hold GIL when deleting numpy array"): Python objects freed without the GIL, a cause of the heap
# corruption that killed router and adapter stubs under load ("malloc(): unaligned fastbin chunk detected"). Held
# this long, the stub's cleanup comes first and the stream ends where Python drops it, with the GIL.
STREAM_HOLD_S = 5.0


def input_value(request: Any, name: str, default: Any) -> Any:
    """The value of a request's scalar input `name` (a str for a BYTES input), or `default` when it was not sent.
    As pb_utils.get_input_tensor_by_name, through the request's own inputs()."""
    tensor = next((t for t in request.inputs() if t.name() == name), None)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item()


def chat_history(text: str) -> list[dict[str, str]]:
    """The optional `chat_history` input: a JSON list of earlier {role, content} messages (a system prompt among them)."""
    if not text:
        return []
    history = json.loads(text)
    if not isinstance(history, list) or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in history):
        raise ValueError("chat_history must be a JSON list of {role, content} messages")
    return history


def encode_prompt(tokenizer: Any, text: str, history: list, apply_chat_template: bool) -> list[int]:
    """Token ids of a prompt: `history` (earlier messages, a system prompt among them) then the user's `text`,
    through the tokenizer's chat template with the assistant's generation prompt; or `text` alone, raw."""
    if not apply_chat_template:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(
        [*history, {"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def scored_token(
    tokenizer: Any, byte_of: dict[str, int], special: frozenset[int], token_id: int, logprob: float
) -> dict[str, Any]:
    """One answer token with its log probability, as OpenAI's chat logprobs spell it: {token, logprob, bytes}.
    `byte_of`: GPT-2's byte-level alphabet (transformers' bytes_to_unicode, inverted), in which a byte-level BPE
    token (Qwen2's) spells each of its bytes, so a token of half a character gets its own bytes, not U+FFFD's;
    another tokenizer's token gets its text's UTF-8. A `special` token is "" with no bytes, as the answer's text
    (decoded without special tokens) has it."""
    text = tokenizer.decode([token_id], skip_special_tokens=True)
    spelled = tokenizer.convert_ids_to_tokens(token_id)
    if token_id in special:
        raw = []
    elif isinstance(spelled, str) and spelled and all(char in byte_of for char in spelled):
        raw = [byte_of[char] for char in spelled]
    else:
        raw = list(text.encode("utf-8"))
    return {"token": text, "logprob": float(logprob), "bytes": raw}


def stream_delta(text: str, sent: str, final: bool) -> tuple[str, str]:
    """What to stream next: the decoded answer so far is `text`, the client has `sent`. Decoding the whole
    answer each step (not token by token) keeps leading spaces and merges; a trailing U+FFFD is the first
    bytes of a character whose other bytes are still to come (a Chinese character split over byte-level
    tokens), so it is held back until the character is whole or the answer ends. Returns (delta, new sent)."""
    if not final:
        text = text.rstrip("\ufffd")
    if not text.startswith(sent):  # the decoder revised what was sent (rare): never send a wrong delta
        return "", sent
    return text[len(sent) :], text


class Forwarder:
    """The execute of a model that forwards each request, whole and streaming, to another model (BLS): the router
    and an adapter's model. Each request goes to a worker thread, so `execute` returns at once and concurrent
    requests reach the model behind together (it batches them); at most `max_in_flight` are forwarded at once, and
    the next is refused at once with UNAVAILABLE (HTTP 503) rather than waiting without bound in the workers' queue.
    `pb_utils`: the stub's triton_python_backend_utils, which only exists inside Triton."""

    def __init__(self, pb_utils: Any, max_in_flight: int, thread_name_prefix: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pb_utils, self.max_in_flight = pb_utils, max_in_flight
        self.workers = ThreadPoolExecutor(max_workers=64, thread_name_prefix=thread_name_prefix)
        self.in_flight, self.count_lock = 0, threading.Lock()
        self.finished: deque[tuple[float, Any]] = deque()  # (when to let go, BLS stream): see STREAM_HOLD_S

    def execute(self, requests: list, route: Any) -> None:
        """Forward each request where `route(request)` says: (model name, inputs). The request is read here, in the
        stub's own thread, before `execute` returns (as Triton's decoupled examples do): its inputs are copied and
        only the copies and its response sender go to a worker thread."""
        pb_utils = self.pb_utils
        for request in requests:
            sender = request.get_response_sender()
            with self.count_lock:
                admitted = self.in_flight < self.max_in_flight
                self.in_flight += admitted
            if admitted:
                model_name, inputs = route(request)
                copies = [pb_utils.Tensor(tensor.name(), tensor.as_numpy()) for tensor in inputs]
                self.workers.submit(self.forward, sender, model_name, copies)
                continue
            busy = pb_utils.TritonError(
                f"the service has {self.max_in_flight} requests in flight; retry shortly",
                pb_utils.TritonError.UNAVAILABLE,
            )
            sender.send(pb_utils.InferenceResponse(error=busy), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def forward(self, sender: Any, model_name: str, inputs: list) -> None:
        stream = None
        try:
            stream = relay(self.pb_utils, sender, model_name, inputs)
        finally:
            with self.count_lock:
                self.in_flight -= 1
            self.hold(stream)

    def hold(self, stream: Any) -> None:
        """Keep a finished BLS stream for STREAM_HOLD_S, and let go of those held longer (here, with the GIL)."""
        now, expired = time.monotonic(), []
        with self.count_lock:
            if stream is not None:
                self.finished.append((now + STREAM_HOLD_S, stream))
            while self.finished and self.finished[0][0] <= now:
                expired.append(self.finished.popleft()[1])
        expired.clear()

    def shutdown(self) -> None:
        self.workers.shutdown(wait=True)  # an unload or a reload waits for requests in flight to finish
        self.finished.clear()


def relay(pb_utils: Any, sender: Any, model_name: str, inputs: list) -> Any:
    """Send `inputs` to `model_name` (decoupled) and stream its text back to a request's `sender`; an error becomes the
    request's final error response. Returns the BLS stream, for the caller to hold (STREAM_HOLD_S); None where there
    was none."""
    stream = None
    # logprobs only where the request asks for them: the llmapi model has no such output
    names = ["text_output", *(["logprobs"] if any(t.name() == "logprobs" for t in inputs) else [])]
    try:
        call = pb_utils.InferenceRequest(model_name=model_name, inputs=inputs, requested_output_names=names)
        stream = call.exec(decoupled=True)
        for response in stream:
            if response.has_error():
                raise RuntimeError(response.error().message())
            outputs = [pb_utils.get_output_tensor_by_name(response, name) for name in names]
            if outputs[0] is not None:
                # copies, not the BLS response's own tensors, which go with the response
                copies = [
                    pb_utils.Tensor(n, o.as_numpy()) for n, o in zip(names, outputs, strict=True) if o is not None
                ]
                sender.send(pb_utils.InferenceResponse(output_tensors=copies))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception as exc:
        sender.send(
            pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )
    return stream
