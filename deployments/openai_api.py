"""OpenAI-compatible HTTP API (FastAPI) in front of a generation backend.

The Coordinator deployment is decorated ``@serve.ingress(openai_api.app)`` and sets
``openai_api.app.state.backend = self``. ``serve.ingress`` serves a *cloudpickled copy* of
``app``, so routes look the backend up on ``request.app.state`` first and then on this
module's ``app.state`` (where the coordinator put it). A backend implements ``Backend``.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /v1/models/{model}, GET /health (and /v1/health), plus FastAPI's /openapi.json and /docs.

Request fields follow OpenAI, plus vLLM's extra sampling fields and this project's
``num_speculative_tokens``, ``target_probs`` and ``drafter_invariant``. Defaults:
temperature 1.0 and top_p 1.0 (OpenAI and vLLM agree); max_tokens 16 for completions
(OpenAI's documented default) and "the rest of the context" for chat (OpenAI and vLLM).
Responses are OpenAI's shape plus ``seed`` (the effective seed: send it back to reproduce the
text) and ``speculation`` (per-request speculation counters), also on the last stream chunk.

Every error is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``:
400 for any invalid input (FastAPI's 422s are converted), 401 for a missing / wrong API key
(only when SPECDEC_API_KEY is set), 404 for an unknown model or route, 413 for a body over
SPECDEC_MAX_BODY_BYTES (1 MiB default), 503 with Retry-After when the service is full.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Annotated, Any, Literal, Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.api_types import (
    GenerateDelta,
    GenerateRequest,
    GenerateResult,
    SpeculationStats,
    TokenLogprob,
    Usage,
)
from specdec.errors import CapacityError, ContextLengthError, RequestError, UnknownModelError
from specdec.params import SamplingParams

logger = logging.getLogger("specdec.http")

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


class Backend(Protocol):
    """What the routes need from the coordinator (or a test fake)."""

    model_name: str
    max_context: int

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]: ...

    def chat_prompt_ids(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> list[int]: ...


# ---- request schemas ---------------------------------------------------------------------

# int64 bounds keep absurd integers out of torch; semantic ranges live in SamplingParams.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Bias = Annotated[float, Field(ge=-100, le=100)]


def _valid_unicode(text: str) -> str:
    # JSON can carry lone surrogates ("\ud800"); tokenizers and UTF-8 encoders cannot.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (it contains a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by both generation endpoints (OpenAI, vLLM extras, this project)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = Field(None, description="The served model id; may be omitted.")
    temperature: float | None = Field(None, description="[0, 2]; 0 = greedy. Default 1.")
    top_p: float | None = Field(None, description="(0, 1]; 1 = off.")
    n: Int64 | None = Field(None, description="Must be 1.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = Field(None, description="A string or a list of strings.")
    seed: Int64 | None = Field(None, description="[0, 2**63); omitted = drawn and returned.")
    presence_penalty: float | None = Field(None, description="[-2, 2].")
    frequency_penalty: float | None = Field(None, description="[-2, 2].")
    logit_bias: dict[str, Bias] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100]."
    )
    user: str | None = Field(None, description="Accepted and ignored.")
    # vLLM's extra sampling fields.
    top_k: Int64 | None = Field(None, description="0 or -1 = off, else >= 1.")
    min_p: float | None = Field(None, description="[0, 1]; 0 = off.")
    repetition_penalty: float | None = Field(None, description="> 0; 1 = off.")
    stop_token_ids: list[TokenId] | None = None
    min_tokens: Int64 | None = Field(None, description=">= 0 and <= max_tokens.")
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, description="Non-empty when set.")
    bad_words: list[Text] | None = None
    # This project's fields.
    num_speculative_tokens: Int64 | None = Field(
        None, description="Draft tokens per round, [0, 16]; 0 = target only."
    )
    target_probs: Literal["processed", "raw"] | None = Field(
        None, description='"processed" (correct, default) or "raw" (benchmark only).'
    )
    drafter_invariant: bool | None = Field(
        None, description="Gumbel-max coupling: same seeded text for any draft and K."
    )


class CompletionRequest(_SamplingFields):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]] = Field(
        description="A string or a list of token ids (one prompt per request)."
    )
    max_tokens: Int64 | None = Field(None, description=">= 1. Default 16.")
    logprobs: Int64 | None = Field(None, description="Top alternatives per token, [0, 20].")
    echo: bool | None = Field(None, description="Not supported: false or omitted.")
    suffix: str | None = Field(None, description="Not supported: null or omitted.")
    best_of: Int64 | None = Field(None, description="Not supported: 1 or omitted.")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = Field(None, description="Text, or text parts.")
    name: str | None = Field(None, description="Accepted and ignored.")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="At least one message.")
    max_tokens: Int64 | None = Field(None, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: Int64 | None = Field(
        None, description=">= 1. Default: the rest of the context."
    )
    logprobs: bool | None = Field(None, description="Return the chosen tokens' logprobs.")
    top_logprobs: Int64 | None = Field(None, description="[0, 20]; needs logprobs=true.")
    add_generation_prompt: bool = True


# ---- response schemas (for the OpenAPI document; built as plain dicts) ---------------------


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    seed: int
    speculation: SpeculationStats


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    seed: int
    speculation: SpeculationStats


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


# ---- the app -------------------------------------------------------------------------------

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)
}
_STREAM_DOC = {"text/event-stream": {"schema": {"type": "string"}}}

app = FastAPI(
    title="specdec: exact speculative decoding",
    version="0.1.0",
    description=__doc__,
    responses=_ERRORS,
)


def _backend(request: Request) -> Backend:
    backend = getattr(request.app.state, "backend", None) or getattr(app.state, "backend", None)
    if backend is None:
        raise CapacityError("the model is still loading; retry shortly")
    return backend


@app.get("/health")
@app.get("/v1/health")
async def health(request: Request) -> dict:
    _backend(request)
    return {"status": "ok"}


@app.get("/v1/models")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(_backend(request))]}


@app.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict:
    backend = _backend(request)
    _check_model(backend, model)
    return _model_card(backend)


@app.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={200: {"content": _STREAM_DOC}},
)
async def completions(body: CompletionRequest, request: Request):
    backend = _backend(request)
    _check_model(backend, body.model)
    _refuse_unsupported_completion_fields(body)
    prompt = _single_prompt(body.prompt)
    params = _sampling_params(body, max_tokens=_completion_max_tokens(body), logprobs=body.logprobs)
    gen = _generate_request(prompt, params, "prompt")
    if body.stream:
        return await _stream(backend, gen, _CompletionChunks(body, backend.model_name), body)
    result = await _call(backend.generate(gen), body)
    return _completion_response(result, backend.model_name)


@app.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={200: {"content": _STREAM_DOC}},
)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    backend = _backend(request)
    _check_model(backend, body.model)
    prompt_ids = _chat_prompt_ids(backend, body)
    params = _sampling_params(
        body, max_tokens=_chat_max_tokens(body, backend, prompt_ids), logprobs=_chat_logprobs(body)
    )
    gen = _generate_request(prompt_ids, params, "messages")
    if body.stream:
        return await _stream(backend, gen, _ChatChunks(body, backend.model_name), body)
    result = await _call(backend.generate(gen), body)
    return _chat_response(result, backend.model_name, logprobs=bool(body.logprobs))


def _model_card(backend: Backend) -> dict:
    return {
        "id": backend.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "specdec",
        "max_model_len": backend.max_context,
    }


def _check_model(backend: Backend, model: str | None) -> None:
    if model is not None and model != backend.model_name:
        raise UnknownModelError(
            f"The model '{model}' does not exist; this server serves '{backend.model_name}' "
            "(or omit 'model').",
            param="model",
        )


# ---- request -> GenerateRequest ------------------------------------------------------------

# Fields with the same name and meaning in the request and in SamplingParams.
_PASS_THROUGH = (
    "temperature top_p n stop seed presence_penalty frequency_penalty logit_bias top_k min_p "
    "repetition_penalty stop_token_ids min_tokens ignore_eos include_stop_str_in_output "
    "allowed_token_ids bad_words num_speculative_tokens target_probs drafter_invariant"
).split()


def _sampling_params(body: _SamplingFields, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """Only fields the client set are passed, so SamplingParams' defaults apply to the rest."""
    data = {name: getattr(body, name) for name in _PASS_THROUGH if getattr(body, name) is not None}
    data["max_tokens"] = max_tokens
    if logprobs is not None:
        data["logprobs"] = logprobs
    try:
        return SamplingParams.model_validate(data)
    except ValidationError as exc:
        raise _params_error(exc, body) from None


def _params_error(exc: ValidationError, body: _SamplingFields) -> RequestError:
    """Name the request's own field (e.g. max_completion_tokens, not max_tokens)."""
    err = exc.errors(include_url=False)[0]
    field = str(err["loc"][0]) if err["loc"] else _first_field_named(err["msg"])
    field = _request_field_name(field, body)
    message = err["msg"].removeprefix("Value error, ")
    if field and field not in message:
        message = f"'{field}': {message}"
    return RequestError(message, param=field)


def _first_field_named(message: str) -> str | None:
    """Cross-field checks (min_tokens <= max_tokens) have no loc: take the first field named."""
    named = [(m.start(), f) for f in SamplingParams.model_fields if (m := re.search(rf"\b{f}\b", message))]
    return min(named)[1] if named else None


def _request_field_name(field: str | None, body: _SamplingFields) -> str | None:
    if field == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    if field == "logprobs" and isinstance(body, ChatCompletionRequest):
        return "top_logprobs"
    return field


def _refuse_unsupported_completion_fields(body: CompletionRequest) -> None:
    if body.echo:
        raise RequestError("'echo' is not supported; omit it or set it to false", param="echo")
    if body.suffix is not None:
        raise RequestError("'suffix' is not supported; omit it", param="suffix")
    if body.best_of not in (None, 1):
        raise RequestError("'best_of' must be 1 or omitted", param="best_of")


def _single_prompt(prompt: str | list) -> str | list[int]:
    """One prompt per request: a string or a list of token ids (or a one-item batch)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return prompt
    if not prompt:
        raise RequestError("'prompt' must not be empty", param="prompt")
    if len(prompt) != 1:
        raise RequestError(
            f"'prompt' must be one prompt (a string or a list of token ids); a batch of "
            f"{len(prompt)} prompts is not supported: send one request per prompt",
            param="prompt",
        )
    return prompt[0]


def _completion_max_tokens(body: CompletionRequest) -> int:
    return DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens


def _generate_request(prompt: str | list[int], params: SamplingParams, field: str) -> GenerateRequest:
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    try:
        return GenerateRequest(**{key: prompt}, sampling_params=params, request_id=uuid.uuid4().hex)
    except ValidationError as exc:
        message = exc.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
        raise RequestError(f"'{field}': {message}", param=field) from None


def _chat_prompt_ids(backend: Backend, body: ChatCompletionRequest) -> list[int]:
    messages = [_template_message(m, i) for i, m in enumerate(body.messages)]
    try:
        return list(backend.chat_prompt_ids(messages, add_generation_prompt=body.add_generation_prompt))
    except RequestError:
        raise
    except Exception as exc:  # a chat template refusing the conversation is the client's input
        if type(exc).__module__.split(".")[0] != "jinja2":
            raise
        raise RequestError(f"'messages' could not be formatted: {exc}", param="messages") from None


def _template_message(message: ChatMessage, index: int) -> dict:
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    if content is None:
        raise RequestError(
            f"'messages[{index}].content' must be text (tool calls are not supported)",
            param=f"messages[{index}].content",
        )
    role = "system" if message.role == "developer" else message.role  # OpenAI's new name
    return {"role": role, "content": content}


def _chat_max_tokens(body: ChatCompletionRequest, backend: Backend, prompt_ids: list[int]) -> int:
    given = [v for v in (body.max_completion_tokens, body.max_tokens) if v is not None]
    if len(given) == 2 and given[0] != given[1]:
        raise RequestError(
            "give 'max_completion_tokens' or its deprecated alias 'max_tokens', not both",
            param="max_tokens",
        )
    if given:
        return given[0]
    room = backend.max_context - len(prompt_ids)
    if room < 1:
        raise ContextLengthError(
            f"This model's maximum context length is {backend.max_context} tokens; the "
            f"messages use {len(prompt_ids)}, leaving no room for a reply.",
            param="messages",
        )
    return room


def _chat_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if not body.logprobs:
        return None
    return body.top_logprobs or 0


async def _call(awaitable, body: _SamplingFields):
    """Backends name their own fields (prompt_token_ids, max_tokens): report the request's."""
    try:
        return await awaitable
    except RequestError as exc:
        if exc.param in ("prompt", "prompt_token_ids"):
            exc.param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        else:
            exc.param = _request_field_name(exc.param, body)
        raise


# ---- responses -----------------------------------------------------------------------------


def _completion_response(result: GenerateResult, model: str) -> dict:
    choice = {
        "index": 0,
        "text": result.text,
        "logprobs": _completion_logprobs(result.logprobs, 0)[0] if result.logprobs is not None else None,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
    }
    return _envelope(f"cmpl-{result.request_id}", "text_completion", model, choice, result)


def _chat_response(result: GenerateResult, model: str, logprobs: bool) -> dict:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": result.text},
        "logprobs": _chat_logprobs_body(result.logprobs) if logprobs else None,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
    }
    return _envelope(f"chatcmpl-{result.request_id}", "chat.completion", model, choice, result)


def _envelope(rid: str, obj: str, model: str, choice: dict, result: GenerateResult) -> dict:
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": result.usage.model_dump(),
        "seed": result.seed,
        "speculation": result.speculation.model_dump(),
    }


def _lp(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def _completion_logprobs(items: list[TokenLogprob], offset: int) -> tuple[dict, int]:
    """OpenAI's legacy shape; text offsets count from the start of the completion."""
    offsets = []
    for item in items:
        offsets.append(offset)
        offset += len(item.token)
    body = {
        "tokens": [i.token for i in items],
        "token_logprobs": [_lp(i.logprob) for i in items],
        "top_logprobs": [{t: _lp(v) for _, t, v in i.top_logprobs} for i in items],
        "text_offset": offsets,
    }
    return body, offset


def _chat_logprobs_body(items: list[TokenLogprob] | None) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode())}

    return {
        "content": [
            entry(i.token, i.logprob) | {"top_logprobs": [entry(t, v) for _, t, v in i.top_logprobs]}
            for i in items or []
        ]
    }


# ---- streaming -----------------------------------------------------------------------------


class _CompletionChunks:
    """Turns backend deltas into /v1/completions stream chunks."""

    object = "text_completion"

    def __init__(self, body: CompletionRequest, model: str):
        self.model, self.created = model, int(time.time())
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.text_offset = 0

    def start(self, rid: str) -> list[dict]:
        self.id = f"cmpl-{rid}"
        return []

    def choice(self, delta: GenerateDelta) -> dict:
        logprobs = None
        if delta.logprobs is not None:
            logprobs, self.text_offset = _completion_logprobs(delta.logprobs, self.text_offset)
        return {"index": 0, "text": delta.text, "logprobs": logprobs}

    def chunks(self, delta: GenerateDelta) -> list[dict]:
        if not delta.text and delta.logprobs is None and delta.finish_reason is None:
            return []  # nothing a client can see yet (text held back at a possible stop)
        choice = self.choice(delta) | {
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }
        chunk = self.chunk([choice])
        if delta.finish_reason is None:
            return [chunk]
        chunk["seed"] = delta.seed
        chunk["speculation"] = delta.speculation.model_dump() if delta.speculation else None
        if not self.include_usage:
            return [chunk]
        usage_chunk = self.chunk([])
        usage_chunk["usage"] = delta.usage.model_dump() if delta.usage else None
        return [chunk, usage_chunk]

    def chunk(self, choices: list[dict]) -> dict:
        chunk = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: null on every chunk but the last
        return chunk


class _ChatChunks(_CompletionChunks):
    object = "chat.completion.chunk"

    def __init__(self, body: ChatCompletionRequest, model: str):
        super().__init__(body, model)  # type: ignore[arg-type]
        self.logprobs = bool(body.logprobs)

    def start(self, rid: str) -> list[dict]:
        self.id = f"chatcmpl-{rid}"
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        return [self.chunk([role | {"finish_reason": None}])]

    def choice(self, delta: GenerateDelta) -> dict:
        logprobs = _chat_logprobs_body(delta.logprobs) if self.logprobs else None
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        return {"index": 0, "delta": content, "logprobs": logprobs}


def _sse(data: dict | str) -> str:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), allow_nan=False)
    return f"data: {text}\n\n"


async def _stream(
    backend: Backend, request: GenerateRequest, chunks: _CompletionChunks, body: _SamplingFields
) -> _SSEResponse:
    """Start the backend's stream and wait for its first delta before answering, so that an
    error at admission (context length, capacity) still gets its own HTTP status."""
    deltas = backend.generate_stream(request)
    try:
        first = await _call(anext(deltas), body)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await _close(deltas)
        raise
    rid = first.request_id if first is not None else request.request_id
    return _SSEResponse(
        _events(deltas, first, chunks, rid),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},  # no proxy buffering
    )


async def _events(
    deltas: AsyncIterator[GenerateDelta],
    first: GenerateDelta | None,
    chunks: _CompletionChunks,
    rid: str,
) -> AsyncIterator[str]:
    try:
        for chunk in chunks.start(rid):
            yield _sse(chunk)
        if first is not None:
            for chunk in chunks.chunks(first):
                yield _sse(chunk)
            async for delta in deltas:
                for chunk in chunks.chunks(delta):
                    yield _sse(chunk)
    except (RequestError, CapacityError, ValidationError) as exc:
        yield _sse(_error_content(exc)[1])  # headers are sent: the error goes in the stream
    except Exception:
        logger.exception("stream %s failed", rid)
        yield _sse(_error_body(500, "internal error; see the server log", "server_error"))
    finally:
        await _close(deltas)  # frees the request's draft and target caches
    yield _sse("[DONE]")


async def _close(deltas: AsyncIterator[GenerateDelta]) -> None:
    aclose = getattr(deltas, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


class _SSEResponse(StreamingResponse):
    """Streams while watching for the client's disconnect (whatever the ASGI spec version),
    and always closes the event generator, which closes the backend's stream."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client is gone
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await _close(self.body_iterator)  # type: ignore[arg-type]


# ---- errors --------------------------------------------------------------------------------

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


def _error_body(status: int, message: str, type_: str | None = None, param=None, code=None) -> dict:
    return {
        "error": {
            "message": message or "error",
            "type": type_ or _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


class _ErrorJSON(JSONResponse):
    """ASCII-escaped, so that client text quoted in a message (even a lone surrogate) can
    never make the error response itself fail."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":"), default=str).encode("ascii")


def _error_response(status: int, message: str, headers: dict | None = None, **kw) -> JSONResponse:
    return _ErrorJSON(_error_body(status, message, **kw), status_code=status, headers=headers)


def _error_content(exc: Exception) -> tuple[int, dict, dict | None]:
    if isinstance(exc, CapacityError):
        retry = str(max(1, int(getattr(exc, "retry_after", 1) or 1)))
        return 503, _error_body(503, str(exc), code="capacity"), {"Retry-After": retry}
    if isinstance(exc, RequestError):
        code = {UnknownModelError: "model_not_found", ContextLengthError: "context_length_exceeded"}
        status, message = getattr(exc, "status_code", 400), exc.message
        if exc.param and exc.param.split("[")[0] not in message:
            message = f"'{exc.param}': {message}"
        return status, _error_body(status, message, param=exc.param, code=code.get(type(exc))), None
    if isinstance(exc, ValidationError):
        err = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        return 400, _error_body(400, err["msg"].removeprefix("Value error, "), param=param), None
    return 500, _error_body(500, "internal error; see the server log"), None


@app.exception_handler(RequestError)
@app.exception_handler(CapacityError)
@app.exception_handler(ValidationError)
async def _domain_error(request: Request, exc: Exception) -> JSONResponse:
    status, body, headers = _error_content(exc)
    return _ErrorJSON(body, status_code=status, headers=headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail, default=str)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}; see /docs"
    return _error_response(exc.status_code, message, headers=getattr(exc, "headers", None))


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    return _error_response(500, "internal error; see the server log")


@app.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    help_ = _FIELD_HELP["chat" if request.url.path.endswith("/chat/completions") else "completions"]
    param, message = _describe_validation(exc.errors(), help_)
    return _error_response(400, message, param=param)


def _describe_validation(errors: Iterable[dict], help_: dict[str, str]) -> tuple[str | None, str]:
    """FastAPI's 422 -> one readable 400: the first invalid field, what it got, what it allows."""
    errors = list(errors)
    if not errors:
        return None, "invalid request"
    err = errors[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if not loc or err.get("type") == "json_invalid":
        return None, _body_message(err)
    path = _field_path(loc)
    if err.get("type") == "extra_forbidden":
        return path, f"unknown or unsupported field '{path}'; see /docs for the accepted fields"
    if err.get("type") == "missing":
        return path, f"'{path}' is required"
    # A union type gives one error per alternative (some deeper): quote none of them.
    paths = [_field_path([p for p in e["loc"] if p != "body"]) for e in errors]
    union = sum(1 for p in paths if p == path or p.startswith((path + ".", path + "["))) > 1
    message = f"invalid '{path}'" + ("" if union else f": {err['msg']}")
    message += f" (got {_short(err.get('input'))})"
    if allowed := help_.get(path.split("[")[0].split(".")[0]):
        message += f"; allowed: {allowed}"
    return path, message


def _body_message(err: dict) -> str:
    kind = err.get("type")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": ")
    if kind == "missing":
        return "the request body is missing: send a JSON object"
    if kind in ("model_attributes_type", "dict_type"):
        return "the request body must be a JSON object sent with 'Content-Type: application/json'"
    return f"invalid request body: {err.get('msg', 'unreadable')}"


def _field_path(loc: list) -> str:
    """Keep field names and list indices; drop pydantic's union-member tags like 'list[int]'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _FIELD_NAMES:
            path += f".{part}" if path else part
    return path or ".".join(str(p) for p in loc)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _model_fields(*models: type[BaseModel]) -> set[str]:
    return {name for m in models for name in m.model_fields}


_FIELD_NAMES = _model_fields(CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions)
_FIELD_HELP = {
    path: {name: f.description for name, f in model.model_fields.items() if f.description}
    for path, model in (("completions", CompletionRequest), ("chat", ChatCompletionRequest))
}
_FIELD_HELP["chat"]["messages"] = (
    'a non-empty list of {"role": "system"|"developer"|"user"|"assistant", '
    '"content": text or [{"type": "text", "text": ...}]}'
)


# ---- API key and body size (ASGI middleware: runs before any body parsing) -----------------


def _max_body_bytes() -> int:
    raw = os.environ.get("SPECDEC_MAX_BODY_BYTES")
    try:
        return int(raw) if raw else DEFAULT_MAX_BODY_BYTES
    except ValueError:
        logger.warning("SPECDEC_MAX_BODY_BYTES=%r is not an integer; using %d", raw, DEFAULT_MAX_BODY_BYTES)
        return DEFAULT_MAX_BODY_BYTES


class GuardMiddleware:
    """Bearer-token check on /v1 when SPECDEC_API_KEY is set (read per request, so a
    replica's runtime_env decides), then a request body limit (413)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            response = _error_response(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
                code="invalid_api_key",
            )
            return await response(scope, receive, send)
        limit = _max_body_bytes()
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._too_large(scope, receive, send, limit)
        body = await _read_body(receive, limit)
        if body is None:
            return await self._too_large(scope, receive, send, limit)
        await self.app(scope, _replay(body, receive), send)

    @staticmethod
    def _authorized(scope: Scope) -> bool:
        key = os.environ.get("SPECDEC_API_KEY")
        if not key or not scope["path"].startswith("/v1"):
            return True
        given = _header(scope, b"authorization") or ""
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    @staticmethod
    async def _too_large(scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        response = _error_response(
            413, f"the request body is larger than {limit} bytes", code="request_too_large"
        )
        await response(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes `limit` (the rest is not read)."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break  # disconnect: let the app see an empty body and the disconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls wait for the disconnect, as usual

    return replay


app.add_middleware(GuardMiddleware)
