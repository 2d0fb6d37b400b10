"""Statistical proof of exactness: speculative generation == direct sampling from the target.

A 7-token vocabulary, a synthetic target whose logits depend on the history (a random table
indexed by position and last token; penalties and min_tokens add the rest of the history)
and a deliberately different draft. For each setting, N sequences of L = 3 tokens are
generated exactly as the service does: the draft proposes K tokens one by one from its
processed distribution (history = committed output + earlier proposals, randomness keyed by
seed and absolute position), the target processes the K + 1 positions via `speculative_rows`
and `process_logits`, and `rejection_sample` decides, round after round, one row per
sequence. The joint frequencies of the 343 possible outputs are compared by a chi-square
test with the exact joint distribution of direct sampling from the processed target
(enumerated). Every seed is fixed, so the outcome is deterministic.

Processing is a pure function of (logits, history), so it runs once per distinct history in
a round and is scattered back to the rows that share it (identical results, far less time).

The known errors must be detected: a target scored raw (vLLM before PR 10198), a draft that
samples from one distribution but reports another, and broken samplers.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy import stats

import specdec.rejection as rejection
from specdec.params import SamplingParams
from specdec.processing import RequestSampling, Row, process_logits, speculative_rows
from specdec.randomness import Purpose, inverse_cdf, sample, uniforms
from specdec.rejection import rejection_sample

V, L = 7, 3  # vocabulary, tokens per sequence
N = 100_000  # sequences per setting
ALPHA = 1e-4  # correct settings must pass at this level, broken ones must fail it
PROMPT = (2, 5, 1, 5)
_gen = torch.Generator().manual_seed(2024)
TARGET_TABLE = torch.randn(L + 1, V, V, generator=_gen) * 1.5  # [position, last token] -> logits
DRAFT_TABLE = 0.8 * TARGET_TABLE + torch.randn(L + 1, V, V, generator=_gen) * 0.9  # related

RESULTS: list[tuple] = []  # (setting, chi2, dof, p, acceptance, impossible outputs)
SIM_COUNTS = {"proposed": 0, "accepted": 0}  # of the latest simulation


def _logits(table: torch.Tensor, histories: list[tuple[int, ...]]) -> torch.Tensor:
    """The synthetic model: logits by (position, last token of prompt + output)."""
    pos = torch.tensor([len(h) for h in histories])
    last = torch.tensor([(PROMPT + h)[-1] for h in histories])
    return table[pos, last]


@dataclass
class Variant:
    """How one simulated system differs from the correct one (default: it does not)."""

    raw_draft: bool = False  # the draft samples from raw softmax and reports it (still exact)
    reports_raw_q: bool = False  # samples from the processed q, reports the raw q (broken)
    drafter_invariant: bool = False


# ---- simulation -----------------------------------------------------------------------------


def _unique_rows(mat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of a small-token matrix (-1 = absent) and each row's index among them."""
    code = ((mat + 1) * (V + 1) ** np.arange(mat.shape[1])).sum(1)  # one int per row
    _, first, inv = np.unique(code, return_index=True, return_inverse=True)
    return mat[first], inv.reshape(-1)


def _tokens(row: np.ndarray) -> tuple[int, ...]:
    return tuple(int(t) for t in row if t >= 0)


def _draft_step(req, out, n, props, i, sel, seeds, variant, q_all):
    """Proposal i of the rows `sel`, drawn from their processed draft distributions."""
    key = np.concatenate([out[sel], props[sel, :i]], 1)  # output (-1 past n) + proposals
    uniq, inv = _unique_rows(key)
    histories = [_tokens(u) for u in uniq]
    rows = [Row(req, h) for h in histories]
    logits = _logits(DRAFT_TABLE, histories)
    q = process_logits(logits, rows, raw=variant.raw_draft).probs[torch.from_numpy(inv)]
    pos = torch.from_numpy(n[sel] + i)
    gumbel = torch.full((len(sel),), variant.drafter_invariant)
    props[sel, i] = sample(q, seeds[sel], pos, Purpose.DRAFT, gumbel).numpy()
    if variant.reports_raw_q:
        q = process_logits(logits, rows, raw=True).probs[torch.from_numpy(inv)]
    q_all[sel, i] = q


def _target_probs(req, out, props, K, raw):
    """p [rows, K + 1, V]: speculative_rows + process_logits per distinct (output, proposals)."""
    key = np.concatenate([out, props], 1)  # output is -1 past n, proposals -1 past k
    uniq, inv = _unique_rows(key)
    rows: list[Row] = []
    counts = []
    for u in uniq:
        r = speculative_rows(req, _tokens(u[:L]), _tokens(u[L:]))
        rows += r
        counts.append(len(r))
    logits = _logits(TARGET_TABLE, [tuple(r.output_ids) for r in rows])
    flat = process_logits(logits, rows, raw=raw).probs
    p = torch.full((len(uniq), K + 1, V), 1.0 / V)  # positions past k_b are never read
    start = 0
    for j, c in enumerate(counts):
        p[j, :c] = flat[start : start + c]
        start += c
    return p[torch.from_numpy(inv)]


def simulate(params: SamplingParams, K: int, seed_base: int, variant: Variant, extra_req=None):
    """N sequences of L tokens by speculative decoding; returns them as [N, L] ints."""
    req = RequestSampling(params, PROMPT, **(extra_req or {}))
    raw_target = params.target_probs == "raw"
    seeds = torch.arange(N, dtype=torch.int64) + seed_base
    counts = SIM_COUNTS
    counts.update(proposed=0, accepted=0)
    out = np.full((N, L), -1, dtype=np.int64)
    n = np.zeros(N, dtype=np.int64)
    while (n < L).any():
        active = np.nonzero(n < L)[0]
        # k_b cycles through 1..K over the rows, so bonus tokens fall inside the kept L
        # tokens, and rows of one round are padded differently; none past position L - 1
        k = np.minimum(1 + active % K, L - n[active])
        props = np.full((len(active), K), -1, dtype=np.int64)
        q_all = torch.zeros(len(active), K, V)
        for i in range(K):
            sel = np.nonzero(k > i)[0]
            if len(sel):
                _draft_step(req, out[active], n[active], props, i, sel, seeds[active], variant,
                            q_all)
        p = _target_probs(req, out[active], props, K, raw_target)
        res = rejection_sample(
            torch.from_numpy(props), torch.from_numpy(k), q_all, p, seeds[active],
            torch.from_numpy(n[active]), torch.full((len(active),), variant.drafter_invariant),
        )
        counts["proposed"] += int(k.sum())
        counts["accepted"] += int(res.num_accepted.sum())
        _commit(out, n, active, props, res)
    return out


def _commit(out, n, active, props, res):
    """Append each active row's emitted tokens (accepted prefix + final), up to L."""
    s = res.num_accepted.numpy()
    emitted = np.concatenate([props, np.zeros((len(active), 1), dtype=np.int64)], 1)
    emitted[np.arange(len(active)), s] = [t[-1] for t in res.tokens]
    take = np.minimum(s + 1, L - n[active])
    for j in range(emitted.shape[1]):
        m = j < take
        out[active[m], n[active[m]] + j] = emitted[m, j]
    n[active] += take


# ---- the truth and the test -----------------------------------------------------------------


def exact_joint(params: SamplingParams, extra_req=None) -> np.ndarray:
    """P(x1, x2, x3) of direct sampling from the processed target, flattened to [V^L]."""
    req = RequestSampling(params.model_copy(update={"target_probs": "processed"}), PROMPT,
                          **(extra_req or {}))
    joint = np.ones(1)
    for t in range(L):
        prefixes = [tuple(int(d) for d in np.unravel_index(j, (V,) * t)) for j in range(V**t)]
        probs = process_logits(_logits(TARGET_TABLE, prefixes), [Row(req, h) for h in prefixes])
        joint = (joint[:, None] * probs.probs.double().numpy()).reshape(-1)
    return joint / joint.sum()


def chi_square(seqs: np.ndarray, joint: np.ndarray) -> tuple[float, int, float, int]:
    """Pearson chi-square of the observed outputs against N * joint: (chi2, dof, p, number of
    outputs impossible under the target). Cells expected < 5 are merged into one; any
    impossible output is an outright error (infinite statistic, p = 0).
    """
    obs = np.bincount(np.ravel_multi_index(seqs.T, (V,) * L), minlength=V**L)
    impossible = int(obs[joint == 0].sum())
    if impossible:
        return float("inf"), 0, 0.0, impossible
    exp = joint * len(seqs)
    big = exp >= 5
    o = np.append(obs[big], obs[~big & (joint > 0)].sum())
    e = np.append(exp[big], exp[~big & (joint > 0)].sum())
    if e[-1] < 5:  # too small to stand alone: fold into the smallest big cell
        j = np.argmin(e[:-1])
        o[j] += o[-1]
        e[j] += e[-1]
        o, e = o[:-1], e[:-1]
    if len(e) < 2:  # a single possible output (greedy): any deviation was caught above
        return 0.0, 0, 1.0, 0
    res = stats.chisquare(o, e * o.sum() / e.sum())
    return float(res.statistic), len(e) - 1, float(res.pvalue), 0


def run_setting(name, params, K=3, variant=Variant(), extra_req=None):
    seqs = simulate(params, K, zlib.crc32(name.encode()) * 1_000_003, variant, extra_req)
    chi2, dof, p, impossible = chi_square(seqs, exact_joint(params, extra_req))
    acc = SIM_COUNTS["accepted"] / max(SIM_COUNTS["proposed"], 1)
    RESULTS.append((name, chi2, dof, p, acc, impossible))
    print(f"\n{name:<40} K={K} N={N}: chi2={chi2:.1f} dof={dof} p={p:.3g} "
          f"acceptance={acc:.3f} impossible outputs={impossible}")
    return seqs, p


@pytest.fixture(scope="module", autouse=True)
def _summary():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: a second thread only adds sync cost (shared CPU)
    yield
    torch.set_num_threads(threads)
    print("\n\nexactness summary (chi-square against direct sampling from the processed target)")
    for name, chi2, dof, p, acc, impossible in RESULTS:
        print(f"  {name:<52} chi2={chi2:>10.1f}  dof={dof:>3}  p={p:<8.3g} "
              f"acceptance={acc:.3f}" + (f"  impossible outputs={impossible}" if impossible else ""))


# ---- settings -------------------------------------------------------------------------------

SETTINGS = {
    "T=0.6": dict(temperature=0.6),
    "T=1.0": dict(temperature=1.0),
    "T=1.5": dict(temperature=1.5),
    "top_k=3": dict(top_k=3),
    "top_p=0.9": dict(top_p=0.9),
    "min_p=0.2": dict(min_p=0.2),
    "repetition=1.3": dict(repetition_penalty=1.3),
    "presence=0.8,frequency=0.6": dict(presence_penalty=0.8, frequency_penalty=0.6),
    "logit_bias": dict(logit_bias={1: 2.0, 4: -1.5, 6: 1.0}),
    "allowed_token_ids": dict(allowed_token_ids=[0, 2, 3, 5, 6]),
    "combined:T0.8,top_k5,top_p0.9,min_p,pen": dict(
        temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
        presence_penalty=0.3, frequency_penalty=0.2, logit_bias={3: 1.0}),
    "combined:T1.5,allowed,rep1.3,min_tokens": dict(
        temperature=1.5, allowed_token_ids=[0, 1, 3, 4, 6], repetition_penalty=1.3,
        min_tokens=2, stop_token_ids=[4]),
}
EXTRA_REQ = {  # RequestSampling fields: eos banned by min_tokens, a two-token bad word
    "combined:T1.5,allowed,rep1.3,min_tokens": dict(eos_token_ids=(6,), bad_words_ids=((3, 1),))
}
# settings where processing changes the target, so a raw target must be caught
RAW_SETTINGS = ["T=0.6", "top_p=0.9", "repetition=1.3", "combined:T0.8,top_k5,top_p0.9,min_p,pen"]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_speculative_output_is_exact(name):
    _, p = run_setting(name, SamplingParams(**SETTINGS[name]), extra_req=EXTRA_REQ.get(name))
    assert p > ALPHA


@pytest.mark.parametrize(
    "name,extra", [("greedy", {}), ("greedy, rep 1.3", {"repetition_penalty": 1.3})]
)
def test_greedy_is_exactly_target_greedy(name, extra):
    params = SamplingParams(temperature=0.0, **extra)
    seqs, _ = run_setting(name, params, K=2)
    joint = exact_joint(params)
    assert joint.max() == 1.0  # greedy: one possible output ...
    expected = np.unravel_index(int(joint.argmax()), (V,) * L)
    assert (seqs == np.array(expected)).all()  # ... and every sequence is exactly it
    assert SIM_COUNTS["accepted"] < SIM_COUNTS["proposed"]  # the draft did disagree


def test_exact_with_k2_and_drafter_invariant_mode():
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2)
    assert run_setting("K=2 T0.8,top_p0.9,rep1.2", params, K=2)[1] > ALPHA
    assert run_setting("drafter-invariant T0.8,top_p0.9,rep1.2", params,
                       variant=Variant(drafter_invariant=True))[1] > ALPHA


def test_unprocessed_draft_is_still_exact():
    # Rejection sampling is exact for ANY proposal distribution q, as long as q is the one the
    # proposals were drawn from: a raw draft only costs acceptance.
    params = SamplingParams(**SETTINGS["combined:T0.8,top_k5,top_p0.9,min_p,pen"])
    variant = Variant(raw_draft=True)
    assert run_setting("raw draft (sampled and reported)", params, variant=variant)[1] > ALPHA


# ---- the check detects the known errors -------------------------------------------------------


@pytest.mark.parametrize("name", RAW_SETTINGS)
def test_raw_target_is_detected(name):
    params = SamplingParams(**SETTINGS[name], target_probs="raw")
    assert run_setting(f"BROKEN raw target, {name}", params)[1] < ALPHA


def test_draft_reporting_another_q_is_detected():
    params = SamplingParams(**SETTINGS["combined:T0.8,top_k5,top_p0.9,min_p,pen"])
    variant = Variant(reports_raw_q=True)
    name = "BROKEN draft samples processed, reports raw"
    assert run_setting(name, params, variant=variant)[1] < ALPHA


def _recover_from_p(original):
    def final(rows, s, k, q, p, seeds, positions):
        """Bug: the recovered token is drawn from p instead of norm(max(0, p - q))."""
        purpose = torch.where(s < k, int(Purpose.RECOVER), int(Purpose.BONUS))
        return inverse_cdf(p[rows, s], uniforms(seeds, positions + s, purpose))

    return final


def _bonus_from_q(original):
    def final(rows, s, k, q, p, seeds, positions):
        """Bug: the bonus token is drawn from the last draft distribution instead of p."""
        out = original(rows, s, k, q, p, seeds, positions)
        bonus = (s == k) & (k > 0)
        u = uniforms(seeds[bonus], positions[bonus] + s[bonus], Purpose.BONUS)
        out[bonus] = inverse_cdf(q[rows[bonus], k[bonus] - 1], u)
        return out

    return final


def _shared_uniform(original):
    def final(rows, s, k, q, p, seeds, positions):
        """Bug: a purpose collision; the recovery reuses the acceptance test's uniform."""
        p_s, recover = p[rows, s], s < k
        q_s = q[rows, s.clamp_max(q.shape[1] - 1)]
        dist = torch.where(recover[:, None], (p_s - q_s).clamp_min(0), p_s)
        purpose = torch.where(recover, int(Purpose.ACCEPT), int(Purpose.BONUS))
        return inverse_cdf(dist, uniforms(seeds, positions + s, purpose))

    return final


@pytest.mark.parametrize(
    "bug", [_recover_from_p, _bonus_from_q, _shared_uniform], ids=lambda f: f.__name__
)
def test_broken_sampler_is_detected(bug, monkeypatch):
    monkeypatch.setattr(rejection, "_final_token", bug(rejection._final_token))
    params = SamplingParams(temperature=1.0)
    assert run_setting(f"BROKEN sampler {bug.__name__[1:]}", params)[1] < ALPHA
