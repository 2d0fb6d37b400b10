"""Small statistics helpers (no scipy needed: torch has the regularized gamma function)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df)."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def _pool_small(expected: list[float], observed: list[list[float]], min_expected: float):
    """Merge categories whose expected count is below min_expected into one bin."""
    keep = [i for i, e in enumerate(expected) if e >= min_expected]
    pooled = [i for i, e in enumerate(expected) if e < min_expected]
    exp = [expected[i] for i in keep]
    obs = [[row[i] for i in keep] for row in observed]
    if pooled:
        exp.append(sum(expected[i] for i in pooled))
        for o, row in zip(obs, observed):
            o.append(sum(row[i] for i in pooled))
    return exp, obs


def two_sample_chi2(a: Mapping, b: Mapping, min_expected: float = 5.0) -> dict:
    """Chi-square test of homogeneity between two samples of categories (counts a, b)."""
    cats = sorted(set(a) | set(b), key=str)
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb or len(cats) < 2:
        return {"stat": 0.0, "df": 0, "p_value": 1.0, "categories": len(cats)}
    total = [a.get(c, 0) + b.get(c, 0) for c in cats]
    n = na + nb
    # Pool on the smaller sample's expected counts (both rows use the same bins).
    smaller = min(na, nb)
    exp_small = [t * smaller / n for t in total]
    keep = [i for i, e in enumerate(exp_small) if e >= min_expected]
    pooled = [i for i, e in enumerate(exp_small) if e < min_expected]
    bins = [[i] for i in keep] + ([pooled] if pooled else [])
    if len(bins) < 2:
        return {"stat": 0.0, "df": 0, "p_value": 1.0, "categories": len(cats)}
    stat = 0.0
    for bin_ in bins:
        t = sum(total[i] for i in bin_)
        for counts, m in ((a, na), (b, nb)):
            o = sum(counts.get(cats[i], 0) for i in bin_)
            e = t * m / n
            if e > 0:
                stat += (o - e) ** 2 / e
    df = len(bins) - 1
    return {"stat": stat, "df": df, "p_value": chi2_sf(stat, df), "categories": len(bins)}


def goodness_of_fit(observed: Mapping, probs: Mapping, min_expected: float = 5.0) -> dict:
    """Chi-square goodness of fit of counts against exact probabilities (categories absent
    from probs have probability 0: observing one gives p-value 0)."""
    n = sum(observed.values())
    impossible = sum(v for c, v in observed.items() if probs.get(c, 0.0) <= 0.0)
    if impossible:
        return {"stat": math.inf, "df": 0, "p_value": 0.0, "impossible": impossible}
    cats = sorted(probs, key=str)
    expected = [n * probs[c] for c in cats]
    exp, (obs,) = _pool_small(expected, [[observed.get(c, 0) for c in cats]], min_expected)
    if len(exp) < 2 or n == 0:
        return {"stat": 0.0, "df": 0, "p_value": 1.0, "impossible": 0}
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    df = len(exp) - 1
    return {"stat": stat, "df": df, "p_value": chi2_sf(stat, df), "impossible": 0}


def tokens_per_round(alpha: float | None, k: int) -> float | None:
    """Expected tokens per round for i.i.d. acceptance alpha: (1 - a^(K+1)) / (1 - a)."""
    if alpha is None:
        return None
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def alpha_from_mean_accepted(mean_accepted: float, k: int) -> float | None:
    """Solve a (1 - a^K) / (1 - a) = mean accepted per round for a (bisection); used when
    only aggregate counters are known (the HTTP backend)."""
    if k <= 0:
        return None
    f = lambda a: sum(a**i for i in range(1, k + 1))  # noqa: E731
    if mean_accepted <= 0:
        return 0.0
    if mean_accepted >= k:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < mean_accepted else (lo, mid)
    return (lo + hi) / 2


def mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None
