"""K per round, by cost and acceptance.

A round with K proposals costs K draft steps and one target pass over K+1 rows, and emits
(1 - a^(K+1)) / (1 - a) tokens on average for per-token acceptance a. `choose_k` takes the K
(0..max_k) with the most expected tokens per millisecond, from the request's own acceptance
so far and a fixed cost table: so a seeded request's K sequence, and with it its text, is a
function of its own history and the deployment's table, never of load or timing.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_ACCEPTANCE = 0.8  # before a request has a history: what code prompts reach here
PRIOR_WEIGHT = 4.0  # proposals' worth of trust in the prior


@dataclass(frozen=True)
class Costs:
    """ms of a draft step (one row) and of a target pass at `rows` rows (linear between)."""

    draft_ms: float
    target_rows: tuple[int, ...]
    target_ms: tuple[float, ...]

    def target(self, rows: int) -> float:
        pts = list(zip(self.target_rows, self.target_ms))
        for (r0, m0), (r1, m1) in zip(pts, pts[1:]):
            if rows <= r1:
                return m0 + (m1 - m0) * (rows - r0) / (r1 - r0)
        (r0, m0), (r1, m1) = pts[-2], pts[-1]
        return m1 + (m1 - m0) * (rows - r1) / (r1 - r0)

    @classmethod
    def from_calibrations(cls, draft: dict, target: dict) -> "Costs | None":
        """From two runners' `calibration()` reports (matmul ms at the profile rows); None
        where a runner measured nothing (GPUs): K then stays as configured."""
        if not draft["forward_ms"] or not target["forward_ms"]:
            return None
        rows = tuple(int(r) for r in target["forward_ms"])
        return cls(float(next(iter(draft["forward_ms"].values()))), rows,
                   tuple(float(m) for m in target["forward_ms"].values()))

    def to_dict(self) -> dict:
        return dict(draft_ms=self.draft_ms, target_rows=list(self.target_rows),
                    target_ms=list(self.target_ms))


def expected_tokens(acceptance: float, k: int) -> float:
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


def running_acceptance(proposed: int, accepted: int) -> float:
    return (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (proposed + PRIOR_WEIGHT)


def choose_k(max_k: int, proposed: int, accepted: int, costs: Costs) -> int:
    a = running_acceptance(proposed, accepted)
    rate = [expected_tokens(a, k) / (k * costs.draft_ms + costs.target(k + 1))
            for k in range(max_k + 1)]
    return max(range(max_k + 1), key=lambda k: (rate[k], -k))
