"""Mutation controls: the statistical exactness test must fail on known bugs.

Each mutant is one line of the serving code (`specdec.rounds`, `specdec.rejection`,
`specdec.processing`) replaced by a wrong one: the function's source is rewritten, compiled
in its module's namespace and monkeypatched in (into every module that imported it by name),
so the code under test is the code the deployments run but for that line. Each test then
runs test_exactness's chi-square test through `run_draft` / `run_target` with the mutant,
on the same seeds as the setting's clean run (shared samples), and asserts that it reports
a failure (p < ALPHA) while the clean run passes (p > ALPHA). A passing test here means the
statistical test can fail: CI proves it on every run.

Self-check: ``SPECDEC_MUTANTS_OFF=1`` leaves the code unmutated; every test below must then
fail (the statistical test passes on correct code, so "mutation detected" is false).
"""

from __future__ import annotations

import inspect
import os
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch

import specdec.processing as processing
import specdec.rejection as rejection
import specdec.rounds as rounds
from specdec.params import SamplingParams
from test_exactness import ALPHA, EXTRA_REQ, SETTINGS, clean_p, run_setting

MUTANTS_OFF = os.environ.get("SPECDEC_MUTANTS_OFF") == "1"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: a second thread only adds sync cost
    yield
    torch.set_num_threads(threads)


def mutate(monkeypatch, module, name: str, original: str, replacement: str) -> None:
    """Patch module.name with a copy whose source has `original` (which must occur exactly
    once) replaced by `replacement`."""
    func = getattr(module, name)
    source = textwrap.dedent(inspect.getsource(func))
    assert source.count(original) == 1, (
        f"mutation site not found once in {module.__name__}.{name}: {original!r} "
        "(the code changed: update the mutant to the new line)")
    namespace = dict(vars(module))
    code = compile(source.replace(original, replacement), f"<mutant {module.__name__}.{name}>",
                   "exec")
    exec(code, namespace)
    if MUTANTS_OFF:
        return
    for mod in list(sys.modules.values()):  # every `from module import name` binding too
        if getattr(mod, name, None) is func:
            monkeypatch.setattr(mod, name, namespace[name])


@dataclass(frozen=True)
class Mutant:
    name: str
    module: object
    function: str
    original: str
    replacement: str
    setting: str  # the SETTINGS entry whose test must catch it


COMBINED = "combined:T0.8,top_k5,top_p0.9,min_p,pen"
PENALTIES = "presence=0.8,frequency=0.6"

MUTANTS = [
    # The seed's bug, in the serving path: the target verifies with raw softmax(logits).
    Mutant("target_raw_in_run_target", rounds, "run_target",
           "process_logits(torch.cat(logits), rows, raw=raw)",
           "process_logits(torch.cat(logits), rows, raw=True)", COMBINED),
    # The draft samples from the processed q but reports the raw q.
    Mutant("draft_reports_raw_q", rounds, "run_draft",
           "q_rows[offsets[idx[keep]] + step] = probs[keep]",
           "q_rows[offsets[idx[keep]] + step] = torch.softmax(logits.float(), 1)[keep]",
           COMBINED),
    # The target's penalty history ignores the proposals before each position.
    Mutant("target_history_ignores_proposals", rounds, "run_target",
           "rows += speculative_rows(c.sampling, output_ids, c.token_ids[committed:])",
           "rows += [Row(c.sampling, output_ids)] * (c.num_proposals + 1)", PENALTIES),
    # A wrong penalty history: row i also sees proposal i, the token it scores.
    Mutant("target_history_off_by_one", processing, "speculative_rows",
           "Row(request, base + props[:i])", "Row(request, base + props[: i + 1])", PENALTIES),
    # The token after a rejection is drawn from p instead of norm(max(0, p - q)).
    Mutant("residual_is_p", rejection, "_final_token",
           "residual = dist.index_select(0, rec).sub_(_rows_at(q, rows[rec], s[rec])).clamp_min_(0)",
           "residual = dist.index_select(0, rec)", "T=1.0"),
    # The bonus token (all k accepted) is drawn from p at the last proposal, not at k.
    Mutant("bonus_from_wrong_position", rejection, "_final_token",
           "dist = _rows_at(p, rows, s).to(torch.float32)",
           "dist = _rows_at(p, rows, torch.where(s < k, s, (s - 1).clamp_min(0))).to(torch.float32)",
           "T=1.0"),
    # Accept slightly too often: u * q(x) <= 1.02 * p(x).
    Mutant("accept_threshold_x1.02", rejection, "_standard_accept",
           "return (u * qx <= px) & (px > 0)", "return (u * qx <= 1.02 * px) & (px > 0)",
           "top_p=0.9"),
    # The bonus token is drawn from the last draft distribution instead of p.
    Mutant("bonus_from_q", rejection, "_final_token",
           "dist = _rows_at(p, rows, s).to(torch.float32)",
           "dist = torch.where((s < k)[:, None], _rows_at(p, rows, s), "
           "_rows_at(q, rows, (k - 1).clamp_min(0))).to(torch.float32)", "T=1.0"),
    # A purpose collision: the recovered token reuses the acceptance test's uniform.
    Mutant("recover_reuses_accept_uniform", rejection, "_final_token",
           "torch.where(s < k, int(Purpose.RECOVER), int(Purpose.BONUS))",
           "torch.where(s < k, int(Purpose.ACCEPT), int(Purpose.BONUS))", "T=1.0"),
]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_mutant_is_detected(mutant: Mutant, monkeypatch):
    assert clean_p(mutant.setting) > ALPHA  # the same test passes on the correct code
    mutate(monkeypatch, mutant.module, mutant.function, mutant.original, mutant.replacement)
    params = SamplingParams(**SETTINGS[mutant.setting])
    _, p = run_setting(f"MUTANT {mutant.name} ({mutant.setting})", params,
                       extra_req=EXTRA_REQ.get(mutant.setting), seed_name=mutant.setting)
    assert p < ALPHA, f"mutation not detected: p = {p:.3g} on {mutant.setting}"


# ---- the three bugs of the serving path, through LocalEngine on the tiny model -----------------
# (on shared seeds with the clean engine run; N = test_exactness.engine_n(setting))

from test_exactness import (  # noqa: E402
    ENGINE_SETTINGS, engine_clean_p, run_engine, small_engine_for)


@pytest.fixture
def small_engine(tmp_path_factory, tokenizer_dir):
    return small_engine_for(tmp_path_factory, tokenizer_dir)  # the one test_exactness uses


@pytest.fixture
def small_pair(tmp_path_factory, tokenizer_dir):
    from test_exactness import small_pair_dirs

    return small_pair_dirs(tmp_path_factory, tokenizer_dir)

ENGINE_MUTANTS = [m for m in MUTANTS if m.module is rounds]


@pytest.mark.parametrize("mutant", ENGINE_MUTANTS, ids=lambda m: m.name)
def test_mutant_is_detected_through_local_engine(mutant: Mutant, monkeypatch, small_engine):
    assert engine_clean_p(small_engine)[mutant.setting] > ALPHA
    mutate(monkeypatch, mutant.module, mutant.function, mutant.original, mutant.replacement)
    p = run_engine(small_engine, {mutant.setting: ENGINE_SETTINGS[mutant.setting]},
                   tag=f"MUTANT {mutant.name} ")[mutant.setting]
    assert p < ALPHA, f"mutation not detected through LocalEngine: p = {p:.3g}"


def test_a_wrong_residual_is_detected_with_a_pruned_draft(monkeypatch, small_pair):
    """The pruned-vocabulary exactness test can fail: with q = 0 on half the vocabulary, a
    residual drawn from p instead of max(0, p - q) shows."""
    from test_exactness import PRUNED_SETTINGS, pruned_engine

    engine = pruned_engine(small_pair)
    mutant = next(m for m in MUTANTS if m.name == "residual_is_p")
    mutate(monkeypatch, mutant.module, mutant.function, mutant.original, mutant.replacement)
    p = run_engine(engine, {"T=1.0": PRUNED_SETTINGS["T=1.0"]}, tag="MUTANT residual_is_p, pruned draft ")["T=1.0"]
    assert p < ALPHA, f"mutation not detected with a pruned draft: p = {p:.3g}"
