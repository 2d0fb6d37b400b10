"""Statistical proof of exactness: speculative generation == direct sampling from the target,
through the code the deployments run.

A 7-token vocabulary, a synthetic target whose logits depend on the history (a random table
indexed by position and last token; penalties and min_tokens add the rest of the history)
and a deliberately different draft, both served by fake runners (`TableRunner`: the
`ModelRunner.extend` contract over those tables). For each setting, N sequences of L = 3
tokens are generated round by round exactly as the Draft and Target deployments compute a
batch: `rounds.run_draft` proposes k tokens per sequence (processed q, randomness keyed by
seed and absolute position) and returns them packed, `rounds.run_target` scores the k + 1
positions (processed p, packed), and `rejection_sample` decides, one row per sequence, as
`Generation.accept` does (batched here: rows are independent). The joint frequencies of the
343 possible outputs are compared by a chi-square test with the exact joint distribution of
direct sampling from the processed target (enumerated). Every seed is fixed, so the outcome
is deterministic.

`tests/test_mutations.py` applies known bugs to this code path (the seed's raw target, a
draft reporting another q, wrong histories, a broken residual, bonus or accept rule) and
asserts that this test reports each; the section at the end runs the same test through
`LocalEngine` on a tiny model (`Generation.accept`, the real runners).

Longer than 300 lines because the table runners, the chi-square machinery and the
settings it drives through the serving rounds belong together.
"""

from __future__ import annotations

import gc
import zlib
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from scipy import stats

import specdec.rounds as rounds
from specdec.packing import PackedProbs, unpack_probs
from specdec.params import SamplingParams
from specdec.processing import RequestSampling, Row, process_logits
from specdec.rejection import rejection_sample
from specdec.rounds import DraftCall, ScoreCall

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


class TableRunner:
    """A fake `ModelRunner` over a table: `extend` returns, for each (request_id, token_ids,
    num_logits), the logits [num_logits, V] at the last num_logits positions of token_ids
    (prompt = PROMPT), which depend on the output position and the token there."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def extend(self, items):
        if all(n == 1 for _, _, n in items):  # draft steps: one position each
            pos = [len(t) - len(PROMPT) for _, t, _ in items]
            last = [t[-1] for _, t, _ in items]
            return self.table[pos, last].unsqueeze(1).unbind(0)
        pos, last, counts = [], [], []
        for _, token_ids, num_logits in items:
            n = len(token_ids)
            pos += range(n - num_logits + 1 - len(PROMPT), n + 1 - len(PROMPT))
            last += token_ids[n - num_logits :]
            counts.append(num_logits)
        return list(torch.split(self.table[pos, last], counts))

    def release(self, request_id) -> None:
        pass


DRAFT_RUNNER, TARGET_RUNNER = TableRunner(DRAFT_TABLE), TableRunner(TARGET_TABLE)


# ---- simulation through run_draft / run_target ------------------------------------------------


def _unpack_all(packs: list[PackedProbs | None], width: int) -> torch.Tensor:
    """[n, width, V]: pack i unpacked into rows 0..r_i - 1 (zeros after), as `unpack_probs`
    would give it, grouped so that 100k packs take a few numpy calls."""
    out = torch.zeros(len(packs), width, V)
    groups: dict[tuple, list[int]] = {}
    for i, pk in enumerate(packs):
        if pk is not None:
            key = ("d", pk.shape[0]) if pk.dense is not None else ("s",) + pk.values.shape
            groups.setdefault(key, []).append(i)
    for key, idx in groups.items():
        r, at = key[1], torch.tensor(idx)
        if key[0] == "d":
            out[at, :r] = torch.from_numpy(np.stack([packs[i].dense for i in idx]))
        else:
            ind = torch.from_numpy(np.stack([packs[i].indices for i in idx])).long()
            val = torch.from_numpy(np.stack([packs[i].values for i in idx]))
            out[at, :r] = torch.zeros(len(idx), r, V).scatter_(2, ind, val)
    for i in range(0, len(packs), max(1, len(packs) // 3)):  # spot checks against the real one
        if packs[i] is not None:
            assert torch.equal(out[i, : packs[i].shape[0]], unpack_probs(packs[i]))
    return out


@contextmanager
def _no_gc():
    """The simulations allocate millions of small objects that all stay alive until the
    end: the cyclic garbage collector's passes over them cost half the time, for nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def simulate(params: SamplingParams, K: int, seed_base: int, extra_req=None, draft_params=None,
             n: int = N):
    with _no_gc():
        return _simulate(params, K, seed_base, extra_req, draft_params, n)


def _simulate(params: SamplingParams, K: int, seed_base: int, extra_req, draft_params, n: int):
    """N sequences of L tokens by speculative decoding through `rounds.run_draft` and
    `rounds.run_target`; returns them as [N, L] ints. `draft_params`: the draft processes
    with other parameters than the request's (exact all the same: any q is)."""
    req = RequestSampling(params, PROMPT, **(extra_req or {}))
    draft_req = req if draft_params is None else RequestSampling(draft_params, PROMPT)
    invariant = params.gumbel_coupled
    seeds = torch.arange(n, dtype=torch.int64) + seed_base
    seed_list = seeds.tolist()
    counts = SIM_COUNTS
    counts.update(proposed=0, accepted=0)
    out: list[list[int]] = [[] for _ in range(n)]
    prompt = list(PROMPT)
    while True:
        active = [b for b in range(n) if len(out[b]) < L]
        if not active:
            break
        # k_b cycles through 1..K over the rows, so bonus tokens fall inside the kept L
        # tokens, and rows of one round are padded differently; none past position L - 1
        ks = [min(1 + b % K, L - len(out[b])) for b in active]
        drafts = rounds.run_draft(DRAFT_RUNNER, [
            DraftCall(f"r{b}", prompt + out[b], k, draft_req, seed_list[b])
            for b, k in zip(active, ks)
        ])
        # The target is a pure function of (token list, number of proposals): its rows are
        # bitwise independent of the batch (tests/test_processing.py). One call per distinct
        # pair, shared by the sequences that hold it.
        unique: dict[tuple, int] = {}
        which = torch.tensor([
            unique.setdefault((tuple(out[b]), tuple(d.tokens)), len(unique))
            for b, d in zip(active, drafts)
        ])
        scores = rounds.run_target(TARGET_RUNNER, [
            ScoreCall(f"u{j}", prompt + list(o) + list(x), len(x), req)
            for j, (o, x) in enumerate(unique)
        ])
        props = np.full((len(active), K), -1, dtype=np.int64)
        for j, d in enumerate(drafts):
            props[j, : len(d.tokens)] = d.tokens
        k = torch.tensor(ks)
        q = None if invariant else _unpack_all([d.probs for d in drafts], K)
        p = _unpack_all([s.probs for s in scores], K + 1)[which]
        idx = torch.tensor(active)
        res = rejection_sample(torch.from_numpy(props), k, q, p, seeds[idx],
                               torch.tensor([len(out[b]) for b in active]),
                               torch.full((len(active),), invariant))
        counts["proposed"] += int(k.sum())
        counts["accepted"] += int(res.num_accepted.sum())
        for b, tokens in zip(active, res.tokens):
            out[b] += tokens[: L - len(out[b])]
    return np.array(out, dtype=np.int64)


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


def run_setting(name, params, K=3, extra_req=None, draft_params=None, seed_name=None, n=N):
    """Simulate and test one setting; `seed_name` reuses another setting's seeds (shared
    samples: a mutant run then differs from the clean run only by the mutation)."""
    seed_base = zlib.crc32((seed_name or name).encode()) * 1_000_003
    seqs = simulate(params, K, seed_base, extra_req, draft_params, n)
    chi2, dof, p, impossible = chi_square(seqs, exact_joint(params, extra_req))
    acc = SIM_COUNTS["accepted"] / max(SIM_COUNTS["proposed"], 1)
    RESULTS.append((name, chi2, dof, p, acc, impossible))
    print(f"\n{name:<40} K={K} N={n}: chi2={chi2:.1f} dof={dof} p={p:.3g} "
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
RAW_SETTINGS = ["combined:T0.8,top_k5,top_p0.9,min_p,pen"]


_CLEAN: dict[str, float] = {}  # setting -> p of its clean run (shared with the mutation tests)


def clean_p(name: str) -> float:
    """p of setting `name` on the correct code (computed once per session)."""
    if name not in _CLEAN:
        params = SamplingParams(**SETTINGS[name])
        _CLEAN[name] = run_setting(name, params, extra_req=EXTRA_REQ.get(name))[1]
    return _CLEAN[name]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_speculative_output_is_exact(name):
    assert clean_p(name) > ALPHA


@pytest.mark.parametrize(
    "name,extra", [("greedy", {}), ("greedy, rep 1.3", {"repetition_penalty": 1.3})]
)
def test_greedy_is_exactly_target_greedy(name, extra):
    params = SamplingParams(temperature=0.0, **extra)
    seqs, _ = run_setting(name, params, K=2, n=N // 10)  # each sequence is checked exactly
    joint = exact_joint(params)
    assert joint.max() == 1.0  # greedy: one possible output ...
    expected = np.unravel_index(int(joint.argmax()), (V,) * L)
    assert (seqs == np.array(expected)).all()  # ... and every sequence is exactly it
    assert SIM_COUNTS["accepted"] < SIM_COUNTS["proposed"]  # the draft did disagree


def test_exact_with_k2_and_drafter_invariant_mode():
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2)
    assert run_setting("K=2 T0.8,top_p0.9,rep1.2", params, K=2)[1] > ALPHA
    invariant = params.model_copy(update={"drafter_invariant": True})
    assert run_setting("drafter-invariant T0.8,top_p0.9,rep1.2", invariant)[1] > ALPHA


def test_draft_with_other_processing_is_still_exact():
    # Rejection sampling is exact for ANY proposal distribution q, as long as q is the one the
    # proposals were drawn from: a draft that ignores the request's parameters (raw softmax)
    # only costs acceptance.
    params = SamplingParams(**SETTINGS["combined:T0.8,top_k5,top_p0.9,min_p,pen"])
    name = "raw draft (sampled and reported)"
    assert run_setting(name, params, draft_params=SamplingParams())[1] > ALPHA


# ---- the check detects the known errors (more in test_mutations.py) ---------------------------


@pytest.mark.parametrize("name", RAW_SETTINGS)
def test_raw_target_is_detected(name):
    # target_probs="raw": the seed's bug, kept as a request option for the benchmark
    params = SamplingParams(**SETTINGS[name], target_probs="raw")
    # impossible outputs by the thousand: a tenth of the sample is plenty
    assert run_setting(f"BROKEN raw target, {name}", params, seed_name=name, n=N // 10)[1] < ALPHA


# ---- the same test through LocalEngine on a tiny model ----------------------------------------
# The whole request path: admission, `Generation.plan_k` / `accept` (unpack, rejection sample,
# commit), `LocalEngine.step` batching run_draft / run_target, and the real `ModelRunner`
# (its KV cache keeps accepted tokens and drops rejected ones) over a tiny random Qwen2 pair
# (specdec.tiny) whose vocabulary is cut to V = 8 tokens, so that the exact joint of L = 3
# tokens (512 outputs) can be enumerated from the target's own logits. The settings' requests
# share the same engine batches (mixed parameters). The real forward costs far more than the
# tables, so N is smaller here (400 per setting; 1500 on the two settings where
# test_mutations checks the draft's reported q and the target's history through the engine):
# this checks the path end to end, the table runners above carry the 100k-sample power.

ENGINE_V = 8
ENGINE_N = 400  # sequences per setting
# more for the settings on which test_mutations checks two subtler bugs through the engine
ENGINE_N_MUTATED = {"combined:T0.8,top_k5,top_p0.9,min_p,pen": 1500,
                    "presence=0.8,frequency=0.6": 1500}


def engine_n(name: str) -> int:
    return ENGINE_N_MUTATED.get(name, ENGINE_N)
ENGINE_PROMPT = [1, 2, 3, 4]
ENGINE_EOS = 6  # banned until min_tokens (ignore_eos: never a stop)


def _engine_setting(name: str) -> dict:
    """SETTINGS[name] for the engine: stop tokens would end sequences early, so none."""
    params = {k: v for k, v in SETTINGS[name].items() if k != "stop_token_ids"}
    return dict(params, ignore_eos=True, max_tokens=L)


_SMALL: dict = {}  # the pair and engine, shared by every module that asks (made once)


def small_pair_dirs(tmp_path_factory, tokenizer_dir):
    """(draft_dir, target_dir): a tiny target with an 8-token vocabulary (the real
    tokenizer) and a noisy copy of it as the draft."""
    if "pair" not in _SMALL:
        import json

        from transformers import AutoTokenizer

        from specdec.tiny import make_tiny_draft, make_tiny_model

        root = tmp_path_factory.mktemp("small-vocab")
        tok = root / "tokenizer"
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(tok))
        (tok / "config.json").write_text(json.dumps({"vocab_size": ENGINE_V}))
        target = make_tiny_model(root / "target", tok, seed=3, logit_std=1.5)
        _SMALL["pair"] = make_tiny_draft(root / "draft", target, noise=0.6, seed=4), target
    return _SMALL["pair"]


def _small_engine(pair, batch_invariant: bool, proposal_vocab: int | None = None):
    from specdec.local import LocalEngine

    engine = LocalEngine(*pair, num_speculative_tokens=3, dtype="float32",
                         batch_invariant=batch_invariant, proposal_vocab=proposal_vocab)
    engine.info.eos_token_ids = (ENGINE_EOS,)  # the tokenizer's own EOS is outside V
    return engine


def small_engine_for(tmp_path_factory, tokenizer_dir):
    """LocalEngine over the small pair (float32, standard kernels)."""
    if "engine" not in _SMALL:
        _SMALL["engine"] = _small_engine(small_pair_dirs(tmp_path_factory, tokenizer_dir), False)
    return _SMALL["engine"]


@pytest.fixture
def small_pair(tmp_path_factory, tokenizer_dir):
    return small_pair_dirs(tmp_path_factory, tokenizer_dir)


@pytest.fixture
def small_engine(tmp_path_factory, tokenizer_dir):
    return small_engine_for(tmp_path_factory, tokenizer_dir)


def engine_exact_joint(engine, params: SamplingParams) -> np.ndarray:
    """P(x1, x2, x3) of direct sampling from the processed target (the engine's runner)."""
    req = RequestSampling(params, tuple(ENGINE_PROMPT), eos_token_ids=(ENGINE_EOS,))
    joint = np.ones(1)
    for t in range(L):
        prefixes = [tuple(int(d) for d in np.unravel_index(j, (ENGINE_V,) * t))
                    for j in range(ENGINE_V**t)]
        items = [(f"exact-{t}-{j}", ENGINE_PROMPT + list(h), 1) for j, h in enumerate(prefixes)]
        logits = torch.cat(engine.target.extend(items))
        for rid, _, _ in items:
            engine.target.release(rid)
        probs = process_logits(logits, [Row(req, h) for h in prefixes]).probs
        joint = (joint[:, None] * probs.double().numpy()).reshape(-1)
    return joint / joint.sum()


def engine_chi_square(seqs: np.ndarray, joint: np.ndarray):
    global V
    saved, V = V, ENGINE_V  # chi_square reads the module's V
    try:
        return chi_square(seqs, joint)
    finally:
        V = saved


def run_engine(engine, settings: dict[str, dict], tag: str = "") -> dict[str, float]:
    """engine_n(name) seeded requests per setting, all settings interleaved in the same
    batches; returns each setting's chi-square p-value."""
    names = list(settings)
    counts = {name: engine_n(name) for name in names}
    order = [name for i in range(max(counts.values())) for name in names if i < counts[name]]
    seen = dict.fromkeys(names, 0)
    requests = []
    for name in order:
        seed = zlib.crc32(name.encode()) * 7919 + seen[name]
        seen[name] += 1
        requests.append({"prompt_token_ids": ENGINE_PROMPT,
                         "sampling_params": dict(settings[name], seed=seed)})
    with _no_gc():
        results = engine.generate(requests, batch_size=1024)
    out = {}
    for name in names:
        mine = [r for r, n in zip(results, order) if n == name]
        seqs = np.array([r.token_ids for r in mine], dtype=np.int64)
        assert seqs.shape == (counts[name], L)
        params = SamplingParams(**settings[name])
        chi2, dof, p, impossible = engine_chi_square(seqs, engine_exact_joint(engine, params))
        proposed = sum(r.speculation.proposed for r in mine)
        acc = sum(r.speculation.accepted for r in mine) / max(proposed, 1)
        label = f"LocalEngine {tag}{name}"
        RESULTS.append((label, chi2, dof, p, acc, impossible))
        print(f"\n{label:<52} N={counts[name]}: chi2={chi2:.1f} dof={dof} p={p:.3g} "
              f"acceptance={acc:.3f} impossible outputs={impossible}")
        out[name] = p
    return out


ENGINE_SETTINGS = {name: _engine_setting(name) for name in SETTINGS}
ENGINE_SETTINGS["drafter-invariant T0.8,top_p0.9,rep1.2"] = dict(
    temperature=0.8, top_p=0.9, repetition_penalty=1.2, drafter_invariant=True,
    ignore_eos=True, max_tokens=L)
_ENGINE_P: dict[str, float] = {}


def engine_clean_p(engine) -> dict[str, float]:
    if not _ENGINE_P:
        _ENGINE_P.update(run_engine(engine, ENGINE_SETTINGS))
    return _ENGINE_P


def test_local_engine_output_is_exact_in_every_setting(small_engine):
    ps = engine_clean_p(small_engine)
    assert min(ps.values()) > ALPHA, ps


def test_local_engine_greedy_equals_target_greedy(small_engine):
    params = dict(temperature=0, repetition_penalty=1.3, ignore_eos=True, max_tokens=L)
    joint = engine_exact_joint(small_engine, SamplingParams(**params))
    expected = list(np.unravel_index(int(joint.argmax()), (ENGINE_V,) * L))
    results = small_engine.generate([
        {"prompt_token_ids": ENGINE_PROMPT, "sampling_params": dict(params, seed=s)}
        for s in range(32)
    ])
    assert all(r.token_ids == expected for r in results)


# A draft whose vocabulary head keeps 4 of the 8 tokens (`proposal_vocab`): q = 0 on the
# others, so the target's mass there comes only from the residual after a rejection; and a
# request whose allowed tokens all lie outside the head still gets a proposal distribution.
PRUNED_SETTINGS = {name: ENGINE_SETTINGS[name] for name in
                   ("T=1.0", "top_p=0.9", "combined:T1.5,allowed,rep1.3,min_tokens")}
PRUNED_SETTINGS["allowed outside the head"] = dict(allowed_token_ids=[4, 5, 7], ignore_eos=True,
                                                   max_tokens=L)
_PRUNED: dict = {}


def pruned_engine(pair):
    if "engine" not in _PRUNED:
        _PRUNED["engine"] = _small_engine(pair, batch_invariant=False, proposal_vocab=4)
    return _PRUNED["engine"]


def test_draft_with_a_pruned_vocabulary_is_exact(small_pair):
    engine = pruned_engine(small_pair)
    assert engine.draft.proposal_vocab == 4  # ids 0..3: the tokenizer's specials lie above V
    ps = run_engine(engine, PRUNED_SETTINGS, tag="draft vocabulary 4/8, ")
    assert min(ps.values()) > ALPHA, ps


def test_one_sampler_with_and_without_speculation(small_pair):
    # A drafter-invariant request gives the same text at any K, and the same text as the
    # request at num_speculative_tokens 0 in either mode: one sampler (Gumbel-max keyed by
    # seed and position) for target-only and drafter-invariant decoding. batch_invariant:
    # a position's logits are the same in a verify, a decode or a prefill.
    engine = _small_engine(small_pair, batch_invariant=True)
    base = dict(temperature=0.9, top_p=0.95, repetition_penalty=1.1, ignore_eos=True,
                max_tokens=12)
    variants = [dict(drafter_invariant=True, num_speculative_tokens=k) for k in (0, 2, 5)]
    variants.append(dict(num_speculative_tokens=0))  # standard mode, target-only
    seeds = range(100, 110)
    texts = [
        [r.token_ids for r in engine.generate([
            {"prompt_token_ids": ENGINE_PROMPT, "sampling_params": dict(base, seed=s, **v)}
            for s in seeds])]
        for v in variants
    ]
    for other in texts[1:]:
        assert other == texts[0]
    assert len({tuple(t) for t in texts[0]}) == len(seeds)  # the seeds do steer the text
