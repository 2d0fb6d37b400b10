"""The OpenAI-compatible HTTP API: ``make_app(backend)`` builds the FastAPI app.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /v1/models/{model}, GET /health (and /v1/health), plus FastAPI's /openapi.json and /docs.

Request fields follow OpenAI, plus vLLM's extra sampling fields and this project's
``num_speculative_tokens``, ``target_probs`` and ``drafter_invariant``. Defaults:
temperature 1.0 and top_p 1.0 (OpenAI and vLLM agree); max_tokens 16 for completions
(OpenAI's documented default) and "the rest of the context" for chat (OpenAI and vLLM).
Responses are OpenAI's shape plus ``seed`` (the effective seed: send it back to reproduce the
text) and ``speculation`` (per-request speculation counters), also on the last stream chunk.

Every error is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``:
400 for any invalid input, 401 for a missing / wrong API key (only when SPECDEC_API_KEY is
set), 404 for an unknown model or route, 413 for a body over SPECDEC_MAX_BODY_BYTES (1 MiB
default), 503 with Retry-After when the service is full.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import FastAPI, Request

from deployments.http import translate as tr
from deployments.http.errors import install_error_handlers
from deployments.http.middleware import GuardMiddleware
from deployments.http.responses import chat_response, completion_response, model_card
from deployments.http.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
from deployments.http.streaming import ChatChunks, CompletionChunks, stream
from specdec.api_types import GenerateDelta, GenerateRequest, GenerateResult
from specdec.errors import CapacityError, UnknownModelError


class Backend(Protocol):
    """What the routes need from the coordinator (or a test fake)."""

    model_name: str
    max_context: int

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]: ...

    def chat_prompt_ids(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> list[int]: ...


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)
}
_STREAM_DOC = {"text/event-stream": {"schema": {"type": "string"}}}


def make_app(backend: Backend | None) -> FastAPI:
    """A new app serving `backend` (kept on ``app.state.backend``; None answers 503)."""
    app = FastAPI(
        title="specdec: exact speculative decoding",
        version="0.1.0",
        description=__doc__,
        responses=_ERRORS,
    )
    app.state.backend = backend
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware)

    @app.get("/health")
    @app.get("/v1/health")
    async def health(request: Request) -> dict:
        _backend(request)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        return {"object": "list", "data": [model_card(_backend(request))]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request) -> dict:
        return model_card(_serving(request, model))

    def generation_route(path: str, response: type):
        doc = {200: {"model": response, "content": _STREAM_DOC}}
        return app.post(path, response_model=None, responses=doc)

    @generation_route("/v1/completions", CompletionResponse)
    async def completions(body: CompletionRequest, request: Request):
        backend = _serving(request, body.model)
        tr.refuse_unsupported_completion_fields(body)
        prompt = tr.single_prompt(body.prompt)
        params = tr.sampling_params(body, max_tokens=tr.completion_max_tokens(body), logprobs=body.logprobs)
        return await _answer(
            backend, body, tr.generate_request(prompt, params, body), CompletionChunks,
            lambda result: completion_response(result, backend.model_name),
        )

    @generation_route("/v1/chat/completions", ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        backend = _serving(request, body.model)
        prompt_ids = tr.chat_prompt_ids(backend, body)
        max_tokens = tr.chat_max_tokens(body, backend.max_context, prompt_ids)
        params = tr.sampling_params(body, max_tokens=max_tokens, logprobs=tr.chat_logprobs(body))
        return await _answer(
            backend, body, tr.generate_request(prompt_ids, params, body), ChatChunks,
            lambda result: chat_response(result, backend.model_name, logprobs=bool(body.logprobs)),
        )

    return app


async def _answer(backend: Backend, body, gen: GenerateRequest, chunks: type[CompletionChunks], respond):
    """A stream of `chunks` when the body asks for one, else `respond(result)`."""
    if body.stream:
        return await stream(backend, gen, chunks(body, backend.model_name), body)
    return respond(await tr.call(backend.generate(gen), body))


def _backend(request: Request) -> Backend:
    backend = getattr(request.app.state, "backend", None)
    if backend is None:
        raise CapacityError("the model is still loading; retry shortly")
    return backend


def _serving(request: Request, model: str | None) -> Backend:
    """The backend, if `model` (when given) is the one it serves."""
    backend = _backend(request)
    if model is not None and model != backend.model_name:
        raise UnknownModelError(
            f"The model '{model}' does not exist; this server serves '{backend.model_name}' "
            "(or omit 'model').",
            param="model",
        )
    return backend
