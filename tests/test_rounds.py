"""The draft and target halves of a round (`specdec.rounds`) and their packing, on the fake
table runners of test_exactness: what each call returns is what that call alone returns."""

from __future__ import annotations

import pytest
import torch

from specdec.packing import pack_blocks, pack_probs, unpack_probs
from specdec.params import SamplingParams
from specdec.processing import RequestSampling, Row, process_logits, speculative_rows
from specdec.randomness import Purpose, sample
from specdec.rounds import DraftCall, ScoreCall, run_draft, run_target
from test_exactness import DRAFT_RUNNER, PROMPT, TARGET_RUNNER


def test_pack_blocks_equals_pack_probs_of_each_block():
    g = torch.Generator().manual_seed(0)
    for vocab in (7, 50, 1000):
        x = torch.softmax(torch.randn(30, vocab, generator=g) * 3, 1)
        x[3:6] = 0
        x[3:6, 2] = 1.0  # one-hot rows: sparse blocks
        x[20:23] *= (x[20:23] > x[20:23].median(1, keepdim=True).values).float()
        lens = [1, 2, 3, 3, 1, 4, 2, 3, 3, 8]
        start = 0
        for r, packed in zip(lens, pack_blocks(x, lens)):
            ref = pack_probs(x[start : start + r])
            assert (packed.dense is None) == (ref.dense is None)
            assert packed.shape == ref.shape
            assert torch.equal(unpack_probs(packed), unpack_probs(ref))
            start += r
    assert pack_blocks(torch.zeros(0, 5), []) == []


def _requests():
    return [
        RequestSampling(SamplingParams(temperature=0.8, top_p=0.9), PROMPT),
        RequestSampling(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5), PROMPT),
        RequestSampling(SamplingParams(temperature=0), PROMPT),
        RequestSampling(SamplingParams(drafter_invariant=True, top_k=3), PROMPT),
    ]


def test_run_draft_returns_the_q_each_proposal_was_drawn_from():
    reqs = _requests()
    calls = [DraftCall(f"r{i}", list(PROMPT) + [1][: i % 2], 1 + i % 3, reqs[i % 4], 100 + i)
             for i in range(12)]
    batch = run_draft(DRAFT_RUNNER, calls)
    for call, proposal in zip(calls, batch):
        alone = run_draft(DRAFT_RUNNER, [call])[0]
        assert proposal.tokens == alone.tokens and len(proposal.tokens) == call.num_tokens
        output = call.token_ids[len(PROMPT) :]
        rows = speculative_rows(call.sampling, output, proposal.tokens)[:-1]
        histories = [list(PROMPT) + list(r.output_ids) for r in rows]
        logits = torch.cat(DRAFT_RUNNER.extend([("x", h, 1) for h in histories]))
        q = process_logits(logits, rows).probs
        invariant = call.sampling.params.gumbel_coupled
        tokens = sample(q, call.seed, torch.arange(len(rows)) + len(output), Purpose.DRAFT,
                        torch.full((len(rows),), invariant))
        assert proposal.tokens == tokens.tolist()
        if invariant:
            assert proposal.probs is None and alone.probs is None
        else:
            assert torch.equal(unpack_probs(proposal.probs), q)
            assert torch.equal(unpack_probs(alone.probs), q)


def test_run_target_scores_each_position_with_the_proposals_before_it():
    reqs = _requests()
    calls = [ScoreCall(f"r{i}", list(PROMPT) + [3, 1, 4, 1][: 1 + i % 3], i % 3, reqs[i % 4])
             for i in range(9)]
    batch = run_target(TARGET_RUNNER, calls)
    for call, scores in zip(calls, batch):
        committed = len(call.token_ids) - call.num_proposals
        rows = [Row(call.sampling, call.token_ids[len(PROMPT) : committed + i])
                for i in range(call.num_proposals + 1)]
        logits = TARGET_RUNNER.extend([("x", call.token_ids, call.num_proposals + 1)])[0]
        assert torch.equal(unpack_probs(scores.probs), process_logits(logits, rows).probs)
        assert torch.equal(unpack_probs(run_target(TARGET_RUNNER, [call])[0].probs),
                           unpack_probs(scores.probs))


@pytest.mark.parametrize("empty", [[], [0]])
def test_no_proposals(empty):
    req = _requests()[0]
    calls = [DraftCall("r", list(PROMPT), k, req, 1) for k in empty]
    assert [p.probs for p in run_draft(DRAFT_RUNNER, calls)] == [None] * len(empty)
