"""An OpenAI request body -> a `GenerateRequest`, and the one mapping from the backend's
field names (prompt_token_ids, max_tokens, logprobs) back to the names the client sent."""

from __future__ import annotations

import re
import uuid

from pydantic import ValidationError

from deployments.http.schemas import (
    SAMPLING_FIELDS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from specdec.api_types import GenerateRequest
from specdec.errors import ContextLengthError, RequestError
from specdec.params import REFUSE_OUT_OF_RANGE_BIAS, SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


def request_param(field: str | None, body: SamplingFields) -> str | None:
    """The request's own name for a field the backend or SamplingParams named."""
    chat = isinstance(body, ChatCompletionRequest)
    if field in ("prompt", "prompt_token_ids"):
        return "messages" if chat else "prompt"
    if field == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    if field == "logprobs" and chat:
        return "top_logprobs"
    return field


def sampling_params(body: SamplingFields, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """Only fields the client set are passed, so SamplingParams' defaults apply to the rest;
    validated with OpenAI's rules (an out-of-range logit bias is refused, not clamped)."""
    data = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
    data["max_tokens"] = max_tokens
    if logprobs is not None:
        data["logprobs"] = logprobs
    try:
        return SamplingParams.model_validate(data, context={REFUSE_OUT_OF_RANGE_BIAS: True})
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        field = str(err["loc"][0]) if err["loc"] else _first_field_named(err["msg"])
        raise _error(err["msg"], request_param(field, body)) from None


def generate_request(prompt: str | list[int], params: SamplingParams, body: SamplingFields) -> GenerateRequest:
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    try:
        return GenerateRequest(**{key: prompt}, sampling_params=params, request_id=uuid.uuid4().hex)
    except ValidationError as exc:
        raise _error(exc.errors(include_url=False)[0]["msg"], request_param(key, body)) from None


async def call(awaitable, body: SamplingFields):
    """Await the backend; a RequestError it raises names the request's field."""
    try:
        return await awaitable
    except RequestError as exc:
        exc.param = request_param(exc.param, body)
        raise


def _error(message: str, field: str | None) -> RequestError:
    message = message.removeprefix("Value error, ")
    if field and field not in message:
        message = f"'{field}': {message}"
    return RequestError(message, param=field)


def _first_field_named(message: str) -> str | None:
    """Cross-field checks (min_tokens <= max_tokens) have no loc: take the first field named."""
    named = [(m.start(), f) for f in SamplingParams.model_fields if (m := re.search(rf"\b{f}\b", message))]
    return min(named)[1] if named else None


# ---- /v1/completions ---------------------------------------------------------------------


def refuse_unsupported_completion_fields(body: CompletionRequest) -> None:
    if body.echo:
        raise RequestError("'echo' is not supported; omit it or set it to false", param="echo")
    if body.suffix is not None:
        raise RequestError("'suffix' is not supported; omit it", param="suffix")
    if body.best_of not in (None, 1):
        raise RequestError("'best_of' must be 1 or omitted", param="best_of")


def single_prompt(prompt: str | list) -> str | list[int]:
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


def completion_max_tokens(body: CompletionRequest) -> int:
    return DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens


# ---- /v1/chat/completions ----------------------------------------------------------------


def chat_prompt_ids(backend, body: ChatCompletionRequest) -> list[int]:
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


def chat_max_tokens(body: ChatCompletionRequest, max_context: int, prompt_ids: list[int]) -> int:
    given = [v for v in (body.max_completion_tokens, body.max_tokens) if v is not None]
    if len(given) == 2 and given[0] != given[1]:
        raise RequestError(
            "give 'max_completion_tokens' or its deprecated alias 'max_tokens', not both",
            param="max_tokens",
        )
    if given:
        return given[0]
    room = max_context - len(prompt_ids)
    if room < 1:
        raise ContextLengthError(
            f"This model's maximum context length is {max_context} tokens; the "
            f"messages use {len(prompt_ids)}, leaving no room for a reply.",
            param="messages",
        )
    return room


def chat_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if not body.logprobs:
        return None
    return body.top_logprobs or 0
