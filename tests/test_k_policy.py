"""K per round from acceptance and measured costs (specdec.k_policy)."""

import random

import pytest

from specdec.k_policy import (Costs, choose_k, expected_tokens, finish_ms, round_ms,
                              running_acceptance)
from specdec.rejection import SpecStats


def test_expected_tokens_is_the_geometric_mean_length():
    assert expected_tokens(0.0, 5) == pytest.approx(1.0)
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.9, 3) == pytest.approx(1 + 0.9 + 0.81 + 0.729)


def test_costs_interpolate_and_extrapolate_linearly():
    c = Costs(10.0, (1, 5, 16), (100.0, 140.0, 360.0))
    assert c.target(1) == 100.0 and c.target(3) == pytest.approx(120.0)
    assert c.target(16) == 360.0 and c.target(27) == pytest.approx(580.0)


def test_costs_extrapolate_with_the_slope_of_the_upper_half():
    """A table that lists both sides of block steps ends within one block (33 to 64 rows
    are three blocks then four): beyond it, the slope from 32 rows, not from 33."""
    c = Costs(10.0, (1, 16, 17, 32, 33, 64), (100.0, 100.0, 200.0, 200.0, 300.0, 400.0))
    assert c.target(96) == pytest.approx(400.0 + 32 * (400.0 - 200.0) / 32)


# Measured on a 2-core AMX Xeon (bf16 target with 16-row blocks on three of five shapes,
# w8a8 draft), listed as a calibration lists them: profile rows first.
STEPPED_ROWS = (1, 5, 16, 8, 17, 32, 33, 64)
STEPPED_TARGET = (123.76, 120.32, 122.65, 120.77, 221.11, 223.27, 321.74, 425.29)
STEPPED_DRAFT = (17.07, 29.54, 41.2, 33.25, 42.16, 54.97, 57.23, 83.48)


def test_costs_from_calibrations_sort_the_listed_rows():
    costs = Costs.from_calibrations({"forward_ms": dict(zip(STEPPED_ROWS, STEPPED_DRAFT))},
                                    {"forward_ms": dict(zip(STEPPED_ROWS, STEPPED_TARGET))})
    assert costs.target_rows == tuple(sorted(STEPPED_ROWS))
    assert costs.target(8) == 120.77 and costs.target(17) == 221.11
    assert costs.target(24) == pytest.approx(222.1, abs=0.1)  # two blocks, not 1.2
    assert costs.draft(8) == 33.25 and costs.draft_ms == 17.07


def test_a_second_row_block_is_priced_from_its_first_row():
    """Twelve requests at K=1 feed 24 rows, two 16-row blocks. Listing only 16 and 64 rows,
    the same measurement put them at 1.2 blocks and chose K=1; with 17 and 32 listed the
    step shows, and K=0 finishes sooner. Alone and at eight requests (16 rows) both agree."""
    measured = Costs.from_calibrations({"forward_ms": dict(zip(STEPPED_ROWS, STEPPED_DRAFT))},
                                       {"forward_ms": dict(zip(STEPPED_ROWS, STEPPED_TARGET))})
    keep = [STEPPED_ROWS.index(r) for r in (1, 5, 16, 64)]
    smooth = Costs(17.07, (1, 5, 16, 64), tuple(STEPPED_TARGET[i] for i in keep),
                   tuple(STEPPED_DRAFT[i] for i in keep))
    assert choose_k(6, 100, 88, smooth, concurrent=12, remaining=64) == 1
    assert choose_k(6, 100, 88, measured, concurrent=12, remaining=64) == 0
    for n, k in ((1, 6), (8, 1)):
        assert choose_k(6, 100, 88, smooth, concurrent=n, remaining=64) == k
        assert choose_k(6, 100, 88, measured, concurrent=n, remaining=64) == k


def test_k_zero_when_the_draft_costs_as_much_as_a_verify():
    costs = Costs(100.0, (1, 5, 16), (100.0, 110.0, 200.0))
    assert choose_k(6, tested=100, accepted=90, costs=costs) == 0


def test_long_k_when_verify_is_flat_and_acceptance_high():
    costs = Costs(5.0, (1, 5, 16), (100.0, 101.0, 104.0))
    assert choose_k(6, tested=100, accepted=97, costs=costs) == 6
    assert choose_k(6, tested=100, accepted=5, costs=costs) <= 1  # the draft is useless


def test_k_follows_acceptance_monotonically():
    costs = Costs(30.0, (1, 5, 16), (160.0, 215.0, 580.0))
    ks = [choose_k(8, tested=1000, accepted=a, costs=costs) for a in range(0, 1001, 50)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] >= 4


def test_k_maximises_tokens_per_ms_among_all_k():
    rng = random.Random(0)
    for _ in range(200):
        costs = Costs(rng.uniform(1, 80), (1, 5, 16),
                      tuple(sorted(rng.uniform(50, 900) for _ in range(3))))
        tested = rng.randint(0, 300)
        accepted = rng.randint(0, tested)
        k = choose_k(7, tested, accepted, costs)
        a = running_acceptance(tested, accepted)
        rate = [expected_tokens(a, j) / (j * costs.draft_ms + costs.target(j + 1)) for j in range(8)]
        assert rate[k] == max(rate)


def test_tested_proposals_estimate_per_token_acceptance_without_k_bias():
    """accepted / proposed falls with K at a fixed per-token acceptance; accepted / tested,
    what choose_k uses, does not."""
    rng = random.Random(1)
    for k in (1, 4, 8):
        s = SpecStats()
        for _ in range(20000):
            acc = 0
            while acc < k and rng.random() < 0.8:
                acc += 1
            s.add_round(k, acc, acc + 1)
        assert abs(s.accepted / s.tested - 0.8) < 0.01
        if k == 8:
            assert s.accepted / s.proposed < 0.6


def test_load_makes_compute_bound_speculation_stop():
    """Measured on a 2-core AVX2 CPU (fp16 weights): verify rows are nearly free alone, but
    eight requests' rounds make the target compute-bound."""
    costs = Costs(36.0, (1, 5, 16), (163.0, 217.0, 577.0), (36.0, 42.0, 125.0))
    assert choose_k(6, tested=100, accepted=88, costs=costs) >= 3
    assert choose_k(6, tested=100, accepted=88, costs=costs, concurrent=8) == 0
    assert round_ms(0, costs, 8) == pytest.approx(costs.target(8) / 8)


def test_plan_k_weighs_load_only_where_text_cannot_depend_on_k():
    from types import SimpleNamespace

    from specdec.generation import Generation

    costs = Costs(36.0, (1, 5, 16), (163.0, 217.0, 577.0), (36.0, 42.0, 125.0))

    def plan(**params):
        base = dict(temperature=0.6, drafter_invariant=False, max_tokens=100)
        p = SimpleNamespace(**dict(base, **params))
        p.greedy = p.temperature == 0
        g = SimpleNamespace(params=p, info=SimpleNamespace(max_context=4096, k_costs=costs),
                            prompt_ids=[1, 2], output=[], num_speculative_tokens=6,
                            adaptive_k=True, stats=SpecStats(tested=100, accepted=88),
                            drafted_upto=2)
        g.text_independent_of_k = Generation.text_independent_of_k.fget(g)
        return Generation.plan_k(g, 1), Generation.plan_k(g, 8)

    assert plan()[0] == plan()[1] >= 3  # standard sampling: the same K at any load
    alone, loaded = plan(temperature=0)
    assert alone >= 3 and loaded == 0
    alone, loaded = plan(drafter_invariant=True)
    assert alone >= 3 and loaded == 0


def test_blocks_beyond_sixteen_rows_are_not_free():
    """Measured on a 2-core Xeon with AMX (bf16, 16-row blocks): a pass costs the same from 1
    to 16 rows, and each further block of 16 as much again. Eight greedy requests at K=3 feed
    32 rows; a table that stopped at 16 rows extrapolated them as free and chose K >= 3."""
    flat = Costs(35.9, (1, 5, 16), (84.6, 84.6, 84.6), (35.9, 32.8, 34.6))
    measured = Costs(35.9, (1, 5, 16, 64), (84.6, 84.6, 84.6, 338.2), (35.9, 32.8, 34.6, 138.2))
    assert choose_k(6, tested=100, accepted=88, costs=flat, concurrent=8) >= 3
    assert choose_k(6, tested=100, accepted=88, costs=measured, concurrent=8) <= 1
    assert choose_k(6, tested=100, accepted=88, costs=measured) >= 3  # alone: unchanged


# Measured on a 2-core Xeon with AMX (bf16 target, 16-row blocks; w8a8 draft).
AMX = Costs(35.9, (1, 5, 16, 64), (84.6, 84.6, 84.6, 338.2), (35.9, 32.8, 34.6, 138.2))


def test_a_draft_catch_up_is_drafted_only_where_the_rest_of_the_request_earns_it():
    """Eight requests of 64 tokens: K=1 saves a little per round, less than the draft's pass
    over a 150-token prompt; alone, or with 2000 tokens to go, drafting pays."""
    assert choose_k(6, 100, 88, AMX, concurrent=8, remaining=64) == 1  # draft caught up
    assert choose_k(6, 100, 88, AMX, concurrent=8, remaining=64, catch_up_rows=150) == 0
    assert choose_k(6, 100, 88, AMX, concurrent=8, remaining=2000, catch_up_rows=150) == 1
    assert choose_k(6, 100, 88, AMX, concurrent=1, remaining=64, catch_up_rows=150) >= 3
    assert choose_k(6, 100, 88, AMX, concurrent=1, remaining=8, catch_up_rows=150) == 0


def test_finish_ms_adds_the_catch_up_once_and_only_to_drafted_rounds():
    a = running_acceptance(100, 88)
    for k in range(4):
        caught_up = finish_ms(k, a, AMX, 8, 64)
        assert caught_up == pytest.approx(64 * round_ms(k, AMX, 8) / expected_tokens(a, k))
        behind = finish_ms(k, a, AMX, 8, 64, catch_up_rows=150)
        extra = AMX.draft(150) - AMX.draft(1) if k else 0.0
        assert behind == pytest.approx(caught_up + extra)


def test_plan_k_counts_the_tokens_the_draft_has_not_seen():
    """A request that ran rounds at K=0 owes the draft those tokens before it drafts again;
    one that drafted last round owes only that round's tokens."""
    from types import SimpleNamespace

    from specdec.generation import Generation

    g = SimpleNamespace(params=SimpleNamespace(max_tokens=64, greedy=True, drafter_invariant=True),
                        info=SimpleNamespace(max_context=4096, k_costs=AMX), prompt_ids=[1] * 150,
                        output=[], num_speculative_tokens=6, adaptive_k=True,
                        stats=SpecStats(tested=100, accepted=88), drafted_upto=0,
                        text_independent_of_k=True, request_id="r", sampling=None, seed=0)
    g.tokens = lambda: Generation.tokens(g)
    assert Generation.plan_k(g, 8) == 0  # the prompt is not in the draft
    assert Generation.plan_k(g, 1) >= 3
    Generation.draft_call(g, 3)
    assert g.drafted_upto == 150 and Generation.used_draft.fget(g)
    g.output = [5, 6, 7]  # the round committed three tokens
    assert Generation.plan_k(g, 8) == 1  # caught up but for them: K=1 pays at c=8
