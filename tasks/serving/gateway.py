"""The client-facing endpoint of `llmops serve`: an OpenAI-compatible API and Triton's generate API for
the service's stable name, in front of the Triton the service runs.

It adds what Triton 2.51's HTTP server lacks (tritonserver --help; measured here):
- API keys per client (`Authorization: Bearer KEY`): Triton's `--http-restricted-api` takes one key per
  API group, so clients could not have keys of their own nor lose them one at a time;
- TLS where certificate paths are configured: Triton has TLS for gRPC only;
- a cap on the request size, and JSON only: Triton has no size option, and a form-encoded body of about
  4 MiB crashes it with SIGSEGV on any path, before any key check (triton-inference-server#5840);
- `max_tokens` bounded by the model's context, and errors in each API's own shape: OpenAI's
  `{"error": {"message", "type", "param", "code"}}` on /v1, Triton's `{"error": "..."}` on /v2.

Why our own small gateway (Starlette + httpx + uvicorn, all already in the environment) rather than
Triton's OpenAI-compatible frontend: that frontend runs Triton in-process through the `tritonserver`
Python bindings, which the nvidia-pytriton binary this project serves with does not ship; nginx would
give TLS and a size cap but neither the OpenAI translation nor per-client keys.

Requests go to the router model (the service name), so the canary's weights apply to every client.
Token counts (usage) use the champion's tokenizer; the model checks the context bound itself.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tasks.platform.errors import BadInput
from tasks.quality.chat import encode_prompt

API_KEYS_ENV = "LLMOPS_API_KEYS"  # comma-separated keys
API_KEYS_FILE_ENV = "LLMOPS_API_KEYS_FILE"  # one key a line; `#` comments; a line `NAME: KEY` names its client


@dataclass
class GatewayConfig:
    triton_url: str
    service: str  # the router model: the name clients call
    context_tokens: int  # the model's context (max_position_embeddings)
    default_max_tokens: int = 64
    max_body_bytes: int = 1 << 20
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> client name; empty: no key needed
    tokenizer_dir: Path | None = None
    apply_chat_template: bool = True  # as the served model does (serve.apply_chat_template)


def read_api_keys(environ: dict[str, str]) -> dict[str, str]:
    """API keys from LLMOPS_API_KEYS or the file LLMOPS_API_KEYS_FILE names (never from a profile)."""
    keys: dict[str, str] = {}
    for index, key in enumerate(k.strip() for k in environ.get(API_KEYS_ENV, "").split(",")):
        if key:
            keys[key] = f"client-{index + 1}"
    path = environ.get(API_KEYS_FILE_ENV)
    if path:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise BadInput(f"{API_KEYS_FILE_ENV} {path}: cannot read ({exc.strerror})") from None
        for number, line in enumerate(lines, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, _, key = line.rpartition(":") if ":" in line else ("", "", line)
            key = key.strip()
            if len(key) < 16:
                raise BadInput(f"{API_KEYS_FILE_ENV} {path} line {number}: an API key must be at least 16 characters")
            keys[key] = name.strip() or f"{Path(path).name}:{number}"
    return keys


class RequestError(Exception):
    """A client error: HTTP status, message, and (OpenAI) the parameter it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def openai_error(error: RequestError) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error"}.get(
        error.status, "invalid_request_error" if error.status < 500 else "server_error"
    )
    return JSONResponse(
        {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}},
        status_code=error.status,
        headers={"WWW-Authenticate": "Bearer"} if error.status == 401 else None,
    )


def triton_error(error: RequestError) -> JSONResponse:
    return JSONResponse({"error": error.message}, status_code=error.status)


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.client = httpx.AsyncClient(base_url=config.triton_url, timeout=httpx.Timeout(300, connect=5))
        self.tokenizer = None
        if config.tokenizer_dir is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_dir)

    # --- the checks every request passes --------------------------------------------------------

    def authorize(self, request: Request) -> str:
        """The client's name; anonymous where no key is configured."""
        if not self.config.api_keys:
            return "anonymous"
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise RequestError(401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key")
        for key, name in self.config.api_keys.items():
            if hmac.compare_digest(given.strip().encode(), key.encode()):
                return name
        raise RequestError(401, "invalid API key", code="invalid_api_key")

    async def json_body(self, request: Request) -> dict:
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            raise RequestError(415, "Content-Type must be application/json")
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.config.max_body_bytes:
            raise RequestError(
                413, f"request body of {declared} bytes is over the limit of {self.config.max_body_bytes}"
            )
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.config.max_body_bytes:
                raise RequestError(413, f"request body is over the limit of {self.config.max_body_bytes} bytes")
        try:
            parsed = json.loads(body)
        except ValueError as exc:
            raise RequestError(400, f"request body is not JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise RequestError(400, "request body must be a JSON object")
        return parsed

    def max_tokens(self, body: dict, *names: str) -> int:
        for name in names:
            value = body.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RequestError(400, f"{name} must be a positive integer, got {value!r}", param=name)
            if value > self.config.context_tokens:
                raise RequestError(
                    400,
                    f"{name} {value} is more than the model's context of {self.config.context_tokens} tokens",
                    param=name,
                    code="context_length_exceeded",
                )
            return value
        return min(self.config.default_max_tokens, self.config.context_tokens)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if self.tokenizer and text else 0

    def count_prompt(self, inputs: dict) -> int:
        """The prompt's tokens as the served model encodes them (its chat template included)."""
        if self.tokenizer is None:
            return 0
        history = json.loads(inputs.get("chat_history", "[]"))
        return len(encode_prompt(self.tokenizer, inputs["text_input"], history, self.config.apply_chat_template))

    # --- Triton ---------------------------------------------------------------------------------

    async def generate(self, inputs: dict) -> str:
        response = await self.client.post(f"/v2/models/{self.config.service}/generate", json=inputs)
        if response.status_code != 200:
            raise RequestError(upstream_status(response.status_code), upstream_message(response))
        return response.json()["text_output"]

    async def generate_stream(self, inputs: dict) -> AsyncGenerator[str, None]:
        """The text pieces of Triton's SSE stream; an error event before the first piece raises."""
        request = self.client.build_request(
            "POST", f"/v2/models/{self.config.service}/generate_stream", json={**inputs, "stream": True}
        )
        response = await self.client.send(request, stream=True)
        try:
            if response.status_code != 200:
                await response.aread()
                raise RequestError(upstream_status(response.status_code), upstream_message(response))
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise RequestError(400, str(event["error"]))
                yield event.get("text_output", "")
        finally:
            await response.aclose()

    # --- the routes -----------------------------------------------------------------------------

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "live"})

    async def ready(self, request: Request) -> Response:
        """Ready when the service name answers on Triton (the router and the model behind it are loaded)."""
        try:
            response = await self.client.get(f"/v2/models/{self.config.service}/ready", timeout=5)
            ready = response.status_code == 200
        except httpx.HTTPError:
            ready = False
        return JSONResponse({"status": "ready" if ready else "not ready"}, status_code=200 if ready else 503)

    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request)
        except RequestError as error:
            return openai_error(error)
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": self.config.service, "object": "model", "created": 0, "owned_by": "llmops"}],
            }
        )

    async def chat_completions(self, request: Request) -> Response:
        return await self.openai(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self.openai(request, chat=False)

    async def openai(self, request: Request, chat: bool) -> Response:
        try:
            self.authorize(request)
            body = await self.json_body(request)
            inputs = self.openai_inputs(body, chat)
            stop = stop_sequences(body.get("stop"))
            stream = bool(body.get("stream", False))
            created, ident = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
            if not stream:
                text = await self.generate(inputs)
                text, stopped = cut_at_stop(text, stop)
                completion_tokens = self.count_tokens(text)
                finish = "stop" if stopped or completion_tokens < inputs["max_tokens"] else "length"
                choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                prompt_tokens = self.count_prompt(inputs)
                return JSONResponse(
                    {
                        "id": ident,
                        "object": "chat.completion" if chat else "text_completion",
                        "created": created,
                        "model": self.config.service,
                        "choices": [choice],
                        "usage": {
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens,
                        },
                    }
                )
            pieces = self.generate_stream(inputs)
            first = await anext(pieces, None)  # errors before the first token still get a status code
        except RequestError as error:
            return openai_error(error)
        return StreamingResponse(
            self.openai_events(pieces, first, stop, chat, ident, created, inputs),
            media_type="text/event-stream",
        )

    def openai_inputs(self, body: dict, chat: bool) -> dict:
        """Triton generate inputs for an OpenAI request."""
        if body.get("model") not in (None, self.config.service):
            raise RequestError(404, f"model {body.get('model')!r} is not served here; GET /v1/models lists it", "model")
        if body.get("n", 1) != 1:
            raise RequestError(400, "only n=1 is supported", "n")
        inputs: dict[str, Any] = {"exclude_input_in_output": True}
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError(400, "messages must be a non-empty list", "messages")
            for index, message in enumerate(messages):
                if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                    raise RequestError(400, f"messages[{index}] needs a string content", "messages")
                if message.get("role") not in ("system", "user", "assistant"):
                    raise RequestError(400, f"messages[{index}].role must be system, user or assistant", "messages")
            if messages[-1]["role"] != "user":
                raise RequestError(400, "the last message must be the user's", "messages")
            history = [{"role": m["role"], "content": m["content"]} for m in messages[:-1]]
            inputs["text_input"] = messages[-1]["content"]
            if history:
                inputs["chat_history"] = json.dumps(history, ensure_ascii=False)
            inputs["max_tokens"] = self.max_tokens(body, "max_completion_tokens", "max_tokens")
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise RequestError(400, "prompt must be a string", "prompt")
            inputs["text_input"] = prompt
            inputs["max_tokens"] = self.max_tokens(body, "max_tokens")
        temperature = body.get("temperature")
        if temperature is not None:
            if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature <= 2:
                raise RequestError(400, "temperature must be a number from 0 to 2", "temperature")
            inputs["temperature"] = float(temperature)
        if isinstance(body.get("seed"), int):
            inputs["random_seed"] = body["seed"]
        return inputs

    async def openai_events(
        self,
        pieces: AsyncGenerator[str, None],
        first: str | None,
        stop: list[str],
        chat: bool,
        ident: str,
        created: int,
        inputs: dict,
    ) -> AsyncIterator[bytes]:
        def event(delta: str | None, finish: str | None, usage: dict | None = None) -> bytes:
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {} if delta is None else {"content": delta}}
            else:
                choice = {"index": 0, "text": delta or ""}
            choice["finish_reason"] = finish
            chunk: dict[str, Any] = {
                "id": ident,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": self.config.service,
                "choices": [choice],
            }
            if usage is not None:
                chunk["usage"] = usage
            return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()

        if chat:
            yield f"data: {json.dumps({'id': ident, 'object': 'chat.completion.chunk', 'created': created, 'model': self.config.service, 'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}, 'finish_reason': None}]})}\n\n".encode()
        text, sent, stopped = "", 0, False
        try:
            piece = first
            while piece is not None:
                text += piece
                cut, stopped = cut_at_stop(text, stop)
                # Hold back what could be the start of a stop sequence until the next piece says.
                safe = len(cut) if stopped else len(cut) - held_back(cut, stop)
                if safe > sent:
                    yield event(cut[sent:safe], None)
                    sent = safe
                if stopped:
                    text = cut
                    break
                piece = await anext(pieces, None)
        except RequestError as error:
            yield f"data: {json.dumps({'error': {'message': error.message, 'type': 'server_error', 'param': None, 'code': None}})}\n\n".encode()
            return
        finally:
            await pieces.aclose()
        if not stopped and len(text) > sent:
            yield event(text[sent:], None)
        completion_tokens = self.count_tokens(text)
        prompt_tokens = self.count_prompt(inputs)
        finish = "stop" if stopped or completion_tokens < inputs["max_tokens"] else "length"
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        yield event(None, finish, usage)
        yield b"data: [DONE]\n\n"

    async def triton_generate(self, request: Request) -> Response:
        """Triton's own generate / generate_stream for the service name, with keys and limits."""
        name, streaming = request.path_params["model"], request.url.path.endswith("_stream")
        try:
            self.authorize(request)
            if name != self.config.service:
                raise RequestError(404, f"model {name!r} is not served here; the service is {self.config.service!r}")
            body = await self.json_body(request)
            if not isinstance(body.get("text_input"), str):
                raise RequestError(400, "text_input must be a string")
            body["max_tokens"] = self.max_tokens(body, "max_tokens")
        except RequestError as error:
            return triton_error(error)
        path = f"/v2/models/{name}/{'generate_stream' if streaming else 'generate'}"
        upstream = await self.client.send(self.client.build_request("POST", path, json=body), stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(
            relay(),
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type", "application/json"),
        )

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health/live", self.live),
                Route("/health/ready", self.ready),
                Route("/v1/models", self.models),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v2/models/{model}/generate", self.triton_generate, methods=["POST"]),
                Route("/v2/models/{model}/generate_stream", self.triton_generate, methods=["POST"]),
            ],
            on_shutdown=[self.client.aclose],
        )


def upstream_status(status: int) -> int:
    """Triton answers a model's refusal (bad input, context exceeded) with 400; its own faults stay 5xx."""
    return status if status in (400, 404) else 502


def upstream_message(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error", response.text))
    except ValueError:
        return response.text[:300]


def stop_sequences(value: Any) -> list[str]:
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or len(values) > 4 or not all(isinstance(v, str) and v for v in values):
        raise RequestError(400, "stop must be a string or a list of up to 4 non-empty strings", "stop")
    return values


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """The text up to the first stop sequence, and whether one was found (OpenAI leaves the stop out)."""
    positions = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(positions)], True) if positions else (text, False)


def held_back(text: str, stop: list[str]) -> int:
    """How many trailing characters of `text` could begin a stop sequence."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
