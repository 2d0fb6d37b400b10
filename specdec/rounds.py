"""The draft and target halves of one speculative round, batched over requests.

These are the pure computations the Draft and Target deployments run: each takes a list of
calls from concurrent requests, shares the model's forward passes between them, and
returns one answer per call. Every call carries the full token list to condition on, so a
runner that never saw the request (another replica, a restart) simply re-prefills.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.packing import PackedProbs, pack_probs
from specdec.processing import RequestSampling, Row, process_logits, speculative_rows
from specdec.randomness import Purpose, sample


@dataclass
class DraftCall:
    request_id: str
    token_ids: list[int]  # prompt + committed output
    num_tokens: int  # K: how many tokens to propose
    sampling: RequestSampling
    seed: int


@dataclass
class Proposal:
    tokens: list[int]
    probs: PackedProbs | None  # q at each proposal; None in drafter-invariant mode


@dataclass
class ScoreCall:
    request_id: str
    token_ids: list[int]  # prompt + committed output + the K proposals
    num_proposals: int
    sampling: RequestSampling


@dataclass
class Scores:
    probs: PackedProbs  # p at the K proposals and the bonus position: [K + 1, V]
    logprobs: np.ndarray | None  # [K + 1, V] float32, only when the request asks for logprobs


def _output_ids(call_tokens: list[int], sampling: RequestSampling) -> list[int]:
    return call_tokens[len(sampling.prompt_ids) :]


def run_draft(runner, calls: list[DraftCall]) -> list[Proposal]:
    """Propose call.num_tokens tokens for every call, one batched forward per step.

    Each proposal is drawn from the request's processed draft distribution, whose history
    includes the proposals before it, with randomness keyed by (seed, absolute position).
    """
    proposed: list[list[int]] = [[] for _ in calls]
    q_rows: list[list[torch.Tensor]] = [[] for _ in calls]
    for step in range(max((c.num_tokens for c in calls), default=0)):
        active = [i for i, c in enumerate(calls) if c.num_tokens > step]
        items = [(calls[i].request_id, calls[i].token_ids + proposed[i], 1) for i in active]
        logits = torch.cat(runner.extend(items))
        rows = [
            Row(calls[i].sampling, _output_ids(calls[i].token_ids, calls[i].sampling) + proposed[i])
            for i in active
        ]
        probs = process_logits(logits, rows).probs
        tokens = sample(
            probs,
            seeds=torch.tensor([calls[i].seed for i in active]),
            positions=torch.tensor([len(r.output_ids) for r in rows]),
            purpose=Purpose.DRAFT,
            gumbel_rows=torch.tensor([calls[i].sampling.params.drafter_invariant for i in active]),
        )
        for row, i in enumerate(active):
            proposed[i].append(int(tokens[row]))
            q_rows[i].append(probs[row])
    return [
        Proposal(
            tokens=proposed[i],
            probs=None
            if c.sampling.params.drafter_invariant or not proposed[i]
            else pack_probs(torch.stack(q_rows[i])),
        )
        for i, c in enumerate(calls)
    ]


def run_target(runner, calls: list[ScoreCall]) -> list[Scores]:
    """Score the K proposals plus the bonus position of every call in one forward pass."""
    items = [(c.request_id, c.token_ids, c.num_proposals + 1) for c in calls]
    logits = runner.extend(items)
    rows: list[Row] = []
    raw: list[bool] = []
    for c in calls:
        committed = len(c.token_ids) - c.num_proposals
        output_ids = c.token_ids[len(c.sampling.prompt_ids) : committed]
        rows += speculative_rows(c.sampling, output_ids, c.token_ids[committed:])
        raw += [c.sampling.params.target_probs == "raw"] * (c.num_proposals + 1)
    processed = process_logits(torch.cat(logits), rows, raw=raw)
    scores, start = [], 0
    for c in calls:
        span = slice(start, start + c.num_proposals + 1)
        start = span.stop
        want_logprobs = c.sampling.params.logprobs is not None
        scores.append(
            Scores(
                probs=pack_probs(processed.probs[span]),
                logprobs=processed.logprobs[span].numpy().copy() if want_logprobs else None,
            )
        )
    return scores
