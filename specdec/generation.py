"""One request's life: admission checks, the draft -> score -> accept loop, stop handling.

`Generation` holds everything a request owns (prompt, committed output, parameters,
effective seed, statistics); `generate_stream` drives its rounds through two async
callables, so the same loop runs in the Ray coordinator (remote calls to the Draft and
Target deployments) and in-process (tests, benchmarks).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from specdec.api_types import (
    GenerateDelta,
    GenerateRequest,
    GenerateResult,
    SpeculationStats,
    TokenLogprob,
    Usage,
)
from specdec.errors import ContextLengthError, RequestError
from specdec.packing import unpack_probs
from specdec.params import SamplingParams, draw_seed
from specdec.processing import RequestSampling, tokenize_bad_words
from specdec.rejection import SpecStats, rejection_sample
from specdec.rounds import DraftCall, Proposal, ScoreCall, Scores

DraftFn = Callable[[DraftCall], Awaitable[Proposal]]
TargetFn = Callable[[ScoreCall], Awaitable[Scores]]


@dataclass
class ModelInfo:
    """What admission needs to know about the served pair."""

    tokenizer: object
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    default_num_speculative_tokens: int = 4


class RoundResult(NamedTuple):
    proposed: int
    accepted: int
    tokens: list[int]  # what the round committed (a stop may cut the emitted tokens short)


@dataclass
class RoundTimes:
    draft_s: float = 0.0
    target_s: float = 0.0
    coordinator_s: float = 0.0


@dataclass
class Generation:
    request_id: str
    params: SamplingParams
    sampling: RequestSampling
    seed: int
    num_speculative_tokens: int
    info: ModelInfo
    client_request_id: str | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    sent_text_len: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    used_draft: bool = False  # whether any draft replica may hold a cache for it
    times: RoundTimes = field(default_factory=RoundTimes)

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.sampling.prompt_ids

    # ---- admission ------------------------------------------------------------------

    @classmethod
    def admit(cls, request: GenerateRequest, info: ModelInfo) -> "Generation":
        """Validate a request against the model and fix its effective seed."""
        params = request.sampling_params
        if request.prompt_token_ids is not None:
            prompt_ids = list(request.prompt_token_ids)
        else:
            prompt_ids = info.tokenizer(request.prompt, add_special_tokens=True)["input_ids"]
        _check_token_ids(prompt_ids, info.vocab_size, "prompt_token_ids")
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
            info=info,
            client_request_id=request.request_id,
        )

    # ---- one round ------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self) -> list[int]:
        return list(self.prompt_ids) + self.output

    def plan_k(self) -> int:
        """Proposals this round: never more than the token budget or the context allow."""
        left = self.params.max_tokens - len(self.output)
        room = self.info.max_context - len(self.prompt_ids) - len(self.output)
        return max(0, min(self.num_speculative_tokens, left - 1, room - 1))

    def draft_call(self, k: int) -> DraftCall:
        self.used_draft = True
        return DraftCall(self.request_id, self.tokens(), k, self.sampling, self.seed)

    def score_call(self, proposal: Proposal) -> ScoreCall:
        return ScoreCall(
            self.request_id, self.tokens() + proposal.tokens, len(proposal.tokens), self.sampling
        )

    def accept(self, proposal: Proposal, scores: Scores) -> RoundResult:
        """Rejection-sample this round and commit the emitted tokens."""
        k = len(proposal.tokens)
        p = unpack_probs(scores.probs)
        q = None if proposal.probs is None else unpack_probs(proposal.probs)[None]
        if q is None and k and not self.params.drafter_invariant:
            raise RuntimeError("the draft returned no probabilities for a standard-mode request")
        result = rejection_sample(
            draft_tokens=torch.tensor([proposal.tokens], dtype=torch.long).reshape(1, k),
            num_draft=torch.tensor([k]),
            draft_probs=q,
            target_probs=p[None],
            seeds=torch.tensor([self.seed]),
            positions=torch.tensor([len(self.output)]),
            drafter_invariant=torch.tensor([self.params.drafter_invariant]),
        )
        emitted = result.tokens[0]
        kept = self._commit(emitted, scores)
        accepted = int(result.num_accepted[0])
        self.stats.add_round(k, accepted, kept)
        return RoundResult(proposed=k, accepted=accepted, tokens=emitted[:kept])

    # ---- committing tokens and stop conditions ---------------------------------------

    def _commit(self, emitted: Sequence[int], scores: Scores) -> int:
        """Append tokens one by one until a stop condition; returns how many were kept."""
        for i, token in enumerate(emitted):
            self.output.append(token)
            if scores.logprobs is not None:
                self.logprobs.append(self._logprob(token, scores.logprobs[i]))
            self._check_stop(token)
            if self.finished:
                return i + 1
        return len(emitted)

    def _check_stop(self, token: int) -> None:
        params, n = self.params, len(self.output)
        previous_len = len(self.text)
        self.text = self.info.tokenizer.decode(self.output, skip_special_tokens=True)
        if n >= params.min_tokens:
            if token in (params.stop_token_ids or ()):
                # As vLLM: the stop token stays in token_ids, its text only if asked for.
                if not params.include_stop_str_in_output:
                    self.text = self.info.tokenizer.decode(self.output[:-1], skip_special_tokens=True)
                self.finish_reason, self.stop_reason = "stop", token
                return
            if token in self.sampling.eos_token_ids and not params.ignore_eos:
                self.finish_reason = "stop"
                return
            if params.stop and self._stop_string(previous_len):
                return
        if n >= params.max_tokens or len(self.prompt_ids) + n >= self.info.max_context:
            self.finish_reason = "length"

    def _stop_string(self, previous_len: int) -> bool:
        stops = _as_list(self.params.stop)
        search_from = max(0, previous_len - max(len(s) for s in stops) + 1)
        found = [(self.text.find(s, search_from), s) for s in stops]
        found = [(i, s) for i, s in found if i >= 0]
        if not found:
            return False
        index, stop = min(found)
        keep = index + len(stop) if self.params.include_stop_str_in_output else index
        self.text = self.text[:keep]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def _logprob(self, token: int, row) -> TokenLogprob:
        row = torch.from_numpy(row)
        top = []
        if self.params.logprobs:
            values, ids = row.topk(self.params.logprobs)
            top = [(int(i), self._piece(int(i)), float(v)) for v, i in zip(values, ids)]
        return TokenLogprob(
            token_id=token, token=self._piece(token), logprob=float(row[token]), top_logprobs=top
        )

    def _piece(self, token: int) -> str:
        return self.info.tokenizer.decode([token])

    # ---- what the caller sees -----------------------------------------------------------

    def delta(self) -> GenerateDelta:
        """Everything not yet sent. While running, text that may still turn out to be
        the start of a stop string (or half a UTF-8 character) is held back."""
        text_end = len(self.text)
        if not self.finished:
            hold = max((len(s) - 1 for s in _as_list(self.params.stop)), default=0)
            text_end = max(self.sent_text_len, text_end - hold)
            while text_end > self.sent_text_len and self.text[text_end - 1] == "\ufffd":
                text_end -= 1
        delta = GenerateDelta(
            request_id=self.client_request_id or self.request_id,
            text=self.text[self.sent_text_len : text_end],
            token_ids=self.output[self.sent_tokens :],
            logprobs=self.logprobs[self.sent_logprobs :] if self.params.logprobs is not None else None,
        )
        self.sent_text_len, self.sent_tokens = text_end, len(self.output)
        self.sent_logprobs = len(self.logprobs)
        if self.finished:
            delta.finish_reason, delta.stop_reason = self.finish_reason, self.stop_reason
            delta.usage, delta.seed, delta.speculation = self.usage(), self.seed, self.speculation()
        return delta

    def usage(self) -> Usage:
        n_prompt, n_out = len(self.prompt_ids), len(self.output)
        return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out)

    def speculation(self) -> SpeculationStats:
        return SpeculationStats(**self.stats.to_dict())

    def result(self) -> GenerateResult:
        return GenerateResult(
            request_id=self.client_request_id or self.request_id,
            text=self.text,
            token_ids=self.output,
            finish_reason=self.finish_reason or "abort",
            stop_reason=self.stop_reason,
            usage=self.usage(),
            seed=self.seed,
            speculation=self.speculation(),
            logprobs=self.logprobs if self.params.logprobs is not None else None,
        )


async def generate_stream(
    gen: Generation,
    draft: DraftFn,
    target: TargetFn,
    on_round: Callable[[Generation, RoundTimes, RoundResult], None] | None = None,
) -> AsyncIterator[GenerateDelta]:
    """Run rounds until the request finishes, yielding what each round adds."""
    while not gen.finished:
        started = time.perf_counter()
        k = gen.plan_k()
        proposal = await draft(gen.draft_call(k)) if k else Proposal(tokens=[], probs=None)
        drafted = time.perf_counter()
        scores = await target(gen.score_call(proposal))
        scored = time.perf_counter()
        outcome = gen.accept(proposal, scores)
        times = RoundTimes(drafted - started, scored - drafted, time.perf_counter() - scored)
        gen.times.draft_s += times.draft_s
        gen.times.target_s += times.target_s
        gen.times.coordinator_s += times.coordinator_s
        if on_round is not None:
            on_round(gen, times, outcome)
        delta = gen.delta()
        if delta.text or delta.token_ids or gen.finished:
            yield delta


async def generate(gen: Generation, draft: DraftFn, target: TargetFn) -> GenerateResult:
    async for _ in generate_stream(gen, draft, target):
        pass
    return gen.result()


def _as_list(stop) -> list[str]:
    if not stop:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _check_token_ids(ids: Sequence[int], vocab_size: int, name: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"{name} must be token ids in [0, {vocab_size}); got {bad[:5]}", param=name
        )


def _check_params_vocab(params: SamplingParams, vocab_size: int) -> None:
    for name in ("allowed_token_ids", "stop_token_ids"):
        _check_token_ids(getattr(params, name) or [], vocab_size, name)
    _check_token_ids(list((params.logit_bias or {}).keys()), vocab_size, "logit_bias")
