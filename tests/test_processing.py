"""Logits processing: each operation on hand-computed examples, history handling, batching,
and property tests against a slow, obviously-correct reference (vLLM V1's order of
operations written out row by row in float64).

Longer than 300 lines because each processing step has its reference check beside the
bitwise batch-invariance checks that reuse the same fixtures.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specdec.errors import RequestError
from specdec.params import SamplingParams
from specdec.processing import (
    Processed,
    RequestSampling,
    Row,
    process_logits,
    speculative_rows,
    tokenize_bad_words,
)

NEG_INF = float("-inf")


def request(prompt=(), eos=(), bad=(), **params) -> RequestSampling:
    return RequestSampling(SamplingParams(**params), tuple(prompt), tuple(eos), tuple(bad))


def one(logits, req: RequestSampling, output=()) -> Processed:
    """Process a single row."""
    out = process_logits(torch.tensor([logits], dtype=torch.float32), [Row(req, tuple(output))])
    return Processed(out.probs[0], out.logprobs[0])


def softmax(values) -> torch.Tensor:
    return torch.softmax(torch.tensor(values, dtype=torch.float64), 0).float()


def support(probs: torch.Tensor) -> set[int]:
    return set((probs > 0).nonzero().flatten().tolist())


# ---- reference ------------------------------------------------------------------------------


class NearBoundary(Exception):
    """The float64 reference sits within rounding of a min_p / top-p cut: float32 may
    legitimately decide the other way, so the example is not comparable."""


def reference(logits: torch.Tensor, req: RequestSampling, output: tuple[int, ...]) -> torch.Tensor:
    """Processed probabilities of one row, step by step in vLLM V1's order (float64)."""
    p, x = req.params, logits.double().clone()
    vocab = len(x)
    if p.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = NEG_INF
    banned = [w[-1] for w in req.bad_words_ids if len(w) - 1 <= len(output) and tuple(output[len(output) - len(w) + 1 :]) == w[:-1]]
    x = _ban_unless_empty(x, banned)
    if len(output) < p.min_tokens:
        x = _ban_unless_empty(x, list(p.stop_token_ids) + list(req.eos_token_ids))
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    for token in set(req.prompt_ids) | set(output):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token in set(output):
        x[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    if p.temperature < 1e-5:
        probs = torch.zeros(vocab, dtype=torch.float64)
        probs[int(torch.argmax(x))] = 1.0  # first maximum
        return probs
    x = x / p.temperature
    if p.min_p > 0:
        probs = torch.softmax(x, 0)
        cut = p.min_p * probs.max()
        _check_margin(probs[probs > 0] - cut, scale=cut)
        x[probs < cut] = NEG_INF
    if 0 < p.top_k < vocab:
        kth = torch.sort(x, descending=True).values[p.top_k - 1]
        x[x < kth] = NEG_INF
    if p.top_p < 1:
        probs = torch.softmax(x, 0)
        desc = torch.sort(probs, descending=True).values
        cum = torch.cumsum(desc, 0)
        _check_margin(cum - p.top_p, scale=1.0)
        threshold = desc[int((cum < p.top_p).sum().clamp(max=vocab - 1))]
        x[probs < threshold] = NEG_INF  # ties with the last kept token stay
    return torch.softmax(x, 0)


def _ban_unless_empty(x, tokens):
    banned = x.clone()
    banned[list(tokens)] = NEG_INF
    return x if torch.isinf(banned).all() else banned


def _check_margin(diffs, scale):
    if len(diffs) and float(diffs.abs().min()) < 1e-5 * max(float(scale), 1e-30):
        raise NearBoundary


# ---- single operations on hand-computed examples --------------------------------------------


def test_plain_softmax_and_logprobs():
    out = one([1.0, 2.0, 3.0], request())
    assert torch.allclose(out.probs, softmax([1, 2, 3]))
    assert torch.allclose(out.logprobs, torch.log(softmax([1, 2, 3])))


def test_temperature_divides_logits():
    out = one([1.0, 2.0, 3.0], request(temperature=0.5))
    assert torch.allclose(out.probs, softmax([2, 4, 6]))


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    # token 0 (prompt) 2 -> 1; token 1 (output) -2 -> -4; tokens 2, 3 unseen.
    out = one([2.0, -2.0, 1.0, 0.5], request(prompt=[0], repetition_penalty=2.0), output=[1])
    assert torch.allclose(out.probs, softmax([1.0, -4.0, 1.0, 0.5]))


def test_repetition_penalty_below_one_encourages_repeats():
    out = one([2.0, -2.0, 1.0], request(prompt=[0, 1], repetition_penalty=0.5))
    assert torch.allclose(out.probs, softmax([4.0, -1.0, 1.0]))


def test_frequency_and_presence_count_output_only():
    # token 0 appears only in the prompt: untouched. Output: token 1 twice, token 2 once.
    req = request(prompt=[0, 0, 0], frequency_penalty=0.5, presence_penalty=0.25)
    out = one([1.0, 1.0, 1.0, 1.0], req, output=[1, 2, 1])
    assert torch.allclose(out.probs, softmax([1.0, 1 - 2 * 0.5 - 0.25, 1 - 0.5 - 0.25, 1.0]))


def test_negative_presence_penalty_rewards_seen_tokens():
    out = one([0.0, 0.0], request(presence_penalty=-1.0), output=[1])
    assert torch.allclose(out.probs, softmax([0.0, 1.0]))


def test_logit_bias_is_added():
    out = one([0.0, 0.0, 0.0], request(logit_bias={"1": 2.0, 2: -1.0}))
    assert torch.allclose(out.probs, softmax([0.0, 2.0, -1.0]))


def test_logit_bias_is_added_before_temperature():
    out = one([0.0, 0.0], request(logit_bias={1: 1.0}, temperature=0.5))
    assert torch.allclose(out.probs, softmax([0.0, 2.0]))


def test_allowed_token_ids_zero_everything_else():
    out = one([5.0, 1.0, 2.0, 3.0], request(allowed_token_ids=[1, 3]))
    assert torch.allclose(out.probs, softmax([NEG_INF, 1.0, NEG_INF, 3.0]))
    assert out.logprobs[0] == NEG_INF and out.logprobs[2] == NEG_INF


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    req = request(eos=[3], min_tokens=2, stop_token_ids=[2])
    early = one([1.0, 1.0, 1.0, 1.0], req, output=[0])
    assert support(early.probs) == {0, 1}
    done = one([1.0, 1.0, 1.0, 1.0], req, output=[0, 1])
    assert support(done.probs) == {0, 1, 2, 3}


def test_min_tokens_ban_is_skipped_when_nothing_else_is_allowed():
    # Only stop tokens are allowed: banning them would leave nothing; the request may stop.
    req = request(eos=[3], min_tokens=5, stop_token_ids=[2], allowed_token_ids=[2, 3])
    out = one([1.0, 1.0, 2.0, 1.0], req)
    assert torch.allclose(out.probs, softmax([NEG_INF, NEG_INF, 2.0, 1.0]))
    assert not out.probs.isnan().any()


def test_bad_words_single_token_is_always_banned():
    out = one([1.0, 1.0, 1.0], request(bad=[(1,)]))
    assert support(out.probs) == {0, 2}


def test_bad_words_last_token_banned_only_after_its_prefix():
    req = request(prompt=[4, 5], bad=[(4, 5, 6)])
    assert 6 not in support(one([1.0] * 8, req, output=[0, 4, 5]).probs)
    assert 6 in support(one([1.0] * 8, req, output=[4, 0]).probs)
    # vLLM matches the output only: a prefix that sits in the prompt does not count.
    assert 6 in support(one([1.0] * 8, req, output=[]).probs)


def test_greedy_is_one_hot_at_argmax_of_penalised_logits():
    # Raw argmax is token 0, but the repetition penalty pushes it below token 2.
    req = request(prompt=[0], repetition_penalty=2.0, temperature=0.0, top_k=1, top_p=0.5)
    out = one([3.0, 0.0, 2.0], req)
    assert out.probs.tolist() == [0.0, 0.0, 1.0]
    assert torch.allclose(out.logprobs, torch.log(softmax([1.5, 0.0, 2.0])))  # temperature 1


def test_greedy_tie_takes_the_first_maximum():
    assert one([1.0, 4.0, 4.0], request(temperature=0)).probs.tolist() == [0.0, 1.0, 0.0]


def test_top_k_keeps_ties_at_the_kth_value():
    out = one([3.0, 2.0, 2.0, 1.0], request(top_k=2))
    assert support(out.probs) == {0, 1, 2}
    assert torch.allclose(out.probs, softmax([3.0, 2.0, 2.0, NEG_INF]))
    assert support(one([3.0, 2.0, 2.0, 1.0], request(top_k=-1)).probs) == {0, 1, 2, 3}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).tolist()
    assert support(one(logits, request(top_p=0.75)).probs) == {0, 1}
    assert support(one(logits, request(top_p=0.85)).probs) == {0, 1, 2}
    assert support(one(logits, request(top_p=0.4)).probs) == {0}  # at least one token
    kept = one(logits, request(top_p=0.75)).probs
    assert torch.allclose(kept, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]))


def test_top_p_keeps_ties_with_the_last_kept_token():
    # Deliberate difference from vLLM, whose cut among ties follows sort order.
    out = one([1.0, 1.0, 1.0, 0.0], request(top_p=0.3))
    assert support(out.probs) == {0, 1, 2}


def test_min_p_is_relative_to_the_top_probability():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).tolist()
    assert support(one(logits, request(min_p=0.2)).probs) == {0, 1, 2}  # cut at 0.1
    assert support(one(logits, request(min_p=0.7)).probs) == {0}  # cut at 0.35


def test_raw_rows_ignore_every_parameter():
    req = request(prompt=[0], temperature=0.3, top_k=1, repetition_penalty=3.0, logit_bias={1: 5.0})
    logits = torch.tensor([[1.0, 2.0, 0.5], [1.0, 2.0, 0.5]])
    out = process_logits(logits, [Row(req, [1]), Row(req, [1])], raw=[True, False])
    assert torch.allclose(out.probs[0], softmax([1.0, 2.0, 0.5]))
    assert out.probs[1].tolist() == [0.0, 1.0, 0.0]
    all_raw = process_logits(logits, [Row(req, [1])] * 2, raw=True)
    assert torch.allclose(all_raw.probs, torch.softmax(logits, 1))


def test_input_logits_are_not_modified_and_other_dtypes_work():
    logits = torch.randn(3, 50)
    before = logits.clone()
    req = request(temperature=0.7, top_p=0.8, top_k=10, repetition_penalty=1.2, prompt=[1, 2])
    out32 = process_logits(logits, [Row(req, [3])] * 3)
    assert torch.equal(logits, before)
    out16 = process_logits(logits.bfloat16(), [Row(req, [3])] * 3)
    assert out16.probs.dtype == torch.float32
    assert torch.allclose(out16.probs.sum(1), torch.ones(3))
    assert torch.allclose(out32.probs.sum(1), torch.ones(3))


def test_nan_logits_are_refused_not_propagated():
    with pytest.raises(ValueError, match="row 1 has no finite maximum"):
        process_logits(torch.tensor([[0.0, 1.0], [float("nan"), 1.0]]), [Row(request(), [])] * 2)


def test_token_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(RequestError, match=r"allowed_token_ids must be token ids in \[0, 4\), got \[9\]"):
        one([0.0] * 4, request(allowed_token_ids=[1, 9]))
    with pytest.raises(RequestError, match="logit_bias"):
        one([0.0] * 4, request(logit_bias={4: 1.0}))


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match=r"logits must be \[len\(rows\)=1, vocab\]"):
        process_logits(torch.zeros(2, 4), [Row(request(), [])])


# ---- history, rows and batches ------------------------------------------------------------


def test_speculative_rows_extend_the_history_one_proposal_at_a_time():
    req = request(prompt=[9])
    rows = speculative_rows(req, [1, 2], [3, 4, 5])
    assert [tuple(r.output_ids) for r in rows] == [(1, 2), (1, 2, 3), (1, 2, 3, 4), (1, 2, 3, 4, 5)]
    assert all(r.request is req for r in rows)
    assert len(speculative_rows(req, [], [])) == 1


def test_penalties_at_each_speculative_position_see_earlier_proposals():
    req = request(repetition_penalty=4.0, frequency_penalty=0.5, min_tokens=2, eos=[0])
    rows = speculative_rows(req, [], [2, 3])
    out = process_logits(torch.full((3, 4), 1.0), rows)
    assert torch.allclose(out.probs[0], softmax([NEG_INF, 1.0, 1.0, 1.0]))
    assert torch.allclose(out.probs[1], softmax([NEG_INF, 1.0, 0.25 - 0.5, 1.0]))
    assert torch.allclose(out.probs[2], softmax([1.0, 1.0, 0.25 - 0.5, 0.25 - 0.5]))  # min_tokens met


def test_rows_with_different_parameters_match_rows_processed_alone():
    torch.manual_seed(0)
    vocab = 300
    reqs = [
        request(temperature=0),
        request(temperature=0.7, top_p=0.9, prompt=[1, 2, 3], repetition_penalty=1.3),
        request(temperature=1.3, top_k=20, min_p=0.02, frequency_penalty=0.4, presence_penalty=-0.3),
        request(allowed_token_ids=list(range(0, 300, 7)), logit_bias={7: 3.0}, top_p=0.5),
        request(bad=[(5,), (6, 8)], min_tokens=3, eos=[4], stop_token_ids=[9]),
        request(),
    ]
    rows = [Row(r, list(torch.randint(0, vocab, (i + 1,)).tolist())) for i, r in enumerate(reqs)]
    rows += [Row(reqs[1], [8, 8, 6])]
    logits = torch.randn(len(rows), vocab) * 3
    raw = [False] * (len(rows) - 1) + [True]
    batch = process_logits(logits, rows, raw=raw)
    for i, row in enumerate(rows):
        alone = process_logits(logits[i : i + 1], [row], raw=raw[i])
        assert torch.allclose(batch.probs[i], alone.probs[0], atol=1e-7)
        assert torch.equal(torch.isinf(batch.logprobs[i]), torch.isinf(alone.logprobs[0]))


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
def test_top_p_on_flat_large_vocabulary_matches_reference(top_p):
    # Flat rows miss p within the top-64 window and take the histogram path.
    torch.manual_seed(1)
    logits = torch.randn(3, 20000) * torch.tensor([[0.5], [1.0], [2.0]])
    req = request(top_p=top_p, temperature=0.8)
    out = process_logits(logits, [Row(req, [])] * 3)
    for i in range(3):
        try:
            expected = reference(logits[i], req, ())
        except NearBoundary:
            continue
        assert support(out.probs[i]) == support(expected)
        assert torch.allclose(out.probs[i].double(), expected, atol=1e-6)


def test_top_p_on_uniform_large_vocabulary_keeps_the_tie():
    out = process_logits(torch.zeros(1, 5000), [Row(request(top_p=0.5), [])])
    assert torch.allclose(out.probs, torch.full((1, 5000), 1 / 5000))


def test_many_small_rows():
    # The statistical tests push ~100k rows of a small vocabulary through here.
    req = request(temperature=0.8, top_p=0.9, repetition_penalty=1.3, prompt=[1])
    rows = [r for i in range(10000) for r in speculative_rows(req, [i % 8], [(i + 1) % 8])]
    out = process_logits(torch.randn(len(rows), 8), rows)
    assert torch.allclose(out.probs.sum(1), torch.ones(len(rows)))


def test_tokenize_bad_words_like_vllm():
    class Tokenizer:  # "bad" -> [1]; " bad" -> [2]; "two words" -> [3, 4]; " two words" -> [5, 4]
        table = {"bad": [1], " bad": [2], "two words": [3, 4], " two words": [5, 4], "x": [7], " x": [7]}

        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return self.table[text]

    ids = tokenize_bad_words(["bad", " two words", "x"], Tokenizer())
    # Both forms; the leading-space form of "x" is the same sequence start, so it is dropped.
    assert ids == ((1,), (2,), (3, 4), (5, 4), (7,))


# ---- properties ---------------------------------------------------------------------------

VOCAB = st.integers(min_value=2, max_value=12)
GRID = st.integers(min_value=-32, max_value=32).map(lambda v: v / 4)  # distinct after scaling


@st.composite
def cases(draw):
    vocab = draw(VOCAB)
    token = st.integers(0, vocab - 1)
    params = dict(
        temperature=draw(st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.6])),
        top_k=draw(st.sampled_from([0, -1, 1, 2, 3, vocab])),
        top_p=draw(st.sampled_from([1.0, 0.95, 0.9, 0.6, 0.2])),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.3])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.8])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.5, -0.5])),
        presence_penalty=draw(st.sampled_from([0.0, 0.7, -0.7])),
        min_tokens=draw(st.integers(0, 3)),
        stop_token_ids=draw(st.lists(token, max_size=2)),
        logit_bias=draw(st.dictionaries(token, st.sampled_from([-5.0, 2.0]), max_size=2)),
        allowed_token_ids=draw(st.none() | st.lists(token, min_size=1, max_size=vocab)),
    )
    req = RequestSampling(
        SamplingParams(**params),
        tuple(draw(st.lists(token, max_size=4))),
        tuple(draw(st.lists(token, max_size=1))),
        tuple(tuple(w) for w in draw(st.lists(st.lists(token, min_size=1, max_size=2), max_size=2))),
    )
    output = tuple(draw(st.lists(token, max_size=4)))
    logits = torch.tensor(draw(st.lists(GRID, min_size=vocab, max_size=vocab)))
    return logits, req, output


def _never_allowed(req: RequestSampling, vocab: int) -> set[int]:
    allowed = req.params.allowed_token_ids
    return set() if allowed is None else set(range(vocab)) - set(allowed)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_property_matches_reference_and_invariants(case):
    logits, req, output = case
    p = req.params
    out = one(logits.tolist(), req, output)
    probs = out.probs
    assert not probs.isnan().any() and not out.logprobs.isnan().any()
    assert abs(float(probs.sum()) - 1) < 1e-5
    assert (probs >= 0).all()
    if p.temperature > 0:  # greedy logprobs are those of temperature 1, by contract
        assert torch.allclose(out.logprobs.exp(), probs, atol=1e-6)
    kept = support(probs)
    assert kept and not kept & _never_allowed(req, len(logits))
    if p.temperature == 0:
        assert len(kept) == 1
    try:
        expected = reference(logits, req, output)
    except NearBoundary:
        assume(False)
    assert kept == support(expected)
    assert torch.allclose(probs.double(), expected, atol=1e-5)


@settings(max_examples=200, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20, width=32), min_size=2, max_size=40),
    top_p=st.floats(0.01, 0.999),
    top_k=st.integers(0, 45),
)
def test_property_top_k_and_top_p_supports(logits, top_p, top_k):
    x = torch.tensor(logits)
    probs = one(logits, request(top_p=top_p, top_k=top_k)).probs
    kept = support(probs)
    if 0 < top_k < len(logits):
        # Support <= k, except tokens tied with the k-th largest logit.
        kth = torch.sort(x, descending=True).values[top_k - 1]
        assert len(kept) <= top_k + int((x == kth).sum()) - 1
    # Top-p keeps a prefix of the tokens by probability, and the smallest one reaching p
    # (up to float32 rounding and ties).
    before = one(logits, request(top_k=top_k)).probs
    order = torch.argsort(before, descending=True, stable=True)
    ranks = sorted(int((order == t).nonzero()) for t in kept)
    assert ranks == list(range(len(kept))) or len(set(before[list(kept)].tolist())) < len(kept)
    mass = float(before[list(kept)].sum())
    assert mass >= top_p - 1e-5
    smallest = float(before[list(kept)].min())
    ties = int((before[list(kept)] == smallest).sum())
    assert mass - ties * smallest < top_p + 1e-5


@settings(max_examples=50, deadline=None)
@given(cases(), st.integers(0, 3))
def test_property_batch_position_does_not_matter(case, position):
    logits, req, output = case
    others = [Row(request(temperature=0.5, top_p=0.7), [0])] * 3
    rows = others[:position] + [Row(req, output)] + others[position:]
    batch = torch.randn(4, len(logits))
    batch[position] = logits
    out = process_logits(batch, rows)
    alone = one(logits.tolist(), req, output)
    assert torch.allclose(out.probs[position], alone.probs, atol=1e-7)


# ---- bitwise independence of the batch and of the thread count -----------------------------
# A row's probabilities must be the same bits alone, beside any other rows, at any position
# in the batch and with any number of threads: no parameter of one row may change how another
# is computed, and every reduction runs in a fixed order. `torch.equal`, not `allclose`.


def _pool(vocab: int) -> list[RequestSampling]:
    """Requests whose rows take every path: greedy, top-k wider and narrower than the top-p
    window, top-p through the window and through the histogram, min_p, penalties, masks."""
    return [
        request(),
        request(temperature=0.7),
        request(temperature=0),
        request(temperature=0, repetition_penalty=1.3, prompt=[1, 2]),
        request(top_p=0.5),
        request(top_p=0.95, temperature=1.3),
        request(top_k=1000),
        request(top_k=5, top_p=0.9),
        request(top_k=2000, top_p=0.7, temperature=0.8),
        request(min_p=0.05, temperature=0.9),
        request(temperature=0.6, top_p=0.9, repetition_penalty=1.2, frequency_penalty=0.3,
                presence_penalty=0.2, prompt=[3, 4, 5]),
        request(allowed_token_ids=list(range(0, vocab, 3)), logit_bias={3: 2.0}, top_p=0.8),
        request(bad=[(7,), (8, 9)], min_tokens=4, eos=[10], stop_token_ids=[11], top_k=50),
    ]


def _random_batch(pool, vocab, size, gen):
    pick = torch.randint(0, len(pool), (size,), generator=gen).tolist()
    rows = [
        Row(pool[j], torch.randint(0, 12, (int(torch.randint(0, 6, (1,), generator=gen)),),
                                   generator=gen).tolist())
        for j in pick
    ]
    # flat rows (top-p by histogram) to peaked rows (top-p inside the window)
    scale = torch.tensor([0.3, 1.0, 3.0, 8.0])[torch.randint(0, 4, (size, 1), generator=gen)]
    logits = torch.randn(size, vocab, generator=gen) * scale
    raw = (torch.rand(size, generator=gen) < 0.1).tolist()
    return logits, rows, raw


def _alone(logits, rows, raw, threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return [process_logits(logits[i : i + 1], [row], raw=[raw[i]])
                for i, row in enumerate(rows)]
    finally:
        torch.set_num_threads(previous)


def _assert_bitwise(batch: Processed, alone: list[Processed], rows) -> None:
    for i, one_row in enumerate(alone):
        assert torch.equal(batch.probs[i], one_row.probs[0]), (i, rows[i].request.params)
        assert torch.equal(batch.logprobs[i], one_row.logprobs[0]), (i, rows[i].request.params)


@pytest.mark.parametrize("vocab", [40_000, 151_936])
def test_rows_are_bitwise_the_same_alone_and_in_mixed_batches_with_1_or_2_threads(vocab):
    # 40,000 and 151,936 tokens: long enough that torch splits a row's reduction between
    # two threads (its grain is 32,768 elements).
    gen = torch.Generator().manual_seed(vocab)
    pool = _pool(vocab)
    sizes = [1, 2, 5, 16, 32] if vocab < 100_000 else [1, 16]
    previous = torch.get_num_threads()
    try:
        for size in sizes:
            logits, rows, raw = _random_batch(pool, vocab, size, gen)
            reference = _alone(logits, rows, raw, threads=1)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                _assert_bitwise(process_logits(logits, rows, raw=raw), reference, rows)
                if size > 1:  # another order: every row beside other neighbours
                    perm = torch.randperm(size, generator=gen)
                    shuffled = process_logits(logits[perm], [rows[i] for i in perm],
                                              raw=[raw[i] for i in perm])
                    _assert_bitwise(shuffled, [reference[i] for i in perm], rows)
    finally:
        torch.set_num_threads(previous)


def test_top_p_row_is_bitwise_the_same_beside_a_wide_top_k_row():
    # A row's top-p window must not widen because another row asks for top_k=1000: the wider
    # window moved rows from the histogram path to the window path (different rounding).
    gen = torch.Generator().manual_seed(7)
    top_p, wide_k = request(top_p=0.5), request(top_k=1000)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for trial in range(40):
            logits = torch.randn(2, 8000, generator=gen) * (1.5 + trial / 20)
            alone = process_logits(logits[:1], [Row(top_p, [])])
            beside = process_logits(logits, [Row(top_p, []), Row(wide_k, [])])
            assert torch.equal(beside.probs[0], alone.probs[0]), trial
            assert torch.equal(beside.logprobs[0], alone.logprobs[0]), trial
    finally:
        torch.set_num_threads(previous)


def test_probabilities_below_the_exp_floor_are_exact_zeros_in_any_batch():
    # A pruned draft head's -1e4 logits, float32's denormal range (exp(-95) = 5.5e-42) and a
    # ban (-inf) in one row: what lies below e^EXP_FLOOR of the largest is exactly 0 (the
    # fast path of exp), the rest is the plain softmax. Beside a row with no such logit (which
    # alone skips the flush), both rows keep their bits.
    from specdec.processing import EXP_FLOOR

    far = [0.0, -3.0, -86.5, -87.5, -95.0, -110.0, -1e4, NEG_INF]
    near = [0.0, -3.0, -20.0, -1.0, -2.0, -4.0, -5.0, -6.0]
    assert -86.5 > EXP_FLOOR > -87.5
    req = request()
    alone = one(far, req)
    assert torch.equal(alone.probs[3:], torch.zeros(5))
    assert (alone.probs[:3] > 0).all()  # e^-86.5 = 2.9e-38 is kept
    assert torch.allclose(alone.probs[:3].double(), softmax(far[:3]).double(), rtol=1e-6, atol=0)
    assert torch.isfinite(alone.logprobs[:7]).all()  # logprobs keep the finite logits' log
    for rows in ([far, near], [near, far]):
        batch = process_logits(torch.tensor(rows), [Row(req, ())] * 2)
        for i, logits in enumerate(rows):
            single = one(logits, req)
            assert torch.equal(batch.probs[i], single.probs)
            assert torch.equal(batch.logprobs[i], single.logprobs)


def test_row_sum_is_a_fixed_order_sum():
    from specdec.processing import row_sum

    x = torch.rand(5, 151_936)
    assert torch.allclose(row_sum(x), x.double().sum(1).float())
    assert torch.equal(row_sum(x)[2:3], row_sum(x[2:3]))
    padded = torch.cat([x, torch.zeros(5, 100_000)], 1)  # zeros on the right change nothing
    assert torch.equal(row_sum(padded), row_sum(x))
    assert row_sum(torch.ones(3, 1)).tolist() == [1.0] * 3
    assert row_sum(torch.ones(2, 0)).tolist() == [0.0, 0.0]


def test_vocab_sum_is_the_same_alone_in_a_batch_and_with_2_threads():
    from specdec.processing import vocab_sum

    previous = torch.get_num_threads()
    try:
        for vocab in (7, 1500, 2048, 40_000, 151_936):
            x = torch.rand(16, vocab)
            torch.set_num_threads(1)
            reference = [vocab_sum(x[i : i + 1]) for i in range(16)]
            torch.set_num_threads(2)
            batch = vocab_sum(x)
            assert all(torch.equal(batch[i : i + 1], reference[i]) for i in range(16)), vocab
            assert torch.allclose(batch, x.double().sum(1).float())
    finally:
        torch.set_num_threads(previous)
