"""The abuse probe of a running `llmops serve` (issue 22's suite, kept and rerun for issue 38): malformed, oversized
and mistyped bodies, huge and negative numbers, unknown fields, deep nesting, long chats, invalid UTF-8 and odd
Unicode, a slow body, many streams at once, clients that hang up mid-stream, unknown models, versions and paths, the
control API and /metrics asked on the clients' port, wrong and missing keys. Each case must get its expected status
with an error in its API's own shape (/v1: OpenAI's `{"error": {message, type, param, code}}`, /v2: Triton's
`{"error": "..."}`), the service must stay ready after each, and no API key may appear in any answer.

A Triton killed under load and a burst over a key's rate limit have tests of their own
(tests/integration/test_serving.py, tests/unit/test_gateway_limits.py, benchmarks/one_key_load.py).

Used by tests/integration/test_serving.py; run it against any serve:

    .venv/bin/python -m tests.abuse --url https://127.0.0.1:8443 --service NAME --keys-file api-keys [--cacert PEM]
"""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import requests

QUESTION = [{"role": "user", "content": "What is the opposite of hot?"}]


@dataclass
class Answer:
    status: int
    body: object
    raw: str = ""


@dataclass
class Case:
    name: str
    path: str  # the API whose error shape it must answer in
    expect: frozenset[int]
    send: Callable[[Probe], list[Answer]]
    http_level: bool = False  # refused by the HTTP server before any route: its plain text, no API's shape


@dataclass
class Result:
    case: Case
    answers: list[Answer]
    ready_after: bool

    @property
    def statuses(self) -> list[int]:
        return sorted({answer.status for answer in self.answers})

    @property
    def shaped(self) -> bool:
        return self.case.http_level or all(
            answer.status == 200 or in_the_apis_shape(self.case.path, answer.body) for answer in self.answers
        )

    @property
    def ok(self) -> bool:
        return set(self.statuses) <= self.case.expect and self.shaped and self.ready_after


def in_the_apis_shape(path: str, body: object) -> bool:
    if not isinstance(body, dict):
        return False
    if path.startswith("/v1/"):
        error = body.get("error")
        return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
    return isinstance(body.get("error"), str)


@dataclass
class Probe:
    url: str  # the gateway, https://host:port or http://host:port
    service: str
    key: str
    cacert: str | bool = True  # requests' `verify`
    keys: list[str] = field(default_factory=list)  # every key, none of which may appear in an answer

    # --- ways to send ----------------------------------------------------------------------------------

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict | None = None, key: str | None = ""
    ) -> Answer:
        sent = {"Content-Type": "application/json"} if body is not None else {}
        if key is not None:
            sent["Authorization"] = f"Bearer {key or self.key}"
        sent.update(headers or {})
        response = requests.request(
            method, f"{self.url}{path}", data=body, headers=sent, verify=self.cacert, timeout=120
        )
        return answered(response)

    def post(self, path: str, body: object, **kwargs) -> list[Answer]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return [self.request("POST", path, raw, **kwargs)]

    def chat(self, headers: dict | None = None, **fields) -> list[Answer]:
        body = {"model": self.service, "messages": QUESTION, **fields}
        return self.post("/v1/chat/completions", body, headers=headers)

    def generate(self, body: object, model: str = "") -> list[Answer]:
        return self.post(f"/v2/models/{model or self.service}/generate", body)

    def socket(self) -> socket.socket:
        parts = urlsplit(self.url)
        plain = socket.create_connection((parts.hostname, parts.port or 443), timeout=30)
        if parts.scheme != "https":
            return plain
        context = ssl.create_default_context(cafile=self.cacert if isinstance(self.cacert, str) else None)
        return context.wrap_socket(plain, server_hostname=parts.hostname)

    def slow_body(self) -> list[Answer]:
        """A client that sends its headers and then a byte every half second: the others are served meanwhile."""
        body = json.dumps({"model": self.service, "messages": QUESTION, "max_tokens": 4}).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {urlsplit(self.url).netloc}\r\n"
            f"Authorization: Bearer {self.key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        with self.socket() as slow:
            slow.sendall(head.encode())
            started = time.monotonic()
            others = self.chat(max_tokens=4)  # while the slow one is open
            for byte in body[:6]:
                slow.sendall(bytes([byte]))
                time.sleep(0.5)
            took = time.monotonic() - started
        return [*others, Answer(200 if took < 30 else 0, {"others_served_in_s": round(took, 1)})]

    def hang_ups(self, count: int = 8) -> list[Answer]:
        """Streams left after their first chunk; the next request is answered."""
        body = {"model": self.service, "messages": QUESTION, "max_tokens": 64, "stream": True}
        for _ in range(count):
            with requests.post(
                f"{self.url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {self.key}"},
                verify=self.cacert,
                stream=True,
                timeout=60,
            ) as response:
                next(response.iter_lines(), None)
        return self.chat(max_tokens=4)

    def streams_at_once(self, count: int = 48) -> list[Answer]:
        def one(_: int) -> Answer:
            body = {"model": self.service, "messages": QUESTION, "max_tokens": 8, "stream": True}
            response = requests.post(
                f"{self.url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {self.key}"},
                verify=self.cacert,
                timeout=120,
            )
            if response.status_code == 200:
                done = response.text.rstrip().endswith("data: [DONE]")
                return Answer(200 if done else 0, None, response.text[-200:])
            return answered(response)

        with ThreadPoolExecutor(count) as pool:
            return list(pool.map(one, range(count)))

    def ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/health/ready", verify=self.cacert, timeout=30).status_code == 200
        except requests.RequestException:
            return False


def answered(response: requests.Response) -> Answer:
    try:
        body: object = response.json()
    except ValueError:
        body = None
    return Answer(response.status_code, body, response.text[:2000])


def deep_json(depth: int = 100_000) -> bytes:
    return ('{"messages": [{"role": "user", "content": "x"}], "x": ' + "[" * depth + "]" * depth + "}").encode()


def b64url(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


FORGED_JWT = (
    ".".join(
        b64url(json.dumps(part).encode()) for part in ({"alg": "RS256", "kid": "k"}, {"sub": "team-a", "exp": 2**40})
    )
    + "."
    + b64url(b"not a signature")
)
UNSIGNED_JWT = (
    ".".join(b64url(json.dumps(part).encode()) for part in ({"alg": "none"}, {"sub": "team-a", "exp": 2**40})) + "."
)


def cases(service: str) -> list[Case]:
    chat, generate = "/v1/chat/completions", f"/v2/models/{service}/generate"
    text = {"text_input": "What is the opposite of hot?", "max_tokens": 4, "exclude_input_in_output": True}
    odd = "\u202eevil\u200d\u200b\ufeff \U0001f525 \u0000 \ud7ff 漢字 \u0301"

    def case(name: str, path: str, expect: set[int], send: Callable[[Probe], list[Answer]], **kw) -> Case:
        return Case(name, path, frozenset(expect), send, **kw)

    return [
        case("no key", chat, {401}, lambda p: [p.request("POST", chat, b"{}", key=None)]),
        case("wrong key", chat, {401}, lambda p: [p.request("POST", chat, b"{}", key="not-a-key")]),
        case(
            "key in a Basic header",
            chat,
            {401},
            lambda p: [p.request("POST", chat, b"{}", {"Authorization": f"Basic {p.key}"})],
        ),
        # signed-token forms (serve.auth.jwt): refused as keys where no issuer is configured, as tokens where one is
        case("a JWT-shaped bearer", chat, {401}, lambda p: [p.request("POST", chat, b"{}", key=FORGED_JWT)]),
        case("a JWT with alg none", chat, {401}, lambda p: [p.request("POST", chat, b"{}", key=UNSIGNED_JWT)]),
        case("broken JSON", chat, {400}, lambda p: p.post(chat, b'{"messages": [')),
        case("empty body", chat, {400}, lambda p: p.post(chat, b"")),
        case("a JSON array as the body", chat, {400}, lambda p: p.post(chat, [1, 2])),
        case("messages a string", chat, {400}, lambda p: p.post(chat, {"messages": "hi"})),
        case("max_tokens a word", chat, {400}, lambda p: p.chat(max_tokens="many")),
        case("max_tokens negative", chat, {400}, lambda p: p.chat(max_tokens=-1)),
        case("max_tokens 10^30", chat, {400}, lambda p: p.chat(max_tokens=10**30)),
        case("temperature infinite", chat, {400}, lambda p: p.post(chat, b'{"messages": [], "temperature": 1e999}')),
        case("temperature 1e6", chat, {400}, lambda p: p.chat(temperature=1e6)),
        case("seed 2^80", chat, {400}, lambda p: p.chat(seed=2**80, max_tokens=4)),
        case("seed negative", chat, {400}, lambda p: p.chat(seed=-1, max_tokens=4)),
        case(
            "a role no API has", chat, {400}, lambda p: p.post(chat, {"messages": [{"role": "root", "content": "x"}]})
        ),
        case("content an object", chat, {400}, lambda p: p.post(chat, {"messages": [{"role": "user", "content": {}}]})),
        case("n = 5", chat, {400}, lambda p: p.chat(n=5)),
        case("JSON nested 100,000 deep", chat, {400}, lambda p: p.post(chat, deep_json())),
        case(
            "a lone surrogate",
            chat,
            {400},
            lambda p: p.post(chat, b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
        ),
        case(
            "invalid UTF-8",
            chat,
            {400},
            lambda p: p.post(chat, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
        ),
        case(
            "odd Unicode (bidi, zero-width, NUL, combining)",
            chat,
            {200},
            lambda p: p.post(chat, {"model": service, "messages": [{"role": "user", "content": odd}], "max_tokens": 4}),
        ),
        case(
            "a chat of 5,000 turns", chat, {400}, lambda p: p.post(chat, {"messages": QUESTION * 5000, "max_tokens": 4})
        ),
        case(
            "a 2 MiB body",
            chat,
            {413},
            lambda p: p.post(chat, {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}),
        ),
        case(
            "a form-encoded body",
            chat,
            {415},
            lambda p: [p.request("POST", chat, b"a=1", {"Content-Type": "application/x-www-form-urlencoded"})],
        ),
        case("a 70 KB header", chat, {200}, lambda p: p.chat(max_tokens=4, headers={"X-Big": "a" * 70_000})),
        case(
            "chunked and Content-Length together (smuggling)",
            chat,
            {400},
            lambda p: [p.request("POST", chat, b"{}", {"Transfer-Encoding": "chunked", "Content-Length": "5"})],
            http_level=True,
        ),
        case("feedback for no request", "/v1/feedback", {400, 404}, lambda p: p.post("/v1/feedback", {"rating": 1})),
        case("an unknown model", chat, {404}, lambda p: p.chat(model="gpt-4o", max_tokens=4)),
        case("a version by name", chat, {400, 404}, lambda p: p.chat(model=f"{service}-v1", max_tokens=4)),
        case("the base engine by name", chat, {400, 404}, lambda p: p.chat(model=f"{service}-base", max_tokens=4)),
        case("an unknown path", "/v1/nowhere", {404}, lambda p: [p.request("GET", "/v1/nowhere")]),
        case("GET on a POST route", chat, {405}, lambda p: [p.request("GET", chat)]),
        case("/metrics on the clients' port", "/v1/metrics", {404}, lambda p: [p.request("GET", "/metrics")]),
        # the control API is on a listener of its own (issue 73's rollouts among it): none of it on the clients' port
        case(
            "the route table on the clients' port",
            "/v1/control",
            {404},
            lambda p: [p.request("GET", "/control/v1/deployment")],
        ),
        case(
            "a rollout submitted on the clients' port",
            "/v1/control",
            {404, 405},
            lambda p: [p.request("PUT", "/control/v1/rollout", json.dumps({"steps": [100], "release": "x"}).encode())],
        ),
        case(
            "a rollout's abort on the clients' port",
            "/v1/control",
            {404, 405},
            lambda p: p.post("/control/v1/rollout/decision", {"decision": "abort", "release": "x"}),
        ),
        case(
            "/v2 without a key",
            generate,
            {401},
            lambda p: [p.request("POST", generate, json.dumps(text).encode(), key=None)],
        ),
        case("/v2 an unknown model", generate, {404}, lambda p: p.generate(text, model="llama-70b")),
        case("/v2 a version by name", generate, {400, 404}, lambda p: p.generate(text, model=f"{service}-v1")),
        case("/v2 an unknown input", generate, {400}, lambda p: p.generate({**text, "parameters": {"x": 1}})),
        case("/v2 no text_input", generate, {400}, lambda p: p.generate({"max_tokens": 4})),
        case("/v2 GET", generate, {405}, lambda p: [p.request("GET", generate)]),
        case(
            "/v2 Triton's model control",
            "/v2/repository",
            {403, 404, 405},
            lambda p: p.post(f"/v2/repository/models/{service}-v1/unload", {}),
        ),
        case(
            "/v2 Triton's repository index",
            "/v2/repository",
            {403, 404, 405},
            lambda p: p.post("/v2/repository/index", {}),
        ),
        case(
            "/v2 Triton's shared memory",
            "/v2/shm",
            {403, 404, 405},
            lambda p: [p.request("GET", "/v2/systemsharedmemory/status")],
        ),
        case("a slow body", chat, {200}, lambda p: p.slow_body()),
        case("8 streams left after the first chunk", chat, {200}, lambda p: p.hang_ups()),
        case("48 streams at once", chat, {200, 429, 503}, lambda p: p.streams_at_once()),
    ]


def probe(target: Probe, only: list[Case] | None = None) -> list[Result]:
    results = []
    for case in only or cases(target.service):
        try:
            answers = case.send(target)
        except requests.RequestException as exc:
            answers = [Answer(0, None, f"{type(exc).__name__}: {exc}")]
        results.append(Result(case, answers, target.ready()))
    return results


def leaked(target: Probe, results: list[Result]) -> list[str]:
    """Cases whose answers show any API key."""
    return [r.case.name for r in results if any(key in a.raw for a in r.answers for key in target.keys)]


def table(results: list[Result]) -> str:
    lines = [f"{'case':<52} {'expected':<14} {'got':<14} shape ready"]
    for r in results:
        expected = ",".join(map(str, sorted(r.case.expect)))
        got = ",".join(map(str, r.statuses))
        flag = "" if r.ok else "  <-- FAILED"
        shaped, ready = "ok" if r.shaped else "NO", "yes" if r.ready_after else "NO"
        lines.append(f"{r.case.name:<52} {expected:<14} {got:<14} {shaped:<5} {ready}{flag}")
    passed = sum(r.ok for r in results)
    lines.append(
        f"{passed} of {len(results)} cases answered as expected, in their API's shape, the service ready after each"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--url", required=True, help="the gateway, e.g. https://127.0.0.1:8443")
    parser.add_argument("--service", required=True, help="the name clients call (the registered model's)")
    parser.add_argument("--keys-file", type=Path, required=True, help="the serve's API keys file (NAME: KEY lines)")
    parser.add_argument("--cacert", help="the certificate to trust (a self-signed serve)")
    args = parser.parse_args(argv)
    keys = [line.split(":", 1)[1].strip() for line in args.keys_file.read_text().splitlines() if ":" in line]
    target = Probe(args.url.rstrip("/"), args.service, keys[0], args.cacert or True, keys)
    results = probe(target)
    print(table(results))
    leaks = leaked(target, results)
    if leaks:
        print(f"an API key appeared in the answers of: {', '.join(leaks)}")
    return 0 if all(r.ok for r in results) and not leaks else 1


if __name__ == "__main__":
    sys.exit(main())
