"""Counter-based randomness: bit-exact against a numpy uint64 reference, uniform, independent."""

import numpy as np
import pytest
import torch
from scipy import stats

from specdec import randomness
from specdec.randomness import (
    Purpose,
    _bits_to_uniform,
    _mix,
    _noise,
    _offsets,
    gumbel_argmax,
    gumbels,
    hash_keys,
    inverse_cdf,
    sample,
    uniforms,
)

N = 1_000_000
ALPHA = 1e-3  # every test input is fixed, so these checks are deterministic


# ---- numpy uint64 reference ---------------------------------------------------------------

G = np.uint64(0x9E3779B97F4A7C15)


def ref_mix(z):
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def ref_keys(seeds, positions, purpose):
    s = np.asarray(seeds, dtype=np.int64).astype(np.uint64)
    p = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        k = ref_mix(s + G)
        k = ref_mix(k + (p + np.uint64(1)) * G)
        return ref_mix(k + np.uint64(purpose) * G)


def ref_uniform(keys):
    k = (keys >> np.uint64(11)).astype(np.float64)
    return np.maximum(k, 0.5) * 2.0**-53


def ref_gumbels(seeds, positions, vocab):
    keys = ref_keys(seeds, positions, Purpose.GUMBEL)[:, None]
    with np.errstate(over="ignore"):
        z = keys + (np.arange(vocab, dtype=np.uint64) + np.uint64(1)) * G
    e = (-np.log(ref_uniform(ref_mix(z)))).astype(np.float32)
    return -np.log(e)


def as_u64(t: torch.Tensor) -> np.ndarray:
    return t.numpy().astype(np.uint64)  # two's complement reinterpretation


# ---- bit-exactness --------------------------------------------------------------------------


def test_mix_reproduces_published_splitmix64_outputs():
    # SplitMix64 output n from state s is mix(s + n * GAMMA); the first outputs for the
    # seeds 0 and 1234567 are the published reference values.
    for seed, expected in [
        (0, [0xE220A8397B1DCDAF]),
        (1234567, [6457827717110365317, 3203168211198807973, 9817491932198370423,
                   4593380528125082431, 16408922859458223821]),
    ]:
        n = torch.arange(1, len(expected) + 1)
        got = as_u64(_mix(torch.tensor(seed) + n * torch.tensor(-7046029254386353131)))
        assert got.tolist() == expected


def test_keys_and_uniforms_bit_exact_against_numpy():
    rng = np.random.default_rng(0)
    n = 200_000
    seeds = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64, endpoint=True)
    seeds[:4] = [0, 1, -1, 2**63 - 1]  # edges of the int64 range
    positions = rng.integers(0, 1 << 40, n, dtype=np.int64)
    for purpose in Purpose:
        keys = hash_keys(torch.from_numpy(seeds), torch.from_numpy(positions), purpose)
        ref = ref_keys(seeds, positions, purpose)
        np.testing.assert_array_equal(as_u64(keys), ref)
        u = uniforms(torch.from_numpy(seeds), torch.from_numpy(positions), purpose)
        assert u.dtype == torch.float64
        np.testing.assert_array_equal(u.numpy(), ref_uniform(ref))


def test_purpose_tensor_equals_scalar_purpose():
    seeds, pos = torch.arange(50), torch.arange(50) * 3
    mixed = torch.tensor([int(p) for p in Purpose] * 10)
    per_row = torch.stack([uniforms(seeds[i], pos[i], Purpose(int(mixed[i]))) for i in range(50)])
    assert torch.equal(uniforms(seeds, pos, mixed), per_row)


def test_gumbels_match_reference_across_chunk_boundaries():
    seeds = torch.tensor([7, -3, 2**62 + 5])
    pos = torch.tensor([0, 11, 4096])
    vocab = 151_936  # crosses the CPU chunking in both directions
    g = gumbels(seeds, pos, vocab)
    assert g.shape == (3, vocab) and g.dtype == torch.float32
    ref = ref_gumbels(seeds.numpy(), pos.numpy(), vocab)
    np.testing.assert_allclose(g.numpy(), ref, rtol=2e-6, atol=2e-6)  # logs: an ulp may differ
    keys = hash_keys(seeds, pos, Purpose.GUMBEL)[:, None]
    assert torch.equal(g, _noise(keys + _offsets(vocab, keys.device)))  # unchunked path


def test_uniform_is_open_interval_with_53_bits():
    bits = torch.tensor([0, 1 << 11, -1, -(1 << 12)])  # k = 0, 1, 2^53 - 1, 2^53 - 2
    u = _bits_to_uniform(bits)
    assert u.tolist() == [2.0**-54, 2.0**-53, 1 - 2.0**-53, 1 - 2.0**-52]


# ---- distribution ---------------------------------------------------------------------------


def _u(seeds, positions, purpose=Purpose.ACCEPT) -> np.ndarray:
    return uniforms(torch.as_tensor(seeds), torch.as_tensor(positions), purpose).numpy()


@pytest.mark.parametrize(
    "case", ["positions", "seeds", "purposes_of_one_seed"], ids=lambda c: c
)
def test_uniformity_ks_and_chi_square(case):
    idx = np.arange(N)
    if case == "positions":
        u = _u(12345, idx)
    elif case == "seeds":
        u = _u(idx, 0)
    else:
        u = np.concatenate([_u(99, idx[: N // 5], p) for p in Purpose])
    ks = stats.kstest(u, "uniform")
    chi = stats.chisquare(np.bincount((u * 1000).astype(int), minlength=1000))
    print(f"\n{case}: KS D={ks.statistic:.2e} p={ks.pvalue:.3f}, chi2 p={chi.pvalue:.3f}")
    assert ks.pvalue > ALPHA and chi.pvalue > ALPHA
    assert 0 < u.min() and u.max() < 1


def _joint_chi_square(a: np.ndarray, b: np.ndarray, bins: int = 20) -> float:
    counts = np.histogram2d(a, b, bins=bins, range=[[0, 1], [0, 1]])[0]
    return stats.chisquare(counts.ravel()).pvalue


@pytest.mark.parametrize(
    "pair",
    ["purpose_accept_vs_recover", "purpose_gumbel_vs_draft", "position_t_vs_t+1",
     "seed_s_vs_s+1", "seed_s_vs_s+GAMMA"],
)
def test_independence_of_neighbouring_coordinates(pair):
    n = N // 2
    idx = np.arange(n)
    a, b = {
        "purpose_accept_vs_recover": lambda: (_u(5, idx), _u(5, idx, Purpose.RECOVER)),
        "purpose_gumbel_vs_draft": lambda: (_u(idx, 3, Purpose.GUMBEL), _u(idx, 3, Purpose.DRAFT)),
        "position_t_vs_t+1": lambda: (_u(77, idx), _u(77, idx + 1)),
        "seed_s_vs_s+1": lambda: (_u(idx, 9), _u(idx + 1, 9)),
        # a seed one stream step away must not reproduce a shifted stream
        "seed_s_vs_s+GAMMA": lambda: (_u(idx, 9), _u(idx - 7046029254386353131, 8)),
    }[pair]()
    p = _joint_chi_square(a, b)
    r = np.corrcoef(a, b)[0, 1]
    print(f"\n{pair}: joint chi2 p={p:.3f}, r={r:+.2e}")
    assert p > ALPHA and abs(r) < 5 / np.sqrt(n)


def test_gumbel_noise_is_standard_gumbel_and_independent_across_tokens():
    g = gumbels(torch.arange(40), torch.full((40,), 3), 25_000).numpy()
    ks = stats.kstest(g.ravel(), "gumbel_r")
    r = np.corrcoef(g[:, :-1].ravel(), g[:, 1:].ravel())[0, 1]
    print(f"\ngumbel: KS p={ks.pvalue:.3f}, neighbour-token r={r:+.2e}")
    assert ks.pvalue > ALPHA and abs(r) < 5 / np.sqrt(g.size)


# ---- sampling -------------------------------------------------------------------------------


def test_inverse_cdf_never_picks_zero_probability_tokens_at_extreme_uniforms():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]] * 4 + [[0.0, 0.3, 0.0, 0.6, 0.0, 0.0]])
    u = torch.tensor([2.0**-54, 0.5 - 2.0**-53, 0.5, 1 - 2.0**-53, 1 - 2.0**-53], dtype=float)
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3, 3]  # last row sums to 0.9: scaled


def test_inverse_cdf_threshold_is_capped_below_the_total():
    # uniforms() never returns 1 (and u * total < total in float64 for u <= 1 - 2^-53), but
    # the cap keeps even u = 1 on the last positive-probability token, never a trailing zero.
    probs = torch.tensor([[0.25, 0.0, 0.75 + 2**-23, 0.0, 0.0]], dtype=torch.float32)
    assert inverse_cdf(probs, torch.tensor([1.0], dtype=torch.float64)).item() == 2


def test_inverse_cdf_two_levels_match_a_full_float64_cumsum():
    # V spans several 1024-token blocks plus a short tail; supports are sparse, with whole
    # empty blocks and zeros on block edges, and the rows are not normalised.
    g = torch.Generator().manual_seed(3)
    V = 5 * 1024 + 300
    probs = torch.rand(400, V, generator=g) * (torch.rand(400, V, generator=g) < 0.02)
    probs[:, 1024:3072] = 0.0
    probs[:, 1023] = probs[:, 4096] = 0.0
    probs[::7, -1] = 5.0  # heavy last token
    u = uniforms(torch.arange(400), torch.zeros(400, dtype=torch.long), Purpose.BONUS)
    u[:3] = torch.tensor([2.0**-54, 1 - 2.0**-53, 0.5], dtype=torch.float64)
    cdf = probs.double().numpy().cumsum(1)
    ref = [np.searchsorted(c, x * c[-1], side="right") for c, x in zip(cdf, u.numpy())]
    got = inverse_cdf(probs, u)
    assert got.tolist() == ref
    assert (probs.gather(1, got[:, None]) > 0).all()


@pytest.mark.parametrize("gumbel", [False, True], ids=["inverse_cdf", "gumbel_max"])
def test_sample_frequencies_match_probs(gumbel):
    p = torch.tensor([0.5, 0.0, 0.2, 0.15, 0.1, 0.05, 0.0])
    n = 200_000
    rows = p.expand(n, -1)
    tokens = sample(rows, torch.arange(n), torch.full((n,), 4), Purpose.BONUS,
                    torch.full((n,), gumbel))
    counts = np.bincount(tokens.numpy(), minlength=7)
    assert counts[1] == counts[6] == 0
    res = stats.chisquare(counts[p > 0], n * p[p > 0].double().numpy())
    print(f"\nsample gumbel={gumbel}: chi2={res.statistic:.2f} p={res.pvalue:.3f}")
    assert res.pvalue > ALPHA


def test_sample_one_hot_rows_give_the_argmax_in_both_modes():
    hot = torch.tensor([3, 0, 6, 5])
    probs = torch.nn.functional.one_hot(hot, 7).float()
    for g in (False, True):
        assert torch.equal(sample(probs, torch.arange(4), torch.arange(4), Purpose.RECOVER,
                                  torch.full((4,), g)), hot)


def test_sample_rows_do_not_interact():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(12, 50), -1)
    seeds, pos = torch.arange(12) * 1000, torch.arange(12)
    g = torch.arange(12) % 3 == 0
    out = sample(probs, seeds, pos, Purpose.DRAFT, g)
    perm = torch.randperm(12)
    permuted = sample(probs[perm], seeds[perm], pos[perm], Purpose.DRAFT, g[perm])
    assert torch.equal(permuted, out[perm])
    one = [slice(i, i + 1) for i in range(12)]
    singles = [sample(probs[i], seeds[i], pos[i], Purpose.DRAFT, g[i]) for i in one]
    assert torch.equal(torch.cat(singles), out)


@pytest.mark.parametrize("support", ["sparse", "dense", "dense_small_chunks"])
def test_gumbel_argmax_paths_equal_argmax_of_log_p_plus_gumbels(support, monkeypatch):
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(6, 30_000, generator=g) * 2, -1)
    if support == "sparse":
        probs[probs < probs.topk(40, dim=-1).values[:, -1:]] = 0
    else:  # dense, with some zeros; small chunks make the column chunks combine
        probs[:, ::3] = 0
        if support == "dense_small_chunks":
            monkeypatch.setattr(randomness, "_GUMBEL_CHUNK", 4096)
    seeds, pos = torch.arange(6) + 17, torch.arange(6) * 5
    reference = gumbels(seeds, pos, 30_000).add_(probs.log()).argmax(-1)
    assert torch.equal(gumbel_argmax(probs, seeds, pos), reference)
