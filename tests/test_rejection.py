"""Rejection sampler: greedy, seeds, drafter-invariant mode, edge cases, statistics."""

import pytest
import torch

from specdec.randomness import Purpose, gumbel_argmax, sample
from specdec.rejection import RejectionOutput, SpecStats, rejection_sample

V = 40


def _probs(*shape, seed=0, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, V, generator=g) * sharp, -1)


def _draft_from(q, seeds, positions, num_draft):
    """Proposals drawn from q [B, K, V] as the draft would (purpose DRAFT), padded with -1."""
    B, K, _ = q.shape
    pos = positions[:, None] + torch.arange(K)
    x = sample(q.flatten(0, 1), seeds.repeat_interleave(K), pos.flatten(), Purpose.DRAFT)
    x = x.view(B, K)
    return torch.where(torch.arange(K) < num_draft[:, None], x, -1)


def _run(x, k, q, p, seeds, pos, inv=None) -> RejectionOutput:
    inv = torch.zeros(len(k), dtype=torch.bool) if inv is None else inv
    return rejection_sample(x, k, q, p, seeds, pos, inv)


# ---- greedy ---------------------------------------------------------------------------------


def test_greedy_one_hot_emits_target_argmax_at_every_position():
    B, K = 64, 4
    g = torch.Generator().manual_seed(1)
    target = torch.randint(0, V, (B, K + 1), generator=g)
    agree = torch.rand(B, K, generator=g) < 0.7  # drafts agree with the target 70 % of the time
    draft = torch.where(agree, target[:, :K], (target[:, :K] + 1) % V)
    k = torch.randint(0, K + 1, (B,), generator=g)
    x = torch.where(torch.arange(K) < k[:, None], draft, -1)
    one_hot = lambda t: torch.nn.functional.one_hot(t, V).float()  # noqa: E731
    out = _run(x, k, one_hot(draft), one_hot(target), torch.arange(B), torch.arange(B) * 7)
    for b in range(B):
        s = int((agree[b, : k[b]].long().cumprod(0)).sum())
        assert out.num_accepted[b] == s
        assert out.tokens[b] == target[b, : s + 1].tolist()  # accepted = target argmax too
    assert out.num_accepted.sum() > 0 and (out.num_accepted < k).any()  # both paths ran


# ---- seeds ----------------------------------------------------------------------------------


def test_same_seed_same_tokens_at_any_row_beside_any_requests():
    K = 4
    q, p = _probs(1, K, seed=1), _probs(1, K + 1, seed=2)
    seed, pos, k = torch.tensor([424242]), torch.tensor([17]), torch.tensor([3])
    x = _draft_from(q, seed, pos, k)
    alone = _run(x, k, q, p, seed, pos)
    # without the padding column: a batch whose K is the request's own k
    assert _run(x[:, :3], k, q[:, :3], p[:, :4], seed, pos).tokens == alone.tokens
    g = torch.Generator().manual_seed(5)
    for trial in range(6):
        B = 5 + trial
        others_q, others_p = _probs(B, K, seed=10 + trial), _probs(B, K + 1, seed=20 + trial)
        seeds = torch.randint(0, 2**62, (B,), generator=g)
        positions = torch.randint(0, 100, (B,), generator=g)
        ks = torch.randint(0, K + 1, (B,), generator=g)
        xs = _draft_from(others_q, seeds, positions, ks)
        row = trial % B
        pairs = ((others_q, q), (others_p, p), (seeds, seed), (positions, pos), (ks, k), (xs, x))
        for batch_tensor, alone_tensor in pairs:
            batch_tensor[row] = alone_tensor[0]
        inv = torch.arange(B) % 2 == 1  # drafter-invariant neighbours, too
        inv[row] = False
        out = _run(xs, ks, others_q, others_p, seeds, positions, inv)
        assert out.tokens[row] == alone.tokens[0]
    assert _run(x, k, q, p, seed, pos).tokens == alone.tokens  # repeated run


def test_different_seeds_give_different_tokens():
    B, K = 200, 3
    q, p = _probs(1, K, seed=3).expand(B, -1, -1), _probs(1, K + 1, seed=4).expand(B, -1, -1)
    seeds, pos, k = torch.arange(B) * 31 + 5, torch.full((B,), 9), torch.full((B,), K)
    out = _run(_draft_from(q, seeds, pos, k), k, q, p, seeds, pos)
    assert len({tuple(t) for t in out.tokens}) > 15  # the seed does steer the output


# ---- drafter-invariant mode -----------------------------------------------------------------

TABLE_T = torch.log(_probs(V, seed=7, sharp=1.5))  # target logits given the last token
TABLE_Q = torch.log(_probs(V, seed=8, sharp=1.5))


def _dist(table, last, pos):
    """Synthetic model: logits by the last token plus a tilt that depends on the position."""
    tilt = 0.3 * torch.sin(torch.arange(V) * (pos[:, None] + 1.0))
    return torch.softmax(table[last] + tilt, -1)


def _target_only(seeds, length, start):
    last, out = start, []
    for t in range(length):
        pos = torch.full_like(seeds, t)
        last = gumbel_argmax(_dist(TABLE_T, last, pos), seeds, pos)
        out.append(last)
    return torch.stack(out, 1).tolist()


def _speculative(seeds, length, start, K, table_q, with_q):
    """Rounds of K Gumbel-argmax proposals + drafter-invariant verification, per row."""
    B = len(seeds)
    out, stats = [[] for _ in range(B)], SpecStats()
    last, gen = start.clone(), torch.Generator().manual_seed(K)
    while min(len(o) for o in out) < length:
        pos = torch.tensor([len(o) for o in out])
        props, qs, h = [], [], last
        for i in range(K):  # the draft: its own distribution, the request's noise
            if table_q is None:  # a fresh random draft distribution every time
                q = _probs(B, seed=len(qs) * 7 + int(pos.sum()))
            else:
                q = _dist(table_q, h, pos + i)
            h = gumbel_argmax(q, seeds, pos + i)
            props.append(h), qs.append(q)
        x = torch.stack(props, 1)
        prev = torch.cat([last[:, None], x], 1)  # the token before each target position
        p = torch.stack([_dist(TABLE_T, prev[:, i], pos + i) for i in range(K + 1)], 1)
        k = torch.randint(0, K + 1, (B,), generator=gen)  # rows submit 0..K of the proposals
        x = torch.where(torch.arange(K) < k[:, None], x, -1)
        res = rejection_sample(x, k, torch.stack(qs, 1) if with_q else None,
                               p, seeds, pos, torch.ones(B, dtype=torch.bool))
        for b, toks in enumerate(res.tokens):
            out[b] += toks
            stats.add_round(int(k[b]), int(res.num_accepted[b]), len(toks))
        last = torch.tensor([o[-1] for o in out])
    return [o[:length] for o in out], stats


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("draft", ["other_model", "random_each_round", "same_as_target"])
def test_drafter_invariant_equals_target_only_gumbel_sampling(K, draft):
    B, L = 24, 10
    seeds = torch.arange(B) * 1_000_003 + 11
    start = torch.randint(0, V, (B,), generator=torch.Generator().manual_seed(K))
    table = {"other_model": TABLE_Q, "random_each_round": None, "same_as_target": TABLE_T}[draft]
    spec, stats = _speculative(seeds, L, start, K, table, with_q=draft != "other_model")
    assert spec == _target_only(seeds, L, start)
    print(f"\nK={K} draft={draft}: acceptance {stats.acceptance_rate:.3f}")
    assert stats.accepted > 0 or draft == "random_each_round"


# ---- standard-mode edge cases ---------------------------------------------------------------


def test_q_equal_p_accepts_everything_and_zero_target_mass_always_rejects():
    B, K = 50, 3
    p = _probs(B, K + 1, seed=5)
    seeds, pos, k = torch.arange(B), torch.zeros(B, dtype=torch.long), torch.full((B,), K)
    x = _draft_from(p[:, :K], seeds, pos, k)
    assert (_run(x, k, p[:, :K], p, seeds, pos).num_accepted == K).all()
    p0 = p.clone()
    p0[:, 0].scatter_(1, x[:, :1], 0.0)  # target gives the first proposal zero mass
    p0[:, 0] /= p0[:, 0].sum(-1, keepdim=True)
    out = _run(x, k, p[:, :K], p0, seeds, pos)
    assert (out.num_accepted == 0).all()
    assert all(t[0] != int(x[b, 0]) for b, t in enumerate(out.tokens))  # recovered elsewhere


def test_zero_mass_residual_falls_back_to_target():
    # p = q / 2 (unnormalised): proposals can be rejected, yet max(0, p - q) is empty.
    B, K = 100, 2
    q = _probs(B, K, seed=6)
    p = torch.cat([q, q[:, :1]], 1) / 2
    seeds, pos, k = torch.arange(B), torch.zeros(B, dtype=torch.long), torch.full((B,), K)
    out = _run(_draft_from(q, seeds, pos, k), k, q, p, seeds, pos)
    assert (out.num_accepted < K).any()
    assert all(len(t) == int(n) + 1 for t, n in zip(out.tokens, out.num_accepted))


def test_padding_zero_proposals_and_output_shape():
    B, K = 6, 3
    q, p = _probs(B, K, seed=9), _probs(B, K + 1, seed=10)
    seeds, pos = torch.arange(B), torch.arange(B)
    k = torch.tensor([0, 1, 2, 3, 0, 3])
    x = _draft_from(q, seeds, pos, k)
    out = _run(x, k, q, p, seeds, pos)
    assert out.num_accepted.dtype == torch.int64 and (out.num_accepted <= k).all()
    for b in range(B):
        n = int(out.num_accepted[b])
        assert out.tokens[b][:n] == x[b, :n].tolist() and len(out.tokens[b]) == n + 1
    # k = 0 everywhere: only target tokens, and no draft probabilities are needed
    empty = _run(torch.empty(B, 0, dtype=torch.long), torch.zeros(B, dtype=torch.long), None,
                 p[:, :1], seeds, pos)
    assert [t[0] for t in empty.tokens] == gumbel_argmax(p[:, 0], seeds, pos).tolist()


@pytest.mark.parametrize("drafter_invariant", [False, True])
def test_target_only_rows_are_gumbel_sampled_in_both_modes(drafter_invariant):
    # One sampler for target-only and drafter-invariant decoding: a row with no proposals
    # emits argmax(log p + g(seed, position)) whatever its mode, which is what every
    # drafter-invariant round emits at that position.
    B, K = 40, 3
    p = _probs(B, K + 1, seed=11)
    seeds, pos = torch.arange(B) * 7 + 3, torch.arange(B) % 5
    k = torch.tensor([0] * (B // 2) + [K] * (B // 2))  # target-only rows beside drafting rows
    q = _probs(B, K, seed=12)
    x = _draft_from(q, seeds, pos, k)
    inv = torch.full((B,), drafter_invariant)
    out = _run(x, k, q, p, seeds, pos, inv)
    only = gumbel_argmax(p[: B // 2, 0], seeds[: B // 2], pos[: B // 2]).tolist()
    assert [t for t, in out.tokens[: B // 2]] == only
    # and a standard-mode row with proposals still uses the accept / residual / bonus rule
    alone = _run(x[B // 2 :], k[B // 2 :], q[B // 2 :], p[B // 2 :], seeds[B // 2 :],
                 pos[B // 2 :], inv[B // 2 :])
    assert out.tokens[B // 2 :] == alone.tokens


def test_missing_draft_probs_for_a_standard_row_is_refused():
    x, k = torch.zeros(2, 2, dtype=torch.long), torch.tensor([2, 2])
    with pytest.raises(ValueError, match="drafter-invariant"):
        rejection_sample(x, k, None, _probs(2, 3), torch.arange(2), torch.arange(2),
                         torch.tensor([True, False]))
    with pytest.raises(ValueError, match="num_draft"):
        _run(x, torch.tensor([3, 0]), _probs(2, 2), _probs(2, 3), torch.arange(2), torch.arange(2))


# ---- statistics -----------------------------------------------------------------------------


def test_spec_stats_arithmetic():
    s = SpecStats()
    assert s.acceptance_rate is None and s.system_efficiency is None
    s.add_round(4, accepted=4, emitted=5)
    s.add_round(4, accepted=1, emitted=2)
    s.add_round(2, accepted=0, emitted=1)
    s.add_round(0, accepted=0, emitted=1)  # target-only round: no proposals
    assert (s.rounds, s.proposed, s.accepted, s.emitted) == (4, 10, 5, 9)
    assert s.tested == 4 + 2 + 1 + 0  # each rejection is tested, proposals after it are not
    assert s.acceptance_rate == 5 / 10
    assert s.system_efficiency == 9 / (5 + 5 + 3 + 1)
    d = s.to_dict()
    assert d == {"rounds": 4, "proposed": 10, "accepted": 5, "emitted": 9,
                 "acceptance_rate": 0.5, "system_efficiency": 9 / 14}
    only_target = SpecStats()
    only_target.add_round(0, 0, 1)
    assert only_target.acceptance_rate is None and only_target.system_efficiency == 1.0
