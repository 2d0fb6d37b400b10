"""The request loop in-process (LocalEngine: the deployments' batched rounds without Ray),
on the tiny random-weight pair in float32."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from scipy import stats
from transformers import AutoModelForCausalLM

from specdec.errors import ContextLengthError, RequestError
from specdec.local import LocalEngine
from specdec.processing import RequestSampling, Row, process_logits

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def engine(tiny_pair):
    draft_dir, target_dir = tiny_pair
    return LocalEngine(draft_dir, target_dir, num_speculative_tokens=3, dtype="float32")


def run(engine, **params):
    prompt = params.pop("prompt", PROMPT)
    return engine.generate([{"prompt": prompt, "sampling_params": params}])[0]


def test_greedy_equals_target_only_and_transformers(engine, tiny_pair):
    speculative = run(engine, temperature=0, max_tokens=24, ignore_eos=True)
    target_only = run(engine, temperature=0, max_tokens=24, ignore_eos=True, num_speculative_tokens=0)
    assert speculative.token_ids == target_only.token_ids
    assert speculative.speculation.proposed > 0

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1], dtype=torch.float32)
    ids = engine.info.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    reference = model.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert speculative.token_ids == reference[0, ids.shape[1] :].tolist()


def test_seeded_output_is_reproducible_and_batch_independent(engine):
    params = dict(temperature=0.8, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = run(engine, **params)
    again = run(engine, **params)
    others = [
        {"prompt": "x" * (i + 1), "sampling_params": {"temperature": 1.0, "max_tokens": 5 + i}}
        for i in range(8)
    ]
    crowded = engine.generate(others[:4] + [{"prompt": PROMPT, "sampling_params": params}] + others[4:])
    assert alone.token_ids == again.token_ids == crowded[4].token_ids
    assert alone.seed == 1234


def test_effective_seed_reproduces_an_unseeded_request(engine):
    first = run(engine, temperature=1.0, max_tokens=12, ignore_eos=True)
    replay = run(engine, temperature=1.0, max_tokens=12, ignore_eos=True, seed=first.seed)
    assert replay.token_ids == first.token_ids


def test_an_unset_mode_follows_the_deployment_default(engine):
    """A request that leaves drafter_invariant unset gets the deployment's mode: under a
    drafter-invariant default its seeded text is its target-only text at any K; under the
    standard default, or asked for explicitly, the same seeds give other texts."""
    from dataclasses import replace

    from specdec.api_types import GenerateRequest
    from specdec.generation import Generation

    def texts(info, k, **extra):
        engine.info = info
        reqs = [{"prompt": PROMPT, "sampling_params": dict(
            temperature=1.0, seed=s, max_tokens=12, ignore_eos=True, num_speculative_tokens=k,
            **extra)} for s in range(6)]
        return [r.token_ids for r in engine.generate(reqs)]

    standard_default = engine.info
    invariant_default = replace(standard_default, default_drafter_invariant=True)
    try:
        admitted = Generation.admit(GenerateRequest.model_validate({"prompt": PROMPT}), invariant_default)
        assert admitted.params.drafter_invariant is True
        target_only = texts(invariant_default, 0)
        assert texts(invariant_default, 3) == target_only
        assert texts(invariant_default, 3, drafter_invariant=False) != target_only
        assert texts(standard_default, 3) != target_only
        assert texts(standard_default, 3, drafter_invariant=True) == target_only
    finally:
        engine.info = standard_default


def test_max_tokens_and_stop_conditions(engine):
    base = run(engine, temperature=0, max_tokens=20, ignore_eos=True)
    assert base.finish_reason == "length" and len(base.token_ids) == 20

    # stop_token_ids: ends at the first occurrence; the token id stays, its text does not.
    stop_token = base.token_ids[5]
    first = base.token_ids.index(stop_token)
    stopped = run(engine, temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token])
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_token
    assert stopped.token_ids == base.token_ids[: first + 1]
    assert stopped.text == engine.info.tokenizer.decode(base.token_ids[:first], skip_special_tokens=True)

    # A stop string: nothing past it, and it is included only when asked.
    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 3]
    cut = base.text.index(stop)
    by_string = run(engine, temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", stop)
    assert by_string.text == base.text[:cut]
    kept = run(engine, temperature=0, max_tokens=20, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    assert kept.text == base.text[: cut + len(stop)]


def test_min_tokens_holds_back_stop_tokens_and_eos(engine):
    base = run(engine, temperature=0, max_tokens=12, ignore_eos=True)
    stop_token = base.token_ids[0]
    early = run(engine, temperature=0, max_tokens=12, stop_token_ids=[stop_token])
    assert len(early.token_ids) == 1
    held = run(engine, temperature=0, max_tokens=12, stop_token_ids=[stop_token], min_tokens=6)
    assert len(held.token_ids) >= 6
    assert stop_token not in held.token_ids[:5]


def test_eos_ends_with_stop(engine):
    eos = engine.info.eos_token_ids[0]
    # Bias EOS up so it is the greedy choice at once.
    out = run(engine, temperature=0, max_tokens=10, logit_bias={eos: 100.0})
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""
    ignored = run(engine, temperature=0, max_tokens=4, logit_bias={eos: 100.0}, ignore_eos=True)
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 4


def test_bad_input_is_refused_clearly(engine):
    with pytest.raises(ContextLengthError, match="maximum context length"):
        run(engine, prompt="word " * 10, max_tokens=engine.info.max_context)
    with pytest.raises(ValidationError, match="top_p"):
        run(engine, top_p=1.5)
    with pytest.raises(RequestError, match="allowed_token_ids"):
        run(engine, allowed_token_ids=[engine.info.vocab_size + 5])


def exact_target_distribution(engine, prompt_ids, params, allowed):
    """P(x1, x2) of direct sampling from the processed target, by enumeration."""
    sampling = RequestSampling(params=params, prompt_ids=tuple(prompt_ids))
    logits = engine.target.extend([("exact", list(prompt_ids), 1)])[0]
    p1 = process_logits(logits, [Row(sampling, [])]).probs[0]
    items = [(f"exact{a}", list(prompt_ids) + [a], 1) for a in allowed]
    second = torch.cat(engine.target.extend(items))
    p2 = process_logits(second, [Row(sampling, [a]) for a in allowed]).probs
    for a in allowed:
        engine.target.release(f"exact{a}")
    engine.target.release("exact")
    return {(a, b): float(p1[a] * p2[i, b]) for i, a in enumerate(allowed) for b in allowed}


@pytest.fixture(scope="module")
def small_vocab_engine(tmp_path_factory, tokenizer_dir):
    """A tiny pair over the first 64 token ids (the real tokenizer decodes them), so that
    thousands of requests cost little."""
    import json
    import shutil

    from specdec.tiny import make_tiny_draft, make_tiny_model

    root = tmp_path_factory.mktemp("small_vocab")
    tokenizer = shutil.copytree(tokenizer_dir, root / "tokenizer")
    config = json.loads((tokenizer / "config.json").read_text()) | {"vocab_size": 64}
    (tokenizer / "config.json").write_text(json.dumps(config))
    target = make_tiny_model(root / "target", tokenizer, seed=3)
    draft = make_tiny_draft(root / "draft", target, noise=0.3, seed=4)
    engine = LocalEngine(draft, target, num_speculative_tokens=2, dtype="float32")
    engine.info.eos_token_ids = ()  # the real EOS ids lie outside this vocabulary
    return engine


@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_speculative_token_frequencies_match_target(small_vocab_engine, mode):
    """6,000 two-token samples through the deployments' batched rounds vs the exact target
    distribution; the pre-PR-10198 "raw" target must be caught."""
    engine = small_vocab_engine
    allowed = [15, 16, 17, 18, 19]  # a few tokens keep the enumeration cheap
    params = dict(temperature=0.6, top_p=0.9, repetition_penalty=1.3, allowed_token_ids=allowed,
                  max_tokens=2, ignore_eos=True, num_speculative_tokens=2, target_probs=mode)
    prompt_ids = [5, 9, 23, 42]  # inside the 64-token vocabulary
    requests = [{"prompt_token_ids": prompt_ids, "sampling_params": params | {"seed": s}} for s in range(6_000)]
    results = engine.generate(requests, batch_size=512)
    counts = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1

    from specdec.params import SamplingParams

    truth = exact_target_distribution(engine, prompt_ids, SamplingParams(**params), allowed)
    cells = [c for c in itertools.product(allowed, allowed) if truth[c] * len(results) >= 5]
    observed = np.array([counts.get(c, 0) for c in cells] + [len(results) - sum(counts.get(c, 0) for c in cells)])
    expected = np.array([truth[c] * len(results) for c in cells] + [len(results) * (1 - sum(truth[c] for c in cells))])
    keep = expected > 0
    chi2, p_value = stats.chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum())
    print(f"mode={mode} chi2={chi2:.1f} cells={keep.sum()} p={p_value:.3g}")
    # total variation distance: also defined where the raw samples leave chi-square degenerate
    # (all of them outside the cells a peaked processed target puts its mass on)
    tv = 0.5 * np.abs(observed / observed.sum() - expected / expected.sum()).sum()
    print(f"mode={mode} total variation {tv:.3f}")
    if mode == "processed":
        assert p_value > 1e-4 and tv < 0.05
    else:
        assert tv > 0.1
