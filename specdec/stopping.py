"""Committing a round's emitted tokens: one by one, detokenising as they come, until a stop
condition (stop token, EOS, stop string, max_tokens, the context) ends the request.

vLLM's rules: nothing stops before min_tokens; a stop token stays in token_ids and its
text only with include_stop_str_in_output; a stop string cuts the text where it starts
(or after it, with include_stop_str_in_output).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdec.api_types import TokenLogprob
from specdec.rounds import Scores

if TYPE_CHECKING:
    from specdec.generation import Generation


def commit(gen: Generation, emitted: Sequence[int], scores: Scores) -> int:
    """Append tokens one by one until a stop condition; returns how many were kept."""
    for i, token in enumerate(emitted):
        gen.output.append(token)
        if scores.logprobs is not None:
            gen.logprobs.append(_logprob(gen, token, scores.logprobs[i]))
        _check_stop(gen, token)
        if gen.finished:
            return i + 1
    return len(emitted)


def stop_strings(stop) -> list[str]:
    if not stop:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _check_stop(gen: Generation, token: int) -> None:
    params, n, tokenizer = gen.params, len(gen.output), gen.info.tokenizer
    previous_len = len(gen.text)
    gen.text = tokenizer.decode(gen.output, skip_special_tokens=True)
    if n >= params.min_tokens:
        if token in (params.stop_token_ids or ()):
            # As vLLM: the stop token stays in token_ids, its text only if asked for.
            if not params.include_stop_str_in_output:
                gen.text = tokenizer.decode(gen.output[:-1], skip_special_tokens=True)
            gen.finish_reason, gen.stop_reason = "stop", token
            return
        if token in gen.sampling.eos_token_ids and not params.ignore_eos:
            gen.finish_reason = "stop"
            return
        if params.stop and _stop_string(gen, previous_len):
            return
    if n >= params.max_tokens or len(gen.prompt_ids) + n >= gen.info.max_context:
        gen.finish_reason = "length"


def _stop_string(gen: Generation, previous_len: int) -> bool:
    stops = stop_strings(gen.params.stop)
    search_from = max(0, previous_len - max(len(s) for s in stops) + 1)
    found = [(gen.text.find(s, search_from), s) for s in stops]
    found = [(i, s) for i, s in found if i >= 0]
    if not found:
        return False
    index, stop = min(found)
    keep = index + len(stop) if gen.params.include_stop_str_in_output else index
    gen.text = gen.text[:keep]
    gen.finish_reason, gen.stop_reason = "stop", stop
    return True


def _logprob(gen: Generation, token: int, row) -> TokenLogprob:
    row = torch.from_numpy(row)  # [V] float32: this position's logprobs
    piece = lambda t: gen.info.tokenizer.decode([t])  # noqa: E731
    top = []
    if gen.params.logprobs:
        values, ids = row.topk(gen.params.logprobs)
        top = [(int(i), piece(int(i)), float(v)) for v, i in zip(values, ids)]
    return TokenLogprob(token_id=token, token=piece(token), logprob=float(row[token]), top_logprobs=top)
