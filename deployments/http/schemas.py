"""Request and response schemas of the OpenAI-compatible API.

The sampling fields of both generation endpoints are derived from `SamplingParams` (the
one source of their names, descriptions and meaning): every field there becomes an
optional JSON field here, with its JSON-facing type (`_json_type`), and the request is
validated again, semantically, by `SamplingParams` itself (translate.py). Only what JSON
needs on top stays here: int64 bounds (absurd integers never reach torch), text free of
lone surrogates, string keys for `logit_bias`, and one string for `stop` / `bad_words`.

Response bodies are the `openai` package's types plus this service's `seed` (the effective
seed: send it back to reproduce the text) and `speculation` (per-request counters).
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Literal, Optional, Union

from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model

from specdec.api_types import SpeculationStats
from specdec.params import SamplingParams

# int64 bounds keep absurd integers out of torch; semantic ranges live in SamplingParams.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


def _valid_unicode(text: str) -> str:
    # JSON can carry lone surrogates ("\ud800"); tokenizers and UTF-8 encoders cannot.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (it contains a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


def _json_type(annotation):
    """The JSON-facing type of a SamplingParams field's type."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is int:
        return Int64
    if annotation is str:
        return Text
    if origin is list and args == (int,):
        return list[TokenId]  # every list of ints in SamplingParams holds token ids
    if origin is list and args == (str,):
        return Union[Text, list[Text]]  # SamplingParams takes one string as a list of one
    if origin is dict:
        return dict[str, _json_type(args[1])]  # JSON object keys are strings
    if origin in (Union, types.UnionType):
        return Union[tuple(_json_type(a) for a in args)]
    return annotation


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _RequestBase(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = Field(None, description="The served model id; may be omitted.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="Accepted and ignored.")


# Sampling fields whose name means something different on each endpoint: defined there.
ENDPOINT_FIELDS = ("max_tokens", "logprobs")
SAMPLING_FIELDS = tuple(n for n in SamplingParams.model_fields if n not in ENDPOINT_FIELDS)

SamplingFields = create_model(
    "SamplingFields",
    __base__=_RequestBase,
    __doc__="Fields shared by both generation endpoints (OpenAI, vLLM extras, this project).",
    **{
        name: (Optional[_json_type(field.annotation)], Field(None, description=field.description))
        for name, field in SamplingParams.model_fields.items()
        if name in SAMPLING_FIELDS
    },
)


class CompletionRequest(SamplingFields):
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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="At least one message.")
    max_tokens: Int64 | None = Field(None, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: Int64 | None = Field(
        None, description=">= 1. Default: the rest of the context."
    )
    logprobs: bool | None = Field(None, description="Return the chosen tokens' logprobs.")
    top_logprobs: Int64 | None = Field(None, description="[0, 20]; needs logprobs=true.")
    add_generation_prompt: bool = True


# ---- responses: openai's types plus seed and speculation ----------------------------------


class _Extras(BaseModel):
    seed: int
    speculation: SpeculationStats


class TextChoice(CompletionChoice):
    stop_reason: str | int | None = None  # vLLM's: the stop string or token that ended it


class CompletionResponse(Completion, _Extras):
    choices: list[TextChoice]  # type: ignore[assignment]


class ChatCompletionResponse(ChatCompletion, _Extras):
    pass


class ChatCompletionStreamChunk(ChatCompletionChunk):
    seed: int | None = None  # on the chunk that carries finish_reason
    speculation: SpeculationStats | None = None


class CompletionStreamChunk(Completion):
    seed: int | None = None
    speculation: SpeculationStats | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def _model_fields(*models: type[BaseModel]) -> set[str]:
    return {name for m in models for name in m.model_fields}


FIELD_NAMES = _model_fields(CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions)
FIELD_HELP = {
    path: {name: f.description for name, f in model.model_fields.items() if f.description}
    for path, model in (("completions", CompletionRequest), ("chat", ChatCompletionRequest))
}
FIELD_HELP["chat"]["messages"] = (
    'a non-empty list of {"role": "system"|"developer"|"user"|"assistant", '
    '"content": text or [{"type": "text", "text": ...}]}'
)
