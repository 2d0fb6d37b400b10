"""Admission: what a request must satisfy before its first round, checked once.

`admit` turns a `GenerateRequest` into a `Generation`: the prompt is tokenized, every token
id the request names (prompt, allowed / stop token ids, logit-bias keys) is checked against
the vocabulary, prompt plus max_tokens against the context, and the effective seed fixed.
After this nothing a round sends can be out of range, so no later stage re-checks ids.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.k_policy import Costs
from specdec.api_types import GenerateRequest
from specdec.errors import ContextLengthError, RequestError
from specdec.params import DEFAULT_NUM_SPECULATIVE_TOKENS, SamplingParams, draw_seed
from specdec.processing import RequestSampling, tokenize_bad_words

if TYPE_CHECKING:
    from specdec.generation import Generation


@dataclass
class ModelInfo:
    """What admission needs to know about the served pair."""

    tokenizer: object
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    default_num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    # Cost table for adaptive K (specdec.k_policy); None: requests use the default K as is.
    k_costs: Costs | None = None
    # The mode of requests that leave drafter_invariant unset (SamplingParams).
    default_drafter_invariant: bool = False


def admit(cls: type[Generation], request: GenerateRequest, info: ModelInfo) -> Generation:
    """Validate a request against the model and fix its effective seed."""
    params = request.sampling_params
    if params.drafter_invariant is None:
        params = params.model_copy(update={"drafter_invariant": info.default_drafter_invariant})
    if request.prompt_token_ids is not None:
        prompt_ids = list(request.prompt_token_ids)
    else:
        prompt_ids = info.tokenizer(request.prompt, add_special_tokens=True)["input_ids"]
    check_token_ids(prompt_ids, info.vocab_size, "prompt_token_ids")
    _check_params_vocab(params, info.vocab_size)
    requested = len(prompt_ids) + params.max_tokens
    if requested > info.max_context:
        raise ContextLengthError(
            f"This model's maximum context length is {info.max_context} tokens, but "
            f"{requested} were requested ({len(prompt_ids)} in the prompt, "
            f"{params.max_tokens} in max_tokens). Shorten the prompt or lower max_tokens.",
            param="max_tokens",
        )
    sampling = RequestSampling(
        params=params,
        prompt_ids=tuple(prompt_ids),
        # Banned until min_tokens even with ignore_eos, as vLLM does; a stop only without.
        eos_token_ids=info.eos_token_ids,
        bad_words_ids=tokenize_bad_words(params.bad_words or [], info.tokenizer),
    )
    k = params.num_speculative_tokens
    return cls(
        request_id=uuid.uuid4().hex,
        params=params,
        sampling=sampling,
        seed=params.seed if params.seed is not None else draw_seed(),
        num_speculative_tokens=info.default_num_speculative_tokens if k is None else k,
        adaptive_k=k is None and info.k_costs is not None,  # an explicit K is kept as asked
        info=info,
        client_request_id=request.request_id,
    )


def check_token_ids(ids: Sequence[int], vocab_size: int, name: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"{name} must be token ids in [0, {vocab_size}); got {bad[:5]}", param=name
        )


def _check_params_vocab(params: SamplingParams, vocab_size: int) -> None:
    for name in ("allowed_token_ids", "stop_token_ids"):
        check_token_ids(getattr(params, name) or [], vocab_size, name)
    check_token_ids(list((params.logit_bias or {}).keys()), vocab_size, "logit_bias")
