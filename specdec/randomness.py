"""Counter-based randomness: every random number is a pure function of its coordinates.

A request's random numbers depend only on (seed, absolute output position, purpose) and, for
Gumbel noise, the token id. There is no stateful generator, so no random number of a seeded
request depends on batch composition, on the replica that served a round, on retries, or on
how many draws other code made (the failure mode of vLLM's per-request ``torch.Generator``).
Which text a seed gives also depends on the logits and on the mode: README, "What a seed
guarantees".

The hash is SplitMix64 (Steele, Lea & Flood 2014; the seeder of the xoshiro generators):
``value(state, n) = mix(state + n * GAMMA)`` is the n-th output of the stream seeded at
``state``. Coordinates are absorbed one after another as stream indices:

    k1 = mix(seed + GAMMA)                     scramble the seed (adjacent seeds unrelated)
    k2 = mix(k1 + (position + 1) * GAMMA)
    k3 = mix(k2 + purpose * GAMMA)             purposes start at 1
    g[token] from mix(k3 + (token + 1) * GAMMA)   (GUMBEL only)

Everything runs on int64 torch tensors on any device: multiplication wraps mod 2^64 exactly
as uint64 does (two's complement), and the logical right shift is an arithmetic shift with
the sign-extended bits masked off.
"""

from __future__ import annotations

from enum import IntEnum

import torch
from torch import Tensor

__all__ = ["Purpose", "uniforms", "gumbels", "gumbel_argmax", "inverse_cdf", "sample", "hash_keys"]


class Purpose(IntEnum):
    """What a random number is for; each purpose gets an independent stream."""

    DRAFT = 1  # the draft's proposal (inverse CDF)
    ACCEPT = 2  # the acceptance test of a proposal
    RECOVER = 3  # the token drawn from the residual at the first rejection
    BONUS = 4  # the token drawn from p after all proposals were accepted
    GUMBEL = 5  # per-token Gumbel noise (drafter-invariant mode)


def _signed(c: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GAMMA = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_TWO_M53 = 2.0**-53
_GUMBEL_CHUNK = 1 << 18  # elements per chunk: the int64 chain stays in cache (measured)
_CDF_BLOCK = 1024  # tokens per block of the two-level inverse CDF
_SPARSE_FRACTION = 0.25  # gumbel_argmax draws noise only on the support below this density


def _srl(z: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bits.

    The functional forms are used on purpose: on CPU, ``z >> s`` and ``z & c`` with Python
    scalars take a slow path (measured 7x and 40x slower than these in torch 2.13).
    """
    return torch.bitwise_and(torch.bitwise_right_shift(z, s), (1 << (64 - s)) - 1)


def _mix_(z: Tensor) -> Tensor:
    """SplitMix64 finaliser (a bijection on 64-bit words), in place, one scratch buffer."""
    t = torch.empty_like(z)
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=t).bitwise_and_((1 << (64 - shift)) - 1)
        z.bitwise_xor_(t)
        if mult is not None:
            z.mul_(mult)
    return z


def _mix(z: Tensor) -> Tensor:
    return _mix_(z.clone())


def _as_long(x, device=None) -> Tensor:
    return torch.as_tensor(x, dtype=torch.int64, device=device)


def hash_keys(seeds: Tensor, positions: Tensor, purpose) -> Tensor:
    """The 64-bit key k3 of each (seed, position, purpose); broadcasts its arguments.

    ``purpose`` is a `Purpose` or an integer tensor of purposes (one per element).
    """
    dev = next((x.device for x in (seeds, positions, purpose) if isinstance(x, Tensor)), None)
    seeds, positions, purpose = (_as_long(x, dev) for x in (seeds, positions, purpose))
    k = _mix_(seeds + _GAMMA)
    k = _mix_(k + torch.add(positions, 1).mul_(_GAMMA))  # broadcasts seeds and positions
    return _mix_(k + torch.mul(purpose, _GAMMA))


def _bits_to_uniform(bits: Tensor) -> Tensor:
    """Top 53 bits -> float64 in (0, 1): k * 2^-53, with k = 0 mapped to 2^-54.

    All 2^53 outcomes are distinct, equally likely and exactly representable; the smallest
    is moved off zero so that log(u) and the acceptance test ``u * q <= p`` are safe.
    """
    k = _srl(bits, 11).to(torch.float64)
    return k.clamp_min_(0.5).mul_(_TWO_M53)


def uniforms(seeds: Tensor, positions: Tensor, purpose) -> Tensor:
    """Uniforms in the open interval (0, 1), float64, one per (seed, position[, purpose])."""
    return _bits_to_uniform(hash_keys(seeds, positions, purpose))


_token_offsets: dict[tuple[int, str], Tensor] = {}


def _offsets(vocab_size: int, device: torch.device) -> Tensor:
    """(token + 1) * GAMMA for every token id, cached per vocabulary size and device."""
    key = (vocab_size, str(device))
    off = _token_offsets.get(key)
    if off is None:
        off = (torch.arange(vocab_size, dtype=torch.int64, device=device) + 1) * _GAMMA
        _token_offsets[key] = off
    return off


def gumbels(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """Standard Gumbel noise [R, V] float32: g = -log(-log(u)), u from (seed, position, token).

    The uniform and the first log are computed in float64 (u can be within 2^-53 of 1, where
    float32 would round it to 1 and give an infinite g); the second log in float32.
    """
    keys = hash_keys(seeds, positions, Purpose.GUMBEL).reshape(-1, 1)
    off = _offsets(vocab_size, keys.device)
    out = torch.empty(keys.shape[0], vocab_size, dtype=torch.float32, device=keys.device)
    if keys.device.type != "cpu":  # accelerators: one pass over the whole tensor
        return out.copy_(_noise(keys + off))
    rows = max(1, _GUMBEL_CHUNK // max(vocab_size, 1))
    cols = min(vocab_size, _GUMBEL_CHUNK)
    for r0 in range(0, keys.shape[0], rows):  # chunks keep the int64 chain in cache
        for c0 in range(0, vocab_size, cols):
            z = keys[r0 : r0 + rows] + off[c0 : c0 + cols]
            out[r0 : r0 + rows, c0 : c0 + cols] = _noise(z)
    return out


def _noise(z: Tensor) -> Tensor:
    """Gumbel noise from pre-mix words z = key + (token + 1) * GAMMA (z is overwritten)."""
    u = _bits_to_uniform(_mix_(z))
    e = u.log_().neg_().to(torch.float32)  # Exp(1), in [1.1e-16, 37.5]
    return e.log_().neg_()


def gumbel_argmax(probs: Tensor, seeds: Tensor, positions: Tensor) -> Tensor:
    """argmax(log p + g) per row: an exact sample from p whose noise is fixed by (seed, pos).

    Zero-probability tokens get log p = -inf and are never chosen, so when the support is
    small (top-k, top-p, greedy) the noise is drawn only there. Each noise value is a pure
    function of its token id, so every path gives the same result as
    ``(gumbels(...) + log p).argmax(-1)`` (ties: lowest index).
    """
    probs = probs.to(torch.float32)
    keys = hash_keys(seeds, positions, Purpose.GUMBEL).expand(probs.shape[0])
    # count_nonzero of p itself (p >= 0), not (p > 0).sum(): no bool or int64 copy of [R, V]
    if torch.count_nonzero(probs).item() > _SPARSE_FRACTION * probs.numel():
        return _dense_gumbel_argmax(probs, keys)
    r, c = probs.nonzero(as_tuple=True)
    score = probs[r, c].log_() + _noise(keys[r] + _offsets(probs.shape[-1], probs.device)[c])
    best = torch.full((probs.shape[0],), -torch.inf, device=probs.device)
    best = best.scatter_reduce(0, r, score, "amax")
    top = score == best[r]
    first = torch.full((probs.shape[0],), probs.shape[-1], device=probs.device)
    first = first.scatter_reduce(0, r[top], c[top], "amin")
    return first.masked_fill_(first == probs.shape[-1], 0)  # all-zero row: 0, as dense argmax


def _dense_gumbel_argmax(probs: Tensor, keys: Tensor) -> Tensor:
    """Chunk by chunk on CPU (as `gumbels`), so neither g nor log p is held at [R, V]."""
    R, V = probs.shape
    off = _offsets(V, probs.device)
    if probs.device.type != "cpu":
        return _noise(keys[:, None] + off).add_(_log(probs)).argmax(dim=-1)
    best = torch.full((R,), -torch.inf, device=probs.device)
    index = torch.zeros(R, dtype=torch.int64, device=probs.device)
    rows, cols = max(1, _GUMBEL_CHUNK // V), min(V, _GUMBEL_CHUNK)
    for r0 in range(0, R, rows):
        r1 = min(R, r0 + rows)
        for c0 in range(0, V, cols):
            p = probs[r0:r1, c0 : c0 + cols]
            val, arg = _noise(keys[r0:r1, None] + off[c0 : c0 + cols]).add_(_log(p)).max(dim=1)
            better = val > best[r0:r1]  # strict: an earlier chunk keeps a tie (lowest index)
            best[r0:r1] = torch.where(better, val, best[r0:r1])
            index[r0:r1] = torch.where(better, arg + c0, index[r0:r1])
    return index


def _log(p: Tensor) -> Tensor:
    """log p with log 0 = -inf, avoiding torch's slow path for log(0) (measured 5x on CPU)."""
    zero = p <= 0
    return torch.where(zero, 1.0, p).log_().masked_fill_(zero, -torch.inf)


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """The first index whose cumulative mass (float64) exceeds u * total, per row.

    Two levels, so that no [R, V] float64 copy or cumsum is made: float64 sums of blocks of
    `_CDF_BLOCK` tokens find the block, a cumsum inside that one block finds the token.
    Scaling by the total tolerates rows that do not sum to exactly 1; the threshold is capped
    just below the total so that rounding cannot run off the end; and the chosen token has
    cdf[i-1] <= t < cdf[i], so its probability is positive. Should rounding of the in-block
    cumsum leave t beyond it, the block's last positive token is taken (its sum is > 0).
    """
    R, V = probs.shape
    size = min(_CDF_BLOCK, V)
    cdf = _block_sums(probs, size).cumsum(dim=1)
    total = cdf[:, -1:]
    below_total = torch.nextafter(total, torch.zeros_like(total))
    t = torch.minimum(u.reshape(-1, 1).to(cdf) * total, below_total)
    block = torch.searchsorted(cdf, t, right=True).clamp_max_(cdf.shape[1] - 1)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp_min(0)), 0.0)
    span = torch.arange(size, device=probs.device)
    cols = block * size + span
    vals = probs.gather(1, cols.clamp_max(V - 1)).to(torch.float64).masked_fill_(cols >= V, 0.0)
    k = torch.searchsorted(vals.cumsum(dim=1), t - before, right=True)
    last_positive = torch.where(vals > 0, span, -1).amax(dim=1, keepdim=True)
    idx = (block * size + torch.minimum(k, last_positive)).squeeze(1)
    return idx.clamp_(0, V - 1)  # only an all-zero (invalid) row could fall outside


def _block_sums(probs: Tensor, size: int) -> Tensor:
    """float64 sums of consecutive blocks of `size` tokens (the last may be shorter)."""
    R, V = probs.shape
    n = V // size
    # convert, then sum: sum(dtype=float64) casts element by element (measured 2x slower)
    sums = probs[:, : n * size].to(torch.float64).reshape(R, n, size).sum(dim=2)
    if n * size < V:
        tail = probs[:, n * size :].to(torch.float64).sum(dim=1, keepdim=True)
        sums = torch.cat([sums, tail], dim=1)
    return sums


def sample(
    probs: Tensor,
    seeds: Tensor,
    positions: Tensor,
    purpose,
    gumbel_rows: Tensor | None = None,
) -> Tensor:
    """One token per row of ``probs`` [R, V] -> LongTensor [R].

    Rows with ``gumbel_rows`` set use Gumbel-max with `gumbels` (purpose ignored; the
    drafter-invariant mode); the others use inverse CDF with ``uniforms(purpose)``. One-hot
    (greedy) rows give their one token either way.
    """
    shape = (probs.shape[0],)
    seeds = _as_long(seeds, probs.device).expand(shape)
    positions = _as_long(positions, probs.device).expand(shape)
    purpose = _as_long(purpose, probs.device).expand(shape)
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    if gumbel_rows is None:
        gumbel_rows = torch.zeros(shape, dtype=torch.bool, device=probs.device)
    gumbel_rows = gumbel_rows.to(probs.device, torch.bool)
    for rows, gumbel in ((gumbel_rows, True), (~gumbel_rows, False)):
        idx = rows.nonzero().squeeze(1)
        if not idx.numel():
            continue
        p = probs if idx.numel() == probs.shape[0] else probs[idx]  # no copy when all rows
        if gumbel:
            out[idx] = gumbel_argmax(p, seeds[idx], positions[idx])
        else:
            out[idx] = inverse_cdf(p, uniforms(seeds[idx], positions[idx], purpose[idx]))
    return out
