"""The rejection sampler: which proposals to keep, and the one token the target adds.

Standard mode (Leviathan et al. 2023; Chen et al. 2023): proposal x_i, drawn from q_i, is
accepted iff ``u * q_i(x_i) <= p_i(x_i)`` with u = uniforms(seed, pos_i, ACCEPT); the
accepted prefix ends at the first rejection, at stop index s. The final token comes from
``norm(max(0, p_s - q_s))`` (purpose RECOVER) after a rejection, or from p_s (purpose BONUS)
when all k proposals were accepted. Every emitted token is then distributed exactly as
direct sampling from p, for any q, provided q is the distribution the proposals were really
drawn from. Greedy requests arrive as one-hot p and q, where the same rule is exact greedy.

Drafter-invariant mode: the draft proposed argmax(log q + g_t), g_t the Gumbel noise of
(seed, position t); the target accepts while argmax(log p_i + g_{t_i}) equals the proposal
and emits its own argmax at the stop. Every emitted token is then argmax(log p_t + g_t):
the text is that of target-only Gumbel sampling with the request's seed, whatever the
draft and K.

Target-only rows (no proposals, k = 0) in either mode draw their token the same way,
argmax(log p_t + g_t). So target-only decoding (``num_speculative_tokens: 0``) and
drafter-invariant speculative decoding are one sampler: a seeded request gives the same
text with or without speculation, for any K and any draft. (Standard-mode rounds with
k >= 1 use the accept / residual / bonus uniforms instead: exact in distribution, but the
text depends on the draft and K.)

Absolute output position of row b's proposal i is positions[b] + i.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from specdec.randomness import Purpose, gumbel_argmax, inverse_cdf, uniforms

__all__ = ["RejectionOutput", "SpecStats", "rejection_sample"]


class RejectionOutput(NamedTuple):
    tokens: list[list[int]]  # emitted per row: accepted prefix + one target token
    num_accepted: Tensor  # LongTensor [B]


def rejection_sample(
    draft_tokens: Tensor,
    num_draft: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    seeds: Tensor,
    positions: Tensor,
    drafter_invariant: Tensor,
) -> RejectionOutput:
    """Accept a prefix of each row's proposals and add one target token.

    draft_tokens [B, K] (padded with -1 beyond num_draft[b]), draft_probs [B, K, V] (None only
    when every row is drafter-invariant), target_probs [B, K + 1, V]; seeds, positions and
    drafter_invariant [B]. Returns the emitted tokens per row and the accepted counts.
    """
    B, K = draft_tokens.shape
    dev = target_probs.device
    num_draft = num_draft.to(dev)
    seeds, positions = seeds.to(dev), positions.to(dev)
    drafter_invariant = drafter_invariant.to(dev, torch.bool)
    draft_probs = None if draft_probs is None else draft_probs.to(dev)
    _check(draft_tokens, num_draft, draft_probs, target_probs, drafter_invariant)
    # Target-only rows sample as drafter-invariant rows do (Gumbel-max): one sampler.
    drafter_invariant = drafter_invariant | (num_draft == 0)
    valid = torch.arange(K, device=dev) < num_draft[:, None]
    tokens = torch.where(valid, draft_tokens.to(dev), 0)  # pads -> 0, never accepted
    accept = torch.zeros(B, K, dtype=torch.bool, device=dev)
    final = torch.zeros(B, dtype=torch.int64, device=dev)

    # Rows are selected by index into the full tensors: no copy of [B, K, V] is made.
    std = (~drafter_invariant).nonzero().squeeze(1)
    if std.numel() and draft_probs is not None:  # None: these rows proposed nothing
        accept[std] = _standard_accept(std, tokens[std], draft_probs, target_probs, seeds[std],
                                       positions[std])
    inv = drafter_invariant.nonzero().squeeze(1)
    if inv.numel():
        choice = _gumbel_choices(inv, num_draft[inv], target_probs, seeds[inv], positions[inv])
        accept[inv] = choice[:, :K] == tokens[inv]

    num_accepted = (accept & valid).to(torch.int64).cumprod(dim=1).sum(dim=1)
    if std.numel():
        final[std] = _final_token(std, num_accepted[std], num_draft[std], draft_probs,
                                  target_probs, seeds[std], positions[std])
    if inv.numel():
        final[inv] = choice.gather(1, num_accepted[inv, None]).squeeze(1)
    return RejectionOutput(_emitted(tokens, num_accepted, final), num_accepted)


def _standard_accept(rows: Tensor, x: Tensor, q: Tensor, p: Tensor, seeds: Tensor,
                     positions: Tensor) -> Tensor:
    """u * q(x) <= p(x) at every proposal of the given rows; p(x) = 0 always rejects."""
    i = torch.arange(x.shape[1], device=x.device)
    px = p[rows[:, None], i, x].to(torch.float64)
    qx = q[rows[:, None], i, x].to(torch.float64)
    pos = positions[:, None] + i
    u = uniforms(seeds[:, None].expand_as(pos), pos, Purpose.ACCEPT)
    return (u * qx <= px) & (px > 0)


def _gumbel_choices(rows: Tensor, k: Tensor, p: Tensor, seeds: Tensor,
                    positions: Tensor) -> Tensor:
    """The target's Gumbel-max token at positions 0..k_b of each given row: [n, K + 1]
    (-1 past k_b, where nothing is needed: the noise is the costly part)."""
    n, K1 = rows.shape[0], p.shape[1]
    i = torch.arange(K1, device=p.device).expand(n, K1)
    needed = i <= k[:, None]
    if bool(needed.all()) and n == p.shape[0]:
        flat = p.flatten(0, 1)  # a view, no copy
    else:
        flat = p[rows[:, None].expand(n, K1)[needed], i[needed]]
    pos = (positions[:, None] + i)[needed]
    seeds = seeds[:, None].expand(n, K1)[needed]
    choice = torch.full((n, K1), -1, dtype=torch.int64, device=p.device)
    choice[needed] = gumbel_argmax(flat, seeds, pos)
    return choice


def _final_token(rows: Tensor, s: Tensor, k: Tensor, q: Tensor | None, p: Tensor,
                 seeds: Tensor, positions: Tensor) -> Tensor:
    """For each given row, stopped at s of k proposals: the recovered token from
    norm(max(0, p_s - q_s)) if s < k, else the bonus token from p_s."""
    dist = _rows_at(p, rows, s).to(torch.float32)  # a copy: the residual goes in place
    rec = (s < k).nonzero().squeeze(1)
    if rec.numel():
        residual = dist.index_select(0, rec).sub_(_rows_at(q, rows[rec], s[rec])).clamp_min_(0)
        has_mass = residual.sum(dim=1) > 0  # p == q: the residual is empty; keep p
        dist.index_copy_(0, rec[has_mass], residual[has_mass])
    purpose = torch.where(s < k, int(Purpose.RECOVER), int(Purpose.BONUS))
    return inverse_cdf(dist, uniforms(seeds, positions + s, purpose))


def _rows_at(x: Tensor, rows: Tensor, i: Tensor) -> Tensor:
    """x[rows, i] for x [B, P, V] as one contiguous row copy (faster than advanced indexing)."""
    return x.flatten(0, 1).index_select(0, rows * x.shape[1] + i)


def _emitted(tokens: Tensor, num_accepted: Tensor, final: Tensor) -> list[list[int]]:
    """Per row: the accepted proposals followed by the final token, as Python lists."""
    B, K = tokens.shape
    out = torch.cat([tokens, torch.zeros(B, 1, dtype=tokens.dtype, device=tokens.device)], 1)
    out.scatter_(1, num_accepted[:, None], final[:, None])
    lengths = (num_accepted + 1).tolist()
    return [row[:n] for row, n in zip(out.tolist(), lengths)]


def _check(draft_tokens, num_draft, draft_probs, target_probs, drafter_invariant) -> None:
    B, K = draft_tokens.shape
    if num_draft.shape != (B,) or bool(((num_draft < 0) | (num_draft > K)).any()):
        raise ValueError(f"num_draft must be [B] = [{B}] with 0 <= k_b <= K = {K}")
    if target_probs.dim() != 3 or target_probs.shape[:2] != (B, K + 1):
        raise ValueError(f"target_probs must be [B, K+1, V] = [{B}, {K + 1}, V], got "
                         f"{tuple(target_probs.shape)}")
    if draft_probs is None:
        if bool((~drafter_invariant & (num_draft > 0)).any()):
            raise ValueError("draft_probs may be None only when every row that proposed "
                             "tokens is drafter-invariant")
    elif draft_probs.shape != (B, K, target_probs.shape[2]):
        raise ValueError(f"draft_probs must be [B, K, V] = [{B}, {K}, {target_probs.shape[2]}]"
                         f", got {tuple(draft_probs.shape)}")


@dataclass
class SpecStats:
    """Speculation counters (DESIGN.md section 2 definitions).

    ``slots`` is the sum over rounds of (k + 1), the most tokens those rounds could emit;
    ``tested`` counts proposals that met the accept test (all before them were accepted), so
    accepted / tested estimates the per-token acceptance whatever K was.
    """

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    slots: int = 0
    tested: int = 0

    def add_round(self, k: int, accepted: int, emitted: int) -> None:
        self.rounds += 1
        self.tested += accepted + (1 if accepted < k else 0)
        self.proposed += k
        self.accepted += accepted
        self.emitted += emitted
        self.slots += k + 1

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / proposed draft tokens; None before any proposal."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def system_efficiency(self) -> float | None:
        """emitted / sum over rounds of (k + 1); None before any round."""
        return self.emitted / self.slots if self.slots else None

    def to_dict(self) -> dict:
        """The fields of `specdec.api_types.SpeculationStats`."""
        d = asdict(self)
        del d["slots"], d["tested"]
        d["acceptance_rate"] = self.acceptance_rate
        d["system_efficiency"] = self.system_efficiency
        return d
