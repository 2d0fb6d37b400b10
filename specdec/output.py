"""What a caller sees of a Generation: streamed deltas (with the cursors of what was sent)
and the final result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.api_types import GenerateDelta, GenerateResult, SpeculationStats, Usage
from specdec.stopping import stop_strings

if TYPE_CHECKING:
    from specdec.generation import Generation


@dataclass
class Cursor:
    """How much of a request's text, tokens and logprobs its stream has sent."""

    text: int = 0
    tokens: int = 0
    logprobs: int = 0


def delta(gen: Generation) -> GenerateDelta:
    """Everything not yet sent. While running, text that may still turn out to be the
    start of a stop string (or half a UTF-8 character) is held back."""
    sent = gen.sent
    text_end = len(gen.text)
    if not gen.finished:
        hold = max((len(s) - 1 for s in stop_strings(gen.params.stop)), default=0)
        text_end = max(sent.text, text_end - hold)
        while text_end > sent.text and gen.text[text_end - 1] == "\ufffd":
            text_end -= 1
    out = GenerateDelta(
        request_id=gen.client_request_id or gen.request_id,
        text=gen.text[sent.text : text_end],
        token_ids=gen.output[sent.tokens :],
        logprobs=gen.logprobs[sent.logprobs :] if gen.params.logprobs is not None else None,
    )
    sent.text, sent.tokens, sent.logprobs = text_end, len(gen.output), len(gen.logprobs)
    if gen.finished:
        out.finish_reason, out.stop_reason = gen.finish_reason, gen.stop_reason
        out.usage, out.seed, out.speculation = usage(gen), gen.seed, speculation(gen)
    return out


def usage(gen: Generation) -> Usage:
    n_prompt, n_out = len(gen.prompt_ids), len(gen.output)
    return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out)


def speculation(gen: Generation) -> SpeculationStats:
    return SpeculationStats(**gen.stats.to_dict())


def result(gen: Generation) -> GenerateResult:
    return GenerateResult(
        request_id=gen.client_request_id or gen.request_id,
        text=gen.text,
        token_ids=gen.output,
        finish_reason=gen.finish_reason or "abort",
        stop_reason=gen.stop_reason,
        usage=usage(gen),
        seed=gen.seed,
        speculation=speculation(gen),
        logprobs=gen.logprobs if gen.params.logprobs is not None else None,
    )
