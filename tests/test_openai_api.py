"""The OpenAI-compatible HTTP layer (deployments/http/) against a fake backend:
in-process through Starlette's TestClient, and over real sockets (uvicorn in a thread) with
the official `openai` client. No Ray.

The `assert_*` / `parse_sse` helpers check only what any backend must satisfy, so the Ray
end-to-end tests can import them (`from test_openai_api import assert_completion_body`).

Longer than 300 lines because the fake backend, the shape assertions other tests
import, the field-by-field error table and the schema fuzzer all serve this one layer.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import threading
import time
from collections import Counter

import openai
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from deployments.http import make_app
from deployments.http.responses import LOGPROB_FLOOR
from deployments.metrics import CoordinatorMetrics
from specdec.api_types import (
    GenerateDelta,
    GenerateRequest,
    GenerateResult,
    SpeculationStats,
    TokenLogprob,
    Usage,
)
from specdec.errors import CapacityError, ContextLengthError, RequestError

try:  # the openai client and Starlette's TestClient use httpx2 where it is installed
    import httpx2 as httpx
except ImportError:
    import httpx

MODEL = "fake-model"


# ---- a deterministic fake backend ----------------------------------------------------------


class FakeBackend:
    """Implements deployments.http.Backend: one character per token; output letter i is a pure
    function of (seed, i), so a seed reproduces the text, like the real service."""

    model_name = MODEL
    max_context = 256
    vocab_size = 1000

    def __init__(self):
        self.full = False  # raise CapacityError at admission
        self.fail_mid_stream = False
        self.delay_s = 0.0  # between streamed tokens
        self.open_streams = 0
        self.closed: list[str] = []  # request ids whose stream was closed

    def chat_prompt_ids(self, messages, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self._tokens(text + ("<assistant>" if add_generation_prompt else ""))

    def _tokens(self, text: str) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def _admit(self, request: GenerateRequest) -> tuple[list[int], int]:
        if self.full:
            raise CapacityError("all slots busy")
        params = request.sampling_params
        ids = request.prompt_token_ids or self._tokens(request.prompt)
        if any(t >= self.vocab_size for t in ids):
            raise RequestError(f"token ids must be < {self.vocab_size}", param="prompt_token_ids")
        if len(ids) + params.max_tokens > self.max_context:
            raise ContextLengthError(
                f"maximum context length is {self.max_context} tokens", param="max_tokens"
            )
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        return ids, seed

    def _token(self, seed: int, i: int) -> TokenLogprob:
        letter = chr(97 + (seed * 7 + i * 13) % 26)
        return TokenLogprob(
            token_id=ord(letter),
            token=letter,
            logprob=-0.5,
            top_logprobs=[(ord(letter), letter, -0.5), (0, "<masked>", float("-inf"))],
        )

    async def generate_stream(self, request: GenerateRequest):
        ids, seed = self._admit(request)  # raises at the first anext, like an async generator
        params, rid = request.sampling_params, request.request_id or "r"
        self.open_streams += 1
        text, n, finish, stop_reason = "", 0, None, None
        try:
            while finish is None:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if self.fail_mid_stream and n == 2:
                    raise CapacityError("lost every target replica")
                tok = self._token(seed, n)
                n += 1
                piece, text = tok.token, text + tok.token
                for stop in params.stop:
                    if text.endswith(stop):
                        finish, stop_reason = "stop", stop
                if finish is None and n >= params.max_tokens:
                    finish = "length"
                delta = GenerateDelta(
                    request_id=rid,
                    text=piece,
                    token_ids=[tok.token_id],
                    logprobs=[_top(tok, params.logprobs)] if params.logprobs is not None else None,
                )
                if finish:
                    delta.finish_reason, delta.stop_reason = finish, stop_reason
                    delta.usage = Usage(prompt_tokens=len(ids), completion_tokens=n, total_tokens=len(ids) + n)
                    delta.seed, delta.speculation = seed, _stats(n)
                yield delta
        finally:
            self.open_streams -= 1
            self.closed.append(rid)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        deltas = [d async for d in self.generate_stream(request)]
        last = deltas[-1]
        return GenerateResult(
            request_id=last.request_id,
            text="".join(d.text for d in deltas),
            token_ids=[t for d in deltas for t in d.token_ids],
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            usage=last.usage,
            seed=last.seed,
            speculation=last.speculation,
            logprobs=[lp for d in deltas for lp in d.logprobs] if last.logprobs is not None else None,
        )


def _top(tok: TokenLogprob, k: int) -> TokenLogprob:
    return tok.model_copy(update={"top_logprobs": tok.top_logprobs[:k]})


def _stats(n: int) -> SpeculationStats:
    rounds = max(1, math.ceil(n / 3))
    proposed, accepted = 4 * rounds, 2 * rounds
    return SpeculationStats(
        rounds=rounds, proposed=proposed, accepted=accepted, emitted=n,
        acceptance_rate=accepted / proposed, system_efficiency=n / (5 * rounds),
    )


# ---- checks any backend must pass (reusable by the Ray end-to-end tests) ------------------


def assert_error(resp, status: int, param: str | None = "ANY") -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and error["message"].strip()
    assert isinstance(error["type"], str) and error["type"]
    if param != "ANY":
        assert error["param"] == param, error
        if param:
            assert param.split("[")[0] in error["message"], error
    return error


def assert_common(body: dict, obj: str, model: str) -> dict:
    assert body["object"] == obj and body["model"] == model
    assert isinstance(body["id"], str) and isinstance(body["created"], int)
    assert len(body["choices"]) == 1 and body["choices"][0]["index"] == 0
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 <= body["seed"] < 2**63
    spec = body["speculation"]
    assert {"rounds", "proposed", "accepted", "emitted"} <= spec.keys()
    assert spec["emitted"] == usage["completion_tokens"]
    return body["choices"][0]


def assert_completion_body(body: dict, model: str) -> dict:
    choice = assert_common(body, "text_completion", model)
    assert isinstance(choice["text"], str) and choice["finish_reason"] in ("stop", "length")
    return choice


def assert_chat_body(body: dict, model: str) -> dict:
    choice = assert_common(body, "chat.completion", model)
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    return choice


def parse_sse(text: str) -> list[dict]:
    """SSE body -> JSON chunks; checks the framing and the final [DONE]."""
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events[:3]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def assert_stream(chunks: list[dict], obj: str, include_usage: bool) -> dict:
    """Returns the chunk with finish_reason (which carries seed and speculation)."""
    assert chunks and all(c["object"] == obj for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    final = finals[0]
    assert 0 <= final["seed"] < 2**63 and final["speculation"]["emitted"] >= 1
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
        assert all(c["usage"] is None for c in chunks[:-1])
    else:
        assert final is chunks[-1] and all("usage" not in c for c in chunks)
    return final


# ---- fixtures --------------------------------------------------------------------------------

APP = make_app(None)  # one app for the module; each test puts its own fake backend in it


@pytest.fixture(autouse=True)
def backend(monkeypatch):
    fake = FakeBackend()
    APP.state.backend = fake  # make_app(fake) would do the same
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    monkeypatch.delenv("SPECDEC_MAX_BODY_BYTES", raising=False)
    yield fake
    APP.state.backend = None


@pytest.fixture(scope="module")
def client():
    return TestClient(APP)


@pytest.fixture(scope="module")
def server():
    """The app on a real loopback socket, for the openai client and disconnects."""
    config = uvicorn.Config(APP, host="127.0.0.1", port=0, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(5)


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=10)


def post(client, path, body, **kw):
    return client.post(path, json=body, **kw)


# ---- routes ----------------------------------------------------------------------------------


def test_health_models_and_openapi(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/health").status_code == 200
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}").json()["max_model_len"] == FakeBackend.max_context
    assert_error(client.get("/v1/models/other"), 404, "model")
    doc = client.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= doc["paths"].keys()
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"top_k", "min_p", "num_speculative_tokens", "drafter_invariant", "seed"} <= props.keys()


def test_completion(client, backend):
    body = post(client, "/v1/completions", {"model": MODEL, "prompt": "def f(", "max_tokens": 5}).json()
    choice = assert_completion_body(body, MODEL)
    assert len(choice["text"]) == 5 and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}
    assert body["id"].startswith("cmpl-") and choice["logprobs"] is None


def test_completion_prompt_forms_and_defaults(client):
    texts = [
        post(client, "/v1/completions", {"prompt": p, "seed": 3}).json()["choices"][0]["text"]
        for p in ([100, 101, 102], [[100, 101, 102]], ["abc"], "abc")
    ]
    assert all(len(t) == 16 for t in texts)  # max_tokens defaults to 16 (model omitted: fine)
    assert len(set(texts)) == 1  # the fake's output depends on the seed only


def test_seed_reproduces_and_is_returned(client):
    first = post(client, "/v1/completions", {"prompt": "x", "max_tokens": 8}).json()
    again = post(client, "/v1/completions", {"prompt": "x", "max_tokens": 8, "seed": first["seed"]}).json()
    assert again["seed"] == first["seed"] and again["choices"][0]["text"] == first["choices"][0]["text"]


def test_chat(client, backend):
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    body = post(client, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_completion_tokens": 4}).json()
    choice = assert_chat_body(body, MODEL)
    assert len(choice["message"]["content"]) == 4 and body["id"].startswith("chatcmpl-")
    prompt_len = len(backend.chat_prompt_ids([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]))
    assert body["usage"]["prompt_tokens"] == prompt_len  # developer -> system, parts joined


def test_chat_default_max_tokens_is_the_rest_of_the_context(client, backend):
    body = post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert body["usage"]["total_tokens"] == backend.max_context
    assert body["choices"][0]["finish_reason"] == "length"


def test_stop_string(client):
    seed = 5
    text = post(client, "/v1/completions", {"prompt": "a", "max_tokens": 10, "seed": seed}).json()["choices"][0]["text"]
    stop = text[3:5]
    body = post(client, "/v1/completions", {"prompt": "a", "max_tokens": 10, "seed": seed, "stop": [stop]}).json()
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["stop_reason"] == stop


def test_logprobs(client):
    body = post(client, "/v1/completions", {"prompt": "a", "max_tokens": 3, "logprobs": 2}).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == list(body["choices"][0]["text"]) and lp["text_offset"] == [0, 1, 2]
    assert lp["token_logprobs"] == [-0.5] * 3
    assert lp["top_logprobs"][0]["<masked>"] == LOGPROB_FLOOR  # -inf is not JSON
    chat = post(client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 1,
    }).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and len(content[0]["top_logprobs"]) == 1
    assert content[0]["bytes"] == list(content[0]["token"].encode())


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_completion(client, include_usage):
    req = {"prompt": "a", "max_tokens": 4, "stream": True, "seed": 9, "logprobs": 1,
           "stream_options": {"include_usage": include_usage}}
    resp = post(client, "/v1/completions", req)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    chunks = parse_sse(resp.text)
    final = assert_stream(chunks, "text_completion", include_usage)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    plain = post(client, "/v1/completions", req | {"stream": False}).json()
    assert text == plain["choices"][0]["text"] and final["seed"] == 9
    offsets = [o for c in chunks if c["choices"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2, 3]


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_chat(client, include_usage):
    req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
           "stream_options": {"include_usage": include_usage}}
    chunks = parse_sse(post(client, "/v1/chat/completions", req).text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    final = assert_stream(chunks, "chat.completion.chunk", include_usage)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text) == 3 and final["speculation"]["emitted"] == 3
    if include_usage:
        assert chunks[-1]["usage"]["completion_tokens"] == 3


# ---- errors ----------------------------------------------------------------------------------

COMPLETION = {"prompt": "hello", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

# (endpoint, change to a valid body, param the error must name); one row per kind of field.
BAD_FIELDS = [
    ("/v1/completions", {"temperature": -1}, "temperature"),
    ("/v1/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/completions", {"top_p": 0}, "top_p"),
    ("/v1/completions", {"top_k": -2}, "top_k"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 2**70}, "max_tokens"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"n": 2}, "n"),
    ("/v1/completions", {"seed": -1}, "seed"),
    ("/v1/completions", {"stop": 5}, "stop"),
    ("/v1/completions", {"stop": [""]}, "stop"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 500}}, "logit_bias"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ("/v1/completions", {"bad_words": [""]}, "bad_words"),
    ("/v1/completions", {"num_speculative_tokens": 17}, "num_speculative_tokens"),
    ("/v1/completions", {"target_probs": "cooked"}, "target_probs"),
    ("/v1/completions", {"drafter_invariant": "maybe"}, "drafter_invariant"),
    ("/v1/completions", {"stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"suffix": "}"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [5000]}, "prompt"),  # past the vocabulary
    ("/v1/completions", {"prompt": None}, "prompt"),
    ("/v1/completions", {"max_tokens": 1000}, "max_tokens"),  # past the context
    ("/v1/completions", {"temprature": 0.5}, "temprature"),  # unknown field
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("/v1/chat/completions", {"max_completion_tokens": 0, "max_tokens": None}, "max_completion_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 5}, "max_tokens"),  # both, and different
    ("/v1/chat/completions", {"tools": []}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 300}], "max_tokens": None}, "messages"),
]


@pytest.mark.parametrize("path,change,param", BAD_FIELDS, ids=[f"{p[4:]}:{c}"[:60] for p, c, _ in BAD_FIELDS])
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_field_is_a_400_naming_it(client, path, change, param, stream):
    base = COMPLETION if path == "/v1/completions" else CHAT
    assert_error(post(client, path, base | change | {"stream": stream}), 400, param)


@pytest.mark.parametrize("content", [b"{", b"[1, 2]", b"", b'{"prompt": NaN}'])
def test_malformed_body_is_a_400(client, content):
    resp = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert_error(resp, 400)


@pytest.mark.parametrize("raw,status", [
    (b'{"prompt": "\\ud800"}', 400),
    (b'{"prompt": "a", "stop": "\\udfff"}', 400),
    (b'{"prompt": "a", "\\ud800": 1}', 400),
    (b'{"prompt": "a", "model": "\\ud800"}', 404),  # quoted in the message: must still encode
])
def test_lone_surrogates_are_refused_not_crashed_on(client, raw, status):
    assert_error(client.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), status)


def test_body_without_json_content_type_is_a_400(client):
    resp = client.post("/v1/completions", content=json.dumps(COMPLETION))
    assert "Content-Type" in assert_error(resp, 400)["message"]


def test_unknown_model_and_route(client):
    error = assert_error(post(client, "/v1/completions", COMPLETION | {"model": "gpt-4"}), 404, "model")
    assert error["code"] == "model_not_found"
    assert_error(post(client, "/v1/chat/completions", CHAT | {"model": "gpt-4", "stream": True}), 404, "model")
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_api_key(client, monkeypatch):
    monkeypatch.setenv("SPECDEC_API_KEY", "s3cret")
    assert_error(post(client, "/v1/completions", COMPLETION), 401)
    assert_error(post(client, "/v1/completions", COMPLETION, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(client.get("/v1/models"), 401)
    ok = post(client, "/v1/completions", COMPLETION, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    assert client.get("/health").status_code == 200  # health stays open


def test_body_size_limit(client, monkeypatch):
    big = COMPLETION | {"prompt": "x" * (1 << 20)}
    assert_error(post(client, "/v1/completions", big), 413)
    monkeypatch.setenv("SPECDEC_MAX_BODY_BYTES", "100")
    assert_error(post(client, "/v1/completions", COMPLETION | {"prompt": "y" * 200}), 413)
    assert post(client, "/v1/completions", COMPLETION).status_code == 200
    # Without a Content-Length header (chunked upload) the limit still holds.
    chunked = client.post("/v1/completions", content=iter([b'{"prompt": "', b"z" * 200, b'"}']),
                          headers={"content-type": "application/json"})
    assert_error(chunked, 413)


@pytest.mark.parametrize("stream", [False, True])
def test_capacity_is_a_503_with_retry_after(client, backend, stream):
    backend.full = True
    resp = post(client, "/v1/completions", COMPLETION | {"stream": stream})
    assert_error(resp, 503)
    assert resp.headers["retry-after"] == "1"


def test_error_after_the_stream_started_is_an_event(client, backend):
    backend.fail_mid_stream = True
    chunks = parse_sse(post(client, "/v1/completions", COMPLETION | {"stream": True}).text)
    assert chunks[-1]["error"]["message"] and backend.open_streams == 0


def test_each_app_serves_its_own_backend(backend):
    """The Coordinator builds its app per replica with make_app(self): an app serves the
    backend it was made with, and another app (another replica) is unaffected."""
    served = make_app(backend)
    assert served is not APP
    APP.state.backend = None
    body = TestClient(served).post("/v1/completions", json=COMPLETION).json()
    assert_completion_body(body, MODEL)


def test_no_backend_yet_is_a_503(client):
    APP.state.backend = None
    assert_error(client.get("/health"), 503)
    assert_error(post(client, "/v1/completions", COMPLETION), 503)


# ---- the official openai client over a real socket -------------------------------------------


def test_openai_client_completion_and_chat(oai):
    comp = oai.completions.create(model=MODEL, prompt="def f(", max_tokens=6, seed=11,
                                  extra_body={"top_k": 5, "num_speculative_tokens": 2})
    assert len(comp.choices[0].text) == 6 and comp.usage.completion_tokens == 6
    assert comp.model_extra["seed"] == 11 and comp.model_extra["speculation"]["emitted"] == 6
    again = oai.completions.create(model=MODEL, prompt="def f(", max_tokens=6, seed=11)
    assert again.choices[0].text == comp.choices[0].text
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=3, temperature=0.7, top_p=0.9)
    assert chat.choices[0].message.role == "assistant" and len(chat.choices[0].message.content) == 3
    assert chat.model_extra["speculation"]["rounds"] >= 1
    assert [m.id for m in oai.models.list().data] == [MODEL]


def test_openai_client_streams(oai):
    stream = oai.completions.create(model=MODEL, prompt="x", max_tokens=5, stream=True, seed=4,
                                    stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == \
        oai.completions.create(model=MODEL, prompt="x", max_tokens=5, seed=4).choices[0].text
    assert chunks[-1].usage.completion_tokens == 5
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert final.model_extra["seed"] == 4
    chat = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert len("".join(c.choices[0].delta.content or "" for c in chat if c.choices)) == 4
    assert chat[-1].usage.total_tokens == chat[-1].usage.prompt_tokens + 4


def test_openai_client_errors(oai, server, monkeypatch, backend):
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model=MODEL, prompt="x", temperature=5)
    assert bad.value.param == "temperature" and "temperature" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    backend.full = True
    with pytest.raises(openai.APIStatusError) as full:
        oai.completions.create(model=MODEL, prompt="x")
    assert full.value.status_code == 503
    monkeypatch.setenv("SPECDEC_API_KEY", "k")
    with pytest.raises(openai.AuthenticationError):
        oai.models.list()
    keyed = openai.OpenAI(base_url=f"{server}/v1", api_key="k", max_retries=0)
    assert keyed.models.list().data[0].id == MODEL


def test_client_disconnect_closes_the_backend_stream(server, backend):
    """A client that goes away mid-stream must close the backend's generator (which is
    where the real coordinator frees the draft and target caches)."""
    backend.delay_s = 0.02
    body = {"prompt": "x", "max_tokens": 200, "stream": True}
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", f"{server}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(l for l in lines if l.startswith("data: "))
            assert backend.open_streams == 1
    deadline = time.monotonic() + 5
    while backend.open_streams and time.monotonic() < deadline:
        time.sleep(0.02)
    assert backend.open_streams == 0 and len(backend.closed) == 1


def test_disconnect_stops_generation_under_asgi_2_4(backend):
    """ASGI 2.4 servers leave disconnect detection to the app (Starlette's StreamingResponse
    would only notice on a failed send): generation must stop soon after the disconnect."""
    backend.delay_s = 0.005
    body = json.dumps({"prompt": "x", "max_tokens": 200, "stream": True}).encode()
    inbox = [{"type": "http.request", "body": body, "more_body": False}]
    gone, sent = asyncio.Event(), []

    async def receive():
        if inbox:
            return inbox.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if len(sent) == 3:  # headers and two events: the client leaves
            gone.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "root_path": "", "query_string": b"", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }
    asyncio.run(asyncio.wait_for(APP(scope, receive, send), 10))
    assert backend.open_streams == 0 and len(backend.closed) == 1
    assert len(sent) < 20  # not all 200 tokens


# ---- fuzzing from the OpenAPI document -------------------------------------------------------

FUZZ_EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "300"))

# Text now and then with lone surrogates: JSON can carry them ("\\ud800"), UTF-8 cannot.
TEXT = st.text(max_size=12) | st.text(st.characters(categories=["Cs", "Ll", "Nd", "Zs"]), max_size=4)
_json_leaf = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | TEXT
)
ANY_JSON = st.recursive(
    _json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)


_small_ids = st.lists(st.integers(0, 999), min_size=1, max_size=6)
PLAUSIBLE = {  # values that are usually valid, so valid paths get their share of the cases
    "model": st.sampled_from([MODEL, None]),
    "prompt": st.one_of(st.text(min_size=1, max_size=20), _small_ids, st.lists(st.text(min_size=1), min_size=1, max_size=1)),
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["system", "developer", "user", "assistant"]),
        "content": st.text(max_size=20) | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2),
    }), min_size=1, max_size=3),
    "n": st.just(1),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "max_tokens": st.integers(1, 8),
    "max_completion_tokens": st.integers(1, 8),
    "stop_token_ids": _small_ids,
    "allowed_token_ids": _small_ids,
    "logit_bias": st.dictionaries(st.integers(0, 999).map(str), st.floats(-100, 100), max_size=3),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "bad_words": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "logprobs": st.integers(0, 5) | st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "num_speculative_tokens": st.integers(0, 16),
    "seed": st.integers(0, 2**63 - 1),
    "top_k": st.integers(-1, 50),
    "min_tokens": st.integers(0, 3),
}


def from_schema(schema: dict, defs: dict, depth: int = 0) -> st.SearchStrategy:
    """Values for a JSON schema as FastAPI/pydantic write it: mostly valid, sometimes any JSON."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, depth)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs, depth) for s in schema["anyOf"]])
    if "const" in schema or "enum" in schema:
        return st.sampled_from(schema.get("enum", [schema.get("const")]))
    kind = schema.get("type")
    if kind == "integer":  # small values (the usual ones), anything in range, and the edges
        lo, hi = schema.get("minimum"), schema.get("maximum")
        return st.one_of(st.integers(-2, 20), st.integers(min_value=lo, max_value=hi),
                         st.sampled_from([2**31, 2**63, -(2**63) - 1]))
    if kind == "number":
        return st.one_of(st.floats(0, 2), st.floats(allow_nan=False, allow_infinity=False),
                         st.sampled_from([0.0, 1.0, -0.0, 1e-9, 1e308]))
    if kind == "string":
        return TEXT
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs, depth + 1) if depth < 3 else ANY_JSON
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=4)
    if kind == "object":
        return object_from_schema(schema, defs, depth + 1)
    return ANY_JSON


def object_from_schema(schema: dict, defs: dict, depth: int = 0, plausible: bool = False) -> st.SearchStrategy:
    """Objects with the required fields and a few optional ones. `plausible`: values from
    PLAUSIBLE where it has one (mostly valid bodies); else schema-shaped values with any
    JSON one time in ten, and now and then every field or unknown extra keys."""
    props = schema.get("properties", {})
    if not props:
        values = from_schema(schema.get("additionalProperties", {}), defs, depth)
        return st.dictionaries(st.text(max_size=6), values, max_size=3)
    required = [k for k in props if k in schema.get("required", ())]
    optional = sorted(set(props) - set(required))

    def value(key: str) -> st.SearchStrategy:
        shaped = from_schema(props[key], defs, depth)
        if plausible:
            return PLAUSIBLE.get(key, shaped)
        return st.integers(0, 9).flatmap(lambda i: ANY_JSON if i == 0 else shaped)

    def body(keys: list[str]) -> st.SearchStrategy:
        return st.fixed_dictionaries({k: value(k) for k in required + keys})

    if not optional:
        return body([])
    few = st.lists(st.sampled_from(optional), max_size=4, unique=True).flatmap(body)
    if plausible:
        return few
    junk = st.dictionaries(TEXT.filter(bool), ANY_JSON, min_size=1, max_size=2)
    return st.one_of(few, few, body(optional), st.builds(lambda b, j: j | b, few, junk))


def _request_bodies(model_name: str) -> st.SearchStrategy:
    """About half plausible bodies, 40 % schema-shaped ones, 10 % any JSON at all."""
    defs = APP.openapi()["components"]["schemas"]
    plausible = object_from_schema(defs[model_name], defs, plausible=True)
    shaped = object_from_schema(defs[model_name], defs)
    small = st.fixed_dictionaries({}, optional={"max_tokens": st.integers(1, 8)})
    # Valid bodies should run quickly: usually a small max_tokens (unless one was drawn).
    shaped = st.builds(lambda b, m: m | b if "max_tokens" in b else b | m, shaped, small)
    return st.integers(0, 9).flatmap(lambda i: plausible if i < 5 else shaped if i < 9 else ANY_JSON)


def _check_fuzz_response(resp, counts: Counter, reasons: Counter) -> None:
    counts[resp.status_code] += 1
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["message"].strip(), resp.text
        reasons[error["param"]] += 1
    elif resp.headers["content-type"].startswith("text/event-stream"):
        parse_sse(resp.text)
    else:
        assert resp.json()["choices"], resp.text


@pytest.mark.parametrize("path,schema", [
    ("/v1/completions", "CompletionRequest"),
    ("/v1/chat/completions", "ChatCompletionRequest"),
])
def test_fuzz_never_5xx(client, path, schema):
    counts, reasons = Counter(), Counter()

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=_request_bodies(schema))
    def run(body):
        # json.dumps escapes lone surrogates, which httpx's own encoder would refuse.
        resp = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        _check_fuzz_response(resp, counts, reasons)

    run()
    print(f"\nfuzz {path}: {sum(counts.values())} cases, by status {dict(sorted(counts.items()))}; "
          f"most refused params {reasons.most_common(8)}")
    assert counts[200] > 0 and sum(v for k, v in counts.items() if 400 <= k < 500) > 0


# ---- metrics ---------------------------------------------------------------------------------


def test_metrics_without_a_ray_cluster_are_safe_and_count():
    exporting = CoordinatorMetrics(model="m")
    assert exporting.exporting  # ray.serve.metrics objects exist even before ray.init
    for metrics in (CoordinatorMetrics(enabled=False), exporting):
        metrics.in_flight(+1)
        metrics.round(0.01, 0.02, 0.001, proposed=4, accepted=3, emitted=4)
        metrics.round(0.01, 0.02, 0.001, proposed=4, accepted=1, emitted=2)
        metrics.first_token(0.05)
        metrics.finished(_stats(6), 0.5, 6, ttft_s=0.05, finish_reason="length")
        metrics.finished({"acceptance_rate": None}, 0.1, 0)  # nothing generated: no division
        metrics.in_flight(-1)
        t = metrics.totals
        assert (t["specdec_proposed_tokens"], t["specdec_accepted_tokens"], t["specdec_emitted_tokens"]) == (8, 4, 6)
        assert t["specdec_round_slots"] == 10 and t["in_flight"] == 0
        assert t["specdec_requests_finished"] == 2
        metrics.round("not", "a", "round")  # a wrong call is logged, never raised
        assert t["specdec_proposed_tokens"] == 8
