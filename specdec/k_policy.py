"""K per round, by cost and acceptance.

A round with K proposals costs K draft steps and one target pass over K+1 rows, and emits
(1 - a^(K+1)) / (1 - a) tokens on average for per-token acceptance a. `choose_k` takes the K
(0..max_k) with the most expected tokens per millisecond, from the request's own acceptance
so far and a fixed cost table: so a seeded request's K sequence, and with it its text, is a
function of its own history and the deployment's table, never of load or timing.

A request whose draft has not seen its latest tokens (its prompt, before its first drafted
round; the tokens of rounds it ran at K=0) pays once for the draft to catch up before its
next proposals: a pass over those rows. `choose_k` then weighs the whole rest of the request
(`remaining` tokens) and drafts only where the cheaper rounds earn the catch-up back: eight
requests of 64 tokens on a 2-core CPU gained ~5 % per decode round at K=1 and lost more on the
draft's prefill of their prompts (docs/benchmark.md). The catch-up depends on the request's
own history only, so standard-mode K stays a function of history and the fixed table.

Requests whose text cannot depend on K (greedy ones, drafter-invariant ones) may also weigh
timing and load. Timing: the whole passes' time, timed when the runners load
(specdec.pass_costs), where the fixed table has their matmuls only. Load: with `concurrent`
requests sharing each pass, a round costs each of them 1/concurrent of a draft pass and a
target pass over all their rows. Where passes are compute-bound (a CPU with few cores at a
large batch) that makes speculation pay less, and K falls to 0. Such requests draft only
where the table expects at least MIN_GAIN over K=0: what it leaves out costs speculation
more than that where a batch is shared. Eight greedy requests through the service (2-core
AMX Xeon, 118-token prompts, 64 tokens) were priced 3.9 % faster at K=1 than at K=0 and ran
6-17 % slower: each extra pool call waits for the coordinator to get to every request
(20-35 ms a round at eight), and a batch whose requests draft at different K splits into
groups. In process the same table priced K=1 ties and ran 5 % slower.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_ACCEPTANCE = 0.8  # before a request has a history: what code prompts reach here
PRIOR_WEIGHT = 4.0  # proposals' worth of trust in the prior
# Each emitted token weighs the evidence before it by this (half-life ~14 tokens), so the
# estimate follows the text's stretches, and a request that stopped drafting after a bad
# one (rounds at K=0 test nothing) drifts back to the prior and tries again.
EVIDENCE_DECAY = 0.95
MIN_GAIN = 0.1  # where K weighs timing and load: the least expected gain worth drafting for


@dataclass(frozen=True)
class Costs:
    """ms of a draft pass and of a target pass at `rows` rows (linear between the measured
    row counts, which are sorted, and beyond them). A draft pass at one row costs draft_ms;
    `draft_row_ms` (optional, measured at target_rows like the target's) gives its cost at
    more rows."""

    draft_ms: float
    target_rows: tuple[int, ...]
    target_ms: tuple[float, ...]
    draft_row_ms: tuple[float, ...] = ()
    # Whole passes timed at load at pass_rows (specdec.pass_costs), optional: what the
    # matmuls leave out is added, linear in rows, for requests that may weigh timing.
    pass_rows: tuple[int, ...] = ()
    draft_pass_ms: tuple[float, ...] = ()
    target_pass_ms: tuple[float, ...] = ()
    draft_prefill_row_ms: float = 0.0  # a draft prefill's whole-pass ms per row

    def target(self, rows: float) -> float:
        return _interpolate(self.target_rows, self.target_ms, rows)

    def draft(self, rows: float = 1) -> float:
        if not self.draft_row_ms:
            return self.draft_ms * rows
        return _interpolate(self.target_rows, self.draft_row_ms, rows)

    def target_pass(self, rows: float) -> float:
        return self.target(rows) + self._rest(self.target, self.target_pass_ms, rows)

    def draft_pass(self, rows: float = 1) -> float:
        return self.draft(rows) + self._rest(self.draft, self.draft_pass_ms, rows)

    def catch_up(self, rows: int, whole_pass: bool = False) -> float:
        """ms of a draft pass over `rows` unseen tokens beyond a decode step's one row."""
        if rows <= 1:
            return 0.0
        if whole_pass and self.draft_prefill_row_ms:
            return (rows - 1) * self.draft_prefill_row_ms
        return self.draft(rows) - self.draft(1)

    def _rest(self, matmuls, pass_ms: tuple[float, ...], rows: float) -> float:
        """A pass's time beyond its matmuls' at `rows` (0 where no pass was timed)."""
        if len(pass_ms) < 2 or len(pass_ms) != len(self.pass_rows):
            return 0.0
        rest = tuple(max(0.0, ms - matmuls(r)) for r, ms in zip(self.pass_rows, pass_ms))
        return max(0.0, _interpolate(self.pass_rows, rest, rows))

    @classmethod
    def from_calibrations(cls, draft: dict, target: dict) -> "Costs | None":
        """From two runners' `calibration()` reports (matmul ms at the profile rows); None
        where a runner measured nothing (GPUs): K then stays as configured."""
        if not draft["forward_ms"] or not target["forward_ms"]:
            return None
        rows, target_ms = _by_rows(target["forward_ms"])
        draft_rows, draft_ms = _by_rows(draft["forward_ms"])
        return cls(draft_ms[0], rows, target_ms, draft_ms if draft_rows == rows else (),
                   **_pass_costs(draft, target))

    def to_dict(self) -> dict:
        return dict(draft_ms=self.draft_ms, target_rows=list(self.target_rows),
                    target_ms=list(self.target_ms), draft_row_ms=list(self.draft_row_ms),
                    pass_rows=list(self.pass_rows), draft_pass_ms=list(self.draft_pass_ms),
                    target_pass_ms=list(self.target_pass_ms),
                    draft_prefill_row_ms=self.draft_prefill_row_ms)


def _pass_costs(draft: dict, target: dict) -> dict:
    """The whole passes' fields of Costs, where both runners timed them at the same rows."""
    pass_rows, draft_pass_ms = _by_rows(draft.get("pass_ms") or {})
    target_rows, target_pass_ms = _by_rows(target.get("pass_ms") or {})
    if not pass_rows or pass_rows != target_rows:
        return {}
    return dict(pass_rows=pass_rows, draft_pass_ms=draft_pass_ms, target_pass_ms=target_pass_ms,
                draft_prefill_row_ms=float(draft.get("prefill_row_ms") or 0.0))


def _by_rows(ms_at: dict) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """A calibration's {rows: ms} in row order (it lists its profile rows first)."""
    pairs = sorted((int(r), float(m)) for r, m in ms_at.items())
    return tuple(r for r, _ in pairs), tuple(m for _, m in pairs)


def _interpolate(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """Linear between the listed rows; beyond the last, the slope over its upper half (a
    table lists both sides of block steps, and its last segment may sit within one block)."""
    pts = list(zip(xs, ys))
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    x1, y1 = pts[-1]
    x0, y0 = max((p for p in pts[:-1] if p[0] <= x1 / 2), default=pts[-2])
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def expected_tokens(acceptance: float, k: int) -> float:
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


def running_acceptance(tested: float, accepted: float) -> float:
    """Per-token acceptance from the proposals that met the accept test, with the prior."""
    return (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (tested + PRIOR_WEIGHT)


@dataclass
class AcceptanceEvidence:
    """What adaptive K knows of a request's acceptance: the proposals that met the accept
    test and those accepted, each weighed by EVIDENCE_DECAY per token emitted since its round.

    Drafts accept in stretches (boilerplate runs, then a hard line). Counted over the whole
    request, a request that stopped drafting after early misses stayed at K=0 to its end:
    rounds at K=0 test nothing, so the estimate never moved (tests/test_k_policy.py). On the
    match sequences of 24 HumanEval prompts (benchmarks.k_replay, docs/benchmark.md) the
    fading gained 0.2-0.6 %. A function of the request's own history, like the counts."""

    tested: float = 0.0
    accepted: float = 0.0
    decay: float = EVIDENCE_DECAY  # 1.0: whole-request counts (benchmarks.k_replay compares)

    def add_round(self, k: int, accepted: int, emitted: int) -> None:
        keep = self.decay ** emitted
        self.tested, self.accepted = self.tested * keep, self.accepted * keep
        if k:
            self.tested += accepted + (1 if accepted < k else 0)
            self.accepted += accepted


def round_ms(k: int, costs: Costs, concurrent: int = 1, whole_pass: bool = False,
             drafting: int | None = None) -> float:
    """One request's share of a round with K=k when `concurrent` requests share the target
    pass and `drafting` of them (all where None) draft at K and share the draft pass: in
    lockstep, requests that draft alone pay a whole draft pass each step. `whole_pass`: with
    the passes' measured time beyond their matmuls."""
    n = max(1, concurrent)
    m = n if drafting is None else min(n, max(1, drafting))
    draft, target = (costs.draft_pass, costs.target_pass) if whole_pass else (costs.draft, costs.target)
    return k * draft(m) / m + target(n + m * k) / n


def finish_ms(k: int, acceptance: float, costs: Costs, concurrent: int, remaining: int,
              catch_up_rows: int = 0, whole_pass: bool = False,
              drafting: int | None = None) -> float:
    """Expected ms of this request's share of the passes that produce its `remaining` tokens
    at K=k, with (k > 0) the draft's pass over `catch_up_rows` tokens it has not seen."""
    per_round = round_ms(k, costs, concurrent, whole_pass, drafting)
    ms = remaining * per_round / expected_tokens(acceptance, k)
    if k:
        ms += costs.catch_up(catch_up_rows, whole_pass)
    return ms


def choose_k(max_k: int, tested: float, accepted: float, costs: Costs, concurrent: int = 1,
             remaining: int = 1, catch_up_rows: int = 0, whole_pass: bool = False,
             drafting: int | None = None, min_gain: float = 0.0) -> int:
    """The K (0..max_k) that finishes the request soonest: the most tokens per ms where the
    draft is caught up; 0 unless that K is expected to finish `min_gain` sooner."""
    a = running_acceptance(tested, accepted)
    ms = [finish_ms(k, a, costs, concurrent, max(1, remaining), catch_up_rows, whole_pass,
                    drafting) for k in range(max_k + 1)]
    best = min(range(max_k + 1), key=lambda k: (ms[k], k))
    return best if ms[0] > ms[best] * (1 + min_gain) else 0
