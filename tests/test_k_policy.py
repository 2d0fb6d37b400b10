"""K per round from acceptance and measured costs (specdec.k_policy)."""

import random

import pytest

from specdec.k_policy import (MIN_GAIN, AcceptanceEvidence, Costs, choose_k, expected_tokens,
                              finish_ms, round_ms, running_acceptance)
from specdec.rejection import SpecStats


def generation(costs: Costs, prompt_len: int = 2, drafted_upto: int | None = None,
               max_tokens: int = 100, output_len: int = 1, **params):
    """A request in rounds with 100 proposals tested, 88 accepted and `output_len` tokens
    out; its prompt and output in the draft unless `drafted_upto` says otherwise."""
    from types import SimpleNamespace

    from specdec.generation import Generation
    from specdec.params import SamplingParams
    from specdec.processing import RequestSampling

    sp = SamplingParams(**dict(dict(temperature=0.6, max_tokens=max_tokens), **params))
    info = SimpleNamespace(max_context=4096, k_costs=costs)
    gen = Generation("r", sp, RequestSampling(sp, [1] * prompt_len), 0, 6, info,
                     adaptive_k=True, stats=SpecStats(tested=100, accepted=88),
                     evidence=AcceptanceEvidence(tested=100, accepted=88),
                     drafted_upto=prompt_len + output_len if drafted_upto is None else drafted_upto)
    gen.output.extend([7] * output_len)
    return gen


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
    costs = Costs(36.0, (1, 5, 16), (163.0, 217.0, 577.0), (36.0, 42.0, 125.0))

    def plan(**params):
        return generation(costs, **params).plan_k(1), generation(costs, **params).plan_k(8)

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
    g = generation(AMX, prompt_len=150, drafted_upto=0, max_tokens=64, temperature=0.0)
    assert g.plan_k(8) == 0  # the prompt and first token are not in the draft
    assert g.plan_k(1) >= 3
    g.draft_call(3)
    assert g.drafted_upto == 151 and g.used_draft
    g.output += [5, 6, 7]  # the round committed three tokens
    assert g.plan_k(8) == 1  # caught up but for them: K=1 pays at c=8


# The same machine's whole passes, timed at load (specdec.pass_costs): a decode pass of the
# round functions at 1 and 16 rows, and a draft prefill's ms per row.
WHOLE = Costs.from_calibrations(
    {"forward_ms": dict(zip(STEPPED_ROWS, STEPPED_DRAFT)), "pass_ms": {1: 39.97, 16: 107.42},
     "prefill_row_ms": 1.744},
    {"forward_ms": dict(zip(STEPPED_ROWS, STEPPED_TARGET)), "pass_ms": {1: 150.11, 16: 190.75}})


def test_whole_passes_add_what_the_matmuls_leave_out_and_keep_the_block_steps():
    assert WHOLE.target_pass(1) == pytest.approx(150.11)
    assert WHOLE.target_pass(16) == pytest.approx(190.75)
    assert WHOLE.target_pass(17) - WHOLE.target_pass(16) > 98  # the second block shows
    assert WHOLE.draft_pass(1) == pytest.approx(39.97) and WHOLE.draft(1) == 17.07
    assert WHOLE.catch_up(118, whole_pass=True) == pytest.approx(117 * 1.744)
    assert WHOLE.catch_up(118) == pytest.approx(WHOLE.draft(118) - WHOLE.draft(1))


def test_costs_take_whole_passes_only_where_both_runners_timed_the_same_rows():
    draft = {"forward_ms": {1: 17.0, 16: 41.0}, "pass_ms": {1: 40.0, 16: 107.0}}
    target = {"forward_ms": {1: 124.0, 16: 123.0}, "pass_ms": {1: 150.0, 16: 191.0}}
    assert Costs.from_calibrations(draft, target).pass_rows == (1, 16)
    for other in ({1: 150.0, 8: 170.0}, None):
        lacking = dict(target, pass_ms=other)
        costs = Costs.from_calibrations(draft, lacking)
        assert costs.pass_rows == () and costs.target_pass(16) == costs.target(16)


def test_eight_requests_weighing_whole_passes_do_not_draft_a_long_prompt():
    """Measured with 8 HumanEval prompts (118 tokens on average) on that machine: 64 greedy
    tokens at K=1 took 18.0-18.3 s, at K=0 16.7-17.3. The draft's catch-up over the prompts
    (1.7 s, 1.8 ms a row) and its 40-ms steps undo the verify's shared rows. The matmuls
    alone price a draft row at 0.9 ms and a step at 17 ms, and draft."""
    for whole_pass, k in ((False, 1), (True, 0)):
        assert choose_k(6, 100, 88, WHOLE, concurrent=8, remaining=64, catch_up_rows=118,
                        whole_pass=whole_pass) == k
    alone = choose_k(6, 100, 88, WHOLE, remaining=64, catch_up_rows=118, whole_pass=True)
    assert 3 <= alone < choose_k(6, 100, 88, WHOLE, remaining=64, catch_up_rows=118)


def test_a_request_that_drafts_alone_pays_a_whole_draft_pass():
    """In lockstep every request waits for the draft pass; one that drafts where the others
    do not shares it with none. Measured: one of eight greedy requests (the shortest prompt)
    drafted alone, the draft ran every step (39 ms), and the batch fell to 0.90x of K=0."""
    for k in range(4):
        assert round_ms(k, WHOLE, 8, True, drafting=8) == pytest.approx(round_ms(k, WHOLE, 8, True))
    assert round_ms(1, WHOLE, 8, True, drafting=1) > round_ms(1, WHOLE, 8, True) + 25
    caught_up = dict(concurrent=8, remaining=64, whole_pass=True)
    assert choose_k(6, 100, 88, WHOLE, **caught_up) == 1
    assert choose_k(6, 100, 88, WHOLE, drafting=1, **caught_up) == 0
    assert choose_k(6, 100, 88, WHOLE, drafting=8, **caught_up) == 1


def test_plan_k_drafts_alone_only_where_that_pays():
    """A greedy request caught up at eight requests would draft where all do (`wants_draft`,
    which its peers count), but with no peer that wants to it does not; a sampled standard
    request's K ignores its peers, and it wants to draft exactly when it does."""
    from specdec.generation import round_load

    g = generation(WHOLE, prompt_len=118, max_tokens=64, temperature=0.0)
    assert g.plan_k(8, drafting_peers=7) == 1 and g.wants_draft
    assert g.plan_k(8, drafting_peers=0) == 0 and g.wants_draft
    behind = generation(WHOLE, prompt_len=118, drafted_upto=0, max_tokens=64, temperature=0.0)
    assert behind.plan_k(8, drafting_peers=7) == 0 and not behind.wants_draft
    standard = generation(WHOLE, prompt_len=118, max_tokens=64)
    k = standard.plan_k(8, drafting_peers=0)
    assert k == standard.plan_k(1) >= 3 and standard.wants_draft
    others = [generation(WHOLE) for _ in range(3)]
    others[0].wants_draft = others[2].wants_draft = True
    assert round_load(g, [g] + others) == (4, 2)
    assert round_load(others[0], [g] + others) == (4, 2)  # g wants to; others[0] is not counted
    assert round_load(g, []) == (1, None)


# The service's pools on that machine timed their whole passes slower than in process.
SERVICE = Costs.from_calibrations(
    {"forward_ms": dict(zip(STEPPED_ROWS, STEPPED_DRAFT)), "pass_ms": {1: 37.54, 16: 109.11},
     "prefill_row_ms": 1.807},
    {"forward_ms": dict(zip(STEPPED_ROWS, STEPPED_TARGET)), "pass_ms": {1: 174.17, 16: 214.24}})


def test_requests_weighing_load_draft_only_for_a_gain_the_table_can_promise():
    """Eight greedy requests through the service with 118-token prompts: the table prices
    K=1 3.9 % faster than K=0, and it ran 6-17 % slower. With MIN_GAIN they stay at K=0;
    a request alone, or caught up, keeps the K the table chooses."""
    behind = dict(concurrent=8, remaining=64, catch_up_rows=118, whole_pass=True)
    assert choose_k(6, 100, 88, SERVICE, **behind) == 1
    assert choose_k(6, 100, 88, SERVICE, min_gain=MIN_GAIN, **behind) == 0
    for load in (dict(concurrent=1, catch_up_rows=118), dict(concurrent=8)):
        args = dict(remaining=64, whole_pass=True, **load)
        k = choose_k(6, 100, 88, SERVICE, **args)
        assert k >= 1 and choose_k(6, 100, 88, SERVICE, min_gain=MIN_GAIN, **args) == k
    greedy = generation(SERVICE, prompt_len=118, drafted_upto=0, max_tokens=64, temperature=0.0)
    assert greedy.plan_k(8) == 0 and greedy.plan_k(1) >= 3
    standard = generation(SERVICE, prompt_len=118, drafted_upto=0, max_tokens=64)
    assert standard.plan_k(8) == choose_k(6, 100, 88, SERVICE, remaining=64, catch_up_rows=118)


def test_the_first_round_of_a_request_that_may_weigh_load_does_not_draft():
    """Its first round is the prompt's prefill, planned before the requests that arrived with
    it are in rounds. It still says whether it wants to draft where all do (its peers count
    that); a standard-mode request's K, a function of its own history, is the table's."""
    greedy = generation(SERVICE, prompt_len=118, drafted_upto=0, output_len=0, temperature=0.0)
    assert greedy.plan_k(1) == 0 and greedy.wants_draft
    greedy.output.append(7)
    assert greedy.plan_k(1) >= 3
    standard = generation(SERVICE, prompt_len=118, drafted_upto=0, output_len=0)
    assert standard.plan_k(1) == standard.plan_k(8) >= 3


# The cost table a shipped engine measured at load on the 2-core Zen 5 EPYC (whole passes:
# a draft pass 0.36 of the target's, a slow-drafting load), and match bits in the shape a
# HumanEval prompt gave at T=0.6 / top_p=0.9 (benchmarks.k_replay): a miss at the start,
# five in a row, then a long stretch of matches.
ZEN5_LOAD = Costs(11.6, (1, 5, 8, 16, 17, 32, 33, 64),
                  (69.84, 78.27, 102.52, 173.33, 177.31, 326.13, 326.23, 636.21),
                  (11.6, 16.79, 19.6, 27.36, 27.87, 42.97, 43.07, 68.0),
                  pass_rows=(1, 16), draft_pass_ms=(29.3, 81.16), target_pass_ms=(82.49, 219.82),
                  draft_prefill_row_ms=1.308)
EARLY_MISSES = [int(c) for c in "10111100000111111111111111111111"]


def test_evidence_fades_with_the_tokens_emitted_since():
    e = AcceptanceEvidence()
    for _ in range(3):
        e.add_round(3, 0, 1)  # three rounds rejected at once
    low = running_acceptance(e.tested, e.accepted)
    assert low < 0.5
    for _ in range(40):
        e.add_round(0, 0, 1)  # target-only rounds test nothing
    assert running_acceptance(e.tested, e.accepted) > 0.7  # back towards the prior (0.8)
    fresh = AcceptanceEvidence()
    fresh.add_round(4, 2, 3)
    assert (fresh.tested, fresh.accepted) == (3, 2)  # a round's own tests count in full


def test_a_request_stopped_by_early_misses_drafts_again():
    """Counted over the whole request, the early misses kept this request at K=0 to its end
    (rounds at K=0 test nothing, so the estimate never moved); fading evidence brings it
    back to drafting, through the stretch of matches, and finishes it sooner."""
    from benchmarks.k_replay import replay, shipped_policy

    def run(evidence):
        gen = generation(ZEN5_LOAD, prompt_len=119, drafted_upto=0, output_len=0,
                         max_tokens=len(EARLY_MISSES), drafter_invariant=True)
        gen.stats = SpecStats()
        ks = []
        choose, on_round = shipped_policy(gen, evidence)
        result = replay(EARLY_MISSES, lambda t, left: ks.append(choose(t, left)) or ks[-1],
                        ZEN5_LOAD, prompt_len=119, on_round=on_round)
        return result, ks

    fading, ks = run(AcceptanceEvidence())
    assert sum(ks[len(ks) // 2:]) > 0  # drafting in the second half of its rounds
    counted, ks_counted = run(AcceptanceEvidence(decay=1.0))  # whole-request counts
    assert ks_counted[-10:] == [0] * 10
    assert fading.ms < 0.95 * counted.ms
