"""benchmarks.k_replay: K policies replayed on drafter-invariant match bits."""

from __future__ import annotations

import random

import pytest

from benchmarks.k_replay import accepted_run, fixed, match_bits, oracle, replay
from specdec.k_policy import Costs, round_ms

# A draft step 10 ms a row, a target pass 100 ms at one row and 4 ms per extra row.
COSTS = Costs(10.0, (1, 16), (100.0, 160.0))


def test_a_round_accepts_the_run_of_matches_up_to_k():
    bits = [1, 1, 0, 1, 1, 1]
    assert [accepted_run(bits, 0, k) for k in range(4)] == [0, 1, 2, 2]
    assert accepted_run(bits, 3, 5) == 3  # the request ends there


def test_replay_prices_rounds_as_the_policy_does():
    r = replay([1] * 16, fixed(3), COSTS, prompt_len=5)
    assert (r.tokens, r.rounds, r.proposed, r.accepted) == (16, 4, 12, 12)
    # four rounds at K=3; the draft first catches up on the prompt (5 rows), then on the
    # two tokens each round leaves it (the last proposal and the bonus token)
    expected = 4 * round_ms(3, COSTS, whole_pass=True) + COSTS.catch_up(5, True) \
        + 3 * COSTS.catch_up(2, True)
    assert r.ms == pytest.approx(expected)
    target_only = replay([1] * 16, fixed(0), COSTS, prompt_len=5)
    assert target_only.rounds == 16 and target_only.ms == pytest.approx(16 * 100.0)


def test_the_oracle_bounds_every_fixed_k():
    rng = random.Random(0)
    for _ in range(20):
        bits, state = [], 1
        for _ in range(64):  # bursty: a match follows a match more often than a miss
            state = int(rng.random() < (0.9 if state else 0.5))
            bits.append(state)
        best = replay(bits, oracle(bits, 6), COSTS, prompt_len=30).ms
        assert all(best <= replay(bits, fixed(k), COSTS, prompt_len=30).ms + 1e-9
                   for k in range(7))


def test_match_bits_predict_the_engine_rounds(tiny_pair):
    """The bits computed with run_draft on the target-only text give exactly the rounds the
    engine runs at a fixed K: the replay models the real process."""
    from benchmarks.backends import LocalBackend
    from benchmarks.shipped import _requests

    draft, target = tiny_pair
    backend = LocalBackend(draft, target, dtype="float32", batch_invariant=True,
                           num_speculative_tokens=2, drafter_invariant=True)
    prompt = backend.tokenizer("def add(a, b):")["input_ids"]
    params = {"temperature": 0.8, "top_p": 0.9}
    bits = match_bits(backend, prompt, params, seed=7, tokens=24)
    assert 0 < sum(bits) < len(bits)  # the tiny draft both matches and misses
    (out,), _ = backend.run(_requests([prompt], params, k=2, max_tokens=24, seed0=7), 1)
    predicted = replay(bits, fixed(2), COSTS, prompt_len=len(prompt))
    spec = out.speculation
    assert (spec["rounds"], spec["proposed"], spec["accepted"]) == (
        predicted.rounds, predicted.proposed, predicted.accepted)
