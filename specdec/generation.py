"""One request's life: its state, one round's calls, and the async round loop.

`Generation` holds everything a request owns (prompt, committed output, parameters,
effective seed, statistics) and the four steps of a round that every driver calls in turn:
`plan_k` (how many proposals), `draft_call`, `score_call` and `accept` (rejection sampling).
The other concerns live beside it: admission and checks (`specdec.admission`), committing
tokens and stop handling (`specdec.stopping`), deltas and the result (`specdec.output`).

Two drivers run the rounds: `generate_stream` (one request, two async callables: the Ray
coordinator's remote calls) and `specdec.lockstep` (many requests in-process, batched).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch

from specdec import output as views
from specdec import stopping
from specdec.k_policy import MIN_GAIN, AcceptanceEvidence, choose_k
from specdec.admission import ModelInfo, admit
from specdec.api_types import GenerateDelta, GenerateRequest, GenerateResult, TokenLogprob
from specdec.packing import unpack_probs
from specdec.params import SamplingParams
from specdec.processing import RequestSampling
from specdec.rejection import SpecStats, rejection_sample
from specdec.rounds import DraftCall, Proposal, ScoreCall, Scores

__all__ = ["Generation", "ModelInfo", "RoundResult", "RoundTimes", "generate_stream"]

DraftFn = Callable[[DraftCall], Awaitable[Proposal]]
TargetFn = Callable[[ScoreCall], Awaitable[Scores]]


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
    num_speculative_tokens: int  # the maximum K when adaptive_k
    info: ModelInfo
    adaptive_k: bool = False
    client_request_id: str | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    evidence: AcceptanceEvidence = field(default_factory=AcceptanceEvidence)  # adaptive K's
    drafted_upto: int = 0  # tokens the request has sent to a draft (its cache's extent)
    wants_draft: bool = False  # its latest plan would draft were the draft pass shared by all
    times: RoundTimes = field(default_factory=RoundTimes)
    sent: views.Cursor = field(default_factory=views.Cursor)  # what the stream has sent

    @classmethod
    def admit(cls, request: GenerateRequest, info: ModelInfo) -> "Generation":
        """Validate a request against the model (once) and fix its effective seed."""
        return admit(cls, request, info)

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.sampling.prompt_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self) -> list[int]:
        return list(self.prompt_ids) + self.output

    # ---- one round ------------------------------------------------------------------

    def plan_k(self, concurrent: int = 1, drafting_peers: int | None = None) -> int:
        """Proposals this round: never more than the token budget or the context allow.

        Where the text cannot depend on K (greedy, drafter-invariant), K also weighs load
        and the passes' timed costs: `concurrent` requests share this round's passes, and
        `drafting_peers` of the others want to draft (their `wants_draft`, None: all). A
        request that would draft where all do, but alone shares no draft pass, weighs
        drafting alone. Such requests draft only for k_policy.MIN_GAIN, and not in their
        first round. For the others K is a function of the request's own acceptance and
        the fixed cost table, never of load or timing."""
        left = self.params.max_tokens - len(self.output)
        room = self.info.max_context - len(self.prompt_ids) - len(self.output)
        k, wish = self.num_speculative_tokens, None
        if self.adaptive_k:
            k, wish = self._adaptive_k(k, left, concurrent, drafting_peers)
        k = max(0, min(k, left - 1, room - 1))
        self.wants_draft = k > 0 if wish is None else wish
        return k

    def _adaptive_k(self, max_k: int, left: int, concurrent: int,
                    drafting_peers: int | None) -> tuple[int, bool | None]:
        """K by k_policy, and (where load counts) whether it drafts where all requests do."""
        choose = partial(choose_k, max_k, self.evidence.tested, self.evidence.accepted,
                         self.info.k_costs, remaining=left,
                         catch_up_rows=len(self.prompt_ids) + len(self.output) - self.drafted_upto)
        if not self.text_independent_of_k:
            return choose(), None
        weigh_load = partial(choose, concurrent, whole_pass=True, min_gain=MIN_GAIN)
        k = weigh_load()
        if not self.output:
            # The first round is the prompt's prefill, planned before the requests that
            # arrived with it are in rounds: it does not draft on a load it cannot see
            # (through the service, the first of eight requests drafted as if alone, and
            # the early ones went on drafting as a group: 0.83x of K=0).
            return 0, k > 0
        if k and drafting_peers is not None:
            return weigh_load(drafting=drafting_peers + 1), True
        return k, k > 0

    @property
    def text_independent_of_k(self) -> bool:
        return self.params.greedy or self.params.drafter_invariant

    @property
    def used_draft(self) -> bool:
        """Whether any draft replica may hold a cache for it."""
        return self.drafted_upto > 0

    def draft_call(self, k: int) -> DraftCall:
        tokens = self.tokens()
        self.drafted_upto = len(tokens)
        return DraftCall(self.request_id, tokens, k, self.sampling, self.seed)

    def score_call(self, proposal: Proposal) -> ScoreCall:
        return ScoreCall(
            self.request_id, self.tokens() + proposal.tokens, len(proposal.tokens), self.sampling
        )

    def accept(self, proposal: Proposal, scores: Scores) -> RoundResult:
        """Rejection-sample this round and commit the emitted tokens."""
        k = len(proposal.tokens)
        p = unpack_probs(scores.probs)  # [k + 1, V]
        q = None if proposal.probs is None else unpack_probs(proposal.probs)[None]  # [1, k, V]
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
        kept = stopping.commit(self, emitted, scores)
        accepted = int(result.num_accepted[0])
        self.record_round(k, accepted, kept)
        return RoundResult(proposed=k, accepted=accepted, tokens=emitted[:kept])

    def record_round(self, k: int, accepted: int, kept: int) -> None:
        """A round's counts: the reported statistics and what adaptive K weighs."""
        self.stats.add_round(k, accepted, kept)
        self.evidence.add_round(k, accepted, kept)

    # ---- what the caller sees (specdec.output) ----------------------------------------

    def delta(self) -> GenerateDelta:
        return views.delta(self)

    def result(self) -> GenerateResult:
        return views.result(self)


def round_load(gen: Generation, in_rounds: Collection[Generation]) -> tuple[int, int | None]:
    """`Generation.plan_k`'s load: the requests in rounds (`gen` among them), and how many
    of the others want to draft."""
    if not in_rounds:
        return 1, None
    return len(in_rounds), sum(g.wants_draft for g in in_rounds if g is not gen)


async def generate_stream(
    gen: Generation,
    draft: DraftFn,
    target: TargetFn,
    on_round: Callable[[Generation, RoundTimes, RoundResult], None] | None = None,
    in_rounds: Collection[Generation] = (),
) -> AsyncIterator[GenerateDelta]:
    """Run rounds until the request finishes, yielding what each round adds. `in_rounds`:
    the requests in rounds now, which share the pools' passes (see Generation.plan_k)."""
    while not gen.finished:
        started = time.perf_counter()
        k = gen.plan_k(*round_load(gen, in_rounds))
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
