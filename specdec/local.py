"""An in-process engine: the same rounds as the Ray deployments, with both runners local.

Requests advance in lockstep (`specdec.lockstep.run`), so each round (`step`) is one
batched `run_draft` and one batched `run_target` call over every unfinished request:
exactly what the Draft and Target deployments compute for a batch. Used by tests (large
statistical samples) and by the benchmark (speculative vs target-only on the same engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer

from specdec import lockstep
from specdec.api_types import GenerateRequest, GenerateResult
from specdec.generation import Generation, ModelInfo, round_load
from specdec.params import DEFAULT_NUM_SPECULATIVE_TOKENS
from specdec.k_policy import Costs
from specdec.pass_costs import with_pass_costs
from specdec.rounds import Proposal, run_draft, run_target
from specdec.runner import DEFAULT_MAX_CACHE_TOKENS, ModelRunner
from specdec.vocab import eos_token_ids


class LocalEngine:
    def __init__(
        self,
        draft_dir: str | Path,
        target_dir: str | Path,
        *,
        num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
        dtype: str = "bfloat16",
        max_cache_tokens: int = DEFAULT_MAX_CACHE_TOKENS,
        batch_invariant: bool = False,
        adaptive_k: bool = False,
        proposal_vocab: int | None = None,
        drafter_invariant: bool = False,
    ):
        kw = dict(dtype=dtype, max_cache_tokens=max_cache_tokens, batch_invariant=batch_invariant)
        self.draft = ModelRunner(draft_dir, proposal_vocab=proposal_vocab, draft=True, **kw)
        self.target = ModelRunner(target_dir, **kw)
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.info = ModelInfo(
            tokenizer=tokenizer,
            vocab_size=min(self.draft.vocab_size, self.target.vocab_size),
            max_context=min(self.draft.max_context, self.target.max_context),
            eos_token_ids=eos_token_ids(target_dir, tokenizer),
            default_num_speculative_tokens=num_speculative_tokens,
            default_drafter_invariant=drafter_invariant,  # for requests that leave it unset
            # K per round from each request's acceptance and the runners' calibrated costs
            k_costs=Costs.from_calibrations(with_pass_costs(self.draft, draft=True),
                                            with_pass_costs(self.target, draft=False))
            if adaptive_k else None,
        )

    def generate(
        self, requests: Sequence[GenerateRequest | dict], batch_size: int = 64
    ) -> list[GenerateResult]:
        """Run requests to completion, `batch_size` at a time (one deployment batch)."""
        results: list[GenerateResult] = []
        for start in range(0, len(requests), batch_size):
            chunk = requests[start : start + batch_size]
            gens = [Generation.admit(GenerateRequest.model_validate(r), self.info) for r in chunk]
            lockstep.run(self, gens)
            results += [g.result() for g in gens]
        return results

    def step(self, gens: Sequence[Generation]) -> None:
        """One round for every request: batched draft, batched target, per-request accept."""
        ks = [g.plan_k(*round_load(g, gens)) for g in gens]
        drafting = [i for i, k in enumerate(ks) if k]
        proposals = [Proposal(tokens=[], probs=None) for _ in gens]
        if drafting:
            answers = run_draft(self.draft, [gens[i].draft_call(ks[i]) for i in drafting])
            for i, answer in zip(drafting, answers):
                proposals[i] = answer
        scores = run_target(self.target, [g.score_call(p) for g, p in zip(gens, proposals)])
        for g, proposal, score in zip(gens, proposals, scores):
            g.accept(proposal, score)
