"""Server-sent events: backend deltas -> OpenAI stream chunks, with the client's disconnect
closing the backend's stream (which frees the request's draft and target caches)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

import anyio
from fastapi.responses import StreamingResponse
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from openai.types.completion_choice import CompletionChoice
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from deployments.http.errors import error_body, error_content
from deployments.http.responses import chat_logprobs, completion_logprobs, speculation, usage
from deployments.http.schemas import (
    ChatCompletionRequest,
    ChatCompletionStreamChunk,
    CompletionRequest,
    CompletionStreamChunk,
    SamplingFields,
)
from deployments.http.translate import call
from specdec.api_types import GenerateDelta, GenerateRequest
from specdec.errors import CapacityError, RequestError

logger = logging.getLogger("specdec.http")


class CompletionChunks:
    """Turns backend deltas into /v1/completions stream chunks."""

    object = "text_completion"
    chunk_type: type = CompletionStreamChunk

    def __init__(self, body: CompletionRequest, model: str):
        self.model, self.created = model, int(time.time())
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.text_offset = 0

    def start(self, rid: str) -> list[dict]:
        self.id = f"cmpl-{rid}"
        return []

    def choice(self, delta: GenerateDelta, finish: dict) -> object:
        logprobs = None
        if delta.logprobs is not None:
            logprobs, self.text_offset = completion_logprobs(delta.logprobs, self.text_offset)
        return CompletionChoice.construct(index=0, text=delta.text, logprobs=logprobs, **finish)

    def chunks(self, delta: GenerateDelta) -> list[dict]:
        if not delta.text and delta.logprobs is None and delta.finish_reason is None:
            return []  # nothing a client can see yet (text held back at a possible stop)
        finish = {"finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
        choice = self.choice(delta, finish)
        if delta.finish_reason is None:
            return [self.chunk([choice])]
        chunk = self.chunk([choice], seed=delta.seed, speculation=speculation(delta.speculation))
        if not self.include_usage:
            return [chunk]
        return [chunk, self.chunk([], usage=usage(delta.usage))]

    def chunk(self, choices: list, **fields) -> dict:
        if self.include_usage:
            fields.setdefault("usage", None)  # as OpenAI: null on every chunk but the last
        return self.chunk_type.construct(
            id=self.id, object=self.object, created=self.created, model=self.model,
            choices=choices, **fields,
        ).to_dict()


class ChatChunks(CompletionChunks):
    object = "chat.completion.chunk"
    chunk_type = ChatCompletionStreamChunk

    def __init__(self, body: ChatCompletionRequest, model: str):
        super().__init__(body, model)  # type: ignore[arg-type]
        self.logprobs = bool(body.logprobs)

    def start(self, rid: str) -> list[dict]:
        self.id = f"chatcmpl-{rid}"
        role = ChoiceDelta.construct(role="assistant", content="")
        return [self.chunk([ChunkChoice.construct(index=0, delta=role, logprobs=None, finish_reason=None)])]

    def choice(self, delta: GenerateDelta, finish: dict) -> object:
        logprobs = chat_logprobs(delta.logprobs) if self.logprobs else None
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        return ChunkChoice.construct(
            index=0, delta=ChoiceDelta.construct(**content), logprobs=logprobs, **finish
        )


def sse(data: dict | str) -> str:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), allow_nan=False)
    return f"data: {text}\n\n"


async def stream(
    backend, request: GenerateRequest, chunks: CompletionChunks, body: SamplingFields
) -> StreamingResponse:
    """Start the backend's stream and wait for its first delta before answering, so that an
    error at admission (context length, capacity) still gets its own HTTP status."""
    deltas = backend.generate_stream(request)
    try:
        first = await call(anext(deltas), body)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await close(deltas)
        raise
    rid = first.request_id if first is not None else request.request_id
    return SSEResponse(
        _events(deltas, first, chunks, rid),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},  # no proxy buffering
    )


async def _events(
    deltas: AsyncIterator[GenerateDelta],
    first: GenerateDelta | None,
    chunks: CompletionChunks,
    rid: str,
) -> AsyncIterator[str]:
    try:
        for chunk in chunks.start(rid):
            yield sse(chunk)
        if first is not None:
            for chunk in chunks.chunks(first):
                yield sse(chunk)
            async for delta in deltas:
                for chunk in chunks.chunks(delta):
                    yield sse(chunk)
    except (RequestError, CapacityError, ValidationError) as exc:
        yield sse(error_content(exc)[1])  # headers are sent: the error goes in the stream
    except Exception:
        logger.exception("stream %s failed", rid)
        yield sse(error_body(500, "internal error; see the server log", "server_error"))
    finally:
        await close(deltas)  # frees the request's draft and target caches
    yield sse("[DONE]")


async def close(deltas: AsyncIterator) -> None:
    aclose = getattr(deltas, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


class SSEResponse(StreamingResponse):
    """Streams while watching for the client's disconnect (whatever the ASGI spec version),
    and always closes the event generator, which closes the backend's stream."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def send_all() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client is gone
                    tg.cancel_scope.cancel()

                tg.start_soon(send_all)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await close(self.body_iterator)  # type: ignore[arg-type]
