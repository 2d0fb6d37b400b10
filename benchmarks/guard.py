"""The guard against fast-but-wrong: speculative output must be distributed as target-only.

A speculative decoder that is fast because it is wrong (the seed's bug: a raw target
distribution, or draft probabilities that are not the ones the proposals were drawn from)
shows up as a difference in the *distribution* of the emitted tokens, which acceptance and
throughput numbers never reveal. On a sample, the guard:

1. samples n sequences of a few tokens with target-only decoding (K = 0) and n with
   speculative decoding (K = k), on one prompt, with disjoint seeds, every token restricted
   with ``allowed_token_ids`` to a small set (digits), so per-position frequencies are
   informative with a few hundred samples;
2. at every output position, tests the two samples' token frequencies for homogeneity
   (chi-square), and at position 0 also tests the speculative sample against the exact
   processed target distribution (returned as ``logprobs`` by a target-only request);
3. flags a mismatch when a Bonferroni-corrected p-value falls below ``alpha``.

The as-is (raw target) arm is run the same way as a positive control: the guard must flag it,
or it has no power on this setting. Greedy exactness (speculative text == target-only text)
is checked separately on the main sweep's outputs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from benchmarks.stats import goodness_of_fit, two_sample_chi2

END = "<end>"  # the sequence had already stopped at this position


def _position_counts(outputs, length: int) -> list[Counter]:
    counts = [Counter() for _ in range(length)]
    for out in outputs:
        pieces = out.pieces or []
        for i in range(length):
            counts[i][pieces[i] if i < len(pieces) else END] += 1
    return counts


def guard_requests(prompt_ids, allowed_ids, params: dict, k: int, target_probs: str, n: int,
                   max_tokens: int, seed0: int, first_logprobs: bool = False) -> list[dict]:
    reqs = []
    for i in range(n):
        sp = dict(params, num_speculative_tokens=k, target_probs=target_probs,
                  seed=seed0 + i, max_tokens=max_tokens, ignore_eos=True,
                  allowed_token_ids=list(allowed_ids))
        if first_logprobs and i == 0:
            sp["logprobs"] = min(len(allowed_ids), 20)
        reqs.append({"prompt_token_ids": list(prompt_ids), "sampling_params": sp})
    return reqs


def compare(reference, sample, length: int, exact_first: dict | None, alpha: float) -> dict:
    ref_counts = _position_counts(reference, length)
    counts = _position_counts(sample, length)
    tests = []
    for pos in range(length):
        t = two_sample_chi2(ref_counts[pos], counts[pos])
        tests.append({"position": pos, "test": "two-sample vs target-only", **t})
    if exact_first:
        t = goodness_of_fit(counts[0], exact_first)
        tests.append({"position": 0, "test": "vs exact target p", **t})
    m = len(tests)
    min_p = min(t["p_value"] for t in tests)
    return {
        "tests": tests,
        "min_p_value": min_p,
        "bonferroni_threshold": alpha / m,
        "mismatch": bool(min_p < alpha / m),
        "top_tokens_position0": counts[0].most_common(5),
        "reference_top_tokens_position0": ref_counts[0].most_common(5),
    }


def run_guard(backend, *, prompt_ids, allowed_ids, setting_name: str, params: dict, k: int,
              n: int, max_tokens: int, concurrency: int, alpha: float, seed0: int = 10_000,
              arms=("fixed", "as-is"),
              progress: Callable[[str, int], Callable[[int], None]] | None = None) -> dict:
    """Runs the target-only reference and the speculative arms; returns the verdicts."""
    def go(name, reqs):
        cb = progress(f"guard {name}", len(reqs) * max_tokens) if progress else None
        outs, stats = backend.run(reqs, concurrency, pieces=True, progress=cb)
        return outs, stats

    ref_reqs = guard_requests(prompt_ids, allowed_ids, params, 0, "processed", n, max_tokens,
                              seed0, first_logprobs=True)
    ref, ref_stats = go("target-only", ref_reqs)
    exact = ref[0].first_probs
    if exact:
        total = sum(exact.values())  # the allowed set carries all the mass
        exact = {t: v / total for t, v in exact.items()} if total > 0 else None
    report = {
        "setting": setting_name, "params": params, "k": k, "n_per_arm": n,
        "max_tokens": max_tokens, "alpha": alpha, "allowed_tokens": len(allowed_ids),
        "exact_first_probs": exact, "reference_wall_s": ref_stats.wall_s, "arms": {},
    }
    for arm in arms:
        target_probs = "processed" if arm == "fixed" else "raw"
        reqs = guard_requests(prompt_ids, allowed_ids, params, k, target_probs, n, max_tokens,
                              seed0 + n * (1 + len(report["arms"])))
        outs, stats = go(arm, reqs)
        res = compare(ref, outs, max_tokens, exact, alpha)
        spec = [o.speculation for o in outs]
        prop = sum(s.get("proposed") or 0 for s in spec)
        res["acceptance_rate"] = sum(s.get("accepted") or 0 for s in spec) / prop if prop else None
        res["wall_s"] = stats.wall_s
        report["arms"][arm] = res
    fixed = report["arms"].get("fixed")
    control = report["arms"].get("as-is")
    report["fixed_mismatch"] = bool(fixed and fixed["mismatch"])
    report["control_detected"] = None if control is None else bool(control["mismatch"])
    return report


def greedy_exactness(spec_outputs, ref_outputs) -> dict:
    """Speculative greedy vs target-only greedy on the same prompts: identical text expected
    (bf16 logits of a K+1-token verify pass may differ in the last bits from a 1-token decode
    pass, so a near-tie can flip; a divergence is reported, with where it happened)."""
    same, first_diff = 0, []
    for a, b in zip(spec_outputs, ref_outputs):
        x = a.token_ids if a.token_ids is not None else a.text
        y = b.token_ids if b.token_ids is not None else b.text
        if x == y:
            same += 1
            continue
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        first_diff.append(n)
    return {"identical": same, "total": min(len(spec_outputs), len(ref_outputs)),
            "first_divergence": first_diff}
