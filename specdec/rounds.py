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

from specdec.packing import PackedProbs, pack_blocks
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
    The q returned for a proposal is the distribution it was drawn from.
    """
    proposed: list[list[int]] = [[] for _ in calls]
    outputs = [_output_ids(c.token_ids, c.sampling) for c in calls]
    ks = [c.num_tokens for c in calls]
    seeds = torch.tensor([c.seed for c in calls], dtype=torch.long)
    first_pos = torch.tensor([len(o) for o in outputs], dtype=torch.long)
    gumbel = torch.tensor([c.sampling.params.gumbel_coupled for c in calls], dtype=torch.bool)
    # q of proposal `step` of call i is row offsets[i] + step of q_rows (only standard mode)
    keep_q = [0 if g else k for g, k in zip(gumbel.tolist(), ks)]
    offsets = torch.tensor(np.cumsum([0] + keep_q[:-1]), dtype=torch.long)
    wants_q = torch.tensor([k > 0 for k in keep_q], dtype=torch.bool)
    q_rows: torch.Tensor | None = None
    for step in range(max(ks, default=0)):
        active = [i for i, k in enumerate(ks) if k > step]
        items = [(calls[i].request_id, calls[i].token_ids + proposed[i], 1) for i in active]
        logits = torch.cat(runner.extend(items))
        rows = [Row(calls[i].sampling, outputs[i] + proposed[i]) for i in active]
        probs = process_logits(logits, rows).probs
        idx = torch.tensor(active, dtype=torch.long)
        tokens = sample(probs, seeds[idx], first_pos[idx] + step, Purpose.DRAFT, gumbel[idx])
        for i, token in zip(active, tokens.tolist()):
            proposed[i].append(token)
        keep = wants_q[idx]
        if keep.any():
            if q_rows is None:
                q_rows = probs.new_zeros(sum(keep_q), probs.shape[1])
            q_rows[offsets[idx[keep]] + step] = probs[keep]
    packed = pack_blocks(q_rows, [k for k in keep_q if k]) if q_rows is not None else []
    blocks = iter(packed)
    return [Proposal(tokens=proposed[i], probs=next(blocks) if keep_q[i] else None)
            for i in range(len(calls))]


def run_target(runner, calls: list[ScoreCall]) -> list[Scores]:
    """Score the K proposals plus the bonus position of every call in one forward pass.

    Row i of a call is the processed target distribution at proposal i, whose history is
    the committed output plus proposals[:i] (`speculative_rows`)."""
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
    packed = pack_blocks(processed.probs, [c.num_proposals + 1 for c in calls])
    scores, start = [], 0
    for c, probs in zip(calls, packed):
        span = slice(start, start + c.num_proposals + 1)
        start = span.stop
        want_logprobs = c.sampling.params.logprobs is not None
        scores.append(
            Scores(
                probs=probs,
                logprobs=processed.logprobs[span].numpy().copy() if want_logprobs else None,
            )
        )
    return scores
