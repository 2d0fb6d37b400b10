"""Response bodies, built from the `openai` package's types (schemas.py) and dumped with
only the fields set, so a body holds what OpenAI's would plus `seed` and `speculation`."""

from __future__ import annotations

import math
import time

from openai.types.chat import ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs
from openai.types.completion_usage import CompletionUsage

from deployments.http.schemas import ChatCompletionResponse, CompletionResponse, TextChoice
from specdec.api_types import GenerateResult, SpeculationStats, TokenLogprob, Usage

LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


def model_card(backend) -> dict:
    return {
        "id": backend.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "specdec",
        "max_model_len": backend.max_context,
    }


def completion_response(result: GenerateResult, model: str) -> dict:
    logprobs = completion_logprobs(result.logprobs, 0)[0] if result.logprobs is not None else None
    choice = TextChoice.construct(text=result.text, logprobs=logprobs, **_finish(result))
    return _body(CompletionResponse, f"cmpl-{result.request_id}", "text_completion", choice, result, model)


def chat_response(result: GenerateResult, model: str, logprobs: bool) -> dict:
    message = ChatCompletionMessage.construct(role="assistant", content=result.text)
    lp = chat_logprobs(result.logprobs) if logprobs else None
    choice = ChatChoice.construct(message=message, logprobs=lp, **_finish(result))
    return _body(ChatCompletionResponse, f"chatcmpl-{result.request_id}", "chat.completion", choice, result, model)


def _finish(result: GenerateResult) -> dict:
    return {"index": 0, "finish_reason": result.finish_reason, "stop_reason": result.stop_reason}


def _body(cls, rid: str, obj: str, choice, result: GenerateResult, model: str) -> dict:
    return cls.construct(id=rid, object=obj, choices=[choice], **_common(result, model)).to_dict()


def _common(result: GenerateResult, model: str) -> dict:
    return dict(
        created=int(time.time()),
        model=model,
        usage=usage(result.usage),
        seed=result.seed,
        speculation=speculation(result.speculation),
    )


def speculation(value: SpeculationStats | None) -> SpeculationStats | None:
    """With every field marked as set, so that the body shows all of them."""
    return None if value is None else SpeculationStats.model_construct(**value.model_dump())


def usage(value: Usage | None) -> CompletionUsage | None:
    return None if value is None else CompletionUsage.construct(**value.model_dump())  # all set


def _lp(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def completion_logprobs(items: list[TokenLogprob], offset: int) -> tuple[Logprobs, int]:
    """OpenAI's legacy shape; text offsets count from the start of the completion."""
    offsets = []
    for item in items:
        offsets.append(offset)
        offset += len(item.token)
    body = Logprobs.construct(
        tokens=[i.token for i in items],
        token_logprobs=[_lp(i.logprob) for i in items],
        top_logprobs=[{t: _lp(v) for _, t, v in i.top_logprobs} for i in items],
        text_offset=offsets,
    )
    return body, offset


def chat_logprobs(items: list[TokenLogprob] | None) -> ChoiceLogprobs:
    def entry(cls, token: str, logprob: float, **more):
        return cls.construct(token=token, logprob=_lp(logprob), bytes=list(token.encode()), **more)

    return ChoiceLogprobs.construct(
        content=[
            entry(
                ChatCompletionTokenLogprob, i.token, i.logprob,
                top_logprobs=[entry(TopLogprob, t, v) for _, t, v in i.top_logprobs],
            )
            for i in items or []
        ]
    )
